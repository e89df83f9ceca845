"""A push into a table of layout "rows" (issue 64, step 2.3): whole groups become rows (disk/rows/):
a segment per SEGMENT_GROUPS groups (or SEGMENT_MEMBERS members) with its state, a directory entry
per group and a run of ready groups, beside the payloads a records table stores; duplicates and
conflicts are answered as a records table answers them, and the counters are a records table's.
A directory that never held a rows table has none of the rows' databases."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
from test_rows_pending import Watched

from expbuf.client import trxp
from expbuf.server.store import Entry, Environment, Moved, Pushed, Store, TableExtension
from expbuf.server.store.core.table_state.state import TableState
from expbuf.server.store.disk import digests, layout
from expbuf.server.store.disk.rows import (
    SEGMENT_GROUPS,
    SEGMENT_MEMBERS,
    GroupRef,
    RunRow,
    SegmentView,
    SegState,
    directory_entry,
)
from expbuf.server.store.schema.errors import Conflict, GroupClosed, InsertLimited
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.states import READY
from expbuf.server.store.schema.table_config import TableConfig

from helpers import StoppedClock as Clock
from helpers import both_layouts as both
from helpers import group_items, layouts_stats, make_experience, take_both
from test_quarantine import damage

ONES = {"estimator": "none", "group_by": "none"}  # each experience its own group, keyed by its uid
EIGHTS = {"estimator": "none", "group_by": "task", "group_size": 8}


def pushes(groups: int, size: int) -> list[list[trxp.RawItem]]:
    """`groups` groups of `size` experiences (each of its own task), in pushes of up to 256."""
    items = [item for task in range(groups) for item in group_items(0, task, size, reward=float(task % 3))]
    return [items[i : i + 256] for i in range(0, len(items), 256)]


def rows_of(store: Store, table: str) -> dict[str, dict[bytes, bytes]]:
    """A table's rows, by database, its prefix taken off the keys."""
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    found: dict[str, dict[bytes, bytes]] = {}
    with store.environment.read() as txn:
        for name in (*layout.ROWS, "blobs"):
            with txn.cursor(db=store.db[name]) as cur:
                found[name] = {}
                if cur.set_range(prefix):
                    while cur.key().startswith(prefix):
                        found[name][bytes(cur.key()[4:])] = bytes(cur.value())
                        if not cur.next():
                            break
    return found


def named_databases(path: Path) -> set[str]:
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=layout.MAX_DBS)
    try:
        with env.begin() as txn:
            return {bytes(key).decode() for key, _ in txn.cursor()}
    finally:
        env.close()


