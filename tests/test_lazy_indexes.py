"""A table keeps every ready-group index from its creation; one a table lacks (an earlier release
kept the uniform slots, the priority and the version index only from the first request that read
them) is built in the background from the open, in chunks that pushes pass between, and a request
that reads it meanwhile waits for the build, never served from part of it. Writes are counted as
bench/bench_writes.py counts them, over a real Store."""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import lmdb
import pytest

from expbuf.client import BufferClient
from expbuf.client.errors import ExpbufError
from expbuf.server.store import Store
from expbuf.server.store.core.ordering import ready as core_ready
from expbuf.server.store.core.ordering.indexes import Index, PriorityIndex, Slots
from expbuf.server.store.core.ordering.ready import IndexBuilding
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.environment import Environment
from expbuf.server.store.schema import errors
from expbuf.server.store.schema.errors import InvalidRequest
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.services import index_builds

from conftest import FIXTURES, Servers
from helpers import group_items, pythonpath, scrape, small_groups, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_writes import Counts, counting, entries

HERE = Path(__file__).resolve().parent

# Ready groups of the tests of a build from the open: what they check holds at any size past a few
# chunks (10,000 are some 40 of BUILD_CHUNK a build); EXPBUF_SOAK_SCALE=100 gives the million of issue 39.
OPEN_READY = 10_000 * int(os.environ.get("EXPBUF_SOAK_SCALE", "1"))
INDEXES = ("ready", "prio", "slots", "slotof", "byver")
RECORDS = ("blobs", "items", "order", "groups")
BUILDER = "expbuf-index-builds"  # the builds' thread
# Who asked for a chunk the builds submitted at the open, before the watch began: the builds alone
# run then (a chunk of theirs, submitted unwatched, may run once the watch is on).
UNWATCHED = "before the watch"


# What a records table keeps, builds and checks (a table as an earlier release made it, builds from
# the open); a rows table's lazy indexes: test_rows_take.py.
pytestmark = pytest.mark.usefixtures("records_layout")


def one_each(tmp_path: Path, name: str = "t") -> Store:
    store = Store(tmp_path)
    store.create_table(TableConfig.of(name=name, estimator="none", group_size=1, drop_zero_variance=False))
    return store


def made_before(store: Store, name: str = "t") -> Store:
    """The table as an earlier release made it (before anything is pushed): it keeps the ready
    order, and each other index only once it is built."""
    table_id, _ = store.catalog.lookup(name)
    prefix, db = layout.table_prefix(table_id), store.environment.db
    store.environment.submit(lambda txn: core_ready.mark_in_use(txn, db, prefix, set()))
    return store


def kept_by(store: Store, name: str = "t") -> set[str] | None:
    """The lazy indexes' databases a table keeps, as its mark says (None: every one)."""
    table_id, _ = store.catalog.lookup(name)
    with store.environment.read() as txn:
        return core_ready.in_use(txn, store.environment.db, layout.table_prefix(table_id))


def fill(store: Store, ready: int, table: str = "t") -> None:
    for first in range(0, ready, 50_000):
        store.put_entries(table, small_groups(first, min(50_000, ready - first)))


def push_puts(store: Store, at: int, n: int = 64) -> dict[str, float]:
    """The puts per experience of pushing n experiences, each its own group (of version 1), by
    database: the counters and the uniform slots' count are written once per push, not counted."""
    counted: Counts = collections.Counter()
    counting(store, counted)
    store.put_entries("t", entries(n, 1, at))
    if counted["put slots"]:
        counted["put slots"] -= 1
    return {key[4:]: value / n for key, value in counted.items() if key.startswith("put ") and key != "put counters"}


def replay(store: Store, table: str = "t", wait: float = 120.0, **spec: object) -> list[str]:
    """A replayed batch's groups, waiting up to `wait` (for data, or for an index being built)."""
    batch = store.sample(TakeSpec(table, delivery="replay", wait_seconds=wait, **spec))  # type: ignore[arg-type]
    assert batch is not None
    return batch.group_ids


