"""A take from a table of layout "rows" (issue 64, step 2.4): whole ready groups read from the runs of
the ready order (fifo or lifo), consumed, held for a stream and confirmed or given back, leased and
acked, nacked or expired, and held batches released at a start: every batch, every counter and every
payload byte as a records table of the same settings gives them, while a take and a confirm write a
state row a segment and a run row a run, never a record per experience. The runs cover the ready
groups exactly after every step."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest

from expbuf.client import BufferClient, trxp
from expbuf.client.errors import NotFoundError
from expbuf.server.store import Moved, Retired, Store, TableExtension, Taken
from expbuf.server.store.core.ordering.ready import BUILD_CHUNK
from expbuf.server.store.core.table_state.state import TableState
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.kinds import Sampled
from expbuf.server.store.disk.rows import RunRow, SegmentView, SegState
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.states import READY
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.schema.views import Groups

from helpers import StoppedClock as Clock
from helpers import both_layouts as both
from helpers import group_items, make_experience, take_both
from helpers import layouts_reply as reply
from helpers import layouts_stats as stats
from test_quarantine import uids

ONES = {"estimator": "none", "group_by": "none"}
EIGHTS = {"estimator": "none", "group_by": "task", "group_size": 8}
SHAPES = {"groups of 1": (ONES, 1), "groups of 8": (EIGHTS, 8)}


def items(groups: int, size: int, first: int = 0) -> list[trxp.RawItem]:
    return [
        item for task in range(first, first + groups) for item in group_items(0, task, size, reward=float(task % 3))
    ]


def push_both(store: Store, name: str, groups: int, size: int, per_push: int = 96, first: int = 0) -> None:
    pushed = items(groups, size, first)
    for at in range(0, len(pushed), per_push):
        for table in (name, f"{name}_rows"):
            store.put(table, pushed[at : at + per_push])


def runs_cover_the_ready_groups(store: Store, table: str) -> None:
    """Every ready group of the rows table is covered by exactly one run, and every run covers only
    ready groups."""
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    covered: list[tuple[int, int]] = []
    ready: set[tuple[int, int]] = set()
    with store.environment.read() as txn:
        for key, value in _rows(txn, store.db["runs"], prefix):
            run = RunRow.decode(value)
            assert key == prefix + layout.u64(run.seg + run.first), "a run is keyed by its first group's place"
            covered.extend((run.seg, g) for g in range(run.first, run.first + run.length))
        for key, value in _rows(txn, store.db["sstate"], prefix):
            state = SegState.decode(value)
            seg = int.from_bytes(key[4:], "big")
            ready.update((seg, g) for g in range(state.groups) if state.state(g) == READY)
    assert len(covered) == len(set(covered)), "a group is covered twice"
    assert set(covered) == ready


def _rows(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    with txn.cursor(db=db) as cur:
        found = cur.set_range(prefix)
        while found and cur.key().startswith(prefix):
            yield bytes(cur.key()), bytes(cur.value())
            found = cur.next()


def given_back_then_confirmed(store: Store, spec: TakeSpec) -> None:
    """A batch held for a stream and given back, then one held and confirmed."""
    held = store.sample(spec, hold=True)
    assert held is not None
    store.give_back(held.lease_id, spec.table)
    held = store.sample(spec, hold=True)
    assert held is not None
    store.confirm(held.lease_id, spec)


@pytest.mark.parametrize("order", ["fifo", "lifo"])
@pytest.mark.parametrize("shape", SHAPES)
def test_consumed_batches_are_a_records_tables(tmp_path: Path, shape: str, order: str) -> None:
    settings, size = SHAPES[shape]
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **settings)
        push_both(store, "t", 150, size)
        for asked in ({"num_groups": 1}, {"num_groups": 7}, {"batch_size": 20}, {"num_groups": 70}):
            assert take_both(store, "t", order=order, **asked) is not None
            assert stats(store, "t_rows") == stats(store, "t")
            runs_cover_the_ready_groups(store, "t_rows")
        push_both(store, "t", 10, size, first=150)  # new groups behind the ones left
        while take_both(store, "t", order=order, num_groups=9, allow_partial=True) is not None:
            assert stats(store, "t_rows") == stats(store, "t")
        assert store.stats("t_rows")["ready"] == 0 and store.stats("t_rows")["consumed"] == 160 * size
        runs_cover_the_ready_groups(store, "t_rows")
        with store.environment.read() as txn:
            prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])
            assert not list(_rows(txn, store.db["blobs"], prefix)), "a consumed payload is deleted"
            assert all(SegState.decode(v).retired for _, v in _rows(txn, store.db["sstate"], prefix))


def varied(groups: int, size: int, first: int = 0) -> list[trxp.RawItem]:
    """Groups whose priorities repeat (ties taken in their place's order) and whose lowest versions
    vary, a few unknown (a member without a version): what the other orders and a lowest version read."""
    return [
        trxp.from_experience(
            make_experience(
                0, task, run, reward=float(task % 3), priority=float((task * 7 + run) % 5),
                version=None if task % 9 == 4 and run == 0 else task % 6 + run % 2,
            )
        )
        for task in range(first, first + groups)
        for run in range(size)
    ]  # fmt: skip


def push_varied(store: Store, name: str, groups: int, size: int, first: int = 0) -> None:
    pushed = varied(groups, size, first)
    for at in range(0, len(pushed), 96):
        for table in (name, f"{name}_rows"):
            store.put(table, pushed[at : at + 96])


def alike(store: Store, name: str, call: Callable[[str], object]) -> object:
    """`call` on tables `name` and `name`_rows, each from the same state of the store's random
    draws (a uniform order's): its result, asserted equal."""
    rng, got = store.sampling.rng, []
    drawn = rng.getstate()
    for table in (name, f"{name}_rows"):
        rng.setstate(drawn)
        got.append(call(table))
    assert got[1] == got[0]
    return got[1]


def sample_alike(store: Store, name: str, **spec: object) -> tuple[object, ...] | None:
    def call(table: str) -> object:
        return reply(store.sample(TakeSpec(table=table, wait_seconds=0, **spec)))  # type: ignore[arg-type]

    return alike(store, name, call)  # type: ignore[return-value]


def alike_and_clean(store: Store, name: str) -> None:
    assert stats(store, f"{name}_rows") == stats(store, name)
    runs_cover_the_ready_groups(store, f"{name}_rows")
    assert store.verify(name) == [] and store.verify(f"{name}_rows") == []


# The orders whose batches a rows table gives as a records table of the same data does: each
# deterministic, or (uniform with a lowest version) a shuffle of the same fresh groups.
ORDERED = {
    "priority": {"order": "priority"},
    "fifo from version 3": {"order": "fifo", "min_model_version": 3},
    "lifo from version 2": {"order": "lifo", "min_model_version": 2},
    "priority from version 2": {"order": "priority", "min_model_version": 2},
    "uniform from version 3": {"order": "uniform", "min_model_version": 3},
}


@pytest.mark.parametrize("asked", ORDERED)
@pytest.mark.parametrize("shape", SHAPES)
def test_batches_in_every_order_and_from_a_lowest_version_are_a_records_tables(
    tmp_path: Path, shape: str, asked: str
) -> None:
    """Consumed, held and given back or confirmed, leased and nacked or acked, replayed: every batch,
    counter and check as a records table's, across a restart, the index the order reads built by
    its first request and kept from then on, fifo takes in between keeping it."""
    settings, size = SHAPES[shape]
    order = ORDERED[asked]
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **settings)
        push_varied(store, "t", 150, size)
        for count in ({"num_groups": 1}, {"num_groups": 7}, {"batch_size": 20}):
            assert sample_alike(store, "t", **order, **count) is not None
            alike_and_clean(store, "t")
        assert sample_alike(store, "t", num_groups=3) is not None  # fifo, from the runs: the index kept
        alike_and_clean(store, "t")
        ids: dict[str, str] = {}

        def held(table: str) -> object:
            batch = store.sample(TakeSpec(table=table, num_groups=4, wait_seconds=0, **order), hold=True)  # type: ignore[arg-type]
            assert batch is not None
            ids[table] = batch.lease_id
            return reply(batch)

        alike(store, "t", held)
        alike(store, "t", lambda table: store.give_back(ids[table], table))  # in its place again
        alike_and_clean(store, "t")
        alike(store, "t", held)
        alike(store, "t", lambda table: store.confirm(ids[table], TakeSpec(table=table, num_groups=1)))
        alike_and_clean(store, "t")

        def leased(table: str) -> object:
            spec = TakeSpec(table=table, num_groups=5, wait_seconds=0, delivery="lease", **order)  # type: ignore[arg-type]
            batch = store.sample(spec)
            assert batch is not None
            ids[table] = batch.lease_id
            return reply(batch)

        alike(store, "t", leased)
        alike(store, "t", lambda table: store.nack(ids[table], table))
        alike(store, "t", leased)
        alike(store, "t", lambda table: store.ack(ids[table], table))
        alike_and_clean(store, "t")
        assert sample_alike(store, "t", num_groups=6, delivery="replay", **order) is not None
        alike_and_clean(store, "t")
        push_varied(store, "t", 20, size, first=150)  # new groups reach the index kept
        alike_and_clean(store, "t")
    with Store(tmp_path, clock=Clock()) as store:
        alike_and_clean(store, "t")
        while sample_alike(store, "t", num_groups=9, allow_partial=True, **order) is not None:
            alike_and_clean(store, "t")
        counts = stats(store, "t_rows")
        assert counts["consumed"] > 40 * size and counts["leased"] == 0  # type: ignore[operator]


def test_a_rows_table_keeps_an_index_from_the_first_request_that_reads_it(tmp_path: Path) -> None:
    """A rows table taken in fifo order writes no index of another order; the first request that
    reads one builds it: in its own transaction where the table holds a chunk of ready groups or
    fewer, in the background where it holds more, the request waiting for it whatever its own wait
    (a records table, which kept it all along, answers at once: so does the rows table, later). The
    table keeps it from then on, across a restart, and every move reaches it."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "small", **ONES)
        both(store, "large", **ONES)
        push_varied(store, "small", BUILD_CHUNK, 1)
        push_varied(store, "large", 3 * BUILD_CHUNK, 1)
        for name in ("small", "large"):
            assert sample_alike(store, name, num_groups=5) is not None
            assert index_rows(store, f"{name}_rows") == {"prio": 0, "slots": 0, "slotof": 0, "byver": 0}
        assert sample_alike(store, "small", num_groups=5, order="priority") is not None  # built in its take
        assert sample_alike(store, "large", num_groups=5, order="priority") is not None  # at wait 0, built meanwhile
        for name in ("small", "large"):
            assert index_rows(store, f"{name}_rows")["prio"] == store.stats(f"{name}_rows")["groups_ready"]
            assert index_rows(store, f"{name}_rows")["byver"] == 0  # never read
            alike_and_clean(store, name)
    with Store(tmp_path, clock=Clock()) as store:
        for name in ("small", "large"):
            assert sample_alike(store, name, num_groups=7) is not None  # fifo, the index kept
            assert sample_alike(store, name, num_groups=7, order="priority") is not None
            alike_and_clean(store, name)


def index_rows(store: Store, table: str) -> dict[str, int]:
    """How many rows of the lazy indexes' databases a table has."""
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    with store.environment.read() as txn:
        return {
            name: sum(len(key) > len(prefix) for key, _ in _rows(txn, store.db[name], prefix))
            for name in ("prio", "slots", "slotof", "byver")
        }


def test_uniform_batches_draw_every_ready_group_alike(tmp_path: Path) -> None:
    """Uniform picks on a rows table: only ready groups, each at most once a batch, every ready group
    drawn, about as often as each other; with the slots built from the ready order on a table no
    group left yet, the same draws as a records table's, consumed step by step."""
    with Store(tmp_path, clock=Clock(), seed=7) as store:
        both(store, "t", **ONES)
        push_varied(store, "t", 40, 1)
        for _ in range(5):
            assert sample_alike(store, "t", num_groups=3, order="uniform") is not None
            alike_and_clean(store, "t")
        # what leases, give-backs and nacks leave differs from a records table's slots: only what the
        # draws may be is asked of them from here
        for _ in range(3):
            lease = store.sample(TakeSpec(table="t_rows", num_groups=4, order="uniform", delivery="lease"))
            assert lease is not None
            store.nack(lease.lease_id, "t_rows")
        ready = set(groups_in(store, "t_rows", READY))
        assert len(ready) == 25
        drawn: collections.Counter[str] = collections.Counter()
        for _ in range(400):
            batch = store.sample(TakeSpec(table="t_rows", num_groups=5, order="uniform", delivery="replay"))
            assert batch is not None and len(set(batch.group_ids)) == 5 and set(batch.group_ids) <= ready
            drawn.update(batch.group_ids)
        assert set(drawn) == ready and min(drawn.values()) > 40 and max(drawn.values()) < 120  # 80 each, about
        assert store.verify("t_rows") == []
        while (batch := store.sample(TakeSpec(table="t_rows", num_groups=4, order="uniform"))) is not None:
            assert len(set(batch.group_ids)) == len(batch.group_ids) and set(batch.group_ids) <= ready
            ready -= set(batch.group_ids)
            if len(ready) < 4:
                break
        counts = store.stats("t_rows")
        assert counts["groups_ready"] == len(ready) == 1 and counts["consumed"] == 39
        assert store.verify("t_rows") == []


@pytest.mark.parametrize("shape", SHAPES)
def test_stale_groups_are_evicted_as_a_records_tables(tmp_path: Path, shape: str) -> None:
    """evict_stale: a rows table keeps the version index from its creation; a trainer's version report
    (alone, or with a take) drops the ready groups that fell below its bound, and the upkeep the
    rest, as a records table's are: the same replies, counters, extensions' events and checks,
    across a restart; a group leased meanwhile and given back stale is dropped by the next pass."""
    settings, size = SHAPES[shape]
    with Store(tmp_path, clock=Clock(), extensions={"heard": Heard}) as store:
        both(store, "t", **settings, evict_stale=True, max_staleness=1, extensions=["heard"])
        push_varied(store, "t", 60, size)
        unknown = sum(task % 9 == 4 for task in range(60))  # groups of a member without a version
        assert index_rows(store, "t_rows")["byver"] == store.stats("t_rows")["groups_ready"] - unknown
        leased = {t: store.sample(TakeSpec(table=t, num_groups=3, delivery="lease")) for t in ("t", "t_rows")}
        assert alike(store, "t", lambda table: store.set_trainer_version(table, 2)) == 2
        alike_and_clean(store, "t")
        assert sample_alike(store, "t", num_groups=4, trainer_version=4, order="priority") is not None
        alike_and_clean(store, "t")
        alike(store, "t", lambda table: store.nack(leased[table].lease_id, table))  # type: ignore[union-attr]
        alike_and_clean(store, "t")
        push_varied(store, "t", 12, size, first=60)  # old versions among them
        assert sample_alike(store, "t", num_groups=2, min_model_version=5, order="lifo") is not None
        alike_and_clean(store, "t")
    with Store(tmp_path, clock=Clock(), extensions={"heard": Heard}) as store:
        assert alike(store, "t", lambda table: store.set_trainer_version(table, 5)) == 5
        store.tick()
        alike_and_clean(store, "t")
        while sample_alike(store, "t", num_groups=3, allow_partial=True) is not None:
            alike_and_clean(store, "t")
        heard = {t: next(e for e in store.extensions_of(t) if isinstance(e, Heard)).events for t in ("t", "t_rows")}
        assert heard["t_rows"] == heard["t"] and ("retired", "dropped") in [e[:2] for e in heard["t"]]
        counts = stats(store, "t")
        assert counts["dropped_stale"] > 10 and counts["consumed"] > 0  # type: ignore[operator]


def groups_in(store: Store, table: str, state: str) -> list[str]:
    """The groups a table's segments say are in `state`."""
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    found = []
    with store.environment.read() as txn:
        for key, value in _rows(txn, store.db["segs"], prefix):
            view, segment = SegmentView(value), SegState.decode(txn.get(key, db=store.db["sstate"]))
            found += [gkey for g, gkey in enumerate(view.keys(0, view.groups)) if segment.state(g) == state]
    return found


@pytest.mark.parametrize("shape", SHAPES)
def test_held_batches_confirmed_or_given_back_are_a_records_tables(tmp_path: Path, shape: str) -> None:
    settings, size = SHAPES[shape]
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **settings)
        push_both(store, "t", 100, size)
        held: dict[str, list[Sampled]] = {"t": [], "t_rows": []}
        for table in held:
            for order, count in (("fifo", 5), ("lifo", 3), ("fifo", 30), ("lifo", 2)):
                batch = store.sample(TakeSpec(table=table, num_groups=count, order=order), hold=True)
                assert batch is not None
                held[table].append(batch)
        assert [reply(b) for b in held["t_rows"]] == [reply(b) for b in held["t"]]
        assert stats(store, "t_rows") == stats(store, "t")
        runs_cover_the_ready_groups(store, "t_rows")
        spec = TakeSpec(table="", num_groups=1)
        for table, batches in held.items():
            store.give_back(batches[0].lease_id, table)  # the client never had it
            spec = dataclasses.replace(spec, table=table)
            assert store.confirm(batches[1].lease_id, spec) == 3 * size  # consumed
            store.give_back(batches[2].lease_id, table)
        assert stats(store, "t_rows") == stats(store, "t")
        runs_cover_the_ready_groups(store, "t_rows")
        # what went back is served again, in its place in the order, counted as never sampled
        assert take_both(store, "t", num_groups=40) is not None
        assert take_both(store, "t", num_groups=40, order="lifo") is not None
        assert stats(store, "t_rows") == stats(store, "t")
        runs_cover_the_ready_groups(store, "t_rows")
        # the last hold is left for the next start, which gives it back
    with Store(tmp_path, clock=Clock()) as store:
        assert store.release_holds() == 2 * size * 2
        assert stats(store, "t_rows") == stats(store, "t")
        runs_cover_the_ready_groups(store, "t_rows")
        while take_both(store, "t", num_groups=6, allow_partial=True) is not None:
            pass
        assert stats(store, "t_rows") == stats(store, "t")