@pytest.mark.parametrize(("settings", "groups", "size"), [(ONES, 300, 1), (EIGHTS, 40, 8)])
def test_a_push_of_whole_groups_writes_their_rows(
    tmp_path: Path, settings: dict[str, object], groups: int, size: int
) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **settings)
        pushed = [Entry.of(item) for push in pushes(groups, size) for item in push]
        for push in pushes(groups, size):
            result = store.put("t_rows", push)
            assert len(result.stored) == len(push) and result.duplicates == []
        found = rows_of(store, "t_rows")
    assert set(found["blobs"]) == {e.uid.encode() for e in pushed}  # a payload per uid, as a records table's
    segments = {int.from_bytes(key, "big"): SegmentView(value) for key, value in found["segs"].items()}
    per_segment = min(SEGMENT_GROUPS, SEGMENT_MEMBERS // size)
    cuts = [
        min(per_segment, n - first)
        for n in (len(p) // size for p in pushes(groups, size))
        for first in range(0, n, per_segment)
    ]
    assert [view.groups for view in segments.values()] == cuts  # cut where a push ends, and at 64 groups or 256 members
    assert sum(view.groups for view in segments.values()) == groups
    members = [m for view in segments.values() for m in view.members.members(0, view.members.count)]
    assert [m.uid for m in members] == [e.uid for e in pushed]  # completion order is push order
    assert [m.digest for m in members] == [digests.of(e.blob) for e in pushed]
    assert [m.seq for m in members] == list(range(len(pushed)))
    assert [m.reward for m in members] == [e.reward for e in pushed]
    keys = [key for view in segments.values() for key in view.keys(0, view.groups)]
    by = "uid" if size == 1 else "tid"
    assert keys == list(dict.fromkeys(getattr(e, by) for e in pushed))
    refs = {key.decode(): directory_entry(value) for key, value in found["gdir"].items()}
    for seg, view in segments.items():
        assert view.rseq0 == seg  # a segment's id is its first group's rseq
        for g, key in enumerate(view.keys(0, view.groups)):
            assert refs[key] == GroupRef(seg, g)
        state = SegState.decode(found["sstate"][seg.to_bytes(8, "big")])
        assert state.states(0, view.groups) == [READY] * view.groups
        assert [state.times(g) for g in range(view.groups)] == [0] * view.groups
        assert RunRow.decode(found["runs"][seg.to_bytes(8, "big")]) == RunRow(seg, 0, view.groups)
    assert len(refs) == groups and len(found["runs"]) == len(segments)
    with Store(tmp_path, clock=Clock()) as store:  # reopened: the rows found again, and consistent
        assert store.verify("t_rows") == [] and store.verify("t") == []


@pytest.mark.parametrize(("settings", "groups", "size"), [(ONES, 300, 1), (EIGHTS, 40, 8)])
def test_duplicates_conflicts_and_counters_are_a_records_tables(
    tmp_path: Path, settings: dict[str, object], groups: int, size: int
) -> None:
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **settings)
        results = {}
        for table in ("t", "t_rows"):
            results[table] = [store.put(table, push) for push in pushes(groups, size)]
            again = pushes(groups, size)[0]  # a retried push: every uid a duplicate
            results[table].append(store.put(table, again))
            changed = group_items(0, 0, size, reward=7.0)  # the uids of the first group, other rewards
            with pytest.raises(Conflict, match="already exists with different content"):
                store.put(table, changed)
        assert [(r.stored, r.duplicates, r.completed_groups) for r in results["t_rows"]] == [
            (r.stored, r.duplicates, r.completed_groups) for r in results["t"]
        ]
        assert results["t_rows"][-1].duplicates and not results["t_rows"][-1].stored
        clock.now += 5.0
        records, rows = store.stats("t"), store.stats("t_rows")
        assert rows == records and rows["ready"] == groups * size and rows["duplicates"] > 0
        assert rows["oldest_age_seconds"] == 5.0
        assert store.verify("t") == []  # the records table as it was


def test_a_retried_push_to_a_rate_limited_table_is_answered_as_a_records_tables(tmp_path: Path) -> None:
    """A push sent again (its reply lost) stores nothing new, so the rate limiter does not hold it:
    a duplicate, as from a records table, while a new experience is held. A rows table held it as an
    insert (InsertLimited), so a pusher that retried waited for samples that would never come."""
    one = group_items(0, 0, 1, response=1, prompt=1)
    limited = {**ONES, "samples_per_insert": 1.0, "samples_per_insert_error": 1.0}
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **limited)
        for table in ("t", "t_rows"):
            assert store.put(table, one).stored == [one[0].uid]
            with pytest.raises(InsertLimited):
                store.put(table, group_items(0, 1, 1, response=1, prompt=1), timeout=0)
            assert store.put(table, one, timeout=0).duplicates == [one[0].uid]
        assert layouts_stats(store, "t_rows") == layouts_stats(store, "t")


