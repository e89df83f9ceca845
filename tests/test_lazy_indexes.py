"""A table keeps only the ready-group indexes its readers use: the ready order always, the
uniform slots, the priority index and the version index from the first request that reads
them, built then from the ready groups. Puts are counted as bench/bench_writes.py counts them,
over a real Store."""

from __future__ import annotations

import collections
import os
import random
import shutil
import sys
import threading
from pathlib import Path

import lmdb
import pytest

from expbuf.client import EID, Experience, trxp
from expbuf.server.store import Store, layout, selection
from expbuf.server.store.errors import InvalidRequest
from expbuf.server.store.kinds import Entry
from expbuf.server.store.ready_indexes import PriorityIndex
from expbuf.server.store.sample_spec import SampleSpec
from expbuf.server.store.selection import IndexBuilding
from expbuf.server.store.table_config import TableConfig

from conftest import FIXTURES
from helpers import group_items

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_writes import counting, entries

# Ready groups of the first-build test: the rule it checks holds at any size past a few chunks;
# EXPBUF_SOAK_SCALE=10 gives the million of issue 29.
BUILD_READY = 100_000 * int(os.environ.get("EXPBUF_SOAK_SCALE", "1"))
INDEXES = ("ready", "prio", "slots", "slotof", "byver")
RECORDS = ("blobs", "items", "order", "groups")


def one_each(tmp_path: Path, name: str = "t") -> Store:
    store = Store(tmp_path)
    store.create_table(TableConfig.of(name=name, estimator="none", group_size=1, drop_zero_variance=False))
    return store


def push_puts(store: Store, at: int, n: int = 64) -> dict[str, float]:
    """The puts per experience of pushing n experiences, each its own group (of version 1), by
    database: the counters and the uniform slots' count are written once per push, not counted."""
    counted: collections.Counter[str] = collections.Counter()
    counting(store, counted)
    store.put_entries("t", entries(n, 1, at))
    if counted["put slots"]:
        counted["put slots"] -= 1
    return {key[4:]: value / n for key, value in counted.items() if key.startswith("put ") and key != "put counters"}


def replay(store: Store, table: str = "t", **spec: object) -> list[str]:
    batch = store.sample(SampleSpec(table, delivery="replay", wait_seconds=0, **spec))  # type: ignore[arg-type]
    assert batch is not None
    return batch.group_ids


def test_a_push_writes_the_indexes_its_table_was_read_with(tmp_path: Path) -> None:
    with one_each(tmp_path) as store:
        assert push_puts(store, 0) == {name: 1.0 for name in (*RECORDS, "ready")}  # 5 puts, not 9
        assert replay(store, num_groups=1, order="fifo") == ["0/0"]
        assert push_puts(store, 64) == {name: 1.0 for name in (*RECORDS, "ready")}
        replay(store, num_groups=1, order="uniform")
        assert push_puts(store, 128) == {name: 1.0 for name in (*RECORDS, "ready", "slots", "slotof")}
        assert store.verify("t") == []
    with Store(tmp_path) as store:  # the mark is durable
        assert push_puts(store, 192) == {name: 1.0 for name in (*RECORDS, "ready", "slots", "slotof")}
        replay(store, num_groups=1, order="priority", min_model_version=1)  # reads the version index only
        assert push_puts(store, 256) == {name: 1.0 for name in (*RECORDS, "ready", "slots", "slotof", "byver")}
        replay(store, num_groups=1, order="priority")
        assert push_puts(store, 320) == {name: 1.0 for name in (*RECORDS, *INDEXES)}
        assert store.verify("t") == []


def kept_always(tmp_path: Path) -> Store:
    """A store whose table keeps every index from its creation, as a table from before the mark."""
    store = one_each(tmp_path)
    table_id, _ = store.catalog.lookup("t")
    key, counters = layout.table_prefix(table_id) + selection.IN_USE, store.environment.db["counters"]
    store.environment.submit(lambda txn: txn.delete(key, db=counters))
    return store