def test_leases_are_acked_nacked_renewed_and_expire_as_a_records_tables(tmp_path: Path) -> None:
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **EIGHTS)
        push_both(store, "t", 20, 8)
        leases: dict[str, list[str]] = {"t": [], "t_rows": []}
        for table, ids in leases.items():
            for count in (2, 3, 4, 1):
                spec = TakeSpec(table=table, num_groups=count, delivery="lease", lease_seconds=30)
                batch = store.sample(spec)
                assert batch is not None and batch.lease_id
                ids.append(batch.lease_id)
        assert stats(store, "t_rows") == stats(store, "t")
        for table, ids in leases.items():
            assert store.ack(ids[0], table) == 16
            assert store.nack(ids[1], table) == 24  # back, counted as sampled
            assert store.renew(ids[3], 300, table)[1] == 8
        assert stats(store, "t_rows") == stats(store, "t")
        clock.now += 60  # the third lease expires; the renewed one does not
        done = store.tick()
        assert done["leases_expired"] == 2 and done["requeued"] == 2 * 32
        by_table = {"leases_expired": 1, "requeued": 32}  # for the log, which named no table
        assert store.upkeep_by_table() == {"t": by_table, "t_rows": by_table}
        assert stats(store, "t_rows") == stats(store, "t")
        assert stats(store, "t")["leases_expired"] == 1 and stats(store, "t")["leased"] == 8
        runs_cover_the_ready_groups(store, "t_rows")
        # the nacked and expired groups come back with their deliveries counted
        batch = take_both(store, "t", num_groups=20, allow_partial=True)
        assert batch is not None and set(batch[6]) == {1, 2}  # type: ignore[arg-type]
        assert stats(store, "t_rows") == stats(store, "t")


