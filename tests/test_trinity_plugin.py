"""The Trinity-RFT plugin, through Trinity's own plugin loader, factories and config objects,
against a real expbuf server on loopback (skipped where trinity-rft is not installed)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch

from expbuf.client import BufferClient, BufferError, Tls
from expbuf.server.advantages import estimators
from expbuf.server.app import ExpbufServer
from expbuf.server.config import TlsConfig
from expbuf.server.store.schema.estimator_registry import Estimator

from conftest import Servers
from helpers import passes_started, registered


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global trinity, ADVANTAGE_FN, GRPOGroupedAdvantage, sample_strategy, DefaultSampleStrategy, BufferReader
    global ensure_v1_operator, experience_pipeline, ExperiencePipeline, READER, Config, ExperienceBufferConfig
    global StorageConfig, EID, Experience, ExpbufAdvantageFn, ExpbufReader, ExpbufWriter, parse, plugin_dir
    global ListReader
    trinity = pytest.importorskip("trinity")
    from trinity.algorithm.advantage_fn import ADVANTAGE_FN
    from trinity.algorithm.advantage_fn.grpo_advantage import GRPOGroupedAdvantage
    from trinity.algorithm.sample_strategy import sample_strategy
    from trinity.algorithm.sample_strategy.sample_strategy import DefaultSampleStrategy
    from trinity.buffer.buffer_reader import BufferReader
    from trinity.buffer.operators.experience_operator import ensure_v1_operator
    from trinity.buffer.pipelines import experience_pipeline
    from trinity.buffer.pipelines.experience_pipeline import ExperiencePipeline
    from trinity.buffer.reader import READER
    from trinity.common.config import Config, ExperienceBufferConfig, StorageConfig
    from trinity.common.experience import EID, Experience

    from expbuf.client.trinity import ExpbufAdvantageFn, ExpbufReader, ExpbufWriter, parse, plugin_dir

    class ListReader(BufferReader):
        """A reader of Trinity's registry, to show its get_buffer_reader still decides other paths."""

        def __init__(self, config: StorageConfig) -> None:
            self.path = config.path

        async def read(self, batch_size: int | None = None, **kwargs: object) -> list:
            return [self.path]


TABLE = "grpo4"


@pytest.fixture(scope="module", autouse=True)
def plugin() -> Iterator[None]:
    """Load the plugin the way Trinity does: TRINITY_PLUGIN_DIRS, then its own loader."""
    from trinity.utils import plugin_loader

    # Trinity's loader copies each plugin module into its own plugins package: undo that.
    copied = Path(plugin_loader.__file__).parent.parent / "plugins" / "expbuf_buffer.py"
    existed = copied.exists()
    saved = os.environ.get("TRINITY_PLUGIN_DIRS")
    os.environ["TRINITY_PLUGIN_DIRS"] = plugin_dir()
    try:
        plugin_loader.load_plugins()
        assert "trinity.plugins.expbuf_buffer" in sys.modules
        yield
    finally:
        if saved is None:
            os.environ.pop("TRINITY_PLUGIN_DIRS")
        else:
            os.environ["TRINITY_PLUGIN_DIRS"] = saved
        if not existed:
            copied.unlink(missing_ok=True)


def buffer_config(port: int, batch_size: int, query: str = "", **settings: object) -> ExperienceBufferConfig:
    """The experience buffer section of a Trinity config, as its validator leaves it."""
    path = f"expbuf://127.0.0.1:{port}/{TABLE}" + (f"?{query}" if query else "")
    settings = {"max_read_timeout": 5.0, **settings}  # a missing batch fails the test, not hangs it
    return ExperienceBufferConfig(name="experience_buffer", path=path, batch_size=batch_size, **settings)


def group(task: int, rewards: list[float]) -> list[Experience]:
    """One task's runs: multi-turn experiences whose action masks have zeros."""
    return [
        Experience(
            eid=EID(batch=3, task=task, run=run),
            tokens=torch.arange(10, dtype=torch.int32),
            prompt_length=4,
            logprobs=torch.full((6,), -0.5),
            action_mask=torch.tensor([1, 1, 0, 0, 1, 1], dtype=torch.bool),
            reward=reward,
            info={"model_version": 1},
        )
        for run, reward in enumerate(rewards)
    ]


def trinity_grpo(exps: list[Experience]) -> dict[str, torch.Tensor]:
    """Trinity's own grpo advantages for these experiences, by uid."""
    done, _ = GRPOGroupedAdvantage().process(copy.deepcopy(exps))
    return {exp.eid.uid: exp.advantages for exp in done}