def test_a_new_table_keeps_every_index_from_its_creation(tmp_path: Path) -> None:
    """A push of groups of one writes every index (9 puts, not the 5 of a table read only in fifo
    order), so a first request in any order builds nothing, and an open has nothing to build."""
    with one_each(tmp_path) as store:
        assert push_puts(store, 0) == {name: 1.0 for name in (*RECORDS, *INDEXES)}
        assert store.index_builds() == []
        for order in ("uniform", "priority"):
            replay(store, num_groups=1, order=order)
        assert replay(store, num_groups=1, order="fifo", min_model_version=1) == ["0/0"]
        assert store.verify("t") == []
    with Store(tmp_path) as store:
        assert store.index_builds() == []
        assert push_puts(store, 64) == {name: 1.0 for name in (*RECORDS, *INDEXES)}
        assert store.verify("t") == []


def test_an_open_builds_the_indexes_a_table_lacks_in_the_background_and_logs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A table an earlier release made keeps the ready order only: its pushes write 5 puts. The
    next open builds its other indexes with no request asking, says so in the log when each
    starts and ends, and from then on a push writes every index."""
    with made_before(one_each(tmp_path)) as store:
        assert push_puts(store, 0) == {name: 1.0 for name in (*RECORDS, "ready")}
        assert kept_by(store) == set()
    caplog.set_level(logging.INFO, logger="expbuf.store")
    with Store(tmp_path) as store:
        wait_for(lambda: kept_by(store) == {"prio", "slots", "slotof", "byver"}, "the builds from the open")
        wait_for(lambda: store.index_builds() == [], "the builds' end")
        assert store.verify("t") == []
        assert push_puts(store, 64) == {name: 1.0 for name in (*RECORDS, *INDEXES)}
    lines = [record.getMessage() for record in caplog.records if record.name == "expbuf.store"]
    for what in ("the uniform slots (slots, slotof)", "the priority index (prio)", "the version index (byver)"):
        assert f"table t: building {what} in the background from 64 ready groups; " in "\n".join(lines), what
        assert any(line.startswith(f"table t: {what} built, 64 ready groups in ") for line in lines), what


def kept_always(tmp_path: Path) -> Store:
    """A store whose table keeps every index from its creation without a mark, as a table from
    before the mark."""
    store = one_each(tmp_path)
    table_id, _ = store.catalog.lookup("t")
    key, counters = layout.table_prefix(table_id) + core_ready.IN_USE, store.environment.db["counters"]
    store.environment.submit(lambda txn: txn.delete(key, db=counters))
    return store


def history(store: Store, batch: int = 1) -> None:
    """Groups of several priorities and versions (one of none), some consumed, one leased and
    given back, one requeued after a replay."""
    for task in range(24):
        version = None if task == 5 else task % 4
        store.put("t", group_items(batch, task, 1, version=version, priority=float(task % 3)))
    assert store.sample(TakeSpec("t", num_groups=3, wait_seconds=0)) is not None
    leased = store.sample(TakeSpec("t", num_groups=2, order="lifo", delivery="lease", lease_seconds=60))
    assert leased is not None and leased.lease_id
    store.nack(leased.lease_id, "t")
    replay(store, num_groups=1, order="fifo")


def test_the_first_request_in_an_order_returns_what_a_table_that_kept_its_index_returns(tmp_path: Path) -> None:
    with kept_always(tmp_path / "always") as always, made_before(one_each(tmp_path / "lazy")) as lazy:
        for store in (always, lazy):
            history(store)
        first = {
            "priority": dict(num_groups=20, order="priority"),
            "priority_fresh": dict(num_groups=5, order="priority", min_model_version=2),
            "fifo_fresh": dict(num_groups=5, order="fifo", min_model_version=3),
            "lifo_fresh": dict(num_groups=5, order="lifo", min_model_version=1),
            "uniform_fresh": dict(num_groups=10, order="uniform", min_model_version=2),
        }
        for name, spec in first.items():
            always.sampling.rng, lazy.sampling.rng = random.Random(name), random.Random(name)
            assert replay(lazy, **spec) == replay(always, **spec), name
        # Uniform's slots are in the order groups came and went: a build makes them in ready
        # order, so the draw differs; the groups it can draw do not.
        everything = dict(num_groups=21, order="uniform")
        assert sorted(replay(lazy, **everything)) == sorted(replay(always, **everything))
        assert always.verify("t") == [] and lazy.verify("t") == []
        for store in (always, lazy):
            history(store, 2)  # the indexes now kept are kept through every change
    with Store(tmp_path / "always") as always, Store(tmp_path / "lazy") as lazy:
        assert always.verify("t") == [] and lazy.verify("t") == []
        for name, spec in first.items():
            always.sampling.rng, lazy.sampling.rng = random.Random(name), random.Random(name)
            assert replay(lazy, **spec) == replay(always, **spec), name


def test_uniform_draws_as_a_table_that_kept_its_slots_when_no_group_left(tmp_path: Path) -> None:
    with kept_always(tmp_path / "always") as always, made_before(one_each(tmp_path / "lazy")) as lazy:
        for store in (always, lazy):
            store.put_entries("t", entries(40, 1))
            store.sampling.rng = random.Random(3)
        assert replay(lazy, num_groups=12, order="uniform") == replay(always, num_groups=12, order="uniform")


def test_the_check_refuses_a_kept_index_that_disagrees_and_rows_of_one_not_kept(tmp_path: Path) -> None:
    with made_before(one_each(tmp_path)) as store:
        store.put_entries("t", entries(4, 1))
        table_id, _ = store.catalog.lookup("t")
        prefix, db = layout.table_prefix(table_id), store.environment.db
        stray = prefix + bytes(16)
        store.environment.submit(lambda txn: txn.put(stray, b"0/0", db=db["prio"]))
        assert store.verify("t") == [
            "the prio index holds 1 rows, but the table does not keep it (it was never read in its order)"
        ]
        store.environment.submit(lambda txn: txn.delete(stray, db=db["prio"]))
        replay(store, num_groups=1, order="priority")
        assert store.verify("t") == []
        with store.environment.read() as txn:
            key = next(bytes(k) for k in txn.cursor(db=db["prio"]).iternext(values=False) if k.startswith(prefix))
        store.environment.submit(lambda txn: txn.delete(key, db=db["prio"]))
        problems = store.verify("t")
        assert "the priority index (prio) holds 3 groups, 4 belong in it" in problems


def test_a_directory_written_before_the_mark_keeps_every_index(tmp_path: Path) -> None:
    """The format-3 fixture, upgraded: its tables had no mark and kept every index; made rows
    tables, they keep every one still (their mark names each), but the ready order's, which their
    runs are, and nothing is built again. A push to a table without the mark writes every index."""
    shutil.copy(FIXTURES / "datadir_v3" / "data.mdb", tmp_path / "data.mdb")
    with Store(tmp_path) as store:
        names = [table.name for table in store.list_tables()]
        assert names
        for name in names:
            assert store.table(name).storage.layout == "rows"
            assert kept_by(store, name) == set(INDEXES) - {"ready"}
            assert store.verify(name) == []
        assert store.index_builds() == []
        store.create_table(TableConfig.of(name="t", estimator="none", group_size=1, drop_zero_variance=False))
        table_id, _ = store.catalog.lookup("t")
        key, counters = layout.table_prefix(table_id) + core_ready.IN_USE, store.environment.db["counters"]
        store.environment.submit(lambda txn: txn.delete(key, db=counters))  # "t" as the fixture's tables
        assert push_puts(store, 0) == {name: 1.0 for name in (*RECORDS, *INDEXES)}


def test_a_request_that_needs_an_index_not_kept_changes_nothing_and_an_undone_chunk_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A request that reads an index its table does not keep raises IndexBuilding before it
    changes anything; a chunk of the build commits with its transaction or not at all, cursor
    included."""
    with made_before(one_each(tmp_path)) as store:
        store.put_entries("t", entries(8, 1))
        table_id, config = store.catalog.lookup("t")

        def needs(txn: lmdb.Transaction[bytes]) -> None:
            store.catalog.state(txn, table_id, config).ready.of(PriorityIndex)

        def refused(txn: lmdb.Transaction[bytes]) -> None:
            assert not store.catalog.state(txn, table_id, config).build_index(PriorityIndex, limit=4).kept
            raise InvalidRequest("refused after a chunk")

        with pytest.raises(IndexBuilding):
            store.environment.submit(needs)
        with pytest.raises(InvalidRequest, match="refused after a chunk"):
            store.environment.submit(refused)
        assert push_puts(store, 8) == {name: 1.0 for name in (*RECORDS, "ready")}
        assert store.verify("t") == []
        with store.environment.read() as txn:
            assert core_ready.builds(txn, store.environment.db, layout.table_prefix(table_id)) == {}
        replay(store, num_groups=1, order="priority")
        assert push_puts(store, 72) == {name: 1.0 for name in (*RECORDS, "ready", "prio")}
        assert store.verify("t") == []