# Replay with reuse: a replayed group not spent lowered by priority_decay (plus priority_noise) and
# sent behind every ready group, or cooled for reuse_cooldown_seconds.
REUSES = {
    "decay": {"priority_decay": 0.5, "max_times_sampled": 4},
    "decay and noise": {"priority_decay": 1.0, "priority_noise": 0.7, "max_times_sampled": 3},
    "cooldown": {"reuse_cooldown_seconds": 5.0, "max_times_sampled": 3},
    "decay and cooldown": {"priority_decay": 2.0, "reuse_cooldown_seconds": 3.0},
}
REPLAYS = [
    ("priority", 3, None), ("fifo", 4, None), ("priority", 5, 2), ("lifo", 2, None), ("uniform", 3, 3),
    ("fifo", 3, 1), ("priority", 6, None),
]  # fmt: skip


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("reuse", REUSES)
def test_replay_with_reuse_is_a_records_tables(tmp_path: Path, reuse: str, hold: bool) -> None:
    """A replayed group not spent gets its new priority and goes behind every ready group at once,
    or cools (leased to no one) until its cooldown ends: in every order, taken in one step or held
    for a stream and confirmed, each batch, counter, extension event and check as a records
    table's, across a restart, while groups are pushed, deleted (a cooling one too) and retired as
    trained; the runs cover the ready groups."""
    clock = Clock()

    def replayed(store: Store, order: str, count: int, fresh: int | None) -> Callable[[str], object]:
        def call(table: str) -> object:
            spec = TakeSpec(
                table=table, num_groups=count, delivery="replay", order=order, allow_partial=True,
                min_model_version=fresh, wait_seconds=0,
            )  # fmt: skip
            batch = store.sample(spec, hold=hold, timeout=0)
            if hold and batch is not None:
                assert store.confirm(batch.lease_id, spec) == len(batch.uids)
            return reply(batch)

        return call

    def heard(store: Store) -> None:
        events = [next(e for e in store.extensions_of(t) if isinstance(e, Heard)).events for t in ("t", "t_rows")]
        assert events[1] == events[0]
        for found in events:
            found.clear()

    for start in range(3):
        with Store(tmp_path, clock=clock, extensions={"heard": Heard}) as store:
            if start == 0:
                both(store, "t", **EIGHTS, **REUSES[reuse], extensions=["heard"])  # type: ignore[arg-type]
            push_varied(store, "t", 12, 8, first=12 * start)
            for step, (order, count, fresh) in enumerate(REPLAYS):
                alike(store, "t", replayed(store, order, count, fresh))
                alike_and_clean(store, "t")
                heard(store)
                clock.now += 2
                if step == 2:
                    task = 12 * start + 1
                    for table in ("t", "t_rows"):
                        store.delete(table, uids=[f"0/{task}/0/0/r0s0"], group_ids=[f"0/{task + 1}"])
                    alike_and_clean(store, "t")
                if step == 4:
                    gkeys = [f"0/{12 * start + task}" for task in range(4, 7)]
                    alike(store, "t", lambda table, g=gkeys: store.retire(table, g, owner="someone"))  # type: ignore[misc]
                    alike_and_clean(store, "t")
                heard(store)
    with Store(tmp_path, clock=clock, extensions={"heard": Heard}) as store:
        alike_and_clean(store, "t")
        for _ in range(40):
            clock.now += 3
            if alike(store, "t", replayed(store, "priority", 7, None)) is None and not store.stats("t")["leased"]:
                break
            alike_and_clean(store, "t")
        counts = stats(store, "t_rows")
        assert counts["sampled"] > counts["pushed"]  # type: ignore[operator]


