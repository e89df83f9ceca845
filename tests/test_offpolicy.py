"""Off-policy control: the trainer's version, the version index, admission and rate limits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from expbuf.client import AsyncBufferClient, BufferClient, BufferError, PermissionDeniedError, trxp
from expbuf.client.rpc import declare
from expbuf.client.torch import ExperienceDataset
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.config import load
from expbuf.server.store import Entry, Store
from expbuf.server.store.disk import layout
from expbuf.server.store.rules.limiter import InsertLimited, SampleLimited
from expbuf.server.store.schema.errors import InvalidRequest, NotFound
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import ConfigError, TableConfig

from conftest import FIXTURES, Servers
from helpers import group_items, scrape
from pages import code_blocks, page

# ---- the trainer's version -----------------------------------------------------------------


def test_trainer_version_is_stored_shown_exported_and_measures_staleness(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, timeout=20) as c:
        c.create_table("t", estimator="none", group_size=2)
        assert c.stats("t")["t"].trainer_version == -1
        assert c.set_trainer_version(3, "t") == 3
        assert c.stats("t")["t"].trainer_version == 3
        with pytest.raises(BufferError) as bad:
            c._run(declare.Unary("SetTrainerVersion", _request("t", -2), lambda reply: reply.version, retry=False))
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "version" in bad.value.details
        with pytest.raises(BufferError) as missing:
            c.set_trainer_version(1, "nope")
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ValueError, match="version"):
            c.set_trainer_version(-1, "t")
        c.push(trxp.build(group_items(1, 0, 2, version=1)), table="t")
        c.push(trxp.build(group_items(1, 1, 2, version=4)), table="t")
        batch = next(c.sample("t", num_groups=2, max_batches=1, trainer_version=5, delivery="consume"))
        assert len(batch.uids) == 4
        assert c.stats("t")["t"].trainer_version == 5
        assert asyncio.run(_async_set(target, 6)) == 6
        assert ExperienceDataset(c, "t").set_trainer_version(7) == 7
    m = scrape(server.metrics_port)
    assert m[("expbuf_trainer_version", (("table", "t"),))] == 7
    # trainer version 5: two experiences of version 1 (staleness 4), two of version 4 (1)
    assert m[("expbuf_sample_staleness_versions_count", (("table", "t"),))] == 4
    assert m[("expbuf_sample_staleness_versions_sum", (("table", "t"),))] == 10
    assert ("expbuf_trainer_version", (("table", "default"),)) not in m
    server.stop(grace=1)
    server = start_server()  # durable: it comes back from the table's counters
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        assert c.stats("t")["t"].trainer_version == 7


def _request(table: str, version: int) -> pb.SetTrainerVersionRequest:
    return pb.SetTrainerVersionRequest(table=table, version=version)


async def _async_set(target: str, version: int) -> int:
    async with AsyncBufferClient(target, timeout=20) as c:
        return await c.set_trainer_version(version, "t")


def test_off_policy_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_staleness"):
        TableConfig.of(name="t", max_staleness=-1)
    with pytest.raises(ConfigError, match="on_stale"):
        TableConfig.of(name="t", on_stale="keep")
    with pytest.raises(ConfigError, match="samples_per_insert"):
        TableConfig.of(name="t", samples_per_insert=float("nan"))


def test_trainer_version_on_a_sample_spec_is_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="trainer_version"):
        TakeSpec("default", num_groups=1, trainer_version=-1)
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", estimator="none"))
        with pytest.raises(InvalidRequest, match="version"):
            store.set_trainer_version("t", True)  # type: ignore[arg-type]
        assert store.sample(TakeSpec("t", num_groups=1, trainer_version=2)) is None
        assert store.stats("t")["trainer_version"] is None  # stored only with a batch (test_trainer_version.py)


# ---- the version index -------------------------------------------------------------------


def test_min_model_version_finds_fresh_groups_behind_100k_stale_ones(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", estimator="none", group_by="none"))
        one = Entry.of(group_items(0, 0, 1, response=1, prompt=1)[0])

        def push(prefix: str, count: int, version: int) -> None:
            store.put_entries("t", [replace(one, uid=f"{prefix}{i}", version=version) for i in range(count)])

        push("first", 1, 9)
        first = store.sample(TakeSpec("t", num_groups=1, delivery="lease", lease_seconds=60))
        for chunk in range(10):
            push(f"stale{chunk}-", 10_000, 1)
        push("last", 1, 9)
        store.put_entries("t", [replace(one, uid="unknown0", version=None)])  # at the back, no version
        # fifo: the first ready group is stale, the fresh one is 100k groups behind it
        assert store.sample(TakeSpec("t", num_groups=1, min_model_version=5)).group_ids == ["last0"]
        store.nack(first.lease_id)  # back to ready, at the front of the order
        # lifo: from the back, an unknown version and 100k stale groups lie before the fresh one
        assert store.sample(TakeSpec("t", num_groups=1, min_model_version=5, order="lifo")).group_ids == ["first0"]
        assert store.sample(TakeSpec("t", num_groups=1, min_model_version=5, order="uniform")) is None
        assert store.sample(TakeSpec("t", num_groups=1, order="lifo")).group_ids == ["unknown0"]
        assert store.sample(TakeSpec("t", num_groups=1, min_model_version=1, order="lifo")).group_ids == ["stale9-9999"]


def test_fifo_and_lifo_merge_the_runs_of_every_fresh_version(tmp_path: Path) -> None:
    versions = [3, 7, 5, 7, 1, 5, 9, 3, 5]
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", estimator="none", group_by="none"))
        one = Entry.of(group_items(0, 0, 1, response=1, prompt=1)[0])
        for i, version in enumerate(versions):
            store.put_entries("t", [replace(one, uid=f"g{i}", version=version, priority=float(i % 3))])
        want = [f"g{i}" for i, v in enumerate(versions) if v >= 5]
        for order, expected in (("fifo", want), ("lifo", want[::-1])):
            batch = store.sample(
                TakeSpec("t", num_groups=len(want), min_model_version=5, order=order, delivery="replay")
            )
            assert batch.group_ids == expected
        by_priority = sorted(want, key=lambda g: (-(int(g[1:]) % 3), int(g[1:])))
        batch = store.sample(TakeSpec("t", num_groups=len(want), min_model_version=5, order="priority"))
        assert batch.group_ids == by_priority
        assert store.verify("t") == []


def test_a_directory_without_the_version_index_gets_it_at_open(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", estimator="none", group_by="none"))
        store.put("t", group_items(1, 0, 3, version=4))
        store.sample(TakeSpec("t", num_groups=1, min_model_version=4, delivery="replay"))  # the table keeps byver
        env = store.environment
        with env.env.begin(write=True) as txn:  # as format 2 left it: no version index
            txn.drop(env.db["byver"], delete=False)
            txn.put(b"format", b"2", db=env.db["meta"])
        problems = store.verify("t")
        assert "the version index (byver) holds 0 groups, 3 belong in it" in problems
        assert sum("missing from the version index" in p for p in problems) == 3
    with Store(tmp_path) as store:
        assert store.verify("t") == []
        assert len(store.sample(TakeSpec("t", num_groups=3, min_model_version=4)).uids) == 3


def test_the_first_format_gets_the_version_index(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "datadir_v1" / "data.mdb", tmp_path / "data.mdb")
    with Store(tmp_path) as store:
        with store.environment.read() as txn:
            assert txn.stat(store.environment.db["byver"])["entries"] > 0
            assert txn.get(b"format", db=store.environment.db["meta"]) == str(layout.FORMAT).encode()
        for table in store.list_tables():
            assert store.verify(table.name) == [], table.name


# ---- admission ---------------------------------------------------------------------------


def test_admission_follows_areals_rule(tmp_path: Path) -> None:
    staleness, batch = 2, 4
    rng = random.Random(7)
    version, submitted, grants = 0, 0, []  # the reference: AReaL's StalenessManager, plainly
    config = TableConfig.of(name="t", estimator="none", max_staleness=staleness, batch_size=batch)
    store = Store(tmp_path)
    store.create_table(config)
    for step in range(300):
        action = rng.random()
        if action < 0.15:
            version += 1
            store.set_trainer_version("t", version)
        elif action < 0.3 and grants:
            grant = grants.pop(rng.randrange(len(grants)))
            accepted = rng.randint(0, grant.count)
            assert store.finish_grant("t", grant.grant_id, accepted) == grant.count - accepted
            submitted -= grant.count - accepted
        else:
            count = rng.randint(1, 6)
            want = min(count, max(0, (staleness + version + 1) * batch - submitted))
            grant = store.admit("t", count)
            assert grant.count == want, step
            submitted += want
            if want:
                grants.append(grant)
        if step == 150:  # grants and counts are durable
            store.close()
            store = Store(tmp_path)
        assert store.stats("t")["submitted"] == submitted
    store.close()


def test_a_vanished_workers_grants_expire_and_their_room_comes_back(tmp_path: Path) -> None:
    clock = [1000.0]
    with Store(tmp_path, clock=lambda: clock[0]) as store:
        store.create_table(TableConfig.of(name="t", estimator="none", max_staleness=0, batch_size=3))
        lost = store.admit("t", 5, grant_seconds=30)
        assert lost.count == 3 and store.admit("t", 1).count == 0
        with pytest.raises(NotFound, match="grant"):
            store.finish_grant("t", "nope")
        clock[0] += 31
        assert store.tick()["rollouts_returned"] == 3
        assert store.stats("t")["grants_expired"] == 3
        with pytest.raises(NotFound, match="grant"):
            store.finish_grant("t", lost.grant_id)
        assert store.admit("t", 2).count == 2


def test_grants_of_a_killed_worker_come_back(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, timeout=20) as c:
        c.create_table("t", estimator="none", max_staleness=1, batch_size=2)
        worker = subprocess.Popen(
            [sys.executable, "-c", KILLED_WORKER, target],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent,
        )
        assert worker.stdout.readline().strip() == "4"  # every rollout the bound allows
        worker.kill()
        worker.wait()
        assert c.admit("t", 1).count == 0  # held: the killed worker's grant lasts GRANT_SECONDS
        again = c.admit("t", 2, wait=15)  # woken by the upkeep that expires the grant
        assert again.count == 2
        assert c.finish_grant(again, accepted=1) == 1
        assert c.stats("t")["t"].grants_expired == 4
        with pytest.raises(BufferError) as bad:
            c.admit("t", 1, grant_seconds=-1)
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("wait", [float("nan"), -1.0, float("inf"), 1e308])
def test_an_admit_whose_wait_is_out_of_range_is_refused_by_name(server, wait: float) -> None:
    """Admit took any wait_seconds without a word (NaN and negatives answered at once, inf waited
    to the deadline, each OK with nothing granted) where Claim and Sample refuse it naming the field
    (a helper's audit)."""
    stub = pb_grpc.ExperienceBufferStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as c:
        c.create_table("t", estimator="none", max_staleness=1, batch_size=2)
    with pytest.raises(grpc.RpcError) as bad:
        stub.Admit(pb.AdmitRequest(table="t", count=1, wait_seconds=wait), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "wait_seconds" in bad.value.details()


def test_a_waiting_admit_whose_caller_left_takes_no_room_that_comes_back(server) -> None:
    """A cancelled Admit waiting for room saw its end only at its next poll (0.25 s): the commit that
    made room woke it first, and it took a grant for no one, the room gone for grant_seconds (an
    audit: 30 of 30 where the room came back 10 ms after the cancel). A woken wait asks whether its
    call ended before it grants; a grant made as its call ended is finished at once."""
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, timeout=10) as c, grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        for attempt in range(3):
            table = f"t{attempt}"
            c.create_table(table, estimator="none", max_staleness=0, batch_size=2)
            held = c.admit(table, 2)
            waiting = stub.Admit.future(pb.AdmitRequest(table=table, count=1, wait_seconds=30), timeout=30)
            time.sleep(0.3)  # waiting for room
            waiting.cancel()
            time.sleep(0.01)
            c.finish_grant(held, accepted=0)  # the room comes back after its caller left
            time.sleep(0.3)
            assert c.admit(table, 2).count == 2, attempt


@contextlib.contextmanager
def two_tokens(start_server: Servers) -> Iterator[tuple[BufferClient, BufferClient]]:
    """Clients of tokens a and b (every scope) of one server, with a's table t: no staleness, batches of two."""
    scopes = frozenset({"push", "sample", "admin"})
    server = start_server(tokens={"a": scopes, "b": scopes})
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="a", timeout=20) as a, BufferClient(target, token="b", timeout=20) as b:
        a.create_table("t", estimator="none", max_staleness=0, batch_size=2)
        yield a, b


