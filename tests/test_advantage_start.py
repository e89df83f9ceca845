"""torch loads after the server listens, and only once a table needs advantages computed
(server/advantages/start.py): the server's modules import no torch, nor does a server that no
table needs it for; a push that comes before it has loaded is answered, and its groups are
computed once it has; a stop does not wait for it; and where torch cannot load, the server still
serves what needs no advantages and refuses by name each push that does."""

from __future__ import annotations

import gc
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expbuf.client import BufferClient, InvalidArgumentError, ResourceExhaustedError, trxp
from expbuf.client.errors import ExpbufError
from expbuf.server.advantages import estimators
from expbuf.server.config import ServerConfig, load
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import ConfigError
from expbuf.server.store.schema.estimator_registry import Estimator
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import ServerProcess, group_items, make_experience, pythonpath, registered, scrape, wait_for

UP = ("expbuf_advantage_worker_up", ())

SERVER_MODULES = (
    "expbuf.server.app",
    "expbuf.server.cli",
    "expbuf.server.rpc.service",
    "expbuf.server.rpc.interceptors.metrics",
)


def test_the_servers_modules_import_no_torch() -> None:
    code = f"import sys\nfor m in {SERVER_MODULES!r}: __import__(m)\nprint('torch' in sys.modules)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0 and child.stdout.strip() == "False", child.stderr


# torch, held back until a file appears: its import, on the server's loading thread, cannot end before
# then; the file's name with ".asked" appears once the import has begun
HELD_TORCH = """import os, sys, time
gate, here = os.environ["EXPBUF_TEST_TORCH_GATE"], os.path.dirname(os.path.abspath(__file__))
open(gate + ".asked", "w").close()
while not os.path.exists(gate):
    time.sleep(0.02)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules["torch"]
import torch
"""