def history(store: Store, batch: int = 1) -> None:
    """Groups of several priorities and versions (one of none), some consumed, one leased and
    given back, one requeued after a replay."""
    for task in range(24):
        version = None if task == 5 else task % 4
        store.put("t", group_items(batch, task, 1, version=version, priority=float(task % 3)))
    assert store.sample(SampleSpec("t", num_groups=3, wait_seconds=0)) is not None
    leased = store.sample(SampleSpec("t", num_groups=2, order="lifo", delivery="lease", lease_seconds=60))
    assert leased is not None and leased.lease_id
    store.nack(leased.lease_id, "t")
    replay(store, num_groups=1, order="fifo")


def test_the_first_request_in_an_order_returns_what_a_table_that_kept_its_index_returns(tmp_path: Path) -> None:
    with kept_always(tmp_path / "always") as always, one_each(tmp_path / "lazy") as lazy:
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
        # Uniform's slots are in the order groups came and went: the first uniform read builds
        # them in ready order, so the draw differs; the groups it can draw do not.
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
    with kept_always(tmp_path / "always") as always, one_each(tmp_path / "lazy") as lazy:
        for store in (always, lazy):
            store.put_entries("t", entries(40, 1))
            store.sampling.rng = random.Random(3)
        assert replay(lazy, num_groups=12, order="uniform") == replay(always, num_groups=12, order="uniform")


def test_the_check_refuses_a_kept_index_that_disagrees_and_rows_of_one_not_kept(tmp_path: Path) -> None:
    with one_each(tmp_path) as store:
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
    """The format-3 fixture, upgraded: its tables have no mark, keep every index, and a push
    writes every one of them."""
    shutil.copy(FIXTURES / "datadir_v3" / "data.mdb", tmp_path / "data.mdb")
    with Store(tmp_path) as store:
        names = [table.name for table in store.list_tables()]
        assert names
        for name in names:
            table_id, _ = store.catalog.lookup(name)
            with store.environment.read() as txn:
                assert selection.in_use(txn, store.environment.db, layout.table_prefix(table_id)) is None
            assert store.verify(name) == []
        store.create_table(TableConfig.of(name="t", estimator="none", group_size=1, drop_zero_variance=False))
        table_id, _ = store.catalog.lookup("t")
        key, counters = layout.table_prefix(table_id) + selection.IN_USE, store.environment.db["counters"]
        store.environment.submit(lambda txn: txn.delete(key, db=counters))  # "t" as the fixture's tables
        assert push_puts(store, 0) == {name: 1.0 for name in (*RECORDS, *INDEXES)}


def test_a_request_that_needs_an_index_not_kept_changes_nothing_and_an_undone_chunk_leaves_nothing(
    tmp_path: Path,
) -> None:
    """A request that reads an index its table does not keep raises IndexBuilding before it
    changes anything; a chunk of the build commits with its transaction or not at all, cursor
    included."""
    with one_each(tmp_path) as store:
        store.put_entries("t", entries(8, 1))
        table_id, config = store.catalog.lookup("t")

        def needs(txn: lmdb.Transaction[bytes]) -> None:
            store.catalog.state(txn, table_id, config).ready.of(PriorityIndex)

        def refused(txn: lmdb.Transaction[bytes]) -> None:
            assert not store.catalog.state(txn, table_id, config).ready.build_step(PriorityIndex, limit=4)
            raise InvalidRequest("refused after a chunk")

        with pytest.raises(IndexBuilding):
            store.environment.submit(needs)
        with pytest.raises(InvalidRequest, match="refused after a chunk"):
            store.environment.submit(refused)
        assert push_puts(store, 8) == {name: 1.0 for name in (*RECORDS, "ready")}
        assert store.verify("t") == []
        with store.environment.read() as txn:
            assert selection.builds(txn, store.environment.db, layout.table_prefix(table_id)) == {}
        replay(store, num_groups=1, order="priority")
        assert push_puts(store, 72) == {name: 1.0 for name in (*RECORDS, "ready", "prio")}
        assert store.verify("t") == []