def test_with_tokens_a_grant_is_finished_only_by_the_token_that_took_it(start_server: Servers) -> None:
    """A grant is bound to the token whose Admit took it, as a lease is: another token's finish
    is refused and gives no room back, so one job cannot end another's rollouts' admission."""
    with two_tokens(start_server) as (a, b):
        grant = a.admit("t", 2)
        assert grant.count == 2
        with pytest.raises(PermissionDeniedError, match="another token"):
            b.finish_grant(grant, accepted=0)
        assert b.admit("t", 1).count == 0  # a's grant still holds its room
        assert a.finish_grant(grant, accepted=0) == 2


def test_an_admit_made_again_under_its_grants_name_takes_no_second_grant(tmp_path: Path) -> None:
    """An admit whose reply was lost, made again (a restart between), took a second grant: the
    first one's room stayed held until it expired. Made under the name of a grant still open, it
    answers that grant, across a reopen too; a finished grant's name makes a new one."""
    config = TableConfig.of(name="t", estimator="none", max_staleness=0, batch_size=3)
    with Store(tmp_path) as store:
        store.create_table(config)
        store.create_table(replace(config, name="other"))
        first = store.admit("t", 2, grant_id="rollout-7")
        assert (first.count, first.grant_id) == (2, "rollout-7")
    with Store(tmp_path) as store:  # grants are durable: so is the name's answer
        again = store.admit("t", 2, grant_id="rollout-7")
        assert again == first
        assert store.stats("t")["submitted"] == 2 and store.stats("t")["admitted"] == 2
        with pytest.raises(InvalidRequest, match="another table"):
            store.admit("other", 1, grant_id="rollout-7")
        for bad in ("a b", "x" * 65, "grant/1"):
            with pytest.raises(InvalidRequest, match="grant_id"):
                store.admit("t", 1, grant_id=bad)
        assert store.finish_grant("t", "rollout-7", 0) == 2
        assert store.admit("t", 1, grant_id="rollout-7").count == 1  # a new grant of that name
        assert store.stats("t")["submitted"] == 1