def check_whole_groups(read: list[Experience], pushed: list[Experience]) -> None:
    want = trinity_grpo([e for e in pushed if e.eid.tid in {r.eid.tid for r in read}])
    assert sorted(want) == sorted(e.eid.uid for e in read)  # every run of each group, nothing else
    for exp in read:
        assert isinstance(exp, Experience)
        torch.testing.assert_close(exp.advantages, want[exp.eid.uid].float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(exp.returns, exp.advantages)


def test_factories_return_expbuf_for_expbuf_paths_and_trinity_otherwise(start_server: Servers, tmp_path: Path) -> None:
    server = start_server()
    with pytest.raises(ValueError, match=r"expbuf table 'grpo4' does not exist at .*create it first"):
        trinity.buffer.get_buffer_reader(buffer_config(server.port, batch_size=8))
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
    config = buffer_config(server.port, batch_size=8)
    assert isinstance(trinity.buffer.get_buffer_writer(config), ExpbufWriter)
    assert isinstance(trinity.buffer.get_buffer_reader(config), ExpbufReader)
    assert isinstance(trinity.buffer.get_buffer_reader(config.to_storage_config()), ExpbufReader)
    # A misspelt storage type, or a path one slash short, was taken silently (the latter by Trinity's own queue).
    for factory in (trinity.buffer.get_buffer_writer, trinity.buffer.get_buffer_reader):
        with pytest.raises(ValueError, match=r"^redis not supported\.$"):
            factory(dataclasses.replace(config, storage_type="redis"))
        with pytest.raises(ValueError, match=r"buffer path 'expbuf:/127.0.0.1:\d+/grpo4' is not an expbuf path"):
            factory(dataclasses.replace(config, path=config.path.replace("://", ":/")))
    # Modules that imported the factories before the plugin loaded (this test module imports
    # them first) now call the plugin's.
    assert experience_pipeline.get_buffer_writer is trinity.buffer.get_buffer_writer
    assert sample_strategy.get_buffer_reader is trinity.buffer.get_buffer_reader

    # Any other path: Trinity's own writers and readers, working as before.
    out = tmp_path / "experiences.jsonl"
    jsonl = StorageConfig(name="out", storage_type="file", path=str(out), wrap_in_ray=False)
    writer = trinity.buffer.get_buffer_writer(jsonl)
    assert type(writer).__module__ == "trinity.buffer.writer.file_writer"
    asyncio.run(writer.write(group(0, [1.0, 2.0])))
    assert len(out.read_text().splitlines()) == 2
    READER.register_module("expbuf_test_list", ListReader, force=True)
    listed = trinity.buffer.get_buffer_reader(StorageConfig(storage_type="expbuf_test_list", path="/data/x"))
    assert isinstance(listed, ListReader) and asyncio.run(listed.read()) == ["/data/x"]
    with pytest.raises(ValueError, match="nosuch not supported"):
        trinity.buffer.get_buffer_writer(StorageConfig(storage_type="nosuch", path="/data/x"))
    with pytest.raises(ValueError, match="Invalid module key: nosuch"):
        trinity.buffer.get_buffer_reader(StorageConfig(storage_type="nosuch", path="/data/x"))


def test_write_restart_server_read_whole_groups_with_advantages(start_server: Servers) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
    pushed = group(0, [1.0, 0.0, 2.0, 0.5]) + group(1, [0.0, 0.0, 1.0, 3.0]) + group(2, [1.0, 0.0, 4.0])
    config = buffer_config(server.port, batch_size=8)

    async def explore() -> tuple[int, int, int]:
        first, second = trinity.buffer.get_buffer_writer(config), trinity.buffer.get_buffer_writer(config)
        await first.acquire()
        opened = await second.acquire()  # the server counts the table's writers
        await first.write(pushed[:8])
        await second.write(pushed[8:])  # task 2 has 3 of its 4 runs: sealed when the write ends
        return opened, await first.release(), await second.release()

    assert asyncio.run(explore()) == (2, 1, 0)
    server.stop(grace=1)
    server = start_server()  # same data directory, another port

    reader = trinity.buffer.get_buffer_reader(buffer_config(server.port, batch_size=8))
    first = asyncio.run(reader.read())
    assert sorted({e.eid.tid for e in first}) == ["3/0", "3/1"]
    check_whole_groups(first, pushed)
    with pytest.raises(ValueError, match="batch_size 3 is not a multiple of the group_size 4"):
        asyncio.run(reader.read(batch_size=3))
    sealed = asyncio.run(reader.read(batch_size=4))  # never more than asked: the sealed group is short
    check_whole_groups(sealed, pushed)
    assert len(sealed) == 3 and reader.state_dict()["current_index"] == 11


def test_trinity_pipeline_writes_and_sample_strategy_reads(start_server: Servers) -> None:
    """Trinity's explorer side (its experience pipeline) and trainer side (its sample strategy),
    from one Trinity Config whose experience buffer path is expbuf://."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
    config = Config()
    config.algorithm.algorithm_type, config.algorithm.advantage_fn = "grpo", "expbuf"
    config.algorithm.advantage_fn_args = {}
    config.data_processor.experience_pipeline.save_input = False
    config.buffer.trainer_input.experience_buffer = buffer_config(server.port, batch_size=4)
    pushed = group(0, [1.0, 0.0, 2.0, 0.5]) + group(1, [3.0, 1.0])

    async def explore() -> dict:
        pipeline = ExperiencePipeline(config)
        await pipeline.output.acquire()  # what prepare() does, without starting auxiliary models
        pipeline.operators = []
        pipeline._set_algorithm_operators(config.algorithm)
        metrics = await pipeline.process(Experience.serialize_many(pushed))
        await pipeline.close()  # task 1 has 2 of its 4 runs: sealed when the write ended
        return metrics

    assert asyncio.run(explore())["experience_pipeline/experience_count"] == 6
    strategy = DefaultSampleStrategy(config.buffer)
    first, _, _ = asyncio.run(strategy.sample(step=1))
    check_whole_groups(first, pushed)
    restarted = DefaultSampleStrategy(config.buffer)
    restarted.load_state_dict(strategy.state_dict())
    second, _, _ = asyncio.run(restarted.sample(step=2))
    check_whole_groups(second, pushed)
    assert sorted(e.eid.tid for e in first + second) == ["3/0"] * 4 + ["3/1"] * 2


def test_reader_restarts_from_its_state_dict(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
        pushed = [exp for task in range(3) for exp in group(task, [float(task), 1.0, 2.0, 5.0])]
        admin.push(Experience.serialize_many(pushed), TABLE)
    config = buffer_config(server.port, batch_size=4)

    trainer = trinity.buffer.get_buffer_reader(config)
    step1 = asyncio.run(trainer.read())
    step2 = asyncio.run(trainer.read())  # acknowledges step 1
    state = trainer.state_dict()  # a checkpoint after training on step 2, then the trainer dies
    assert len(state["lease_ids"]) == 1 and state["batches_read"] == 2 and state["current_index"] == 8

    restarted = trinity.buffer.get_buffer_reader(config)
    restarted.load_state_dict(state)
    step3 = asyncio.run(restarted.read())  # acknowledges step 2, which the checkpoint holds
    with BufferClient(target) as admin:
        stats = admin.stats(TABLE)[TABLE]
    assert (stats.consumed, stats.leased, stats.ready) == (8, 4, 0)
    assert len({e.eid.tid for e in step1 + step2 + step3}) == 3
    check_whole_groups(step3, pushed)
    assert restarted.state_dict()["current_index"] == 12


def test_reader_decodes_a_batch_without_the_collectors_passes(start_server: Servers) -> None:
    """Trinity's decode of a batch (Experience.deserialize_many) makes and drops a dozen objects an
    experience: the reader holds the collector's passes off while it runs (gc_pause.py), so none
    starts inside it, where at this threshold dozens would."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
        admin.push(
            Experience.serialize_many([exp for task in range(128) for exp in group(task, [0.0, 1.0, 2.0, 3.0])]), TABLE
        )
    reader = trinity.buffer.get_buffer_reader(buffer_config(server.port, batch_size=512))
    with passes_started(inside="deserialize_many") as inside:
        read = asyncio.run(reader.read())
    assert len(read) == 512 and gc.isenabled()
    assert inside and not any(inside)  # passes ran (the threshold is low), none inside the decode


def until(condition: Callable[[], bool], seconds: float = 60.0) -> bool:
    """Whether `condition` holds within `seconds` (a bound for a broken run, not a timing)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_reader_keeps_its_leases_while_it_lives_and_lets_them_go_when_closed(start_server: Servers) -> None:
    """A 1 s lease outlives a step of several seconds: the reader renews what it holds. Once the
    reader is closed, or dropped, its batch comes back within a lease."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
        admin.push(Experience.serialize_many([e for t in range(3) for e in group(t, [1.0, 2.0, 3.0, 4.0])]), TABLE)

        def counts() -> tuple[int, int, int, int]:
            stats = admin.stats(TABLE)[TABLE]
            return stats.ready, stats.leased, stats.consumed, stats.leases_expired

        config = buffer_config(server.port, 4, "lease_seconds=1")
        reader = trinity.buffer.get_buffer_reader(config)
        asyncio.run(reader.read())
        time.sleep(4)  # a training step four leases long
        assert counts() == (8, 4, 0, 0)
        asyncio.run(reader.read())  # acknowledges the first batch, still held
        assert counts() == (4, 4, 4, 0)
        reader.close()
        assert until(lambda: counts() == (8, 0, 4, 1))
        dropped = trinity.buffer.get_buffer_reader(config)
        asyncio.run(dropped.read())
        assert counts()[1] == 4
        del dropped
        gc.collect()
        assert until(lambda: counts() == (8, 0, 4, 2))


def test_a_read_given_up_on_gives_back_what_it_took(start_server: Servers) -> None:
    """A read of 64 finds 3 groups of 4 and waits for more; the trainer cancels it: the groups
    go back at once, not renewed for as long as the reader lives. So do they at max_read_timeout."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(TABLE, group_size=0, estimator="grpo")
        admin.writers(TABLE, 1)  # an explorer is open
        admin.push(Experience.serialize_many([e for t in range(3) for e in group(t, [1.0, 2.0, 3.0, 4.0])]), TABLE)
        reader = trinity.buffer.get_buffer_reader(buffer_config(server.port, 64, max_read_timeout=600.0))

        async def give_up() -> None:
            read = asyncio.ensure_future(reader.read())
            while admin.stats(TABLE)[TABLE].leased < 12:
                await asyncio.sleep(0.05)
            read.cancel()
            with pytest.raises(asyncio.CancelledError):
                await read

        asyncio.run(give_up())
        stats = admin.stats(TABLE)[TABLE]
        assert (stats.ready, stats.leased, stats.leases_expired) == (12, 0, 0)
        impatient = trinity.buffer.get_buffer_reader(buffer_config(server.port, 64, max_read_timeout=1.0))
        with pytest.raises(TimeoutError, match="max_read_timeout"):
            asyncio.run(impatient.read())
        stats = admin.stats(TABLE)[TABLE]
        assert (stats.ready, stats.leased, stats.leases_expired) == (12, 0, 0)


def test_reader_times_out_like_trinity_queue(start_server: Servers) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
        admin.push(Experience.serialize_many(group(0, [1.0, 2.0, 3.0])), TABLE)  # 3 of 4 runs
    reader = trinity.buffer.get_buffer_reader(buffer_config(server.port, batch_size=4, max_read_timeout=0.3))
    with pytest.raises(TimeoutError, match="max_read_timeout"):
        asyncio.run(reader.read())


def test_token_from_the_environment_and_push_only_writers(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server(tokens={"w-secret": frozenset({"push"}), "r-secret": frozenset({"sample", "admin"})})
    with BufferClient(f"127.0.0.1:{server.port}", token="r-secret") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
    monkeypatch.setenv("EXPBUF_TOKEN", "w-secret")
    monkeypatch.setenv("TRAINER_TOKEN", "r-secret")
    pushed = group(0, [1.0, 2.0, 3.0, 4.0]) + group(1, [1.0, 2.0])

    async def explore() -> int:
        writer = trinity.buffer.get_buffer_writer(buffer_config(server.port, batch_size=4))
        await writer.acquire()
        await writer.write(pushed)
        return await writer.release()  # cannot read the table's settings: seals nothing

    assert asyncio.run(explore()) == 0
    reader = trinity.buffer.get_buffer_reader(buffer_config(server.port, 4, "token_env=TRAINER_TOKEN"))
    check_whole_groups(asyncio.run(reader.read()), pushed)
    with BufferClient(f"127.0.0.1:{server.port}", token="r-secret") as admin:
        assert admin.stats(TABLE)[TABLE].groups_pending == 1


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def test_mutual_tls_from_the_environment_and_the_path(
    start_server: Servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer takes TLS from EXPBUF_TLS_CA and EXPBUF_TLS_CLIENT_*, the reader from the path's query."""
    d = tmp_path / "certs"
    d.mkdir()
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-days", "1", "-subj", "/CN=ca", "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem")
    for name, ext in {"server": "subjectAltName=IP:127.0.0.1", "client": "extendedKeyUsage=clientAuth"}.items():
        _openssl("req", *ec, "-subj", f"/CN={name}", "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr")
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", f"{d}/{name}.ext", "-out", f"{d}/{name}.pem")  # fmt: skip
    tls = TlsConfig(cert=f"{d}/server.pem", key=f"{d}/server.key", client_ca=f"{d}/ca.pem")
    server = start_server(tls=tls)
    admin_tls = Tls(f"{d}/ca.pem", f"{d}/client.pem", f"{d}/client.key")
    with BufferClient(f"127.0.0.1:{server.port}", tls=admin_tls) as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
    pushed = group(0, [1.0, 2.0, 3.0, 5.0])
    for name, suffix in (("CA", "ca.pem"), ("CLIENT_CERT", "client.pem"), ("CLIENT_KEY", "client.key")):
        monkeypatch.setenv(f"EXPBUF_TLS_{name}", str(d / suffix))
    # The server's own pair under the server's names, on the same host: the plug-in does not take it.
    monkeypatch.setenv("EXPBUF_SERVER_TLS_CERT", f"{d}/server.pem")
    monkeypatch.setenv("EXPBUF_SERVER_TLS_KEY", f"{d}/server.key")
    asyncio.run(trinity.buffer.get_buffer_writer(buffer_config(server.port, batch_size=4)).write(pushed))
    for name in ("CA", "CLIENT_CERT", "CLIENT_KEY"):
        monkeypatch.delenv(f"EXPBUF_TLS_{name}")
    query = f"tls_ca={d}/ca.pem&tls_cert={d}/client.pem&tls_key={d}/client.key"
    check_whole_groups(
        asyncio.run(trinity.buffer.get_buffer_reader(buffer_config(server.port, 4, query)).read()), pushed
    )
    # A path without the client's pair is refused by the server: a client of its TLS alone, not a
    # reader, whose start waits the client's timeout (30 s) for a server it cannot reach.
    without_client_cert = parse(buffer_config(server.port, 4, f"tls_ca={d}/ca.pem").path, env={})
    with (
        pytest.raises(BufferError) as refused,
        BufferClient(without_client_cert.target, tls=without_client_cert.tls, timeout=2, retries=0) as client,
    ):
        client.stats(TABLE)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_path_options() -> None:
    env = {"EXPBUF_TOKEN": "t0", "OTHER": "t1", "EXPBUF_TLS_CA": "/env/ca.pem"}
    plain = parse("expbuf://buffer.internal:6000/grpo8", env={})
    assert (plain.target, plain.table, plain.token, plain.tls) == ("buffer.internal:6000", "grpo8", None, None)
    assert parse("expbuf://[::1]/t", env={}).target == "[::1]:50051"
    located = parse(
        "expbuf://h:1/t?token_env=OTHER&tls_cert=/c.pem&tls_key=/c.key&lease_seconds=60&order=lifo&delivery=replay", env
    )
    assert (located.token, located.lease_seconds, located.order, located.delivery) == ("t1", 60.0, "lifo", "replay")
    assert (plain.delivery, plain.lease_seconds) == ("lease", 60.0)
    assert located.tls is not None
    assert (located.tls.root_certificates, located.tls.certificate_chain) == ("/env/ca.pem", "/c.pem")
    assert parse("expbuf://h:1/t?tls=1", env={}).tls.root_certificates is None  # system roots
    refused = {
        "expbuf://h:1/t?token=abc": "never goes in the path",
        "expbuf://user:pw@h:1/t": "credentials do not belong",
        "expbuf://h:1/t?colour=red": "'colour' is unknown",
        "expbuf://h:1/t?token_env=UNSET": "UNSET but that environment variable is not set",
        "expbuf://h:1/t?tls_cert=/c.pem": "go together",
        "expbuf://h:1/t?lease_seconds=0": "lease_seconds='0' must be a number > 0",
        "expbuf://h:1/t?order=random": "order='random'",
        "expbuf://h:1/t?delivery=keep": "delivery='keep'; expected one of consume, lease, replay",
        "expbuf://h:99999/t": "invalid port",
        "expbuf://h:1/a/b": "table 'a/b'",
        "sqlite:///x.db": "not an expbuf path",
    }
    for path, message in refused.items():
        with pytest.raises(ValueError, match=message):
            parse(path, env)


def test_expbuf_advantage_fn_keeps_the_buffers_advantages(start_server: Servers) -> None:
    fn_cls = ADVANTAGE_FN.get("expbuf")
    assert fn_cls is ExpbufAdvantageFn and not fn_cls.compute_in_trainer()
    fn = fn_cls(**fn_cls.default_args())

    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
        admin.push(Experience.serialize_many(group(0, [0.0, 1.0, 1.0, 7.0])), TABLE)
    read = asyncio.run(trinity.buffer.get_buffer_reader(buffer_config(server.port, batch_size=4)).read())
    before = [exp.advantages.clone() for exp in read]

    # In Trinity's experience pipeline (an operator before the buffer) and on a list: untouched.
    out, metrics = fn(read)
    assert out is read and metrics == {}
    piped, _ = asyncio.run(ensure_v1_operator(fn).process(read))
    for exps in (out, piped):
        assert all(torch.equal(exp.advantages, b) for exp, b in zip(exps, before, strict=True))
    # In the trainer, on the batch Trinity built from the experiences (verl's DataProto holds
    # its tensors in `.batch`): the advantages stay as they are.
    advantages = torch.stack(before)
    batch = SimpleNamespace(batch={"advantages": advantages, "returns": advantages.clone()})
    same, _ = fn(batch)
    assert same is batch and same.batch["advantages"] is advantages
    assert torch.equal(same.batch["advantages"], torch.stack(before))
    with pytest.raises(ValueError, match="no advantages in the batch"):
        fn(SimpleNamespace(batch={"token_level_rewards": advantages}))


@pytest.mark.parametrize("kl_penalty_fn", ["none", "k2"])
def test_expbuf_advantage_fn_refuses_rewards_the_trainer_changed(kl_penalty_fn: str) -> None:
    """Trinity's trainer puts algorithm.kl_penalty_fn's KL penalty in a batch's rewards before its
    advantage function, for algorithms computing advantages there: the buffer's advantages, from
    the rewards as pushed, would leave it out, silently. Refused, naming the setting; none passes."""
    from trinity.algorithm.kl_fn import KL_FN
    from verl import DataProto

    rows, length = 4, 3
    scores = torch.zeros(rows, length)
    scores[:, -1] = torch.tensor([0.0, 1.0, 1.0, 7.0])
    batch = DataProto.from_dict(
        {
            "responses": torch.ones(rows, length, dtype=torch.long),
            "attention_mask": torch.ones(rows, 2 + length, dtype=torch.long),
            "response_mask": torch.ones(rows, length),
            "token_level_scores": scores,
            "old_log_probs": torch.full((rows, length), -0.5),
            "ref_log_prob": torch.full((rows, length), -0.9),
            "advantages": torch.ones(rows, length),
        }
    )
    penalized, _ = KL_FN.get(kl_penalty_fn)(kl_coef=0.1).apply_kl_penalty_to_reward(batch)
    fn = ADVANTAGE_FN.get("expbuf")()
    if kl_penalty_fn == "none":
        assert fn(penalized)[0] is penalized
    else:
        with pytest.raises(ValueError, match="kl_penalty_fn"):
            fn(penalized)


def test_import_expbuf_client_loads_no_trinity() -> None:
    code = "import sys, expbuf.client; print(sorted(m for m in sys.modules if m.split('.')[0] == 'trinity'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_reader_tells_the_table_the_trainers_model_version(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo", max_staleness=1)
        admin.push(Experience.serialize_many(group(0, [1.0, 2.0, 3.0, 4.0])), TABLE)
    reader = trinity.buffer.get_buffer_reader(buffer_config(server.port, batch_size=4))
    with pytest.raises(ValueError, match="model_version must be a non-negative integer, got '-1'"):
        asyncio.run(reader.read(model_version=-1))
    assert len(asyncio.run(reader.read(min_model_version=1, model_version=2))) == 4
    stale = group(1, [1.0, 2.0, 3.0, 4.0])
    for exp in stale:
        exp.info["model_version"] = 0
    with BufferClient(target) as admin:
        assert admin.stats(TABLE)[TABLE].trainer_version == 2
        result = admin.push(Experience.serialize_many(stale), TABLE)
    assert sorted(result.stale) == sorted(exp.eid.uid for exp in stale)