class Writes:
    """What the writer does, watched: the rows each request writes, by the thread that asked for
    it (a request's path), and for each write transaction, whether it ran a chunk of a build and
    what else; for each push, the chunks committed while it waited (its own transaction
    included)."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch, pusher: str) -> None:
        self.by_thread: dict[str, Counts] = collections.defaultdict(collections.Counter)
        self.chunks: list[tuple[str, int]] = []  # each chunk's asking thread and its groups
        self.batches: list[tuple[int, int]] = []  # each write transaction's chunks and other requests
        self.waited: list[int] = []  # the chunks committed while each push waited
        self._who, self._lock, self._queued = UNWATCHED, threading.Lock(), dict[int, int]()
        env, writer = store.environment, store.environment.writer
        counting(store, cast(Counts, self))
        build_step, submit, apply, queue = core_ready.ReadyIndex.build_step, env.submit, writer._apply, writer._queue
        watch = self

        def step(
            ready: core_ready.ReadyIndex, cls: type[Index], groups: core_ready.ReadyGroups, limit: int | None = None
        ) -> core_ready.BuildStep:
            done = build_step(ready, cls, groups, limit)
            watch.chunks.append((watch._who, done.groups))
            return done

        def asked(fn: Callable[[lmdb.Transaction[bytes]], Any], **kwargs: bool) -> Any:
            who = threading.current_thread().name

            def run(txn: lmdb.Transaction[bytes]) -> Any:
                watch._who = who
                try:
                    return fn(txn)
                finally:  # an unwatched chunk the writer runs next in the same batch is not this caller's
                    watch._who = UNWATCHED

            return submit(run, **kwargs)

        def applied(ops: list[Any], **kwargs: bool) -> None:
            chunks = len(self.chunks)
            apply(ops, **kwargs)
            with self._lock:
                ran = len(self.chunks) - chunks
                self.batches.append((ran, len(ops) - ran))
                done = sum(1 for ran, _ in self.batches if ran)
                self.waited.extend(done - self._queued.pop(id(op)) for op in ops if id(op) in self._queued)

        class Queue:
            """The writer's queue, noting the chunks committed when each push is queued."""

            def put(self, op: object) -> None:
                with watch._lock:
                    if threading.current_thread().name == pusher and op is not None:
                        watch._queued[id(op)] = sum(1 for ran, _ in watch.batches if ran)
                    queue.put(op)

            get, get_nowait = queue.get, queue.get_nowait

        monkeypatch.setattr(core_ready.ReadyIndex, "build_step", step)
        monkeypatch.setattr(env, "submit", asked)
        monkeypatch.setattr(writer, "_apply", applied)
        monkeypatch.setattr(writer, "_queue", Queue())  # the writer waits on `queue` itself

    def __getitem__(self, key: str) -> int:
        return self.by_thread[self._who][key]

    def __setitem__(self, key: str, value: int) -> None:
        self.by_thread[self._who][key] = value

    def index_rows(self, thread: str) -> int:
        return sum(n for key, n in self.by_thread[thread].items() if key.split()[-1] in INDEXES[1:])