def test_an_admit_made_again_after_its_grant_expired_takes_a_new_grant(tmp_path: Path) -> None:
    """Made again under the name of a grant whose time passed before the upkeep ended it, an admit
    answered that grant, its expiry already past: the worker rolled out under a grant the next
    upkeep pass ended, its room counted twice. Now the old grant ends there (expired) and a new one
    is made."""
    now = [1000.0]
    with Store(tmp_path, clock=lambda: now[0]) as store:
        store.create_table(TableConfig.of(name="t", estimator="none", max_staleness=0, batch_size=3))
        first = store.admit("t", 2, grant_seconds=10, grant_id="rollout-8")
        now[0] += 11
        again = store.admit("t", 3, grant_seconds=10, grant_id="rollout-8")
        assert (again.count, again.grant_id, again.expires) == (3, "rollout-8", now[0] + 10)
        assert first.expires < now[0]
        stats = store.stats("t")
        assert (stats["submitted"], stats["admitted"], stats["grants_expired"]) == (3, 5, 2)
        assert store.tick()["rollouts_returned"] == 0
        assert store.finish_grant("t", "rollout-8", 3) == 0


def test_the_client_names_each_grant_and_a_name_is_bound_to_its_token(start_server: Servers) -> None:
    """The client names every grant it asks for (so that its own retries, and an adapter's across
    a restart, take no second one); another token's admit under that name is refused, as its
    finish is."""
    with two_tokens(start_server) as (a, b):
        named = a.admit("t", 1)
        assert len(named.grant_id) == 32 and int(named.grant_id, 16) >= 0
        assert a.admit("t", 1, grant_id=named.grant_id) == named
        with pytest.raises(PermissionDeniedError, match="another token"):
            b.admit("t", 1, grant_id=named.grant_id)
        assert a.stats("t")["t"].submitted == 1