def test_the_first_request_in_an_order_builds_its_index_in_chunks_that_pushes_pass_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A priority sample on a table of 5,000 ready groups that keeps no priority index: the
    index is built in transactions of at most BUILD_CHUNK groups (100 here), and pushes made
    meanwhile commit between them, never waiting for the whole build; the sample is served
    when the build is done, as a table that kept the index all along serves it."""
    monkeypatch.setattr(selection, "BUILD_CHUNK", 100)
    ready = 5000
    with one_each(tmp_path) as store:
        store.put_entries("t", entries(ready, 1))
        counted: collections.Counter[str] = collections.Counter()
        counting(store, counted)
        batches: list[tuple[int, int]] = []  # each write transaction's priority rows and payloads
        apply = store.environment._apply

        def measured(ops: list) -> None:  # type: ignore[type-arg]
            prio, blobs = counted["put prio"], counted["put blobs"]
            apply(ops)
            batches.append((counted["put prio"] - prio, counted["put blobs"] - blobs))

        monkeypatch.setattr(store.environment, "_apply", measured)
        taken: list[list[str]] = []
        sampler = threading.Thread(target=lambda: taken.append(replay(store, num_groups=1, order="priority")))
        sampler.start()
        pushed = 0
        while sampler.is_alive():
            store.put_entries("t", entries(1, 1, ready + pushed))
            pushed += 1
        sampler.join()
        building = [i for i, (prio, _) in enumerate(batches) if prio]
        assert len(building) >= ready // 100
        assert max(prio for prio, _ in batches) <= 100
        during = [i for i, (_, blobs) in enumerate(batches) if blobs and building[0] < i < building[-1]]
        assert during, "no push committed while the index was built"
        assert taken == [["0/0"]]  # every group has priority 0: the oldest first, as fifo
        assert store.verify("t") == []
        assert push_puts(store, ready + pushed) == {name: 1.0 for name in (*RECORDS, "ready", "prio")}


SMALL = trxp.from_experience(Experience(eid=EID(batch=0, task=0, run=0), tokens=list(range(8)), prompt_length=4))


def many(first: int, count: int) -> list[Entry]:
    """Experiences of tasks first..first+count-1, each its own group: as entries() makes them,
    from one template, cheaply enough for a million."""
    made = []
    for task in range(first, first + count):
        meta = {**SMALL.meta, "eid": {**SMALL.meta["eid"], "task": task}}
        made.append(Entry.of(trxp.RawItem(meta, SMALL.tensors)))
    return made


def test_pushes_during_the_first_build_on_many_ready_groups_wait_for_at_most_two_of_its_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: the first priority request on a table of BUILD_READY ready groups (1 M with
    EXPBUF_SOAK_SCALE=10) that keeps no priority index, at the default BUILD_CHUNK, while one
    client pushes all along. Each write
    transaction of the build indexes at most BUILD_CHUNK groups, and a push made meanwhile waits
    for at most the chunk under way and the next (which its own transaction may hold): never more
    than 2 x BUILD_CHUNK rows however many groups are ready (bench_growth.py --restart measures
    the milliseconds). Pushes commit between the chunks until the build ends; the request is then
    served."""
    ready, chunk = BUILD_READY, selection.BUILD_CHUNK
    with one_each(tmp_path) as store:
        for first in range(0, ready, 50_000):
            store.put_entries("t", many(first, min(50_000, ready - first)))
        counted: collections.Counter[str] = collections.Counter()
        counting(store, counted)
        batches: list[tuple[int, int]] = []  # each write transaction's priority rows and payloads
        lock, indexed = threading.Lock(), [0]  # priority rows committed so far
        queued: dict[int, int] = {}  # a push's request -> the rows committed when it was queued
        waited: list[int] = []  # the priority rows committed while each push waited, its own included
        apply, writes = store.environment._apply, store.environment._queue
        pusher = threading.current_thread()

        class Queue:
            """The writer's queue, noting when each push is queued (atomically with the count)."""

            def put(self, op: object) -> None:
                with lock:
                    if threading.current_thread() is pusher and op is not None:
                        queued[id(op)] = indexed[0]
                    writes.put(op)

            get, get_nowait = writes.get, writes.get_nowait

        def measured(ops: list) -> None:  # type: ignore[type-arg]
            prio, blobs = counted["put prio"], counted["put blobs"]
            apply(ops)
            batches.append((counted["put prio"] - prio, counted["put blobs"] - blobs))
            with lock:
                indexed[0] = counted["put prio"]
                waited.extend(indexed[0] - queued.pop(id(op)) for op in ops if id(op) in queued)

        monkeypatch.setattr(store.environment, "_apply", measured)
        monkeypatch.setattr(store.environment, "_queue", Queue())  # the writer waits on `writes` itself
        taken: list[list[str]] = []
        sampler = threading.Thread(target=lambda: taken.append(replay(store, num_groups=1, order="priority")))
        sampler.start()
        pushed = 0
        while sampler.is_alive():
            store.put_entries("t", many(ready + pushed, 1))
            pushed += 1
        sampler.join()
        building = [i for i, (prio, _) in enumerate(batches) if prio]
        assert sum(prio for prio, _ in batches) == ready + pushed  # the pushes' groups too
        assert len(building) >= ready // chunk
        assert max(prio for prio, _ in batches) <= chunk
        during = [i for i, (_, blobs) in enumerate(batches) if blobs and building[0] < i < building[-1]]
        assert len(during) >= 2, "pushes did not commit between the chunks of the build"
        assert len(waited) == pushed and 0 < max(waited) <= 2 * chunk, max(waited)
        assert taken == [["0/0"]]  # every group has priority 0: the oldest first, as fifo
        assert store.stats("t")["ready"] == ready + pushed