def test_a_requeued_groups_old_place_is_forgotten_with_its_segment(tmp_path: Path) -> None:
    """A group requeued at once leaves its old place as a group deleted whole: meanwhile a retried
    push of its members is a duplicate (its directory entry names its new place); tombstone_seconds
    after every group retired, every segment is forgotten, the old places counting nothing, as a
    records table's tombstones are, and the uids are stored again."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **EIGHTS, priority_decay=1.0, max_times_sampled=2, tombstone_seconds=60)
        push_both(store, "t", 6, 8)
        assert take_both(store, "t", num_groups=4, delivery="replay") is not None  # moved behind 0/4, 0/5
        alike_and_clean(store, "t")
        again = items(1, 8)  # group 0/0's members
        for table in ("t", "t_rows"):
            pushed = store.put(table, again)
            assert not pushed.stored and len(pushed.duplicates) == 8
        while take_both(store, "t", num_groups=3, delivery="replay", allow_partial=True) is not None:
            alike_and_clean(store, "t")
        assert (store.stats("t_rows")["consumed"], store.stats("t_rows")["ready"]) == (48, 0)
        clock.now += 61
        store.tick()
        alike_and_clean(store, "t")
        assert store.stats("t_rows")["consumed"] == 0
        with store.environment.read() as txn:
            prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])
            assert not list(_rows(txn, store.db["segs"], prefix)), "every segment forgotten"
        for table in ("t", "t_rows"):
            assert len(store.put(table, again).stored) == 8


def test_a_requeued_rows_tables_payloads_are_served_from_the_map_as_a_records_tables(tmp_path: Path) -> None:
    """A take reads a payload from its snapshot's map (a view, not a copy) where the snapshot holds
    it: a rows table's groups requeued into its newest segment (their members pushed long before)
    do not make it take the newer groups' payloads for ones the snapshot lacks."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS, priority_decay=1.0)
        push_both(store, "t", 6, 8)
        for _ in range(3):
            kinds = {}
            for table in ("t", "t_rows"):
                batch = store.sample(TakeSpec(table=table, num_groups=2, delivery="replay", wait_seconds=0))
                assert batch is not None
                kinds[table] = [type(blob).__name__ for blob in batch.blobs]
            assert kinds["t_rows"] == kinds["t"] == ["memoryview"] * 16