def test_the_first_requests_after_an_open_find_their_indexes_built_in_the_background_which_pushes_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39: a table an earlier release made holds OPEN_READY ready groups and keeps no uniform
    or priority index. At the next open their builds start with no request asking; a uniform and
    a priority request made once the first chunk has committed are served without a row of an
    index written on their path (they wait while the builds go on), and the batches are right.
    Every chunk indexes at most BUILD_CHUNK groups in a write transaction of its own, and a push
    made all along waits for at most one chunk (the one under way when it came)."""
    with made_before(one_each(tmp_path)) as store:
        fill(store, OPEN_READY)
    with Store(tmp_path) as store:
        writes = Writes(store, monkeypatch, pusher="pusher")
        finished, pushed = threading.Event(), [0]

        def pusher() -> None:
            while not finished.is_set():
                store.put_entries("t", small_groups(OPEN_READY + pushed[0], 1))
                pushed[0] += 1

        thread = threading.Thread(target=pusher, name="pusher")
        thread.start()
        try:
            wait_for(lambda: writes.chunks, "a chunk of a build from the open")
            store.sampling.rng = random.Random(39)
            (uniform,) = replay(store, num_groups=1, order="uniform", wait=600)
            assert replay(store, num_groups=1, order="priority", wait=600) == ["0/0"]  # every priority 0: fifo
            wait_for(lambda: kept_by(store) == {"prio", "slots", "slotof", "byver"}, "every build", 600)
            wait_for(lambda: pushed[0] > 0, "a push")
        finally:
            finished.set()
            thread.join()
        me = threading.current_thread().name
        assert int(uniform.split("/")[1]) < OPEN_READY + pushed[0]
        assert writes.index_rows(me) == 0 and BUILDER in {who for who, _ in writes.chunks} <= {BUILDER, UNWATCHED}
        built = writes.index_rows(BUILDER) + writes.index_rows(UNWATCHED)
        assert built >= 3 * OPEN_READY  # slots, slotof and prio rows: no version
        assert max(groups for _, groups in writes.chunks) <= core_ready.BUILD_CHUNK
        assert all(others == 0 for ran, others in writes.batches if ran), "a chunk shared a transaction"
        chunked = [i for i, (ran, _) in enumerate(writes.batches) if ran]
        between = [i for i, (ran, others) in enumerate(writes.batches) if others and chunked[0] < i < chunked[-1]]
        assert len(between) >= 2, "no request committed between the chunks"
        assert len(writes.waited) == pushed[0] and max(writes.waited) <= 1, max(writes.waited)
        assert store.verify("t") == []
        assert store.stats("t")["ready"] == OPEN_READY + pushed[0]


def held_builds(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every store's index builds before their next chunk until the event is set."""
    go, chunk = threading.Event(), index_builds.IndexBuilds._chunk

    def held(self: index_builds.IndexBuilds, job: Any) -> None:
        go.wait()
        chunk(self, job)

    monkeypatch.setattr(index_builds.IndexBuilds, "_chunk", held)
    return go