# Long enough that the admission right after the worker's kill finds its grant held on a loaded
# machine (0.5 s expired first there once), short for the wait that follows.
GRANT_SECONDS = 3.0
KILLED_WORKER = f"""
import sys, time
from expbuf.client import BufferClient
with BufferClient(sys.argv[1]) as c:
    print(c.admit("t", 10, grant_seconds={GRANT_SECONDS}).count, flush=True)
    time.sleep(60)
"""


def test_stale_pushes_are_dropped_or_refused(start_server: Servers) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        c.create_table("drop", estimator="none", group_by="none", max_staleness=2)
        c.create_table("refuse", estimator="none", group_by="none", max_staleness=2, on_stale="refuse")
        assert c.list_tables()[-1].on_stale == "refuse"
        items = [
            *group_items(1, 0, 1, version=2),
            *group_items(1, 1, 1, version=3),
            *group_items(1, 2, 1, version=None),
        ]
        assert c.push(trxp.build(items), table="drop").stale == []  # no trainer version yet
        for name in ("drop", "refuse"):
            c.set_trainer_version(5, name)
        fresh = [
            *group_items(2, 0, 1, version=2),
            *group_items(2, 1, 1, version=3),
            *group_items(2, 2, 1, version=None),
        ]
        result = c.push(trxp.build(fresh), table="drop")
        assert result.stale == [fresh[0].eid.uid] and len(result.stored) == 2
        assert c.stats("drop")["drop"].stale_dropped == 1
        with pytest.raises(BufferError) as refused:
            c.push(trxp.build(fresh), table="refuse")
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "model_version 2, below 3" in refused.value.details
        assert c.stats("refuse")["refuse"].pushed == 0
        with pytest.raises(BufferError, match="samples_per_insert_error") as bad:
            c.create_table("bad", samples_per_insert=2.0, samples_per_insert_error=1.0)
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    m = scrape(server.metrics_port)
    assert m[("expbuf_stale_dropped_total", (("table", "drop"),))] == 1
    assert m[("expbuf_refused_total", (("reason", "stale"), ("table", "refuse")))] == 1


def test_workers_under_admission_never_feed_the_trainer_stale_experience(tmp_path: Path) -> None:
    staleness, batch, steps = 1, 4, 8
    config = TableConfig.of(name="t", estimator="none", group_by="none", max_staleness=staleness, batch_size=batch)
    one = Entry.of(group_items(0, 0, 1, response=1, prompt=1)[0])
    done = threading.Event()
    worst: list[int] = []
    with Store(tmp_path) as store:
        store.create_table(config)

        def worker(name: int) -> None:
            rng, n = random.Random(name), 0
            while not done.is_set():
                grant = store.admit("t", rng.randint(1, 3), wait=0.2)
                version = store.stats("t")["trainer_version"] or 0  # the weights the rollouts use
                entries = [replace(one, uid=f"w{name}-{n + i}", version=version) for i in range(grant.count)]
                n += grant.count
                time.sleep(rng.random() * 0.005)
                if entries:
                    stored = store.put_entries("t", entries).stored
                    store.finish_grant("t", grant.grant_id, len(stored))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        try:
            for version in range(steps):
                spec = TakeSpec("t", batch_size=batch, min_model_version=max(0, version - staleness), wait_seconds=20)
                sampled = store.sample(spec)
                assert sampled is not None, f"no batch at trainer version {version}"
                worst.append(max(version - v for v in sampled.versions))
                store.set_trainer_version("t", version + 1)
        finally:
            done.set()
            for thread in threads:
                thread.join()
        assert max(worst) <= staleness
        stats = store.stats("t")
        assert stats["submitted"] <= (staleness + steps + 1) * batch
        assert store.verify("t") == []