def test_a_damaged_payload_fails_its_group_and_the_others_are_served(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        push_both(store, "t", 4, 8)
        prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])
        with store.environment.env.begin(write=True) as txn:
            key = prefix + b"0/1/3/0/r3s0"
            value = bytearray(txn.get(key, db=store.db["blobs"]))
            value[-1] ^= 0xFF
            txn.put(key, bytes(value), db=store.db["blobs"])
        batch = store.sample(TakeSpec(table="t_rows", num_groups=2, wait_seconds=0))
        assert batch is not None and sorted(set(batch.group_ids)) == ["0/0", "0/2"]
        counts = store.stats("t_rows")
        assert counts["groups_failed"] == 1 and counts["failed"] == 7 and counts["damaged"] == 1
        assert counts["quarantined"] == 1
        assert "group 0/1: " in str(counts["last_failure"]) and counts["ready"] == 8
        runs_cover_the_ready_groups(store, "t_rows")


def garble_segment(store: Store, table: str, seg: int, db: str) -> None:
    """A segment's rows (segs) or state row (sstate) left undecodable, as a damaged page would: its
    first byte, the row's kind, changed."""
    key = layout.table_prefix(store.catalog.lookup(table)[0]) + layout.u64(seg)
    store.environment.submit(lambda txn: txn.put(key, b"\x07" + txn.get(key, db=store.db[db])[1:], db=store.db[db]))


@pytest.mark.parametrize(("db", "order"), [("segs", "fifo"), ("sstate", "lifo"), ("segs", "priority")])
def test_a_sample_passes_over_a_segment_that_does_not_decode_and_serves_the_others(  # type: ignore[no-untyped-def]
    start_server, caplog: pytest.LogCaptureFixture, db: str, order: str
) -> None:
    """A segment (its rows, or its state row) a damaged page left undecodable: a sample over gRPC, in
    the runs' order or an index's (built by that sample), passes over its groups, logged once naming
    it and `expbuf check` (the table's last failure), and serves the others, where it failed with an
    internal error."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    server = start_server()
    store = server.store
    store.create_table(TableConfig.of("t", layout="rows", **EIGHTS))
    store.put("t", items(40, 8))  # 320 members: a segment of 32 groups (256 members), one of 8
    prefix = layout.table_prefix(store.catalog.lookup("t")[0])
    with store.environment.read() as txn:
        segs = [int.from_bytes(key[4:], "big") for key, _ in _rows(txn, store.db["segs"], prefix)]
    assert segs == [0, 32]
    damaged = segs[1] if order == "lifo" else segs[0]  # the one a take reaches first
    garble_segment(store, "t", damaged, db)
    served = set(range(32, 40)) if damaged == 0 else set(range(32))
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        for _ in range(2):
            batch = next(iter(client.sample("t", num_groups=4, order=order, max_batches=1, timeout=5)))
            assert len(batch.uids) == 32 and {int(gkey[2:]) for gkey in batch.group_ids} <= served
    assert sum(f"segment {damaged}" in r.getMessage() and "expbuf check" in r.getMessage() for r in caplog.records) == 1
    assert str(store.stats("t")["last_failure"]).startswith(f"segment {damaged} does not decode")


def passed_over_once(caplog: pytest.LogCaptureFixture, store: Store, seg: int) -> None:
    """The segment named once in an error log line, with `expbuf check`, and as the table's last failure."""
    assert sum(f"segment {seg}" in r.getMessage() and "expbuf check" in r.getMessage() for r in caplog.records) == 1
    assert str(store.stats("t")["last_failure"]).startswith(f"segment {seg} does not decode")


@pytest.mark.parametrize("db", ["segs", "sstate"])
@pytest.mark.parametrize("end", ["ack", "nack"])
def test_a_lease_in_part_in_a_segment_that_does_not_decode_ends_for_the_rest(  # type: ignore[no-untyped-def]
    start_server, caplog: pytest.LogCaptureFixture, db: str, end: str
) -> None:
    """A lease of groups of two segments, one of which a damaged page left undecodable: its ack over
    gRPC consumes the groups of the other, its nack puts them back, and the lease is gone; the damaged
    segment's groups, which nothing can name apart from it, are passed over, the segment named once,
    for `expbuf check`. Both were refused INTERNAL (ValueError), the lease left as it was."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    server = start_server()
    store = server.store
    store.create_table(TableConfig.of("t", layout="rows", **EIGHTS))
    store.put("t", items(40, 8))  # segment 0 of 32 groups, segment 32 of 8
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        stream = client.sample("t", num_groups=36, delivery="lease", window=1, prefetch=0)
        batch = next(stream)
        stream.close()  # the batch handed over stays leased: segment 0's groups and 4 of segment 32's
        garble_segment(store, "t", 0, db)
        assert (batch.ack() if end == "ack" else batch.nack()) == 32
        stats = client.stats("t").tables["t"]
        assert (stats.consumed, stats.ready, stats.leased) == ((32, 32, 256) if end == "ack" else (0, 64, 256))
        if end == "ack":
            assert batch.ack() == 32  # made again (its reply lost): answered as the first was
        else:
            with pytest.raises(NotFoundError, match="was nacked"):
                batch.ack()
        served = next(iter(client.sample("t", num_groups=4, max_batches=1, timeout=5)))
        assert {int(gkey[2:]) for gkey in served.group_ids} <= set(range(32, 40))
    passed_over_once(caplog, store, 0)


@pytest.mark.parametrize("db", ["segs", "sstate"])
def test_an_expired_lease_in_part_in_a_segment_that_does_not_decode_ends_for_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, db: str
) -> None:
    """The upkeep's expiry of such a lease puts the other segment's groups back and ends it, the
    damaged segment named once: the upkeep failed at the lease at every pass, which never ended."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        store.create_table(TableConfig.of("t", layout="rows", **EIGHTS))
        store.put("t", items(40, 8))
        spec = TakeSpec("t", num_groups=36, delivery="lease", lease_seconds=10, wait_seconds=0)
        assert store.sample(spec, hold=False) is not None
        garble_segment(store, "t", 0, db)
        clock.now += 11
        done = store.tick()
        assert (done["failed"], done["leases_expired"], done["requeued"]) == (0, 1, 32)
        assert store.tick()["failed"] == 0
        assert (store.stats("t")["ready"], store.stats("t")["leases_expired"]) == (64, 1)
        passed_over_once(caplog, store, 0)