def test_a_request_waits_for_the_build_of_its_index_within_its_own_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the uniform slots are being built, a uniform request whose wait ends first is refused
    (IndexNotReady, naming the table and the index) and takes nothing; one that is stopped returns
    nothing; one with a longer wait waits for the build and is then served, as a table that kept
    its slots serves it."""
    with made_before(one_each(tmp_path)) as store:
        store.put_entries("t", entries(300, 1))
    go = held_builds(monkeypatch)
    with Store(tmp_path) as store:
        spec = TakeSpec("t", num_groups=300, order="uniform", delivery="consume", wait_seconds=0.2)
        with pytest.raises(errors.IndexNotReady) as refused:
            store.sample(spec)
        assert str(refused.value).startswith("table 't': the uniform slots (slots, slotof) is being built in the ")
        assert str(refused.value).endswith("the request's wait ended first: ask again, or wait longer")
        assert store.sample(spec, timeout=600, stop=lambda: True) is None
        assert store.stats("t")["ready"] == 300
        taken: list[list[str]] = []
        waiting = threading.Thread(target=lambda: taken.append(store.sample(spec, timeout=600).group_ids))  # type: ignore[union-attr]
        waiting.start()
        wait_for(lambda: [(b.index, b.waiting) for b in store.index_builds() if b.waiting] == [("slots", 1)], "a wait")
        go.set()
        waiting.join()
        assert sorted(taken[0]) == sorted(f"0/{task}" for task in range(300))
        assert store.stats("t")["ready"] == 0 and store.verify("t") == []


def test_a_sample_past_its_wait_while_the_index_builds_is_deadline_exceeded_and_the_build_is_in_the_metrics(
    tmp_path: Path, start_server: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over gRPC: a Sample stream whose wait ends while its index is still being built ends
    DEADLINE_EXCEEDED with the build's message and the reason index_building; the metrics show
    the build (its ready groups, the groups indexed, the requests waiting) until it is done."""
    with made_before(one_each(tmp_path / "data")) as store:
        store.put_entries("t", entries(50, 1))
    go = held_builds(monkeypatch)
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(ExpbufError) as refused:
            next(client.sample("t", num_groups=1, order="priority", timeout=0.3))
        assert refused.value.code.name == "DEADLINE_EXCEEDED"
        assert "the priority index (prio) is being built in the background" in str(refused.value)
        metrics = scrape(server.metrics_port)
        labels = (("index", "prio"), ("table", "t"))
        assert metrics[("expbuf_index_build_ready_groups", labels)] == 0  # not started: held
        assert metrics[("expbuf_index_build_indexed_groups", labels)] == 0
        assert metrics[("expbuf_refused_total", (("reason", "index_building"), ("table", "t")))] == 1
        go.set()
        wait_for(lambda: not any(name.startswith("expbuf_index_build") for name, _ in scrape(server.metrics_port)), "")
        assert len(next(client.sample("t", num_groups=1, order="priority", timeout=60)).experiences) == 1