# ---- rate limits -------------------------------------------------------------------------


def _limited(name: str, **settings: object) -> TableConfig:
    return TableConfig.of(name=name, estimator="none", group_by="none", **settings)


def test_the_rate_limit_keeps_samples_per_insert_in_its_band(tmp_path: Path) -> None:
    spi, error, min_size = 2.0, 3.0, 2
    config = _limited("t", samples_per_insert=spi, samples_per_insert_error=error, min_size_to_sample=min_size)
    one = Entry.of(group_items(0, 0, 1, response=1, prompt=1)[0])
    centre = spi * min_size
    seen: list[float] = []
    with Store(tmp_path) as store:
        store.create_table(config)

        def observe() -> None:
            stats = store.stats("t")
            seen.append(stats["pushed"] * spi - stats["sampled"] - centre)

        for phase, (insert_pause, sample_pause) in enumerate(((0.0, 0.002), (0.002, 0.0))):

            def insert(phase: int = phase, pause: float = insert_pause) -> None:
                for i in range(15):
                    store.put_entries("t", [replace(one, uid=f"p{phase}-{i}")], timeout=20)
                    observe()
                    time.sleep(pause)

            inserter = threading.Thread(target=insert)
            inserter.start()
            for _ in range(28):  # 2 per insert, but never below the band
                assert store.sample(TakeSpec("t", num_groups=1, delivery="replay", wait_seconds=20)) is not None
                observe()
                time.sleep(sample_pause)
            inserter.join()
        assert len(seen) == 86
        assert all(-error <= d <= error for d in seen), seen
        assert max(seen) == error  # the inserts reached the top of the band: the limit held them


def test_both_sides_block_and_time_out_with_the_limit_named(start_server: Servers) -> None:
    """Each side waits for what the server bounds (a sample its `timeout`, a push the server's
    max_wait_seconds), well within the client's deadline: the refusal, not the deadline, ends it."""
    server = start_server(max_wait_seconds=0.5)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        c.create_table(
            "t", estimator="none", group_by="none", min_size_to_sample=2, samples_per_insert=1.0,
            samples_per_insert_error=1.0,
        )  # fmt: skip
        assert c.list_tables()[-1].samples_per_insert == 1.0
        c.push(trxp.build(group_items(1, 0, 1)), table="t")
        with pytest.raises(BufferError) as early:
            next(c.sample("t", num_groups=1, timeout=0.3, delivery="consume"))
        assert early.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        held = "min_size_to_sample 2 holds samples; 1 experiences that can still be sampled were inserted"
        assert held in early.value.details
        for i in (1, 2):  # diff 3: the top of the band (centre 2, error 1)
            c.push(trxp.build(group_items(1, i, 1)), table="t")
        with pytest.raises(BufferError) as insert:
            c.push(trxp.build(group_items(1, 3, 1)), table="t")
        assert insert.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "samples_per_insert 1 (error 1) holds inserts" in insert.value.details
        assert "max_wait_seconds = 0.5" in insert.value.details
        batches = c.sample("t", num_groups=1, timeout=0.3, delivery="replay")
        assert len(next(batches).uids) == 1 and len(next(batches).uids) == 1  # diff 1: the bottom
        with pytest.raises(BufferError) as sample:
            next(batches)
        assert sample.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "holds samples until more is inserted" in sample.value.details
        assert c.stats("t")["t"].pushed == 3
    m = scrape(server.metrics_port)
    assert m[("expbuf_refused_total", (("reason", "rate_limited"), ("table", "t")))] == 3
    assert m[("expbuf_rate_limit_blocked_seconds_total", (("side", "insert"), ("table", "t")))] > 0
    assert m[("expbuf_rate_limit_blocked_seconds_total", (("side", "sample"), ("table", "t")))] > 0