def test_a_build_cut_short_is_kept_consistent_and_goes_on_after_a_restart(tmp_path: Path) -> None:
    """Three chunks of a uniform build, then the store closes: the part built is kept in step
    with every change (pushes, consumed and leased groups, a lease given back), checks clean
    after the restart, and the first uniform request finishes it; it then draws what a table
    that kept its slots all along can draw."""
    with kept_always(tmp_path / "always") as always, one_each(tmp_path / "lazy") as lazy:
        for store in (always, lazy):
            store.put_entries("t", entries(40, 1))
        table_id, config = lazy.catalog.lookup("t")
        for _ in range(3):
            lazy.environment.submit(
                lambda txn: lazy.catalog.state(txn, table_id, config).ready.build_step(selection.Slots, limit=8)
            )
        with lazy.environment.read() as txn:
            assert selection.builds(txn, lazy.environment.db, layout.table_prefix(table_id)) == {"slots": 24}
        assert lazy.verify("t") == []
    with Store(tmp_path / "always") as always, Store(tmp_path / "lazy") as lazy:
        for store in (always, lazy):
            store.put_entries("t", entries(8, 1, 40))
            assert store.sample(SampleSpec("t", num_groups=5, wait_seconds=0)) is not None  # 0/0..0/4 consumed
            leased = store.sample(SampleSpec("t", num_groups=30, order="lifo", delivery="lease", lease_seconds=60))
            assert leased is not None and leased.lease_id
            store.nack(leased.lease_id, "t")  # back with their places in the ready order
            replay(store, num_groups=2, order="fifo")  # requeued: new places past the cursor
            assert store.verify("t") == []
        everything = dict(num_groups=43, order="uniform")
        assert sorted(replay(lazy, **everything)) == sorted(replay(always, **everything))
        assert lazy.verify("t") == []
        with lazy.environment.read() as txn:
            assert selection.builds(txn, lazy.environment.db, layout.table_prefix(table_id)) == {}


def test_the_upkeep_builds_an_index_it_needs_and_uses_it_at_its_next_pass(tmp_path: Path) -> None:
    """A table that evicts stale groups, whose version index is not kept (its mark and rows
    removed, as a build never made): the upkeep's eviction needs it, so the pass leaves that
    table's piece undone, the index is built in chunks, and the next pass evicts."""
    config = TableConfig.of(
        name="t", estimator="none", group_size=1, drop_zero_variance=False, evict_stale=True, max_staleness=0
    )
    with Store(tmp_path) as store:
        store.create_table(config)
        for task in range(6):
            store.put("t", group_items(0, task, 1, version=task % 3))
        store.set_trainer_version("t", 1)  # builds the version index, and evicts the groups of version 0
        assert store.stats("t")["ready"] == 4
        table_id, _ = store.catalog.lookup("t")
        prefix, db = layout.table_prefix(table_id), store.environment.db

        def forget(txn: lmdb.Transaction[bytes]) -> None:
            selection.mark_in_use(txn, db, prefix, set())
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
        with store.environment.read() as txn:
            assert "byver" in (selection.in_use(txn, db, prefix) or set())
        assert store.maintenance_failures == 0 and store.stats("t")["ready"] == 4
        store.tick()
        assert store.stats("t")["ready"] == 2 and store.verify("t") == []