def held_torch(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A child's environment whose torch loads only once the returned file exists."""
    held, gate = tmp_path / "held", tmp_path / "torch-may-load"
    held.mkdir()
    (held / "torch.py").write_text(HELD_TORCH)
    return {"PYTHONPATH": pythonpath(held), "EXPBUF_TEST_TORCH_GATE": str(gate)}, gate


def asked(gate: Path) -> bool:
    """Whether the child behind `held_torch` has begun to import torch."""
    return gate.with_name(gate.name + ".asked").exists()


def serves_what_needs_no_advantages(client: BufferClient) -> None:
    """A table without an estimator takes a group and hands it out."""
    client.create_table("plain", group_size=2, estimator="none")
    client.push(trxp.build(group_items(0, 0, 2)), table="plain")
    (batch,) = client.sample("plain", num_groups=1, max_batches=1, delivery="consume")
    assert len(batch.uids) == 2


def left_to_compute(data: Path) -> None:
    """A data directory whose table `left` (grpo) holds a group still to compute: a server
    started on it needs its advantage worker at once."""
    with Store(data) as store:
        store.create_table(TableConfig.of("left", group_size=2, estimator="grpo"))
        store.put("left", group_items(0, 0, 1, reward=1.0))  # pending: one of two


def test_a_server_that_no_table_needs_advantages_of_loads_no_torch(tmp_path: Path) -> None:
    """Nothing makes a server load torch but a table that needs advantages computed: a start,
    a table without an estimator pushed to and sampled, a table with one created and left alone
    do not (torch's import cost each `expbuf serve` 1.5-2.5 s of CPU at its start, needed or not);
    ServerInfo says the worker is not needed, and the gauge is 1 (nothing is amiss). The first push
    to a table with an estimator loads it, and its groups are computed."""
    env, gate = held_torch(tmp_path)
    gate.touch()  # torch loads as soon as it is asked for
    server = ServerProcess(str(tmp_path / "data"), env=env)
    try:
        with BufferClient(server.target, timeout=30) as client:
            serves_what_needs_no_advantages(client)
            client.create_table("g", group_size=4, estimator="grpo")
            assert not asked(gate), "".join(server.log)
            info = client.server_info()
            assert (info.advantage_worker_state, info.advantage_device, info.advantage_worker_failure) == (
                "not_needed",
                "",
                "",
            )
            assert scrape(server.metrics_port)[UP] == 1
            client.push([make_experience(0, 0, run, reward=float(run)) for run in range(4)], table="g")
            wait_for(lambda: client.stats("g")["g"].ready == 4, "the group pushed computed")
            (batch,) = client.sample("g", num_groups=1, max_batches=1, delivery="consume")
            firsts = sorted(float(e.advantages.flatten()[0]) for e in batch.experiences)
            assert firsts[0] < 0 < firsts[-1]  # GRPO's: rewards 0..3 around their mean
            wait_for(lambda: client.server_info().advantage_worker_state == "running", "the worker said it runs")
            assert client.server_info().advantage_device in ("cpu", "cuda")
            assert scrape(server.metrics_port)[UP] == 1
            assert asked(gate)
    finally:
        server.stop(signal.SIGTERM)
    log = "".join(server.log)
    assert "advantage worker not needed yet" in log, log
    assert "advantage worker loading torch: table 'g' computes advantages with grpo" in log, log


def test_a_push_that_stores_nothing_loads_no_torch(tmp_path: Path) -> None:
    """A push that the rate limit holds, or that a full table of when_full = block holds, until
    its deadline stores nothing, and needs nothing computed: it is refused RESOURCE_EXHAUSTED,
    and torch does not begin to load. It did: the push's refusal, due just before its deadline,
    raced torch's import, which holds the interpreter for seconds at a time under load, and the
    caller saw DEADLINE_EXCEEDED (a push it could not tell from one lost)."""
    data = str(tmp_path / "data")
    first = ServerProcess(data, "--advantage-worker", "at_start")
    try:
        with BufferClient(first.target, timeout=30) as client:
            client.create_table("limited", group_size=2, samples_per_insert=1.0, samples_per_insert_error=1.0)
            client.create_table("full", group_size=2, capacity_experiences=2, when_full="block")
            for table in ("limited", "full"):
                client.push(trxp.build(group_items(0, 0, 2)), table=table)
                wait_for(lambda t=table: client.stats(t)[t].ready == 2, f"{table}'s group computed")
    finally:
        assert first.stop(signal.SIGTERM) == 0, "".join(first.log)
    env, gate = held_torch(tmp_path)  # the gate stays shut: a push that began torch's import shows
    server = ServerProcess(data, env=env)
    try:
        with BufferClient(server.target, timeout=30, retries=0) as client:
            for table in ("limited", "full"):
                with pytest.raises(ResourceExhaustedError):
                    client.push(trxp.build(group_items(0, 1, 2)), table=table, timeout=1)
                assert client.stats(table)[table].pushed == 2
            assert client.server_info().advantage_worker_state == "not_needed"
            assert not asked(gate), "".join(server.log)
    finally:
        server.stop(signal.SIGKILL)


@pytest.mark.parametrize("left", ["computing", "pending"])
def test_a_server_loads_torch_at_its_start_for_groups_left_to_compute(tmp_path: Path, left: str) -> None:
    """Groups the last run left to compute (computing, or pending: a timeout or a seal may
    complete them with no push of this run) need the worker at the start, with no push to ask for
    it; those computing are computed."""
    data = tmp_path / "data"
    with Store(data) as store:  # a store without a server computes nothing: full groups stay computing
        store.create_table(TableConfig.of("left", group_size=2, estimator="grpo"))
        store.put("left", group_items(0, 0, 2 if left == "computing" else 1, reward=1.0))
        assert store.stats("left")[left] > 0
    env, gate = held_torch(tmp_path)
    server = ServerProcess(str(data), env=env, warm=False)
    try:
        with BufferClient(server.target, timeout=30) as client:
            wait_for(lambda: asked(gate), "the start began to load torch")
            assert client.server_info().advantage_worker_state == "loading"
            assert scrape(server.metrics_port)[UP] == 0
            gate.touch()
            wait_for(lambda: client.server_info().advantage_worker_state == "running", "the worker started")
            if left == "computing":
                wait_for(lambda: client.stats("left")["left"].ready == 2, "the group left computing computed")
    finally:
        gate.touch()
        server.stop(signal.SIGTERM)
    log = "".join(server.log)
    assert "advantage worker loading torch: table 'left' holds groups whose advantages are still to compute" in log


def test_advantage_worker_at_start_loads_torch_at_the_start(tmp_path: Path) -> None:
    """`advantage_worker = "at_start"` loads torch at the start, with nothing to compute: a torch
    that cannot load shows at once, and the first pushes compute their advantages themselves."""
    assert load(None).advantage_worker == "when_needed"
    toml = tmp_path / "expbuf.toml"
    toml.write_text('advantage_worker = "at_start"\n')
    assert load(str(toml)).advantage_worker == "at_start"
    with pytest.raises(ConfigError, match="advantage_worker must be 'when_needed' or 'at_start', got 'soon'"):
        ServerConfig(data=str(tmp_path), advantage_worker="soon")
    env, gate = held_torch(tmp_path)
    server = ServerProcess(str(tmp_path / "data"), "--advantage-worker", "at_start", env=env, warm=False)
    try:
        wait_for(lambda: asked(gate), "the start began to load torch")
        with BufferClient(server.target, timeout=30) as client:
            assert client.server_info().advantage_worker_state == "loading"
            gate.touch()
            wait_for(lambda: client.server_info().advantage_worker_state == "running", "the worker started")
    finally:
        gate.touch()
        server.stop(signal.SIGTERM)
    assert "advantage worker loading torch: advantage_worker = at_start" in "".join(server.log)


def test_a_push_while_torch_loads_is_answered_and_computed_once_it_has(tmp_path: Path) -> None:
    """torch's import is in no push's path: a push to a table with an estimator is answered while
    torch cannot load (it waited for it, and its deadline expired under load), its groups
    computing; once torch has loaded, the worker computes them."""
    env, gate = held_torch(tmp_path)
    server = ServerProcess(str(tmp_path / "data"), env=env, warm=False)
    try:
        with BufferClient(server.target, timeout=30) as client:
            client.create_table("g", group_size=4, estimator="grpo")
            client.push([make_experience(0, 0, run, reward=float(run)) for run in range(4)], table="g")
            assert client.stats("g")["g"].computing == 4
            loading = client.server_info()
            assert loading.advantage_device == "" and loading.advantage_worker_failure == ""
            assert loading.advantage_worker_state == "loading"
            assert scrape(server.metrics_port)[UP] == 0  # not up yet, and not failed
            gate.touch()
            wait_for(lambda: client.stats("g")["g"].ready == 4, "the worker computed the group pushed before it")
            (batch,) = client.sample("g", num_groups=1, max_batches=1, delivery="consume")
            firsts = sorted(float(e.advantages.flatten()[0]) for e in batch.experiences)
            assert firsts[0] < 0 < firsts[-1]  # GRPO's: rewards 0..3 around their mean
            assert client.server_info().advantage_device in ("cpu", "cuda")
            assert scrape(server.metrics_port)[UP] == 1
    finally:
        gate.touch()
        server.stop(signal.SIGTERM)


def test_a_stop_while_torch_loads_does_not_wait_for_it(tmp_path: Path) -> None:
    """A stop ends the server while torch still loads (it waited for the worker to come up), and
    no worker starts after it. The process ends at once (os._exit), not through the interpreter's
    exit, which, run beside torch's import under way, once died of SIGABRT after the stop had
    committed everything (exit code -6 in a clean clone's CI)."""
    env, _ = held_torch(tmp_path)  # the gate stays shut
    server = ServerProcess(str(tmp_path / "data"), env=env, warm=False)
    try:
        with BufferClient(server.target, timeout=30) as client:
            client.create_table("g", group_size=2, estimator="grpo")
            client.push(trxp.build(group_items(0, 0, 2, reward=1.0)), table="g")
        assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = "".join(server.log)
    assert "expbuf stopped" in log and "advantage worker started" not in log, log
    assert "torch's import still under way: the process ends without waiting for it" in log
    with Store(tmp_path / "data") as store:
        assert store.stats("g")["computing"] == 2  # for the next start's worker


def test_a_server_whose_torch_cannot_load_serves_what_needs_none(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "torch.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    left_to_compute(tmp_path / "data")  # torch is needed at the start, and fails to load
    server = ServerProcess(str(tmp_path / "data"), env={"PYTHONPATH": pythonpath(broken)})
    try:
        with BufferClient(server.target, timeout=60) as client:
            serves_what_needs_no_advantages(client)
            client.create_table("g", group_size=2, estimator="grpo")
            with pytest.raises(ExpbufError, match="advantages cannot be computed on this server") as refused:
                client.push(trxp.build(group_items(1, 0, 2)), table="g")
            assert not isinstance(refused.value, InvalidArgumentError)
            assert "this torch is broken on purpose" in str(refused.value)
            assert client.stats("g")["g"].pushed == 0  # stored nothing
            assert client.server_info().advantage_device == ""
    finally:
        server.stop(signal.SIGTERM)
    said = [line for line in server.log if " ERROR " in line and "advantage worker did not start" in line]
    assert len(said) == 1, "".join(server.log)  # once: a refusal names it at INFO


def test_an_advantage_worker_that_cannot_start_is_plain_to_its_operator(tmp_path: Path) -> None:
    """Where torch cannot load, the log says so once at ERROR, naming the cause and what it means
    on its first line; ServerInfo names the cause (`advantage_worker_failure`) and the gauge
    `expbuf_advantage_worker_up` is 0, for an alert. Health stays SERVING: what needs no
    advantages is served, and a restart would not mend a broken torch. Before, ServerInfo's
    empty `advantage_device` read as a server whose torch still loads, and the metrics said nothing."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "torch.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    cause = "ImportError: this torch is broken on purpose"
    left_to_compute(tmp_path / "data")  # torch is needed at the start, and fails to load
    server = ServerProcess(str(tmp_path / "data"), env={"PYTHONPATH": pythonpath(broken)})
    try:
        with BufferClient(server.target, timeout=60) as client, grpc.insecure_channel(server.target) as channel:
            client.create_table("g", group_size=2, estimator="grpo")
            with pytest.raises(ExpbufError, match=cause):
                client.push(trxp.build(group_items(0, 0, 2, reward=1.0)), table="g")
            info = client.server_info()
            assert info.advantage_device == ""
            assert info.advantage_worker_failure == f"the advantage worker did not start: {cause}"
            assert info.advantage_worker_state == "failed"
            assert scrape(server.metrics_port)[UP] == 0
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(signal.SIGTERM)
    (error,) = [line for line in server.log if " ERROR " in line]  # the traceback's lines follow it
    assert "advantage worker did not start" in error and cause in error, error
    assert "refused" in error and "fail" in error, error  # what it means for pushes and groups computing


BROKEN_LATER = """import os, time
gate = os.environ["EXPBUF_TEST_TORCH_GATE"]
while not os.path.exists(gate):
    time.sleep(0.02)
raise ImportError("this torch is broken on purpose")
"""


def test_groups_pushed_while_a_torch_that_cannot_load_loads_fail_naming_why(tmp_path: Path) -> None:
    """A push that comes while torch loads is answered, its groups computing for the worker; where
    torch then fails to load, no worker ever computes them: they fail, each table's Stats naming
    the cause (they stayed computing for ever, the server saying nothing of them), and a push
    after is refused by name."""
    broken, gate = tmp_path / "broken", tmp_path / "torch-may-load"
    broken.mkdir()
    (broken / "torch.py").write_text(BROKEN_LATER)
    env = {"PYTHONPATH": pythonpath(broken), "EXPBUF_TEST_TORCH_GATE": str(gate)}
    server = ServerProcess(str(tmp_path / "data"), env=env)
    try:
        with BufferClient(server.target, timeout=30) as client:
            client.create_table("g", group_size=2, estimator="grpo")
            assert client.server_info().advantage_worker_state == "not_needed"  # a broken torch matters not yet
            assert scrape(server.metrics_port)[UP] == 1
            client.push(trxp.build(group_items(0, 0, 2, reward=1.0)), table="g")
            assert client.stats("g")["g"].groups_computing == 1
            gate.touch()
            wait_for(lambda: client.stats("g")["g"].groups_failed == 1, "the group pushed while torch loaded failed")
            stats = client.stats("g")["g"]
            assert stats.computing == 0 and stats.groups_computing == 0, stats
            assert "advantages cannot be computed on this server" in stats.last_failure, stats.last_failure
            assert "this torch is broken on purpose" in stats.last_failure, stats.last_failure
            with pytest.raises(ExpbufError, match="advantages cannot be computed on this server"):
                client.push(trxp.build(group_items(1, 0, 2)), table="g")
            assert client.server_info().advantage_worker_state == "failed"
            assert scrape(server.metrics_port)[UP] == 0
    finally:
        gate.touch()
        assert server.stop(signal.SIGTERM) == 0, "".join(server.log)


def test_an_advantage_worker_that_ends_is_reported_as_one_that_did_not_start(
    start_server: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker retries a pass that raises an Exception; one that raises what is not an
    Exception (SystemExit, from an estimator that calls sys.exit) ended its thread without a word
    (threading says nothing of SystemExit): pushes were taken and their groups stayed computing,
    ServerInfo and the metrics saying the worker was up. It is now the state of a worker that did
    not start: logged once at ERROR, named in ServerInfo, the gauge at 0, the groups left
    computing failed naming it, a push that needs advantages refused."""

    def exits(b: estimators.FlatBatch) -> estimators.Advantages:
        raise SystemExit("this estimator exits on purpose")

    caplog.set_level(logging.INFO, logger="expbuf")
    server = start_server()
    cause = "SystemExit: this estimator exits on purpose"
    with (
        registered(Estimator("exits", ingest=exits, token_level=True)) as name,
        BufferClient(f"127.0.0.1:{server.port}", timeout=30) as client,
    ):
        client.create_table("x", group_size=2, estimator=name)
        wait_for(lambda: scrape(server.metrics_port)[UP] == 1, "the worker started")  # torch loads after the start
        client.push(trxp.build(group_items(0, 0, 2, reward=1.0)), table="x")  # the worker computes it, and ends
        wait_for(lambda: client.stats("x")["x"].groups_failed == 1, "the group left computing failed")
        assert cause in client.stats("x")["x"].last_failure
        info = client.server_info()
        assert info.advantage_worker_failure == f"the advantage worker ended: {cause}"
        assert scrape(server.metrics_port)[UP] == 0
        with pytest.raises(ExpbufError, match="advantages cannot be computed on this server"):
            client.push(trxp.build(group_items(1, 0, 2, reward=1.0)), table="x")
    (error,) = [r for r in caplog.records if r.getMessage().startswith("the advantage worker")]
    assert error.levelno == logging.ERROR and cause in error.getMessage(), error.getMessage()


@pytest.mark.parametrize("advantage_worker", ["at_start", "when_needed"])
def test_what_the_server_loaded_at_its_start_is_out_of_the_collectors_sight(
    start_server: Servers, advantage_worker: str
) -> None:
    """Once torch has loaded, or at the start where nothing needs it, the server freezes its heap
    (gc.freeze): a full collection, which the records of takes and pushes bring on, then walks only
    what was made since. A server that loads no torch froze nothing: each full collection walked
    its own modules' objects."""
    before = gc.get_freeze_count()
    live = [[] for _ in range(10_000)]  # tracked objects that are alive when the server freezes
    server = start_server(advantage_worker=advantage_worker)
    deadline = time.monotonic() + 120
    while server.service.advantage_worker_state not in ("running", "not_needed"):
        assert time.monotonic() < deadline, "the advantage worker did not start"
        time.sleep(0.05)
    try:
        assert gc.get_freeze_count() >= before + len(live)
    finally:
        gc.unfreeze()  # this test process's objects, frozen with the server's