def test_a_build_killed_midway_goes_on_from_its_cursor_at_the_next_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL in the middle of a build from the open, while pushes go on: the part built and its
    cursor are consistent with every acknowledged push, the next open goes on from the cursor (its
    log says how far the build had come), and the index then holds every ready group."""
    ready = OPEN_READY // 2  # some 150 chunks a build in the child (its BUILD_CHUNK is 32)
    with made_before(one_each(tmp_path)) as store:
        fill(store, ready)
    child = subprocess.Popen(
        [sys.executable, str(HERE / "index_build_child.py"), str(tmp_path), str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": pythonpath(HERE)},
        text=True,
    )
    pushed, killed = ready, False
    assert child.stdout is not None and child.stderr is not None
    for line in child.stdout:
        said = json.loads(line)
        pushed = said["pushed"]
        if any(total and indexed >= total // 4 for _, indexed, total in said["builds"]):
            child.send_signal(signal.SIGKILL)
            killed = True
            break
    child.wait()
    assert killed, f"no build was seen under way: {child.stderr.read()[-2000:]}"
    child.stdout.close()
    child.stderr.close()
    reader = Environment(tmp_path, readonly=True)
    try:
        with reader.read() as txn:
            prefix = next(
                layout.table_prefix(json.loads(raw)["id"])
                for name, raw in txn.cursor(db=reader.db["tables"])
                if bytes(name) == b"t"
            )
            cursors = core_ready.builds(txn, reader.db, prefix)
    finally:
        reader.close()
    assert any(cursor > 0 for cursor in cursors.values()), cursors
    caplog.set_level(logging.INFO, logger="expbuf.store")
    with Store(tmp_path) as store:
        assert store.verify("t") == []
        wait_for(lambda: kept_by(store) == {"prio", "slots", "slotof", "byver"}, "the builds after the kill", 600)
        assert store.verify("t") == []
        assert store.stats("t")["ready"] >= pushed
    assert any("indexed before a restart" in record.getMessage() for record in caplog.records)


def test_a_build_cut_short_is_kept_consistent_and_goes_on_after_a_restart(tmp_path: Path) -> None:
    """Three chunks of a uniform build, then the store closes: the part built is kept in step
    with every change (pushes, consumed and leased groups, a lease given back), checks clean
    after the restart, and the build from the open finishes it; it then draws what a table that
    kept its slots all along can draw."""
    with kept_always(tmp_path / "always") as always, made_before(one_each(tmp_path / "lazy")) as lazy:
        for store in (always, lazy):
            store.put_entries("t", entries(40, 1))
        table_id, config = lazy.catalog.lookup("t")
        for _ in range(3):
            lazy.environment.submit(lambda txn: lazy.catalog.state(txn, table_id, config).build_index(Slots, limit=8))
        with lazy.environment.read() as txn:
            assert core_ready.builds(txn, lazy.environment.db, layout.table_prefix(table_id)) == {"slots": 24}
        assert lazy.verify("t") == []
    with Store(tmp_path / "always") as always, Store(tmp_path / "lazy") as lazy:
        for store in (always, lazy):
            store.put_entries("t", entries(8, 1, 40))
            assert store.sample(TakeSpec("t", num_groups=5, wait_seconds=0)) is not None  # 0/0..0/4 consumed
            leased = store.sample(TakeSpec("t", num_groups=30, order="lifo", delivery="lease", lease_seconds=60))
            assert leased is not None and leased.lease_id
            store.nack(leased.lease_id, "t")  # back with their places in the ready order
            replay(store, num_groups=2, order="fifo")  # requeued: new places past the cursor
            assert store.verify("t") == []
        everything = dict(num_groups=43, order="uniform")
        assert sorted(replay(lazy, **everything)) == sorted(replay(always, **everything))
        assert lazy.verify("t") == []
        with lazy.environment.read() as txn:
            assert core_ready.builds(txn, lazy.environment.db, layout.table_prefix(table_id)) == {}


def test_the_upkeep_has_an_index_it_needs_built_and_uses_it_once_built(tmp_path: Path) -> None:
    """A table that evicts stale groups, whose version index is not kept (its mark and rows
    removed, as a build never made): the upkeep's eviction needs it, so the pass leaves that
    table's piece undone and has the index built in the background; a pass after that evicts."""
    config = TableConfig.of(
        name="t", estimator="none", group_size=1, drop_zero_variance=False, evict_stale=True, max_staleness=0
    )
    with Store(tmp_path) as store:
        store.create_table(config)
        for task in range(6):
            store.put("t", group_items(0, task, 1, version=task % 3))
        store.set_trainer_version("t", 1)  # evicts the groups of version 0
        assert store.stats("t")["ready"] == 4
        table_id, _ = store.catalog.lookup("t")
        prefix, db = layout.table_prefix(table_id), store.environment.db

        def forget(txn: lmdb.Transaction[bytes]) -> None:
            core_ready.mark_in_use(txn, db, prefix, core_ready.every_lazy(db) - {"byver"})
            with txn.cursor(db=db["byver"]) as cur:
                found = cur.set_range(prefix)
                while found and cur.key().startswith(prefix):
                    found = cur.delete()
            tt = store.catalog.state(txn, table_id, config)
            tt.counters.trainer_version = 2  # groups of version 1 fall stale
            tt.save()

        store.environment.submit(forget)
        assert store.verify("t") == []
        store.tick()
        assert store.maintenance_failures == 0 and store.stats("t")["ready"] == 4
        wait_for(lambda: "byver" in (kept_by(store) or set()), "the version index's build")
        store.tick()
        assert store.stats("t")["ready"] == 2 and store.verify("t") == []