@pytest.mark.parametrize("db", ["segs", "sstate"])
def test_an_eviction_passes_over_a_segment_that_does_not_decode_and_evicts_the_next(  # type: ignore[no-untyped-def]
    start_server, caplog: pytest.LogCaptureFixture, db: str
) -> None:
    """A push over gRPC into a full table (when_full=evict) whose oldest segment a damaged page left
    undecodable evicts the oldest group of the next and is stored, the damaged segment named once,
    and so do the pushes after it. It was refused INTERNAL (ValueError)."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    server = start_server()
    store = server.store
    store.create_table(TableConfig.of("t", layout="rows", capacity_experiences=320, when_full="evict", **EIGHTS))
    store.put("t", items(40, 8))
    garble_segment(store, "t", 0, db)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        assert len(client.push(trxp.build(items(1, 8, first=40)), "t").stored) == 8
        assert client.stats("t").tables["t"].evicted == 8
        for first in range(41, 48):  # the rest of segment 32, then the new groups
            client.push(trxp.build(items(1, 8, first=first)), "t")
        served = next(iter(client.sample("t", num_groups=8, max_batches=1, timeout=5)))
        assert {int(gkey[2:]) for gkey in served.group_ids} == set(range(40, 48))
    passed_over_once(caplog, store, 0)


@pytest.mark.parametrize("db", ["segs", "sstate"])
def test_reads_pass_over_a_segment_that_does_not_decode_and_serve_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, db: str
) -> None:
    """Get, its raw read, ReadFields, ListExperiences and a rank's part of a lease, of a rows table one
    of whose segments a damaged page left undecodable: Get and ReadFields list its members as missing
    and serve the others, ListExperiences lists the others' and names the segment in the log, and the
    part is the lease's groups of the other segment, as a sample passes over such a segment. Each was
    refused INTERNAL (ValueError), the whole read with it."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", layout="rows", **EIGHTS))
        store.put("t", items(40, 8))  # segment 0 of 32 groups, segment 32 of 8
        batch = store.sample(TakeSpec("t", num_groups=36, delivery="lease", wait_seconds=0), hold=False)
        assert batch is not None and batch.lease_id
        garble_segment(store, "t", 0, db)
        damaged, others = uids(0, 8), uids(32, 8)
        assert store.get("t", damaged + others).keys() == set(others)
        assert store.get_payload("t", damaged + others)[1] == damaged
        fields, missing = store.read_fields("t", damaged + others)
        try:
            assert (fields.uids, missing) == (others, damaged)
        finally:
            fields.release()
        listed = store.list_experiences("t").items
        assert {item.group for item in listed} == {f"0/{task}" for task in range(32, 40)}
        assert any("ListExperiences passed over segment 0" in r.getMessage() for r in caplog.records)
        part, step, gone = store.lease_part("t", batch.lease_id, 0, 1, "tokens")
        assert gone == []
        assert part == step == [uid for task in range(32, 36) for uid in uids(task, 8)]


def test_a_sample_stream_over_grpc_serves_a_rows_table_as_a_records_one(start_server) -> None:  # type: ignore[no-untyped-def]
    server = start_server()
    both(server.store, "t", **EIGHTS)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        for table in ("t", "t_rows"):
            client.push(trxp.build(items(12, 8)), table=table)
        got = {}
        for table in ("t", "t_rows"):
            stream = client.sample(table, num_groups=2, delivery="consume", timeout=5)
            got[table] = [(b.uids, b.group_ids, b.payload) for b in itertools.islice(stream, 5)]
            stream.close()
        assert got["t_rows"] == got["t"] and len(got["t"]) == 5
        # the stream's last batch, held and never confirmed, goes back as it closes
        deadline = time.monotonic() + 10
        while any(server.store.stats(table)["leased"] for table in ("t", "t_rows")):
            assert time.monotonic() < deadline, "a closed stream's held batch did not go back"
            time.sleep(0.02)
        shown = {table: dataclasses.asdict(client.stats(table).tables[table]) for table in ("t", "t_rows")}
        for table in shown.values():
            del table["name"], table["oldest_age_seconds"]
        assert shown["t_rows"] == shown["t"] and shown["t"]["consumed"] == 80 and shown["t"]["ready"] == 16
        for order in ("priority", "uniform"):  # each the first request to read its index
            batch = next(iter(client.sample("t_rows", num_groups=1, order=order, max_batches=1, timeout=5)))
            assert len(batch.uids) == 8 and batch.group_ids[0] in {f"0/{task}" for task in range(10, 12)}


def test_a_first_priority_stream_of_a_large_rows_table_at_wait_0_is_served_as_a_records_tables(  # type: ignore[no-untyped-def]
    start_server,
) -> None:
    """Over gRPC, a rows table of more than a chunk of ready groups, never read in priority order:
    a Sample stream in that order with no wait is served once the index is built, the batch a
    records table (which kept the index all along) serves at once, where it ended DEADLINE_EXCEEDED."""
    server = start_server()
    both(server.store, "t", **ONES)
    push_varied(server.store, "t", 3 * BUILD_CHUNK, 1)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=60) as client:
        got = {}
        for table in ("t", "t_rows"):
            stream = client.sample(table, num_groups=5, order="priority", delivery="replay", max_batches=1, timeout=0)
            got[table] = [(b.uids, b.group_ids, b.payload) for b in stream]
        assert got["t_rows"] == got["t"] and len(got["t"]) == 1 and len(got["t"][0][1]) == 5
    assert stats(server.store, "t_rows") == stats(server.store, "t") and server.store.verify("t_rows") == []


def test_a_replay_stream_with_reuse_over_grpc_serves_a_rows_table_as_a_records_one(start_server) -> None:  # type: ignore[no-untyped-def]
    """A Sample stream replaying in priority order from a table with a priority decay: each batch held,
    confirmed by the next request (its groups lowered and sent behind the others), the last given
    back as the stream closes: the same batches and stats from a rows table as from a records one."""
    server = start_server()
    both(server.store, "t", **EIGHTS, priority_decay=1.0, max_times_sampled=3)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        for table in ("t", "t_rows"):
            client.push(trxp.build(varied(6, 8)), table=table)
        got = {}
        for table in ("t", "t_rows"):
            stream = client.sample(table, num_groups=2, delivery="replay", order="priority", timeout=5)
            got[table] = [(b.uids, b.group_ids, b.times_sampled) for b in itertools.islice(stream, 7)]
            stream.close()
        assert got["t_rows"] == got["t"] and len(got["t"]) == 7
        deadline = time.monotonic() + 10
        while any(server.store.stats(table)["leased"] for table in ("t", "t_rows")):
            assert time.monotonic() < deadline, "a closed stream's held batch did not go back"
            time.sleep(0.02)
        assert stats(server.store, "t_rows") == stats(server.store, "t")
        assert server.store.verify("t_rows") == []