def test_the_rate_limits_state_survives_a_restart(tmp_path: Path) -> None:
    one = Entry.of(group_items(0, 0, 1, response=1, prompt=1)[0])
    replay = TakeSpec("t", num_groups=1, delivery="replay")
    with Store(tmp_path) as store:
        store.create_table(_limited("t", samples_per_insert=1.0, samples_per_insert_error=1.0))
        store.put_entries("t", [replace(one, uid="a")])  # diff 1: the top of the band
        with pytest.raises(InsertLimited):
            store.put_entries("t", [replace(one, uid="b")])
        store.put_entries("t", [replace(one, uid="a")])  # a retried push of stored experiences is not held
        assert store.sample(replay) is not None and store.sample(replay) is not None  # diff -1: the bottom
        with pytest.raises(SampleLimited):
            store.sample(replay)
    with Store(tmp_path) as store:
        with pytest.raises(SampleLimited):
            store.sample(replay)
        store.put_entries("t", [replace(one, uid="b")])
        store.put_entries("t", [replace(one, uid="c")])
        with pytest.raises(InsertLimited):
            store.put_entries("t", [replace(one, uid="d")])


@pytest.mark.parametrize("when_full", ["evict", "block"])
@pytest.mark.parametrize("group", [1, 2])
def test_min_size_to_sample_past_what_capacity_bytes_holds_waits_only_until_the_table_is_full(
    tmp_path: Path, when_full: str, group: int
) -> None:
    """min_size_to_sample is checked against capacity_experiences at a table's creation, but no
    count of experiences can be checked against capacity_bytes: a table that held 9 experiences of
    its bytes never reached 20, evicting as more came (evict mode), and no sample went, for good
    (the limits audit). Once the table holds all it can, the bound holds samples no more; while a
    group more fits, it holds them."""
    grouping = {"group_by": "none"} if group == 1 else {"group_by": "task", "group_size": group}
    tasks = [[Entry.of(item) for item in group_items(0, task, group, response=1, prompt=1)] for task in range(5)]
    size = tasks[0][0].size
    take = TakeSpec("t", num_groups=1, delivery="replay")
    with Store(tmp_path) as store:
        config = TableConfig.of(
            "t",
            estimator="none",
            min_size_to_sample=20,
            capacity_bytes=4 * group * size,
            when_full=when_full,
            **grouping,
        )
        store.create_table(config)
        for entries in tasks[:3]:
            store.put_entries("t", entries)
        with pytest.raises(SampleLimited, match=f"{3 * group} experiences that can still be sampled were inserted"):
            store.sample(take)  # room for a group more: the bound still holds
        store.put_entries("t", tasks[3])  # full
        assert store.sample(take) is not None
        if when_full == "evict":
            store.put_entries("t", tasks[4])  # evicts the oldest, and stays full
            assert store.stats("t")["evicted"] == group and store.sample(take) is not None


def test_min_size_to_sample_past_what_an_evicting_table_holds_lets_go_with_groups_always_open(tmp_path: Path) -> None:
    """Runs pushed as they end keep a group open at all times (the next task's first runs come before
    the last task's last run): an evicting table whose capacity_bytes holds fewer experiences than
    min_size_to_sample never counted as holding all it can, its open groups' runs still to come, and
    served no sample, for good (the docs review: 0 of 39). Evicting, it waits for nothing once it has
    no room for a group more."""
    tasks = [[Entry.of(item) for item in group_items(0, task, 4, response=1, prompt=1)] for task in range(12)]
    config = TableConfig.of(
        "t", estimator="none", group_size=4, min_size_to_sample=20, when_full="evict",
        capacity_bytes=8 * tasks[0][0].size,
    )  # fmt: skip
    served = 0
    with Store(tmp_path) as store:
        store.create_table(config)
        for task, runs in enumerate(tasks):
            store.put_entries("t", runs[:3])
            if task:
                store.put_entries("t", tasks[task - 1][3:])  # the task before completes, this one stays open
            with contextlib.suppress(SampleLimited):
                served += store.sample(TakeSpec("t", num_groups=1, delivery="replay")) is not None
        assert store.stats("t")["groups_pending"] == 1
    assert served >= len(tasks) - 3  # held only until the table had no room for a group more


@pytest.mark.parametrize("delivery", ["consume", "replay"])
def test_a_rate_band_past_what_capacity_bytes_holds_is_centred_on_what_the_table_holds(
    tmp_path: Path, delivery: str
) -> None:
    """With samples_per_insert, the band's centre, spi * min_size_to_sample, was out of reach of an
    evicting table that holds fewer: past min_size_to_sample (released once the table holds all it
    can), the band held every sample for good (the review: 0 of 40 served). Full, it is centred on
    what the table holds, a sample an insert as the band asks."""
    entries = [Entry.of(group_items(0, task, 1, response=1, prompt=1)[0]) for task in range(12)]
    config = _limited(
        "t", min_size_to_sample=20, samples_per_insert=1.0, samples_per_insert_error=2.0, when_full="evict"
    )
    with Store(tmp_path) as store:
        store.create_table(replace(config, capacity=replace(config.capacity, bytes=4 * entries[0].size)))
        served = 0
        for entry in entries:
            store.put_entries("t", [entry])
            with contextlib.suppress(SampleLimited):
                served += store.sample(TakeSpec("t", num_groups=1, delivery=delivery)) is not None
        assert served == len(entries) - 3  # held until the table was full, then one an insert