def test_a_push_to_a_complete_rows_group_is_refused_and_stores_nothing(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        store.put("t_rows", group_items(0, 1, 8))
        with pytest.raises(GroupClosed, match="group 0/1 is already complete"):
            store.put("t_rows", [trxp.from_experience(make_experience(0, 1, 8))])
        assert store.stats("t_rows")["pushed"] == 8
        assert len(rows_of(store, "t_rows")["blobs"]) == 8


@pytest.mark.usefixtures("records_layout")
def test_only_a_directory_that_held_a_rows_table_has_the_rows_databases(tmp_path: Path) -> None:
    """The rows' databases are made with the first rows table (Environment.open_rows), in a
    transaction of their own: opening, reading read-only or checking a directory of records
    tables creates none of them, and they are found again at the next open."""
    with Store(tmp_path / "records", clock=Clock()) as store:
        store.create_table(TableConfig.of("t", **EIGHTS))
        store.put("t", group_items(0, 0, 8))
    assert named_databases(tmp_path / "records").isdisjoint(layout.ROWS)
    reader = Environment(tmp_path / "records", readonly=True)  # as `expbuf check` opens it
    try:
        assert reader.missing == [] and set(layout.ROWS).isdisjoint(reader.db)
    finally:
        reader.close()
    assert named_databases(tmp_path / "records").isdisjoint(layout.ROWS)
    with Store(tmp_path / "rows", clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        store.put("t_rows", group_items(0, 0, 8))
    assert set(layout.ROWS) <= named_databases(tmp_path / "rows")
    check = [sys.executable, "-m", "expbuf.server.cli", "check", "--data"]
    for data in ("records", "rows"):  # a check of each reads each table's records or rows
        done = subprocess.run([*check, str(tmp_path / data)], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0 and "t: ok" in done.stdout, done.stdout + done.stderr
    with Store(tmp_path / "rows", clock=Clock()) as store:
        assert store.table("t_rows").storage.layout == "rows"
        assert store.put("t_rows", group_items(0, 0, 8)).duplicates != []  # found through the rows again
        store.put("t_rows", group_items(0, 5, 3))  # a pending group: its head and fragment
        store.drop_table("t_rows")  # its rows go with it
        with store.environment.read() as txn:
            assert [txn.stat(store.db[name])["entries"] for name in layout.ROWS] == [0] * len(layout.ROWS)


def test_the_check_of_a_rows_table_names_what_is_damaged(tmp_path: Path) -> None:
    """verify() (and so `expbuf check`) of a rows table reads its rows, not records: a missing
    payload, a changed one, a directory entry that names another place and the ready groups no
    run covers are each named."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        for push in pushes(40, 8):
            store.put("t_rows", push)
        assert store.verify("t_rows") == []
        prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])
        found = rows_of(store, "t_rows")
        seg = min(found["segs"])
        view = SegmentView(found["segs"][seg])
        first, second = view.members.uids(0, 2)
        gkey = view.keys(1, 2)[0]

        def damage(txn: lmdb.Transaction) -> None:
            txn.delete(prefix + first.encode(), db=store.db["blobs"])
            value = bytearray(txn.get(prefix + second.encode(), db=store.db["blobs"]))
            value[-1] ^= 0xFF
            txn.put(prefix + second.encode(), bytes(value), db=store.db["blobs"])
            txn.put(prefix + gkey.encode(), GroupRef(int.from_bytes(seg, "big"), 0).encode(), db=store.db["gdir"])
            txn.delete(prefix + seg, db=store.db["runs"])

        store.environment.submit(damage)
        problems = store.verify("t_rows")
    check = [sys.executable, "-m", "expbuf.server.cli", "check", "--data", str(tmp_path)]
    done = subprocess.run(check, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "t: ok" in done.stdout and "t_rows: " in done.stdout, done.stdout
    assert f"item {first} is ready but its payload is missing" in done.stdout, done.stdout
    assert f"item {first} is ready but its payload is missing" in problems
    assert f"item {second}: its payload does not match its digest" in problems
    assert f"group {gkey} of segment {int.from_bytes(seg, 'big')} has no directory entry naming it" in problems
    assert "group 0/0 is ready but covered by another count of ready runs" in problems
    assert len(problems) == 2 + 1 + view.groups


class Heard(TableExtension):
    """What a table's extension hears of its pushes, and the members it reads of the groups moved."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        self.events.append(("pushed", list(event.gkeys)))

    def on_moved(self, tt: TableState, event: Moved) -> None:
        members = [tt.members(grp) for _, grp in event.groups]
        rewards = [
            [(uid, m.group, m.state, m.rid, m.reward, m.times_sampled) for uid, m in ms.items()] for ms in members
        ]
        states = {grp.state for _, grp in event.groups}
        self.events.append(("moved", event.was, event.now, [gkey for gkey, _ in event.groups], states, rewards))


def test_the_check_names_a_damaged_payload_as_a_records_tables_does(tmp_path: Path) -> None:
    """`expbuf check` (verify) names a live experience's damaged payload in the same line for either
    layout (a deployment's scripts and tests/faults/test_fault_datadir.py read it); a rows table's
    named the group too ("item U of group G: ...")."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        uid = group_items(0, 1, 8)[3].uid
        for table in ("t", "t_rows"):
            for push in pushes(3, 8):
                store.put(table, push)
            damage(store, table, uid)
        assert store.verify("t_rows") == store.verify("t") == [f"item {uid}: its payload does not match its digest"]


def test_an_extension_hears_a_rows_tables_groups_become_ready_once_a_push(tmp_path: Path) -> None:
    """The groups a push readies are heard in one Moved (pending -> ready), as a records table's
    are, and their members read through the table's state (the prompt ledger reads rewards so)."""
    with Store(tmp_path, clock=Clock(), extensions={"heard": Heard}) as store:
        both(store, "t", **EIGHTS, extensions=["heard"])
        for table in ("t", "t_rows"):
            store.put(table, [item for task in range(2) for item in group_items(0, task, 8, reward=float(task))])
        heard = {
            table: next(e for e in store.extensions_of(table) if isinstance(e, Heard)).events
            for table in ("t", "t_rows")
        }
    assert heard["t_rows"] == heard["t"]
    (_, (_, was, now, gkeys, states, rewards)) = heard["t_rows"]
    assert (was, now, gkeys, states) == ("pending", "ready", ["0/0", "0/1"], {"ready"})
    assert rewards[1][3] == ("0/1/3/0/r3s0", "0/1", "ready", "0/1/3", 1.0, 0)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_large_payloads_in_chunks_are_stored_beside_a_rows_tables_rows(tmp_path: Path, compression: str) -> None:
    """A payload whose tensor section goes to chunks (compressed or not) is stored as a records
    table stores it: the rows hold its digest, the check reads it through its chunks, and it is
    a duplicate when pushed again."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", estimator="none", group_size=2, compression=compression)
        items = group_items(0, 0, 2, response=200_000)
        assert store.table("t_rows").storage.compression == compression
        assert len(store.put("t_rows", items).stored) == 2
        assert store.verify("t_rows") == []
        assert store.put("t_rows", group_items(0, 0, 2, response=200_000)).duplicates == [
            e.uid for e in map(Entry.of, items)
        ]


@pytest.mark.parametrize("bound", [{"capacity_experiences": 20}, {"capacity_bytes": 14_000}])
def test_a_full_rows_table_that_evicts_evicts_its_oldest_ready_groups_as_a_records_table(
    tmp_path: Path, bound: dict[str, int]
) -> None:
    """A push into a full table of when_full = evict evicts the oldest ready groups, never a leased
    or a pending one, as many as it needs and in one step (one Retired event): every reply, batch,
    counter and event of a rows table the same as a records table's, when its groups complete in
    the order their first experiences came (a records table evicts by its oldest experience, a rows
    table in its ready order: the next test)."""
    with Store(tmp_path, clock=Clock(), extensions={"watched": Watched}) as store:
        both(
            store,
            "t",
            estimator="none",
            group_by="task",
            group_size=4,
            when_full="evict",
            extensions=["watched"],
            **bound,
        )
        for task in range(12):
            if task == 5:
                take_both(store, "t", num_groups=1, delivery="lease")  # 0/0 leased: never evicted
            items = group_items(0, task, 4, response=1 + task % 5)
            if task % 4 == 3:  # one run left pending, pushed with the next group
                held, items = items[-1:], items[:-1]
            elif task % 4 == 0 and task:
                items = held + items
            got = [store.put(table, items) for table in ("t", "t_rows")]
            assert [(r.stored, r.completed_groups) for r in got[1:]] == [
                (r.stored, r.completed_groups) for r in got[:1]
            ]
            assert layouts_stats(store, "t_rows") == layouts_stats(store, "t")
            heard = [next(e for e in store.extensions_of(t) if isinstance(e, Watched)).events for t in ("t", "t_rows")]
            assert heard[1] == heard[0]
            for events in heard:
                events.clear()
            assert store.verify("t") == [] and store.verify("t_rows") == []
        rows = store.stats("t_rows")
        assert rows["evicted"] > 0 and rows["evicted_total"] == store.stats("t")["evicted_total"]
        while take_both(store, "t", num_groups=2, allow_partial=True) is not None:
            pass


def test_a_rows_table_evicts_in_the_order_its_groups_completed(tmp_path: Path) -> None:
    """Where a group completes after newer ones (its runs came over many pushes), a rows table evicts
    it after them (its ready order), a records table before them (its oldest experience)."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", estimator="none", group_by="task", group_size=2, capacity_experiences=4, when_full="evict")
        for table in ("t", "t_rows"):
            store.put(table, group_items(0, 0, 2)[:1])  # 0/0 opens first
            store.put(table, group_items(0, 1, 2))  # 0/1 completes first
            store.put(table, group_items(0, 0, 2)[1:])  # then 0/0
            store.put(table, group_items(0, 2, 2))  # full: one group evicted
        taken = [store.sample(TakeSpec(table=t, num_groups=2, wait_seconds=0)) for t in ("t", "t_rows")]
        assert [batch.group_ids for batch in taken if batch is not None] == [
            ["0/1", "0/1", "0/2", "0/2"],
            ["0/0", "0/0", "0/2", "0/2"],
        ]
        assert store.verify("t") == [] and store.verify("t_rows") == []


def test_pushes_of_a_few_groups_fill_the_newest_segment_while_no_group_of_it_moved(tmp_path: Path) -> None:
    """Pushes of fewer than GROW_BELOW groups (a rollout worker's trajectory at a time) go into the
    table's newest segment, 64 groups at most, its run growing over them, where each push made a
    segment of its own; once a take moved one of its groups the next push starts a segment. Takes,
    stats and the check are a records table's."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **ONES)
        items = [trxp.from_experience(make_experience(0, task, 0, reward=float(task % 3))) for task in range(150)]
        for item in items[:100]:
            clock.now += 1
            for table in ("t", "t_rows"):
                assert store.put(table, [item]).stored == [item.uid]
        found = rows_of(store, "t_rows")
        views = [SegmentView(value) for value in found["segs"].values()]
        assert [view.groups for view in views] == [SEGMENT_GROUPS, 100 - SEGMENT_GROUPS]
        assert [RunRow.decode(value) for value in found["runs"].values()] == [
            RunRow(view.rseq0, 0, view.groups) for view in views
        ]
        assert [m.uid for view in views for m in view.members.members()] == [item.uid for item in items[:100]]
        assert take_both(store, "t", num_groups=SEGMENT_GROUPS + 6) is not None  # the newest's first 6 among them
        for item in items[100:103]:
            for table in ("t", "t_rows"):
                store.put(table, [item])
        assert len(rows_of(store, "t_rows")["segs"]) == 3  # the newest had moved: a segment of their own
        assert layouts_stats(store, "t_rows") == layouts_stats(store, "t")
        while take_both(store, "t", num_groups=7, allow_partial=True) is not None:
            pass
        assert store.stats("t_rows")["consumed"] == 103
        assert store.verify("t_rows") == [] and store.verify("t") == []


def test_a_group_completed_into_the_newest_segment_moves_its_oldest_member(tmp_path: Path) -> None:
    """A group whose first run came before the newest segment's oldest member, completed into that
    segment, becomes the segment's oldest: the table's oldest live experience is its first run's."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **EIGHTS)
        early = group_items(1, 0, 8)
        for table in ("t", "t_rows"):
            store.put(table, early[:7])  # pending from time 0
        clock.now += 50
        for table in ("t", "t_rows"):
            store.put(table, group_items(1, 1, 8))  # a segment of its own, the newest, from time 50
        clock.now += 50
        for table in ("t", "t_rows"):
            store.put(table, early[7:])  # completes group 1/0 into it
        assert len(rows_of(store, "t_rows")["segs"]) == 1
        assert store.stats("t_rows")["oldest_age_seconds"] == store.stats("t")["oldest_age_seconds"] == 100
        assert store.verify("t_rows") == [] and store.verify("t") == []


@pytest.mark.parametrize("order", ["fifo", "lifo", "priority", "uniform"])
def test_a_newest_segment_held_and_given_back_whole_grows_as_one_never_held(tmp_path: Path, order: str) -> None:
    """The newest segment's groups held by a take in any order and given back: where that leaves its
    state and run as they were written (a fifo take's one run), the next pushes' groups join it;
    else they start a segment of their own. Either way the table stays a records table's twin."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **ONES)
        items = [trxp.from_experience(make_experience(0, task, 0, reward=float(task % 3))) for task in range(10)]

        def push(part: list[trxp.RawItem]) -> None:
            for item in part:
                clock.now += 1
                for table in ("t", "t_rows"):
                    store.put(table, [item])

        push(items[:5])
        for table in ("t", "t_rows"):
            held = store.sample(TakeSpec(table, num_groups=5, wait_seconds=0, order=order), hold=True)
            assert held is not None
            store.give_back(held.lease_id, table)
        push(items[5:])
        groups = [SegmentView(value).groups for value in rows_of(store, "t_rows")["segs"].values()]
        assert (groups == [10]) if order == "fifo" else (sum(groups) == 10)
        assert layouts_stats(store, "t_rows") == layouts_stats(store, "t")
        while take_both(store, "t", num_groups=3, allow_partial=True) is not None:
            pass
        assert store.stats("t_rows")["consumed"] == 10
        assert store.verify("t_rows") == [] and store.verify("t") == []