def test_expbuf_sample_strategy_passes_the_trainers_version(start_server: Servers) -> None:
    from trinity.algorithm.sample_strategy import SAMPLE_STRATEGY

    from expbuf.client.trinity import ExpbufSampleStrategy

    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
        old, fresh = group(0, [1.0, 2.0, 3.0, 4.0]), group(1, [4.0, 3.0, 2.0, 1.0])
        for exp in fresh:
            exp.info["model_version"] = 5
        admin.push(Experience.serialize_many(old + fresh), TABLE)
    config = Config()
    config.buffer.trainer_input.experience_buffer = buffer_config(server.port, batch_size=4)
    strategy_cls = SAMPLE_STRATEGY.get("expbuf")
    assert strategy_cls is ExpbufSampleStrategy
    strategy = strategy_cls(config.buffer, max_staleness=1)
    # Trinity asks for step 7 after 6 finished steps: the trainer holds version 6, so 5 is the oldest taken.
    batch, metrics, _ = asyncio.run(strategy.sample(step=7))
    assert sorted({e.eid.tid for e in batch}) == ["3/1"]
    assert metrics["sample/model_version/max"] == 5
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        assert admin.stats(TABLE)[TABLE].trainer_version == 6


def test_tls_variables_name_the_server_and_the_client_apart(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EXPBUF_SERVER_TLS_* are `expbuf serve`'s pair, EXPBUF_TLS_CLIENT_* the plug-in's (as for
    `expbuf stats`/`health`); the old EXPBUF_TLS_CERT/KEY still work for one release, with a warning."""
    from expbuf.server.config import load

    for var in ("EXPBUF_TLS_CERT", "EXPBUF_TLS_KEY", "EXPBUF_TLS_CLIENT_CA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EXPBUF_SERVER_TLS_CERT", "/srv/server.pem")
    monkeypatch.setenv("EXPBUF_SERVER_TLS_KEY", "/srv/server.key")
    monkeypatch.setenv("EXPBUF_SERVER_TLS_CLIENT_CA", "/srv/ca.pem")
    assert load().tls == TlsConfig(cert="/srv/server.pem", key="/srv/server.key", client_ca="/srv/ca.pem")
    env = {"EXPBUF_SERVER_TLS_CERT": "/srv/server.pem", "EXPBUF_SERVER_TLS_KEY": "/srv/server.key"}
    assert parse("expbuf://h:1/t", env=env).tls is None  # the server's pair is never the client's
    client = parse("expbuf://h:1/t", env={**env, "EXPBUF_TLS_CLIENT_CERT": "/c.pem", "EXPBUF_TLS_CLIENT_KEY": "/c.key"})
    assert (client.tls.certificate_chain, client.tls.private_key) == ("/c.pem", "/c.key")
    assert not caplog.records

    for var in env:
        monkeypatch.delenv(var)
    monkeypatch.delenv("EXPBUF_SERVER_TLS_CLIENT_CA")
    monkeypatch.setenv("EXPBUF_TLS_CERT", "/old/cert.pem")
    monkeypatch.setenv("EXPBUF_TLS_KEY", "/old/key.pem")
    with caplog.at_level(logging.WARNING):
        assert load().tls == TlsConfig(cert="/old/cert.pem", key="/old/key.pem", client_ca=None)
        old = parse("expbuf://h:1/t", env={"EXPBUF_TLS_CERT": "/old/cert.pem", "EXPBUF_TLS_KEY": "/old/key.pem"})
    assert old.tls.certificate_chain == "/old/cert.pem"
    assert "EXPBUF_TLS_CERT is renamed EXPBUF_SERVER_TLS_CERT" in caplog.text
    assert "EXPBUF_TLS_CERT is renamed EXPBUF_TLS_CLIENT_CERT for clients" in caplog.text


def test_table_settings_in_the_path_are_refused_with_where_they_go() -> None:
    for name in ("max_staleness=2", "batch_size=8", "on_stale=drop", "samples_per_insert=2"):
        with pytest.raises(ValueError, match=r"setting of the table.*TOML \[\[tables\]\] or with create_table"):
            parse(f"expbuf://h:1/t?{name}", env={})


def test_a_writer_released_after_a_restart_does_not_end_the_table_another_still_writes(
    start_server: Servers,
) -> None:
    """Two explorers' writers acquire; the server restarts, forgetting its count of writers (kept
    in memory); one explorer releases while the other still explores. Its release found no writer
    open and ended the table as a release without an acquire does: the trainer's next read ended
    (StopAsyncIteration) and the other explorer's next step was never trained (a helper's audit).
    A writer that acquired ends nothing where the server forgot it: the trainer reads on."""
    server = start_server()
    port = server.port
    with BufferClient(f"127.0.0.1:{port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
    config = buffer_config(port, batch_size=4)
    first, second = trinity.buffer.get_buffer_writer(config), trinity.buffer.get_buffer_writer(config)
    assert (asyncio.run(first.acquire()), asyncio.run(second.acquire())) == (1, 2)
    asyncio.run(first.write(group(0, [1.0, 0.0, 2.0, 0.5])))
    start_server.stop(server)
    start_server(port=port)
    assert asyncio.run(first.release()) == 0
    reader = trinity.buffer.get_buffer_reader(config)
    assert sorted({e.eid.tid for e in asyncio.run(reader.read())}) == ["3/0"]
    later = threading.Timer(2.5, lambda: asyncio.run(second.write(group(1, [0.0, 0.0, 1.0, 3.0]))))
    later.start()
    try:
        read = asyncio.run(reader.read())  # the second explorer's next step, not the end of data
    finally:
        later.join()
    assert sorted({e.eid.tid for e in read}) == ["3/1"]


def test_a_late_release_of_a_tables_earlier_life_does_not_end_the_table_made_again(start_server: Servers) -> None:
    """A run's writer acquires; the table is dropped and made again for the next run, whose writer
    acquires; the first run's writer releases late. The server counted writers by table name: the
    late close took the new run's count to 0 and ended its table, its trainer's reads ending while
    its explorers still wrote (a helper's audit). Each writer names itself now: its close counts
    against the table it opened alone, and an open or close made again counts once."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
        config = buffer_config(server.port, batch_size=4)
        old = trinity.buffer.get_buffer_writer(config)
        assert asyncio.run(old.acquire()) == 1
        admin.drop_table(TABLE)
        admin.create_table(TABLE, group_size=4, estimator="grpo")
        new = trinity.buffer.get_buffer_writer(config)
        assert asyncio.run(new.acquire()) == 1
        assert asyncio.run(old.release()) == 1  # the new run's writer is still open
        assert admin.writers(TABLE) == (1, False)
        assert admin.writers(TABLE, 1, "w") == (2, False) == admin.writers(TABLE, 1, "w")  # made again: once
        assert admin.writers(TABLE, -1, "w") == (1, False) == admin.writers(TABLE, -1, "w")
        assert asyncio.run(new.release()) == 0
        assert admin.writers(TABLE) == (0, True)


def test_a_server_restart_of_a_second_or_two_is_ridden_out_by_the_writer_and_the_reader(
    start_server: Servers,
) -> None:
    """The server goes away for 1.5 s, once under a write and once under a read: each waits for it
    (for the client's timeout) rather than raising UNAVAILABLE after gRPC's own retries (under a
    second), which ended Trinity's training loop and lost the written group; the read acks the
    batch before it, trained."""
    server = start_server()
    port = server.port
    with BufferClient(f"127.0.0.1:{port}") as admin:
        admin.create_table(TABLE, group_size=4, estimator="grpo")
    config = buffer_config(port, batch_size=4)
    writer, reader = trinity.buffer.get_buffer_writer(config), trinity.buffer.get_buffer_reader(config)
    asyncio.run(writer.write(group(0, [1.0, 0.0, 2.0, 0.5])))
    first = asyncio.run(reader.read())
    second_group = group(1, [0.0, 0.0, 1.0, 3.0])
    read: list[list[Experience]] = []
    for call in (lambda: asyncio.run(writer.write(second_group)), lambda: read.append(asyncio.run(reader.read()))):
        start_server.stop(server)
        restarted: list[ExpbufServer] = []
        back = threading.Timer(1.5, lambda into=restarted: into.append(start_server(port=port)))
        back.start()
        try:
            call()
        finally:
            back.join()
        server = restarted[0]
    assert sorted({e.eid.tid for e in first}) == ["3/0"] and sorted({e.eid.tid for e in read[0]}) == ["3/1"]
    check_whole_groups(read[0], second_group)
    with BufferClient(f"127.0.0.1:{port}") as admin:
        stats = admin.stats(TABLE)[TABLE]
    assert (stats.consumed, stats.leased, stats.ready) == (4, 4, 0), stats


def test_a_writer_made_while_the_server_restarts_waits_for_it_and_seals_short_groups(start_server: Servers) -> None:
    """Made while the server could not be reached (a job started before it, a restart), the
    writer logged that the settings were not checked and sealed no group a write left short: the
    group (6 of 8 runs, 2 dropped by a reward filter) stayed pending and the trainer timed out. It
    waits for the server, as its writes do."""
    server = start_server()
    port = server.port
    with BufferClient(f"127.0.0.1:{port}") as admin:
        admin.create_table(TABLE, group_size=8, estimator="grpo")
    start_server.stop(server)
    restarted: list[ExpbufServer] = []
    back = threading.Timer(1.5, lambda: restarted.append(start_server(port=port)))
    back.start()
    try:
        writer = trinity.buffer.get_buffer_writer(buffer_config(port, batch_size=8))
    finally:
        back.join()
    asyncio.run(writer.write(group(0, [1.0, 0.0, 2.0, 0.5, 0.0, 1.0])))
    with BufferClient(f"127.0.0.1:{port}") as admin:  # the short group, sealed and computed
        assert until(lambda: (admin.stats(TABLE)[TABLE].pending, admin.stats(TABLE)[TABLE].ready) == (0, 6))


def test_the_end_of_data_waits_for_the_groups_still_computing(start_server: Servers) -> None:
    """The explorer writes its last step and releases (ExperiencePipeline.close), the trainer reads
    to the end of data: the reader ended on an empty take as soon as the writers were done, while
    the step's groups were still computing (a fresh server's advantage worker starting, here an
    estimator held for 3 s), and they were never trained."""
    computed = threading.Event()

    def held(batch: estimators.FlatBatch) -> estimators.Advantages:
        computed.wait(60)
        return estimators.reinforce(batch)

    with registered(Estimator("held_for_3_s", ingest=held, token_level=True)) as name:  # the worker computes it
        server = start_server()
        with BufferClient(f"127.0.0.1:{server.port}") as admin:
            admin.create_table(TABLE, group_size=4, estimator=name)
        config = buffer_config(server.port, batch_size=4)
        writer, reader = trinity.buffer.get_buffer_writer(config), trinity.buffer.get_buffer_reader(config)

        async def last_step_then_read() -> list[Experience]:
            await writer.acquire()
            await writer.write(group(0, [1.0, 0.0, 2.0, 0.5]))
            await writer.release()
            read: list[Experience] = []
            with pytest.raises(StopAsyncIteration, match="its writers are done and it is empty"):
                while True:
                    read += await reader.read()
            return read

        release = threading.Timer(3.0, computed.set)
        release.start()
        try:
            read = asyncio.run(last_step_then_read())
        finally:
            release.join()
    assert sorted(e.eid.run for e in read) == [0, 1, 2, 3]