@pytest.mark.parametrize("layout", ["records", "rows"])
def test_a_run_joining_an_open_group_is_not_held_by_a_group_the_limiter_holds(tmp_path: Path, layout: str) -> None:
    """A blocking byte-bounded table: a run joining an open group, larger than the group's first,
    was refused for bytes while a ready group might free room, and that group's sample was held by
    min_size_to_sample, each waiting for the other for good (the review). A ready group the rate
    limiter holds back frees no room: the run is let in, as where only open groups are held."""
    small, big = (lambda task: group_items(1, task, 2)), (lambda task: group_items(1, task, 2, response=2000))
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("sizes", estimator="none", group_size=2))
        store.put("sizes", small(0)[:1])
        small_bytes = store.stats("sizes")["bytes"]
        store.put("sizes", big(1)[1:])
        big_bytes = store.stats("sizes")["bytes"] - small_bytes
        config = TableConfig.of(
            "t", estimator="none", group_size=2, when_full="block", min_size_to_sample=8,
            capacity_bytes=3 * small_bytes + big_bytes + 100,  # the ready group, B's first run and its estimate
        )  # fmt: skip
        store.create_table(replace(config, storage=replace(config.storage, layout=layout)))
        store.put("t", small(0)[:1])
        store.put("t", big(0)[1:])  # a ready group, which min_size_to_sample holds back
        store.put("t", small(1)[:1])  # opens B, its runs to come estimated as small
        assert store.put("t", big(1)[1:], timeout=0.3).completed_groups == ["1/1"]


def test_the_docs_off_policy_settings_load_from_toml(tmp_path: Path) -> None:
    toml = code_blocks(page("concepts/staleness.md"), "toml")[0]
    (tmp_path / "expbuf.toml").write_text(toml)
    (table,) = load(str(tmp_path / "expbuf.toml")).tables
    assert (table.staleness.max_staleness, table.staleness.batch_size, table.staleness.on_stale) == (2, 4, "drop")
    limiter = table.rate_limiter
    assert (limiter.min_size_to_sample, limiter.samples_per_insert, limiter.error_buffer) == (0, 0.0, 0)


# ---- stale-group eviction ----------------------------------------------------------------