class Heard(TableExtension):
    """What a table's extension hears of its takes, and the members it reads of the groups each names."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def _groups(self, tt: TableState, groups: Groups) -> list[tuple[object, ...]]:
        """The groups, by key: a lease of runs names its groups in the ready order, not the take's."""
        return sorted(
            (
                gkey,
                grp.state,
                grp.lease != "",
                [(uid, m.state, m.reward, m.times_sampled) for uid, m in tt.members(grp).items()],
            )
            for gkey, grp in groups
        )

    def on_moved(self, tt: TableState, event: Moved) -> None:
        self.events.append(("moved", event.was, event.now, self._groups(tt, event.groups)))

    def on_taken(self, tt: TableState, event: Taken) -> None:
        self.events.append(("taken", event.delivery, self._groups(tt, event.groups)))

    def on_retired(self, tt: TableState, event: Retired) -> None:
        self.events.append(("retired", event.state, self._groups(tt, event.groups)))


def test_an_extension_hears_a_rows_tables_takes_as_a_records_tables(tmp_path: Path) -> None:
    """Takes, holds, give-backs, confirms and leases are heard as a records table's are: the same
    events, groups, states and members (the prompt ledger reads a retired group's rewards so)."""
    with Store(tmp_path, clock=Clock(), extensions={"heard": Heard}) as store:
        both(store, "t", **EIGHTS, extensions=["heard"])
        push_both(store, "t", 12, 8)
        for table in ("t", "t_rows"):
            spec = TakeSpec(table=table, num_groups=2)
            given_back_then_confirmed(store, spec)
            leased = store.sample(TakeSpec(table=table, num_groups=3, delivery="lease", order="lifo"))
            assert leased is not None
            store.nack(leased.lease_id, table)
            assert store.sample(TakeSpec(table=table, num_groups=1)) is not None
        heard = {
            table: next(e for e in store.extensions_of(table) if isinstance(e, Heard)).events
            for table in ("t", "t_rows")
        }
    assert heard["t_rows"] == heard["t"]
    assert [event[:2] for event in heard["t"]] == [
        ("moved", "pending"), ("moved", "ready"), ("taken", "lease"), ("moved", "leased"),  # held, given back
        ("moved", "ready"), ("taken", "lease"), ("retired", "consumed"),  # held, confirmed
        ("moved", "ready"), ("taken", "lease"), ("moved", "leased"),  # leased, nacked
        ("retired", "consumed"), ("taken", "consume"),  # consumed in its take
    ]  # fmt: skip


def attempt(name: str, epoch: int, index: int, attempt: int, runs: int) -> list[trxp.RawItem]:
    """The experiences of one attempt at a claimed prompt, whole: EID batch name/epoch, task index@attempt."""
    experiences = (
        make_experience(f"{name}/{epoch}", f"{index}@{attempt}", run, reward=float(run)) for run in range(runs)
    )
    return [trxp.from_experience(exp) for exp in experiences]


def test_the_prompt_ledger_follows_a_rows_tables_groups_as_a_records_tables(tmp_path: Path) -> None:
    """Prompts claimed from a dataset are generated when their group is pushed, trained when it is
    consumed (in its take, or a held batch confirmed, or a lease acked) and left generated when a
    held batch goes back: on a rows table as on a records table, and `verify` (the ledger's check
    of each generated prompt's group included) finds nothing wrong in either."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", group_by="task", group_size=2, estimator="none")
        found: dict[str, object] = {}
        for table in ("t", "t_rows"):
            store.claims.create(table, DatasetRecord("math", size=8))
            prompts, _ = store.claims.claim(table, "math", 6, seconds=60, owner="w")
            for prompt in prompts:
                pushed = attempt("math", prompt.epoch, prompt.index, prompt.attempt, 2)
                store.put(table, pushed)
            spec = TakeSpec(table=table, num_groups=1)
            assert store.sample(spec) is not None  # consumed in its take
            given_back_then_confirmed(store, spec)
            leased = store.sample(TakeSpec(table=table, num_groups=2, delivery="lease"))
            assert leased is not None
            store.ack(leased.lease_id, table)
            (ds,) = store.claims.datasets(table, "math")
            page = store.claims.prompts(table, "math")
            found[table] = (ds, [(e, i, r.state, r.attempt) for e, i, r in page.prompts])
            assert store.verify(table) == []
        assert found["t_rows"] == found["t"]
        ds, prompts = found["t"]
        assert [state for _, _, state, _ in prompts] == ["trained"] * 4 + ["generated"] * 2  # type: ignore[union-attr]


def test_trained_groups_retire_and_a_lease_is_read_in_parts_as_a_records_tables(tmp_path: Path) -> None:
    """Retire (groups a trainer trained without a lease: ready ones, and leased ones, their lease going
    on without them) and a leased step's rank parts give a rows table's groups as a records table's."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        push_both(store, "t", 12, 8)
        found: dict[str, tuple[object, ...]] = {}
        for table in ("t", "t_rows"):
            lease = store.sample(TakeSpec(table=table, num_groups=4, delivery="lease"))
            assert lease is not None
            parts = [store.lease_part(table, lease.lease_id, rank, 2, "tokens")[0] for rank in range(2)]
            retired = store.retire(table, ["0/1", "0/9", "0/10", "0/99"])  # leased, ready, ready, absent
            again = store.retire(table, ["0/1", "0/9"])  # a retried call changes nothing
            after = [store.lease_part(table, lease.lease_id, rank, 2, "tokens")[0] for rank in range(2)]
            acked = store.ack(lease.lease_id, table)  # what the lease still holds
            found[table] = (parts, retired, again, after, acked, stats(store, table))
            assert store.verify(table) == []
            runs_cover_the_ready_groups(store, "t_rows")
        assert found["t_rows"] == found["t"]
        parts, retired, again, after, acked, counts = found["t"]
        assert sorted(uid[:4] for part in parts for uid in part) == sorted(  # type: ignore[attr-defined]
            f"0/{task}/" for task in range(4) for _ in range(8)
        )
        assert (retired, again, acked) == (3, 0, 24)
        assert counts["consumed"] == 6 * 8 and counts["ready"] == 6 * 8  # type: ignore[index]


@pytest.mark.parametrize("order", ["lifo", "priority"])
@pytest.mark.parametrize("hold", [False, True])
def test_a_lease_taken_out_of_its_groups_places_order_is_read_in_parts_in_the_batchs_order(
    tmp_path: Path, order: str, hold: bool
) -> None:
    """A lifo or priority take's lease (or held batch) of a table that does not reuse: its rank parts
    list its groups in the order the batch gave them, as a records table's do and as the client's
    `batch.rank_parts` splits them (docs/concepts/sampling.md: "the very parts read_part serves"). A
    rows table kept such a lease as ranges of places and read its parts in the places' order: one
    rank's part was all of the batch reordered, two ranks' parts were swapped."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", estimator="none", group_by="task", group_size=2)
        found: dict[str, tuple[object, ...]] = {}
        for table in ("t", "t_rows"):
            items = [make_experience(0, task, n, priority=float(task)) for task in range(3) for n in range(2)]
            store.put(table, [trxp.from_experience(exp) for exp in items])
            spec = TakeSpec(table=table, num_groups=2, order=order, delivery="consume" if hold else "lease")
            batch = store.sample(spec, hold=hold)
            assert batch is not None
            parts = [
                store.lease_part(table, batch.lease_id, rank, ranks, "tokens")[0]
                for ranks in (1, 2)
                for rank in range(ranks)
            ]
            found[table] = (list(batch.uids), parts)
        assert found["t_rows"] == found["t"]
        uids, parts = found["t"]
        assert parts[0] == uids and parts[1:] == [uids[:2], uids[2:]]  # type: ignore[index]
        assert uids[0].startswith("0/2/")  # type: ignore[index]


@pytest.mark.parametrize("hold", [False, True])
def test_replayed_batches_are_a_records_tables(tmp_path: Path, hold: bool) -> None:
    """Replay keeps the groups ready where they are, their deliveries counted, until
    max_times_sampled consumes them: taken in one step, or held for a stream and confirmed (then
    the groups go back counted); the replies and counters are a records table's."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS, max_times_sampled=3)
        push_both(store, "t", 10, 8)
        for order, count in (("fifo", 2), ("lifo", 3), ("fifo", 4), ("fifo", 4), ("lifo", 10), ("fifo", 10)):
            got = {}
            for table in ("t", "t_rows"):
                spec = TakeSpec(table=table, num_groups=count, delivery="replay", order=order, allow_partial=True)
                batch = store.sample(spec, hold=hold, timeout=0)
                if hold and batch is not None:
                    assert store.confirm(batch.lease_id, spec) == len(batch.uids)
                got[table] = reply(batch)
            assert got["t_rows"] == got["t"]
            assert stats(store, "t_rows") == stats(store, "t")
            runs_cover_the_ready_groups(store, "t_rows")
            assert store.verify("t_rows") == []
        counts = stats(store, "t")
        assert counts["consumed"] > 0 and counts["ready"] > 0 and counts["sampled"] > counts["pushed"]  # type: ignore[operator]


def test_verify_finds_nothing_wrong_while_a_lease_names_a_group_retired_as_trained(tmp_path: Path) -> None:
    """A group of a lease retired as trained leaves its lease, which goes on naming it in its runs:
    that is no damage, and `verify` says so while the lease lasts, as a records table's does."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        push_both(store, "t", 6, 8)
        for table in ("t", "t_rows"):
            lease = store.sample(TakeSpec(table=table, num_groups=3, delivery="lease"))
            held = store.sample(TakeSpec(table=table, num_groups=2), hold=True)
            assert lease is not None and held is not None
            assert store.retire(table, ["0/1", "0/4"]) == 2  # one of each
            assert store.verify(table) == []
        assert stats(store, "t_rows") == stats(store, "t")


def test_a_group_failed_when_sampled_leaves_the_rate_limiters_count(tmp_path: Path) -> None:
    """A ready group that fails when sampled (a damaged payload) leaves the rate limiter's count as a
    records table's does: its experiences are no longer inserted, so they owe no samples."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        push_both(store, "t", 4, 8)
        for table in ("t", "t_rows"):
            prefix = layout.table_prefix(store.catalog.lookup(table)[0])
            with store.environment.env.begin(write=True) as txn:
                key = prefix + b"0/1/3/0/r3s0"
                value = bytearray(txn.get(key, db=store.db["blobs"]))
                value[-1] ^= 0xFF
                txn.put(key, bytes(value), db=store.db["blobs"])
            assert store.sample(TakeSpec(table=table, num_groups=2, wait_seconds=0)) is not None
        limiter = {
            table: {k: stats(store, table)[k] for k in ("rate_inserted", "rate_sampled")} for table in ("t", "t_rows")
        }
        assert limiter["t_rows"] == limiter["t"] == {"rate_inserted": 24, "rate_sampled": 16}


def test_verify_reports_a_rows_tables_damaged_runs_and_reads_past_a_damaged_lease(tmp_path: Path) -> None:
    """A run that does not decode, or is not keyed by its first group's place (where a take looks for
    it), is reported; a lease that does not decode (the directory's check reports it) does not stop
    the check of a rows table's rows."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **ONES)
        push_both(store, "t", 130, 1, per_push=130)  # segments 0 and 64 of 64 groups, 128 of 2
        prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])
        with store.environment.env.begin(write=True) as txn:
            txn.put(b"feedfacefeedface", b"\x01\x02", db=store.db["leases"])
            txn.delete(prefix + layout.u64(64), db=store.db["runs"])
            txn.put(prefix + layout.u64(70), RunRow(64, 0, 64).encode(), db=store.db["runs"])
            txn.put(prefix + layout.u64(128), b"\x01\x02", db=store.db["runs"])
        problems = store.verify("t_rows")
        assert any("run keyed at 70 is of group 0 of segment 64, whose place is 64" in p for p in problems), problems
        assert any(p.startswith(f"ready run {128} does not decode") for p in problems), problems
        assert not any("feedface" in p for p in problems), "the directory's check reports a damaged lease"


@pytest.mark.parametrize("places", [range(3, 9), range(8, 2, -1), [8, 3, 4, 5, 6, 7], range(5, 6), range(0)])
def test_a_runs_places_give_the_ranges_and_ends_a_list_of_them_gives(places: range | list[int]) -> None:
    """A fifo or lifo take's places are a range, read at its ends (picks.extent, row_select.ranges)
    rather than walked or sorted: the same ranges and least and greatest place as a list of them."""
    from expbuf.server.store.core.table_state.picks import extent
    from expbuf.server.store.core.verbs.rows.select import ranges

    listed = list(places)
    assert ranges(places) == ranges(listed) == ([(3, 6)] if len(listed) == 6 else [(g, 1) for g in listed])
    if listed:
        assert extent(places) == (min(listed), max(listed))