def test_many_stale_groups_are_evicted_in_bounded_steps_and_fresh_ones_stay(tmp_path: Path) -> None:
    """Three steps' worth of stale groups (EVICT_LIMIT a step; EXPBUF_SOAK_SCALE multiplies them:
    10 makes 300,000) go a bounded step at a time, and the fresh ones in front, between and
    behind them stay."""
    from expbuf.server.store.rules.staleness import EVICT_LIMIT

    stale = 3 * EVICT_LIMIT * max(1, int(float(os.environ.get("EXPBUF_SOAK_SCALE", "1"))))
    with Store(tmp_path) as store:
        store.create_table(
            TableConfig.of(name="t", estimator="none", group_by="none", max_staleness=2, evict_stale=True)
        )
        one = Entry.of(group_items(0, 0, 1, response=1, prompt=1)[0])

        def push(prefix: str, count: int, version: int | None) -> None:
            store.put_entries("t", [replace(one, uid=f"{prefix}{i}", version=version) for i in range(count)])

        push("fresh-early", 3, 7)  # in front of the stale ones in the ready order
        for chunk in range(stale // 10_000):
            push(f"stale{chunk}-", 10_000, 4)
        push("edge", 2, 5)  # exactly at the bound: stays
        push("fresh", 3, 9)
        push("unknown", 1, None)  # no version: never stale
        assert store.tick()["groups_stale_evicted"] == 0  # no trainer version yet
        store.set_trainer_version("t", 7)  # bound 5: a first bounded step
        assert store.stats("t")["dropped_stale"] == EVICT_LIMIT
        steps = []
        while evicted := store.tick()["groups_stale_evicted"]:
            steps.append(evicted)
        assert all(0 < step <= EVICT_LIMIT for step in steps) and len(steps) == stale // EVICT_LIMIT - 1
        stats = store.stats("t")
        assert (stats["dropped_stale"], stats["groups_dropped"], stats["groups_ready"]) == (stale, stale, 9)
        assert store.verify("t") == []
        taken = store.sample(TakeSpec("t", num_groups=20, allow_partial=True))
        assert sorted(taken.group_ids) == sorted(
            ["fresh-early0", "fresh-early1", "fresh-early2", "edge0", "edge1", "fresh0", "fresh1", "fresh2", "unknown0"]
        )


def test_stale_groups_stay_without_evict_stale_and_go_when_the_trainer_advances(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        for name, evict in (("keep", False), ("evict", True)):
            store.create_table(
                TableConfig.of(name=name, estimator="none", group_by="none", max_staleness=1, evict_stale=evict)
            )
            store.put_entries(name, [Entry.of(item) for item in group_items(0, 0, 4, version=3)])
            store.put_entries(name, [replace(Entry.of(group_items(0, 1, 1, version=6)[0]), uid="new")])
        for version in (4, 5):  # bound 3 keeps version 3; bound 4 makes it stale
            store.set_trainer_version("keep", version)
            store.set_trainer_version("evict", version)
        assert store.tick()["groups_stale_evicted"] == 0  # the advance already evicted them
        assert store.stats("keep")["groups_ready"] == 5 and store.stats("keep")["dropped_stale"] == 0
        evicted = store.stats("evict")
        assert (evicted["groups_ready"], evicted["dropped_stale"], evicted["ready"]) == (1, 4, 1)
        assert store.verify("evict") == []
        store.put_entries("evict", [replace(Entry.of(group_items(0, 2, 1, version=5)[0]), uid="mid")])
        batch = store.sample(TakeSpec("evict", num_groups=2, trainer_version=7, allow_partial=True))
        assert batch.group_ids == ["new"]  # bound 6: "mid" (version 5) was evicted, not taken
        assert store.stats("evict")["dropped_stale"] == 5
    with pytest.raises(ConfigError, match="evict_stale must be true or false"):
        TableConfig.of(name="t", evict_stale="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["records", "rows"])
@pytest.mark.parametrize("back", ["expired", "nacked", "replayed"])
def test_groups_back_from_a_lease_below_the_bound_go_at_the_next_upkeep_pass(
    tmp_path: Path, layout: str, back: str
) -> None:
    """Groups leased while the trainer's version passed them, back ready (a lease that expired, a
    nack, a replayed batch its stream's client confirmed): the next upkeep pass evicts them. A rows
    table's waited for its 30 s sweep, counted ready and in its capacity meanwhile (a helper's audit)."""
    now = [1000.0]
    with Store(tmp_path, clock=lambda: now[0]) as store:
        made = TableConfig.of(name="t", estimator="none", group_size=1, max_staleness=0, evict_stale=True)
        store.create_table(replace(made, storage=replace(made.storage, layout=layout)))
        for task in range(3):
            store.put("t", group_items(1, task, 1, version=1))
        store.tick()  # the first pass, a sweep
        spec = TakeSpec("t", num_groups=2, delivery="replay" if back == "replayed" else "lease", lease_seconds=5)
        out = store.sample(spec, hold=back == "replayed")
        store.set_trainer_version("t", 2)  # bound 2: the ready group goes, the leased two stay out
        now[0] += 1
        store.tick()
        if back == "nacked":
            store.nack(out.lease_id, "t")
        elif back == "replayed":
            assert store.confirm(out.lease_id, spec) == 2
        now[0] += 6  # the lease's end, had it not been nacked
        store.tick()
        stats = store.stats("t")
        assert (stats["ready"], stats["leased"], stats["dropped_stale"]) == (0, 0, 3)
        assert store.verify("t") == []


@pytest.mark.parametrize("layout", ["records", "rows"])
def test_a_group_back_ready_below_the_bound_is_never_taken(tmp_path: Path, layout: str) -> None:
    """A leased group the version passed while it was out, nacked, and a pending group that
    completes with a member below the bound: ready and stale before any upkeep, and a take
    drops them rather than serve them."""
    with Store(tmp_path) as store:
        made = TableConfig.of(name="t", estimator="none", group_size=2, max_staleness=1, evict_stale=True)
        store.create_table(replace(made, storage=replace(made.storage, layout=layout)))
        store.set_trainer_version("t", 1)
        store.put("t", group_items(1, "leased", 2, version=1))
        store.put("t", group_items(1, "pending", 2, version=1)[:1])
        out = store.sample(TakeSpec("t", num_groups=1, delivery="lease"))
        store.set_trainer_version("t", 3)  # bound 2
        store.put("t", group_items(1, "pending", 2, version=3)[1:])
        store.put("t", group_items(1, "fresh", 2, version=3))
        store.nack(out.lease_id, "t")
        batch = store.sample(TakeSpec("t", num_groups=3, allow_partial=True))
        assert batch.group_ids == ["1/fresh", "1/fresh"]
        stats = store.stats("t")
        assert (stats["dropped_stale"], stats["groups_ready"], stats["ready"]) == (2, 0, 0)
        assert store.verify("t") == []


def test_evict_stale_over_grpc_and_the_stale_drop_metric(start_server: Servers) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        config = c.create_table("t", estimator="none", group_by="none", max_staleness=0, evict_stale=True)
        assert config.evict_stale is True
        assert {t.name: t.evict_stale for t in c.list_tables()} == {"default": False, "t": True}
        c.push(trxp.build(group_items(1, 0, 3, version=1)), table="t")
        c.push(trxp.build(group_items(1, 1, 1, version=2)), table="t")
        c.set_trainer_version(2, "t")
        assert c.stats("t")["t"].groups_ready == 1
    m = scrape(server.metrics_port)
    assert m[("expbuf_groups_dropped_total", (("reason", "stale"), ("table", "t")))] == 3
