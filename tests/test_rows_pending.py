"""Groups of a rows table that arrive over many pushes (issue 64, step 2.8: GRPO's rollout workers each
pushing their own runs of a task): a pending group keeps a head and one fragment a push until it
completes into a segment; it is joined, completed, sealed, timed out, reported short, dropped and
answered for retried pushes exactly as a records table of the same settings does it, every reply and
counter equal, `verify` clean after every step and across a restart; and a push to a pending group
writes its fragment and its head, no record per experience."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import re
from collections.abc import Callable
from pathlib import Path

import grpc
import lmdb
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expbuf.client import BufferClient, trxp
from expbuf.client.errors import DataLossError
from expbuf.client.rollout_pieces import split
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Entry, Moved, Push, Retired, Store, TableExtension
from expbuf.server.store.core.table_state.state import TableState
from expbuf.server.store.core.whole_table.pages import Reported
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.rows import PendingHead, decode_member_rows, directory, directory_entry
from expbuf.server.store.disk.rows.directory import SPILL_BYTES
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.errors import Conflict, DamagedGroup, StoreError
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.states import DROPPED, LEASED, PENDING, READY
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.schema.views import Groups

from conftest import Servers
from helpers import StoppedClock as Clock
from helpers import both_layouts as both
from helpers import layouts_reply as reply
from helpers import layouts_stats as stats
from helpers import make_experience, take_both
from test_partial_rollouts import rollout
from test_quarantine import damage

EIGHTS = {"estimator": "none", "group_by": "task", "group_size": 8}


def run(
    task: int, number: int, reward: float | None = None, version: int | None = 1, priority: float | None = None
) -> trxp.RawItem:
    """Run `number` of task `task` (batch 0), its reward varied across the group's runs."""
    reward = float((task + number) % 3) if reward is None else reward
    return trxp.from_experience(make_experience(0, task, number, reward=reward, version=version, priority=priority))


def uid(task: int, number: int) -> str:
    return Entry.of(run(task, number)).uid


def worker_pushes(tasks: int, workers: int, size: int, seed: int) -> list[list[trxp.RawItem]]:
    """Each worker's runs of every task (size / workers each), pushed a few tasks at a time, the
    workers' pushes interleaved at random: groups complete over several pushes from several workers."""
    rng = random.Random(seed)
    share = size // workers
    queues = []
    for worker in range(workers):
        mine = [run(task, worker * share + r) for task in range(tasks) for r in range(share)]
        cuts = [0]
        while cuts[-1] < len(mine):
            cuts.append(min(len(mine), cuts[-1] + rng.randint(1, 3 * share)))
        queues.append([mine[a:b] for a, b in itertools.pairwise(cuts)])
    pushes = []
    while any(queues):
        queue = rng.choice([q for q in queues if q])
        pushes.append(queue.pop(0))
    return pushes


def put_both(store: Store, name: str, items: list[trxp.RawItem]) -> tuple[object, ...]:
    """The same push into both tables: its result (or the error it raised), asserted equal."""
    got = []
    for table in (name, f"{name}_rows"):
        try:
            result = store.put(table, items)
            got.append((result.stored, result.duplicates, result.completed_groups, result.dropped_groups))
        except StoreError as exc:
            got.append((type(exc).__name__, str(exc)))
    assert got[1] == got[0]
    assert stats(store, f"{name}_rows") == stats(store, name)
    return got[1]


def clean(store: Store, *tables: str) -> None:
    for table in tables:
        assert store.verify(table) == [], table


def heads(store: Store, table: str) -> dict[str, PendingHead]:
    """The pending groups' heads a rows table keeps in its group directory."""
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    found = {}
    with store.environment.read() as txn, txn.cursor(db=store.db["gdir"]) as cur:
        at = cur.set_range(prefix)
        while at and cur.key().startswith(prefix):
            entry = directory_entry(cur.value())
            if isinstance(entry, PendingHead):
                found[bytes(cur.key()[len(prefix) :]).decode()] = entry
            at = cur.next()
    return found


@pytest.mark.parametrize("seed", [1, 2])
def test_groups_from_many_workers_complete_as_a_records_tables(tmp_path: Path, seed: int) -> None:
    clock = Clock()
    store = Store(tmp_path, clock=clock)
    try:
        both(store, "t", **EIGHTS)
        pushes = worker_pushes(tasks=24, workers=4, size=8, seed=seed)
        for number, items in enumerate(pushes):
            clock.now += 0.5
            put_both(store, "t", items)
            if number % 5 == 0:
                put_both(store, "t", items)  # a retried push: every uid a duplicate, pending or complete
            if number % 7 == 3:  # a few ready groups taken while others still fill
                take_both(store, "t", num_groups=2, allow_partial=True)
            clean(store, "t", "t_rows")
            if number == len(pushes) // 2:  # the pending groups outlive a restart
                assert heads(store, "t_rows"), "groups were pending across the restart"
                store.close()
                store = Store(tmp_path, clock=clock)
                clean(store, "t_rows")
        assert heads(store, "t_rows") == {}
        while take_both(store, "t", num_groups=5, allow_partial=True) is not None:
            pass
        assert store.stats("t_rows")["consumed"] == 24 * 8 and store.stats("t_rows")["pending"] == 0
        assert put_both(store, "t", [run(0, 0)])[1] == [uid(0, 0)]  # consumed, still a duplicate
        clean(store, "t", "t_rows")
    finally:
        store.close()


def test_a_pending_groups_conflicts_overfills_and_closed_groups_are_a_records_tables(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        put_both(store, "t", [run(0, n) for n in range(5)])
        assert put_both(store, "t", [run(0, 2, reward=9.0)])[0] == "Conflict"
        assert put_both(store, "t", [run(0, 4), run(0, 5)]) == ([uid(0, 5)], [uid(0, 4)], [], [])
        refused = put_both(store, "t", [run(0, n) for n in range(6, 9)])
        assert refused[0] == "GroupOverfilled" and "6 of 8 experiences; 3 more" in str(refused[1])
        assert put_both(store, "t", [run(0, 6), run(0, 7)])[2] == ["0/0"]
        assert put_both(store, "t", [run(0, 8)])[0] == "GroupClosed"
        assert store.stats("t_rows")["ready"] == 8 and store.stats("t_rows")["groups_pending"] == 0
        take_both(store, "t", num_groups=1)
        clean(store, "t", "t_rows")


def test_timed_out_groups_are_released_or_dropped_as_a_records_tables(tmp_path: Path) -> None:
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "rel", **EIGHTS, group_timeout_seconds=10)
        both(store, "drop", **EIGHTS, group_timeout_seconds=10, on_group_timeout="drop")
        both(store, "min", **EIGHTS, group_timeout_seconds=10, min_group_size=4)
        for name in ("rel", "drop", "min"):
            put_both(store, name, [run(0, n) for n in range(5)])
            put_both(store, name, [run(1, n) for n in range(2)])
        clock.now += 5
        for name in ("rel", "drop", "min"):
            put_both(store, name, [run(2, 0)])
        clock.now += 6  # tasks 0 and 1 time out, task 2 not yet
        store.tick()
        for name in ("rel", "drop", "min"):
            assert stats(store, f"{name}_rows") == stats(store, name)
            clean(store, name, f"{name}_rows")
            assert set(heads(store, f"{name}_rows")) == {"0/2"}
            while take_both(store, name, num_groups=1, allow_partial=True) is not None:
                pass
            assert put_both(store, name, [run(1, 0), run(1, 5)])[0] == "GroupClosed"
        assert store.stats("rel_rows")["groups_short"] == 2 and store.stats("drop_rows")["dropped_timeout"] == 2
        assert store.stats("min_rows")["dropped_short"] == 1 and store.stats("min_rows")["consumed"] == 5


def test_failed_runs_and_seals_complete_or_drop_a_pending_group_as_a_records_tables(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS, min_group_size=5)
        put_both(store, "t", [run(0, n) for n in range(6)])
        put_both(store, "t", [run(1, n) for n in range(3)])
        failed = {}
        for table in ("t", "t_rows"):
            reported = store.fail_runs(table, [uid(0, 6), uid(0, 6), uid(1, 3), uid(3, 0)], ["oom"] * 4)
            failed[table] = (reported.recorded, reported.completed_groups, reported.dropped_groups)
        assert failed["t_rows"] == failed["t"] and stats(store, "t_rows") == stats(store, "t")
        put_both(store, "t", [run(1, 4)])
        for table in ("t", "t_rows"):  # a run pushed cannot be reported failed
            with pytest.raises(Conflict, match="was pushed"):
                store.fail_runs(table, [uid(1, 4)], ["late"])
        assert put_both(store, "t", [run(0, 6), run(0, 7)])[2] == ["0/0"]  # the failed run pushed after all
        for table in ("t", "t_rows"):  # of a complete group too
            with pytest.raises(Conflict, match="was pushed"):
                store.fail_runs(table, [uid(0, 7)], ["late"])
        for uids in ([uid(1, n) for n in range(5, 8)], [uid(3, n) for n in range(1, 8)]):
            for table in ("t", "t_rows"):  # task 1: 4 of 8 pushed, short of 5; task 3: none pushed
                reported = store.fail_runs(table, uids, [])
                failed[table] = (reported.recorded, reported.completed_groups, reported.dropped_groups)
            assert failed["t_rows"] == failed["t"] and stats(store, "t_rows") == stats(store, "t")
        put_both(store, "t", [run(4, n) for n in range(5)])
        assert [store.seal(table, "0/4") for table in ("t", "t_rows")] == [5, 5]
        for table in ("t", "t_rows"):
            with pytest.raises(StoreError, match="does not exist"):
                store.seal(table, "0/9")
        assert stats(store, "t_rows") == stats(store, "t")
        while take_both(store, "t", num_groups=1, allow_partial=True) is not None:
            pass
        assert store.stats("t_rows")["dropped_short"] == 2 and store.stats("t_rows")["consumed"] == 13
        clean(store, "t", "t_rows")


def test_groups_whose_rewards_are_all_equal_are_dropped_as_a_records_tables(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS, drop_zero_variance=True)
        put_both(store, "t", [run(0, n, reward=1.0) for n in range(4)])
        assert put_both(store, "t", [run(0, n, reward=1.0) for n in range(4, 8)])[3] == ["0/0"]
        put_both(store, "t", [run(1, n) for n in range(8)])
        assert put_both(store, "t", [run(0, 3, reward=1.0)])[1] == [uid(0, 3)]  # dropped, still a duplicate
        assert store.stats("t_rows")["dropped_zero_variance"] == 1 and store.stats("t_rows")["ready"] == 8
        take_both(store, "t", num_groups=2, allow_partial=True)
        clean(store, "t", "t_rows")


class Heard(TableExtension):
    """What a table's extension hears of its groups' moves and retirements: each event's groups, their
    states and their members' uids, states and rewards."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def _groups(self, tt: TableState, groups: Groups) -> list[tuple[object, ...]]:
        members = [[(uid, m.state, m.reward) for uid, m in tt.members(grp).items()] for _, grp in groups]
        return [(gkey, grp.state, found) for (gkey, grp), found in zip(groups, members, strict=True)]

    def on_moved(self, tt: TableState, event: Moved) -> None:
        self.events.append(("moved", event.was, event.now, self._groups(tt, event.groups)))

    def on_retired(self, tt: TableState, event: Retired) -> None:
        self.events.append(("retired", event.state, self._groups(tt, event.groups)))


def test_an_extension_hears_pending_groups_complete_and_drop_as_a_records_tables(tmp_path: Path) -> None:
    """One event a push for the groups it completes, in completion order, and one for the groups a
    timeout drops, with their members: as a records table's."""
    clock = Clock()
    with Store(tmp_path, clock=clock, extensions={"heard": Heard}) as store:
        both(store, "t", **EIGHTS, group_timeout_seconds=10, on_group_timeout="drop", extensions=["heard"])
        put_both(store, "t", [run(0, n) for n in range(4)] + [run(1, n) for n in range(3)])
        put_both(store, "t", [run(2, n) for n in range(8)] + [run(0, n) for n in range(4, 8)])
        clock.now += 11
        store.tick()
        heard = {
            table: next(e for e in store.extensions_of(table) if isinstance(e, Heard)).events
            for table in ("t", "t_rows")
        }
    assert heard["t_rows"] == heard["t"]
    dropped = [("0/1", PENDING, [(uid(1, n), PENDING, float((1 + n) % 3)) for n in range(3)])]
    assert [event[:-1] for event in heard["t"]] == [("moved", PENDING, READY), ("retired", DROPPED)]
    assert [gkey for gkey, _, _ in heard["t"][0][-1]] == ["0/2", "0/0"] and heard["t"][1][-1] == dropped


def counted(store: Store, table: str) -> dict[str, int]:
    """How many rows each database of a rows table's holds (and none in a records table's)."""
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    found = {}
    with store.environment.read() as txn:
        for name in ("frags", "gdir", "segs", "pending", "blobs", "items", "groups"):
            with txn.cursor(db=store.db[name]) as cur:
                n, at = 0, cur.set_range(prefix)
                while at and cur.key().startswith(prefix):
                    n, at = n + 1, cur.next()
            found[name] = n
    return found


def test_a_push_to_a_pending_group_writes_its_head_with_its_members_rows(tmp_path: Path) -> None:
    """The rows a push to a pending group writes: its payloads and its head, which holds the group's
    members' rows (no fragment, for a group of 8 such runs); the group's completion writes its
    segment; no records."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        store.put("t_rows", [run(task, n) for task in range(3) for n in range(2)])
        assert counted(store, "t_rows") == {
            "frags": 0, "gdir": 3, "segs": 0, "pending": 3, "blobs": 6, "items": 0, "groups": 0,
        }  # fmt: skip
        store.put("t_rows", [run(task, n) for task in range(3) for n in range(2, 5)])
        assert counted(store, "t_rows") == {
            "frags": 0, "gdir": 3, "segs": 0, "pending": 3, "blobs": 15, "items": 0, "groups": 0,
        }  # fmt: skip
        for task, head in enumerate(heads(store, "t_rows").values()):
            assert head.fragments == 0 and len(head.hashes) == 5
            assert [member.uid for member in decode_member_rows(head.inline)] == [uid(task, n) for n in range(5)]
        store.put("t_rows", [run(task, n) for task in range(3) for n in range(5, 8)])
        assert counted(store, "t_rows") == {
            "frags": 0, "gdir": 3, "segs": 1, "pending": 0, "blobs": 24, "items": 0, "groups": 0,
        }  # fmt: skip


def test_a_retried_push_to_pending_groups_is_found_in_their_heads_as_a_records_tables(tmp_path: Path) -> None:
    """A push sent again to groups that stay pending (their heads screened in their bytes,
    PendingHead.holds): its runs are duplicates, stored once, beside the new runs pushed with them;
    one of them with other content is refused and stores nothing; the groups complete as a records
    table's."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        for table in ("t", "t_rows"):
            store.put(table, [run(task, 0) for task in range(4)])
            store.put(table, [run(task, 1) for task in range(4)])
        replies = {}
        for table in ("t", "t_rows"):
            again = store.put(table, [run(task, 1) for task in range(4)])
            mixed = store.put(table, [run(0, 0), run(1, 2), run(2, 1), run(3, 2)])
            replies[table] = [(r.stored, sorted(r.duplicates), r.completed_groups) for r in (again, mixed)]
            with pytest.raises(Conflict, match="already exists with different content"):
                store.put(table, [run(1, 3), run(2, 0, reward=9.0)])
        assert replies["t_rows"] == replies["t"]
        assert replies["t_rows"][0] == ([], sorted(uid(task, 1) for task in range(4)), [])
        assert replies["t_rows"][1] == ([uid(1, 2), uid(3, 2)], sorted([uid(0, 0), uid(2, 1)]), [])
        assert sorted(len(head.hashes) for head in heads(store, "t_rows").values()) == [2, 2, 3, 3]
        assert stats(store, "t_rows") == stats(store, "t") and store.stats("t_rows")["pending"] == 10
        for table in ("t", "t_rows"):
            store.put(
                table, [run(task, n) for task in range(4) for n in range(2, 8) if (task, n) not in ((1, 2), (3, 2))]
            )
        assert stats(store, "t_rows") == stats(store, "t") and store.stats("t_rows")["ready"] == 32
        assert store.verify("t_rows") == []


LARGE = {**EIGHTS, "group_size": 40}


def test_a_large_pending_groups_rows_spill_from_its_head_into_fragments(tmp_path: Path) -> None:
    """A pending group's members' rows past SPILL_BYTES go from its head into a fragment, and the
    ones after wait in its head again: each push rewrites a few rows, not all. Its members stay in
    push order through a Delete (which writes those left in its head again) and its completion, and
    it answers as a records table's does."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **LARGE)
        for at in range(0, 31, 3):  # 31 runs a group
            put_both(store, "t", [run(task, n) for task in range(2) for n in range(at, min(at + 3, 31))])
        pending = heads(store, "t_rows")
        assert list(pending) == ["0/0", "0/1"]
        for task, head in enumerate(pending.values()):
            assert head.fragments >= 2 and 0 < len(head.inline) <= SPILL_BYTES and len(head.hashes) == 31
            with store.environment.read() as txn:
                tt = TableState(
                    txn, store.db, store.catalog.lookup("t_rows")[0], store.catalog.lookup("t_rows")[1], 0.0, ()
                )
                assert [member.uid for member in tt.pending_rows(f"0/{task}", head)] == [
                    uid(task, n) for n in range(31)
                ]
        assert counted(store, "t_rows")["frags"] == sum(head.fragments for head in pending.values())
        clean(store, "t", "t_rows")
        gone = [uid(0, n) for n in (0, 7, 30)]
        assert [store.delete(table, gone) for table in ("t", "t_rows")] == [3, 3]
        assert stats(store, "t_rows") == stats(store, "t")
        head = heads(store, "t_rows")["0/0"]
        assert head.fragments == 1 and not head.inline and len(head.hashes) == 28  # 28 rows pass SPILL_BYTES
        clean(store, "t", "t_rows")
        put_both(store, "t", [run(task, n) for task in range(2) for n in range(31, 40)])
        head = heads(store, "t_rows")["0/0"]  # 37 of 40: still pending
        assert list(heads(store, "t_rows")) == ["0/0"] and len(head.hashes) == 37
        got = take_both(store, "t", num_groups=1)
        assert got is not None and got[0] == [uid(1, n) for n in range(40)]
        for table in ("t", "t_rows"):
            store.seal(table, "0/0")
        assert heads(store, "t_rows") == {} and counted(store, "t_rows")["frags"] == 0
        got = take_both(store, "t", num_groups=1)
        assert got is not None and got[0] == [uid(0, n) for n in range(40) if uid(0, n) not in gone]
        clean(store, "t", "t_rows")


def test_verify_names_a_pending_groups_damaged_rows(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **LARGE)
        for at in range(0, 30, 3):
            store.put("t_rows", [run(0, n) for n in range(at, at + 3)])
        store.put("t_rows", [run(1, n) for n in range(2)])
        store.put("t_rows", [run(2, n) for n in range(2)])
        prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])
        env: lmdb.Environment = store.environment.env
        with env.begin(write=True) as txn:
            frag = txn.cursor(db=store.db["frags"])
            assert frag.set_range(prefix + b"0/0\x00" + (1).to_bytes(4, "big"))
            frag.delete()
            txn.put(prefix + b"0/7\x00" + bytes(4), b"stray", db=store.db["frags"])
            with txn.cursor(db=store.db["pending"]) as cur:
                cur.set_range(prefix)
                while not cur.key().endswith(b"0/1"):
                    cur.next()
                cur.delete()
            raw = txn.get(prefix + b"0/2", db=store.db["gdir"])
            txn.put(prefix + b"0/2", raw[:-3], db=store.db["gdir"])  # its head's last row cut short
        problems = store.verify("t_rows")
        assert "pending group 0/0: its fragment 1 is not stored" in problems
        assert "pending group 0/1 is not in the pending index" in problems
        assert any(p.startswith("pending group 0/2: ") for p in problems), problems
        assert any("'0/7'" in p and "head is lost, its fragments" in p and "expbuf repair" in p for p in problems)
        assert any(p.startswith("counter pending is 34 but ") for p in problems), problems


def lose_first_fragment(store: Store, how: str, gkey: str = "0/0") -> list[str]:
    """A group's first fragment in table t_rows lost (`how`: "lost") or cut short so that it no longer
    decodes ("cut"), as damage would, and the records of the same members lost in table t: the uids."""
    key = layout.table_prefix(store.catalog.lookup("t_rows")[0]) + directory.fragment_key(b"", gkey, 0)
    with store.environment.read() as txn:
        raw = bytes(txn.get(key, db=store.db["frags"]))
    uids = [member.uid for member in decode_member_rows(raw)]
    records = layout.table_prefix(store.catalog.lookup("t")[0])

    def hurt(txn: lmdb.Transaction) -> None:
        txn.put(key, raw[: len(raw) // 2], db=store.db["frags"]) if how == "cut" else txn.delete(
            key, db=store.db["frags"]
        )
        for lost in uids:
            txn.delete(records + lost.encode(), db=store.db["items"])

    store.environment.submit(hurt)
    return uids


@pytest.mark.parametrize(("end", "how"), [("push", "cut"), ("seal", "lost"), ("release", "cut"), ("drop", "lost")])
def test_a_pending_group_whose_rows_are_damaged_ends_as_a_records_tables_with_lost_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, end: str, how: str
) -> None:
    """A pending group's fragment lost or undecodable: pushes to the group go on, and where it ends (its
    last runs, a seal, a timeout that releases or drops it) it fails or is dropped as a records table's
    group whose members' records are lost is, the group pushed beside it completing: the members whose
    rows were lost quarantined (found by their payloads, which go), each logged once, the others kept
    as failed; a retried push of one is a duplicate, and both tables check clean."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    clock = Clock()
    by = "step" if end == "drop" else "task"  # a step's uids are found by their batch and task
    gkeys = ["0/0/0", "0/1/0"] if by == "step" else ["0/0", "0/1"]
    with Store(tmp_path, clock=clock) as store:
        timeout = {"group_timeout_seconds": 60, "on_group_timeout": "drop" if end == "drop" else "release"}
        both(store, "t", **{**LARGE, "group_by": by}, **timeout)
        for at in range(0, 33, 3):
            put_both(store, "t", [run(task, n) for task in range(2) for n in range(at, at + 3)])
        lost = lose_first_fragment(store, how, gkeys[0])

        def push(items: list[trxp.RawItem]) -> tuple[list[str], list[str], list[str]]:
            got = [(r.stored, r.duplicates, r.completed_groups) for r in (store.put(t, items) for t in ("t", "t_rows"))]
            assert got[1] == got[0]
            return got[1]

        push([run(task, n) for task in range(2) for n in range(33, 36)])  # it stays pending
        if end == "push":
            assert push([run(task, n) for task in range(2) for n in range(36, 40)])[2] == gkeys
        elif end == "seal":
            for table, gkey in itertools.product(("t", "t_rows"), gkeys):
                store.seal(table, gkey)
        else:
            clock.now += 61
            assert store.tick()["failed"] == 0
        got = {k: v for k, v in stats(store, "t_rows").items() if k != "last_failure"}
        assert got == {k: v for k, v in stats(store, "t").items() if k != "last_failure"}
        ready = int(end != "drop")
        assert (got["groups_failed"], got["groups_ready"], got["pending"]) == (ready, ready, 0)
        assert got["quarantined"] == got["damaged"] == len(lost) > 0
        failures = [str(store.stats(table)["last_failure"]).rsplit(": ", 1) for table in ("t", "t_rows")]
        assert failures[1][0] == failures[0][0] and failures[1][0].startswith(f"group {gkeys[0]}: experience")
        assert all(sum(uid in r.getMessage() for r in caplog.records) == 2 for uid in lost)  # once a table
        assert store.get_payload("t_rows", lost[:1])[1] == lost[:1]
        assert push([run(0, 0)])[1] == [uid(0, 0)]  # a duplicate
        served = take_both(store, "t", num_groups=2, allow_partial=True)
        assert (served and set(served[1])) == (None if end == "drop" else {gkeys[1]})  # type: ignore[arg-type]
        clean(store, "t", "t_rows")


@pytest.mark.parametrize("how", ["lost", "cut"])
def test_a_pending_group_whose_rows_are_damaged_is_read_and_deleted_as_a_records_tables_with_lost_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A pending group's fragment lost or undecodable: Get, its raw read and ReadFields serve its members
    whose rows read and list the others as missing, logged, ListExperiences lists those (logged) as a
    records table's passes over a member whose record is lost, and a Delete of those (one by uid, then
    the group) takes them out, as a records table's group whose members' records are lost: the group is
    left with its lost members, and a seal then fails it with them quarantined. Each was refused
    (StoreError "fragment ... is named but not stored", or INTERNAL: struct.error)."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **LARGE)
        for at in range(0, 33, 3):
            put_both(store, "t", [run(task, n) for task in range(2) for n in range(at, at + 3)])
        lost = lose_first_fragment(store, how)
        kept = [uid(0, n) for n in range(33) if uid(0, n) not in lost]
        for table in ("t", "t_rows"):
            assert store.get(table, [*lost, *kept]).keys() == set(kept)
            assert store.get_payload(table, [*lost, *kept])[1] == lost
            batch, missing = store.read_fields(table, [*lost, *kept])
            try:
                assert (batch.uids, missing) == (kept, lost)
            finally:
                batch.release()
        assert all(sum(u in r.getMessage() for r in caplog.records) >= 2 for u in lost)  # logged for each table
        listed = [store.list_experiences(table).items for table in ("t", "t_rows")]
        assert listed[1] == listed[0] and {item.uid for item in listed[1] if item.group == "0/0"} == set(kept)
        assert any(f"passed over {len(lost)} member(s) of group 0/0" in r.getMessage() for r in caplog.records)
        assert [store.delete(table, uids=[kept[0], lost[0]]) for table in ("t", "t_rows")] == [1, 1]
        assert [store.delete(table, group_ids=["0/0"]) for table in ("t", "t_rows")] == [len(kept) - 1] * 2
        assert stats(store, "t_rows") == stats(store, "t")
        assert store.get("t_rows", kept) == {}
        for table in ("t", "t_rows"):
            store.seal(table, "0/0")
        got = {k: v for k, v in stats(store, "t_rows").items() if k != "last_failure"}
        assert got == {k: v for k, v in stats(store, "t").items() if k != "last_failure"}
        assert (got["groups_failed"], got["quarantined"], got["pending"]) == (1, len(lost), 33)
        clean(store, "t", "t_rows")


def cut_head(store: Store, table: str, gkey: str) -> None:
    """Cut a pending group's head (its directory entry) to 5 bytes, as a damaged page leaves a value
    that no longer decodes."""
    key, gdir = layout.table_prefix(store.catalog.lookup(table)[0]) + gkey.encode(), store.db["gdir"]
    store.environment.submit(lambda txn: txn.put(key, bytes(txn.get(key, db=gdir))[:5], db=gdir))


UNDECODED = "group 0/1: its record does not decode ("


@pytest.mark.parametrize("met_by", ["push", "seal", "fail_runs"])
def test_a_request_that_changes_a_pending_group_whose_head_does_not_decode_is_refused_data_loss(
    tmp_path: Path, met_by: str
) -> None:
    """A push to a pending group whose head no longer decodes, its seal and a report of its runs failed
    were refused INTERNAL (struct.error) at every try. Each is refused DATA_LOSS naming the group and
    the way out, nothing of the request stored (the push's runs of another group neither), and the
    table's other groups take runs and complete. A Delete naming the group or one of its members
    removes it whole (test_damaged_group_delete.py)."""
    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout="rows", **EIGHTS))
        store.put("t", [run(1, n) for n in range(3)] + [run(2, n) for n in range(3)])
        cut_head(store, "t", "0/1")
        before = store.stats("t")
        with pytest.raises(DamagedGroup, match=re.escape(UNDECODED)) as refused:
            if met_by == "push":
                store.put("t", [run(2, 3), run(1, 3)])
            elif met_by == "seal":
                store.seal("t", "0/1")
            else:
                store.fail_runs("t", [uid(1, 5)], ["died"])
        assert (refused.value.status, refused.value.reason) == ("DATA_LOSS", "damaged")
        assert "run `expbuf check`" in str(refused.value) and "Delete the group by its id" in str(refused.value)
        assert store.stats("t") == before
        assert store.put("t", [run(2, n) for n in range(3, 8)]).completed_groups == ["0/2"]
        assert store.stats("t")["groups_ready"] == 1


@pytest.mark.parametrize("table_layout", ["rows"], indirect=True)
@pytest.mark.usefixtures("table_layout")
def test_through_the_server_a_push_to_a_pending_group_whose_head_does_not_decode_is_data_loss(
    start_server: Servers,
) -> None:
    """Through the server: the push was refused INTERNAL. It is refused DATA_LOSS (reason damaged)
    naming the group, the health check says SERVING, and another table and group take pushes."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        for table in ("t", "other"):
            client.create_table(table, group_size=8, estimator="none")
            client.push([make_experience(0, 1, n) for n in range(3)], table)
        cut_head(server.store, "t", "0/1")
        with pytest.raises(DataLossError, match=re.escape(UNDECODED)) as refused:
            client.push([make_experience(0, 1, 3)], "t")
        assert refused.value.reason == "damaged"
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert client.push([make_experience(0, 2, n) for n in range(8)], "t").completed_groups == ["0/2"]
        assert client.push([make_experience(0, 1, n) for n in range(3, 8)], "other").completed_groups == ["0/1"]


def test_the_timeout_passes_over_a_pending_group_whose_head_does_not_decode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The table's upkeep failed at every pass over a pending group whose head no longer decodes, and
    timed out none of its other groups. It passes over that group, named once in an error log and
    left to `expbuf check`, and times out the others."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        store.create_table(TableConfig.of("t", layout="rows", group_timeout_seconds=5, **EIGHTS))
        store.put("t", [run(1, n) for n in range(3)] + [run(2, n) for n in range(3)])
        cut_head(store, "t", "0/1")
        clock.now += 6
        assert [(done["groups_timed_out"], done["failed"]) for done in (store.tick(), store.tick())] == [(1, 0), (0, 0)]
        assert sum("pending group 0/1" in r.getMessage() for r in caplog.records) == 1
        stats = store.stats("t")
        assert (stats["groups_pending"], stats["groups_ready"], stats["ready"]) == (1, 1, 3)
        assert any("0/1" in problem and "does not decode" in problem for problem in store.verify("t"))


def test_a_page_passes_over_a_pending_group_whose_head_does_not_decode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pending group's head (its directory entry) cut so that it no longer decodes: ListExperiences
    lists the other groups' members and names the group in an error log, and a Get lists its members
    as missing. The page was refused INTERNAL (struct.error)."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", layout="rows", **EIGHTS))
        store.put("t", [run(0, n) for n in range(8)] + [run(1, n) for n in range(3)])  # 0/0 complete, 0/1 pending
        cut_head(store, "t", "0/1")
        complete, pending = [uid(0, n) for n in range(8)], [uid(1, n) for n in range(3)]
        assert [item.uid for item in store.list_experiences("t").items] == complete
        assert any("ListExperiences passed over pending group 0/1" in r.getMessage() for r in caplog.records)
        assert store.get("t", complete + pending).keys() == set(complete)


def test_reads_log_each_damaged_thing_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ListExperiences and Get logged an ERROR for each damaged thing they passed over at every call,
    so a table listed again and again filled the operator's log. Each is logged once a store: a
    segment that does not decode, a pending group's head that does not decode, one whose rows do not
    read, and each member Get could not serve for it."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", layout="rows", **EIGHTS))
        store.put("t", [run(task, n) for task in range(3) for n in range(8 if task == 0 else 3)])
        prefix = layout.table_prefix(store.catalog.lookup("t")[0])
        cut_head(store, "t", "0/1")
        for key, db, keep in ((prefix + bytes(8), "segs", 9), (prefix + b"0/2", "gdir", 18 + 8 * 3 + 3)):
            store.environment.submit(
                lambda txn, key=key, db=store.db[db], keep=keep: txn.put(key, bytes(txn.get(key, db=db))[:keep], db=db)
            )  # segment 0 (group 0/0) cut short; 0/2's rows in its head cut short after its hashes
        pending = [uid(task, n) for task in (1, 2) for n in range(3)]
        for _ in range(3):
            assert store.list_experiences("t").items == []
            assert store.get("t", pending) == {}
        logged = [r.getMessage() for r in caplog.records]
        for what in ("segment 0:", "pending group 0/1:", "of group 0/2:", *pending):
            assert sum(what in message for message in logged) == 1, what


def test_the_memory_of_the_damage_logged_is_bounded() -> None:
    """The reads' memory of the damage they logged keeps at most Reported.MOST things, the oldest
    forgotten first: met again, it is logged again. A table's is apart from another's."""
    reported = Reported()
    firsts = [reported.first(b"t", "0/1"), reported.first(b"t", "0/1"), reported.first(b"u", "0/1")]
    assert firsts == [True, False, True]
    for n in range(Reported.MOST - 1):
        reported.first(b"t", str(n))
    assert [reported.first(b"t", "0/1"), reported.first(b"t", "0")] == [True, False]


def test_a_computing_group_whose_rows_are_damaged_fails_as_a_records_tables_with_lost_records(tmp_path: Path) -> None:
    """A group waiting for its advantages whose fragment is lost: the advantage worker's pass fails it
    (the members whose rows were lost quarantined) as a records table's whose members' records are
    lost, and computes the others, where it stopped at the group before."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **{**LARGE, "estimator": "grpo", "drop_zero_variance": False})
        for at in range(0, 40, 4):
            put_both(store, "t", [run(task, n) for task in range(2) for n in range(at, at + 4)])
        assert store.stats("t_rows")["groups_computing"] == 2
        lost = lose_first_fragment(store, "lost")
        assert AdvantageWorker(store).run_once() == 2  # a table's group each
        got = {k: v for k, v in stats(store, "t_rows").items() if k != "last_failure"}
        assert got == {k: v for k, v in stats(store, "t").items() if k != "last_failure"}
        assert (got["groups_failed"], got["groups_ready"], got["quarantined"]) == (1, 1, len(lost))
        clean(store, "t", "t_rows")


def attempt_runs(epoch: int, index: int, attempt: int, runs: range) -> list[trxp.RawItem]:
    """Runs of one attempt at a claimed prompt of dataset "math" (EID batch math/epoch, task index@attempt)."""
    made = (make_experience(f"math/{epoch}", f"{index}@{attempt}", r, reward=float(r)) for r in runs)
    return [trxp.from_experience(exp) for exp in made]


def test_the_prompt_ledger_drops_a_pending_group_whose_claim_ended_as_a_records_tables(tmp_path: Path) -> None:
    """Prompts claimed, their groups pushed half by one worker: a claim that runs out drops its
    pending group and sends its prompt out again, the others' groups complete over a second push;
    prompts, datasets and `verify` (the ledger's check of each claimed prompt's pending group
    included) as a records table's."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", group_by="task", group_size=4, estimator="none")
        found: dict[str, object] = {}
        for table in ("t", "t_rows"):
            store.claims.create(table, DatasetRecord("math", size=8))
            short, _ = store.claims.claim(table, "math", 1, seconds=30, owner="w")
            prompts, _ = store.claims.claim(table, "math", 3, seconds=300, owner="w")
            for prompt in [*short, *prompts]:
                store.put(table, attempt_runs(prompt.epoch, prompt.index, prompt.attempt, range(2)))
            assert store.verify(table) == []
        clock.now += 60
        store.tick()  # the short claim ends: its pending group dropped
        for table in ("t", "t_rows"):
            for prompt in prompts:
                store.put(table, attempt_runs(prompt.epoch, prompt.index, prompt.attempt, range(2, 4)))
            (ds,) = store.claims.datasets(table, "math")
            page = store.claims.prompts(table, "math")
            found[table] = (ds, [(e, i, r.state, r.attempt) for e, i, r in page.prompts])
            assert store.verify(table) == []
        assert found["t_rows"] == found["t"]
        assert stats(store, "t_rows") == stats(store, "t")
        assert store.stats("t_rows")["groups_dropped"] == 1 and store.stats("t_rows")["ready"] == 12
        assert heads(store, "t_rows") == {}


def test_rollouts_in_pieces_join_a_rows_tables_pending_group_as_a_records_tables(tmp_path: Path) -> None:
    """A first piece opens its group (as a records table's), the last one's rollout joins it whole;
    a group of a rollout in pieces alone times out and drops it; a sealed group drops its runs in
    pieces."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", estimator="none", group_size=2, group_timeout_seconds=5)
        pieces = [trxp.from_experience(piece) for piece in split(rollout(run=1), [4, 8])]
        lone = trxp.from_experience(split(rollout(task=1), [4, 8])[0])
        sealed = trxp.from_experience(split(rollout(task=2, run=1), [4])[0])
        for table in ("t", "t_rows"):
            assert store.put(table, [pieces[0], lone]).partial == [pieces[0].uid, lone.uid]
            store.put(table, [trxp.from_experience(rollout(run=0)), pieces[1]])
            assert store.stats(table)["groups_pending"] == 2 and store.stats(table)["partials"] == 2
        assert stats(store, "t_rows") == stats(store, "t") and set(heads(store, "t_rows")) == {"0/0", "0/1"}
        clock.now += 3
        for table in ("t", "t_rows"):
            assert store.put(table, [pieces[2]]).stored == [pieces[2].uid]
            store.put(table, [trxp.from_experience(rollout(task=2)), sealed])
            assert store.seal(table, "0/2") == 1
        clock.now += 3
        assert store.tick()["groups_timed_out"] == 2  # one a table
        assert stats(store, "t_rows") == stats(store, "t")
        got = take_both(store, "t", num_groups=3, allow_partial=True)
        assert got is not None and got[1] == ["0/0", "0/0", "0/2"]
        assert store.stats("t_rows")["partials"] == 0 and store.stats("t_rows")["dropped_short"] == 1
        clean(store, "t", "t_rows")


def test_a_finished_rollouts_last_piece_sent_again_is_a_duplicate_as_a_records_tables(tmp_path: Path) -> None:
    """A worker that sends its rollout's last piece again (its reply lost) hears a duplicate, whether
    the rollout's group is still pending, ready, or consumed: as from a records table. A rows table
    told it the buffer held 0 of the rollout's tokens (ALREADY_EXISTS), as if its pieces were lost."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", estimator="none", group_size=2)
        first, second, last = (trxp.from_experience(piece) for piece in split(rollout(run=1), [4, 8]))
        got: dict[str, list[object]] = {"t": [], "t_rows": []}
        for table in ("t", "t_rows"):
            for piece in (first, second, last):
                store.put(table, [piece])
            got[table].append(store.put(table, [last]).duplicates)  # its group pending
            store.put(table, [trxp.from_experience(rollout(run=0))])
            got[table].append(store.put(table, [last]).duplicates)  # ready
        assert take_both(store, "t", num_groups=1) is not None
        for table in ("t", "t_rows"):
            got[table].append(store.put(table, [last]).duplicates)  # consumed: its tombstone
        assert got["t_rows"] == got["t"] == [[last.uid]] * 3
        assert stats(store, "t_rows") == stats(store, "t")
        clean(store, "t", "t_rows")


@pytest.mark.parametrize("delivery", ["consume", "lease"])
def test_a_consumed_groups_rollouts_in_pieces_are_dropped_as_a_records_tables(tmp_path: Path, delivery: str) -> None:
    """A rollout in pieces whose group filled without it: dropped as the group completes (it takes
    no more pieces), as a records table's is; the group's take (consumed, or leased and acked) then
    finds none, and the table counts no pieces."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", estimator="none", group_size=2)
        first = trxp.from_experience(split(rollout(run=2), [4, 8])[0])
        put_both(store, "t", [first])  # a push that completes the group with it is refused
        put_both(store, "t", [trxp.from_experience(rollout(run=0)), run(0, 1)])
        assert store.stats("t_rows")["partials"] == 0 and store.stats("t_rows")["ready"] == 2
        assert stats(store, "t_rows") == stats(store, "t")
        for table in ("t", "t_rows"):
            batch = store.sample(TakeSpec(table=table, num_groups=1, delivery=delivery))
            assert batch is not None
            if delivery == "lease":
                assert store.ack(batch.lease_id, table) == 2
        assert stats(store, "t_rows") == stats(store, "t")
        assert store.stats("t_rows")["partials"] == 0 and store.stats("t_rows")["partial_bytes"] == 0
        clean(store, "t", "t_rows")


def test_the_oldest_experiences_age_counts_pending_groups_as_a_records_tables(tmp_path: Path) -> None:
    """A pending group's members are live: the oldest one's age (stats' oldest_age_seconds, the metric
    expbuf_oldest_age_seconds) counts them while their group is pending, and once it completes after
    a newer group pushed whole, as a records table's does."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **EIGHTS)

        def ages() -> list[float]:
            found = [store.stats(table)["oldest_age_seconds"] for table in ("t", "t_rows")]
            assert found[1] == found[0]
            return found

        store.fail_runs("t", [uid(0, 7)], ["oom"])  # a group opened by a failed run has no member yet
        store.fail_runs("t_rows", [uid(0, 7)], ["oom"])
        clock.now += 2
        put_both(store, "t", [run(1, n) for n in range(3)])
        clock.now += 5
        assert ages() == [5.0, 5.0]
        put_both(store, "t", [run(2, n) for n in range(8)])
        clock.now += 5
        put_both(store, "t", [run(1, n) for n in range(3, 8)])  # completes after group 0/2
        assert ages() == [10.0, 10.0]
        clean(store, "t", "t_rows")


class Watched(Heard):
    """What an extension hears, as `Heard`, of a randomized run (test_random_steps_...)."""


def _lease_end(event: tuple[object, ...]) -> bool:
    """Whether an event is of groups leaving a lease (moved from leased, or retired while leased)."""
    groups = event[-1]
    assert isinstance(groups, list)
    return (event[0] == "moved" and event[1] == LEASED) or any(state == LEASED for _, state, _ in groups)


def _heard_alike(events: list[tuple[object, ...]]) -> tuple[list[object], list[object]]:
    """Events as a records and a rows table's compare: those of groups leaving leases apart, each's
    groups and the events themselves sorted (a rows table's lease of runs gives its groups back in
    their places' order, a records table's in the order taken; leases that end at one time end in
    their random ids' order); the others in the order heard."""
    ends = sorted(repr((*e[:-1], sorted(e[-1]))) for e in events if _lease_end(e))  # type: ignore[arg-type]
    return ends, [e for e in events if not _lease_end(e)]


class RandomSteps:
    """A records and a rows table of the same settings driven through the same random steps: pushes of
    random runs of random tasks (new, pending and complete groups, runs pushed twice, retried pushes,
    conflicting content, overfills, rollouts in pieces, several pushes in one transaction), failed
    runs, seals, the clock advanced and upkeep run (timeouts, lease expiries, stale groups), trainer
    versions reported, restarts and takes (consumed, held and confirmed or given back, leased and
    acked or nacked, replayed with reuse where the settings have it, in one step or held; fifo, lifo
    and priority, and from a lowest version in those and uniform order, whose shuffle of the fresh
    groups is the same for both from the same random state, as a priority's noise is), Deletes of
    runs and of whole groups in any state, and Gets and pages of the live experiences. After every
    step each reply or error (type and message), each batch, the stats (the oldest live experience's
    age too) and what an extension heard are the same, and `verify` finds nothing wrong in either."""

    def __init__(self, root: Path, settings: dict[str, object], seed: int) -> None:
        self.root, self.rng, self.clock = root, random.Random(seed), Clock()
        self.size = int(settings["group_size"])  # type: ignore[call-overload]
        settings = dict(settings)
        self.in_push = bool(settings.pop("in_push", False))  # the store computes advantages in its pushes
        self.computes = settings.get("estimator", "none") != "none"
        reuse = ("priority_decay", "reuse_cooldown_seconds", "max_times_sampled")
        self.replays = any(name in settings for name in reuse)  # its takes replay too
        self.store = self.open()
        self.worker = self.attach()
        both(self.store, "t", group_by="task", extensions=["watched"], **{"estimator": "none", **settings})
        self.low = 0  # pushes go to tasks low..low+7, mostly to those whose groups are open
        self.closed: set[int] = set()
        self.pushes: list[list[trxp.RawItem]] = []
        self.held: list[tuple[str, dict[str, str], TakeSpec]] = []  # leases and holds: (kind, id by table, spec)
        self.leases: dict[str, str] = {}  # the lease id of each table a call names
        self.log: list[str] = []
        self.verified: tuple[Store, int] | None = None  # the store and its last commit at the last check

    def open(self) -> Store:
        """The store over `root`, at the start and at each restart."""
        return Store(self.root, clock=self.clock, extensions={"watched": Watched})

    def both(self, what: str, call: Callable[[str], object]) -> object:
        """`call` on each table: its result, or the error it raised (the table's name, quoted or in a
        hint's command line, and lease ids in its message made alike), asserted equal."""
        got: list[object] = []
        for table in ("t", "t_rows"):
            try:
                got.append(call(table))
            except StoreError as exc:
                message = str(exc).replace("'t_rows'", "'t'").replace(" t_rows ", " t ")
                got.append((type(exc).__name__, message.replace(self.leases.get(table, "\0"), "<lease>")))
        self.log.append(f"{what} -> {got[0]!r}"[:300])
        assert got[1] == got[0], "\n".join(self.log[-25:])
        return got[0]

    def check(self) -> None:
        store = self.store
        assert stats(store, "t_rows") == stats(store, "t"), "\n".join(self.log[-25:])
        ages = [store.stats(table)["oldest_age_seconds"] for table in ("t", "t_rows")]
        assert ages[1] == ages[0], "\n".join(self.log[-25:])
        heard = [next(e for e in store.extensions_of(t) if isinstance(e, Watched)).events for t in ("t", "t_rows")]
        assert _heard_alike(heard[1]) == _heard_alike(heard[0]), "\n".join(self.log[-25:])
        for events in heard:
            events.clear()
        if self.committed():
            clean(store, "t", "t_rows")

    def committed(self) -> bool:
        """Whether anything was committed since the last check, or the store was opened again: `verify`
        reads the committed data and nothing else, so until then it finds what it found. Most steps
        commit nothing (a read, a refusal, an empty take), and their verifies were most of a walk's CPU."""
        at = (self.store, self.store.environment.env.info()["last_txnid"])
        committed, self.verified = at != self.verified, at
        return committed

    def reward(self, task: int, number: int) -> float:
        return 1.0 if task % 3 == 0 else float((task * 7 + number * 3) % 4)  # task 0, 3, ...: all equal

    def run(self, task: int, number: int, reward: float) -> trxp.RawItem:
        """A run of a version (a few unknown: its group is of none) and a priority, which the takes in
        priority order and from a lowest version read."""
        version = None if task % 7 == 3 and number % 4 == 0 else task % 4 + number % 2
        return run(task, number, reward, version=version, priority=float((task * 5 + number) % 3))

    def items(self) -> list[trxp.RawItem]:
        rng, items = self.rng, []
        tasks = [t for t in range(self.low, self.low + 8) if t not in self.closed or rng.random() < 0.1]
        for task in rng.sample(tasks, min(len(tasks), rng.randint(1, 3))):
            for number in rng.sample(range(self.size + 2), rng.randint(1, self.size)):
                reward = 9.0 if rng.random() < 0.01 else self.reward(task, number)  # 9: a conflict, once pushed
                items.extend([self.run(task, number, reward)] * (2 if rng.random() < 0.03 else 1))
            if rng.random() < 0.2:  # a piece of a rollout of one of the task's runs
                number, at = rng.randrange(self.size + 2), rng.choice([0, 0, 1, 2])
                made = rollout(task=task, run=number, reward=float(number % 2))
                items.append(trxp.from_experience(split(made, [4, 8])[at]))
        return items

    def closes(self, got: object) -> None:
        """The tasks whose groups a reply says are complete or dropped."""
        assert isinstance(got, tuple)
        if got[0] == "GroupClosed":
            named = str(got[1]).split()[1]  # "group T/t is complete ...", or a push refused whole: none closed
            if "/" in named:
                self.closed.add(int(named.split("/")[1]))
        elif not isinstance(got[0], str):
            self.closed.update(int(g.split("/")[1]) for gkeys in got[-3:] for g in gkeys)  # type: ignore[attr-defined]

    def push(self) -> None:
        if self.pushes and self.rng.random() < 0.15:
            items = self.rng.choice(self.pushes)  # retried
        else:
            items = self.items()
            self.pushes.append(items)

        def put(table: str) -> object:
            r = store.put(table, items)
            return (r.stored, r.duplicates, r.completed_groups, r.dropped_groups, r.partial)

        store = self.store
        self.closes(self.both(f"push {[i.uid for i in items]}", put))

    def push_in_order(self) -> None:
        batches = [self.items() for _ in range(self.rng.randint(2, 3))]

        def put(table: str) -> object:
            got: list[object] = []
            try:
                for r in store.put_in_order([Push(table, [Entry.of(i) for i in b]) for b in batches]):
                    got.append((r.stored, r.duplicates, r.completed_groups, r.dropped_groups, r.partial))
            except StoreError as exc:
                got.append((type(exc).__name__, str(exc).replace("'t_rows'", "'t'")))
            return tuple(got)

        store = self.store
        self.both(f"in order {[[i.uid for i in b] for b in batches]}", put)

    def fail(self) -> None:
        rng = self.rng
        uids = [
            uid(rng.randrange(self.low, self.low + 8), rng.randrange(self.size + 2)) for _ in range(rng.randint(1, 4))
        ]

        def call(table: str) -> object:
            r = self.store.fail_runs(table, uids, ["oom"] * len(uids))
            return (r.recorded, r.completed_groups, r.dropped_groups)

        self.closes(self.both(f"fail {uids}", call))

    def seal(self) -> None:
        task = self.rng.randrange(self.low, self.low + 8)
        self.both(f"seal 0/{task}", lambda table: self.store.seal(table, f"0/{task}"))
        self.closed.add(task)

    def tick(self) -> None:
        self.clock.now += self.rng.choice([0.5, 2, 4, 7])
        self.log.append(f"tick to {self.clock.now}: {self.store.tick()}")

    def attach(self) -> AdvantageWorker:
        """The store's advantage worker (run by `compute`), which computes in its pushes too where
        the settings say so."""
        worker = AdvantageWorker(self.store)
        if self.in_push:
            self.store.in_push = worker.in_push
        return worker

    def compute(self) -> None:
        self.log.append(f"computed {self.worker.run_once()}")

    def restart(self) -> None:
        self.store.close()
        self.store = self.open()
        self.worker = self.attach()
        self.log.append(f"released {self.store.release_holds()}")  # as a server's start gives held batches back
        self.held = [h for h in self.held if h[0] == "lease"]
        self.log.append("restart")

    def take(self) -> None:
        rng = self.rng
        kind = rng.choice(["consume", "hold", "lease", *(["replay"] * 3 if self.replays else [])])
        replayed = kind == "replay" or (kind == "hold" and self.replays and rng.random() < 0.7)
        fresh = rng.choice([None, None, 0, 1, 2])
        spec = TakeSpec(
            num_groups=rng.randint(1, 4),
            order=rng.choice(["fifo", "lifo", "priority", *(["uniform"] if fresh is not None else [])]),
            delivery="lease" if kind == "lease" else "replay" if replayed else "consume",
            lease_seconds=rng.choice([3, 30]),
            allow_partial=rng.random() < 0.7,
            min_model_version=fresh,
        )
        ids: dict[str, str] = {}
        drawn = self.store.sampling.rng.getstate()  # a uniform order's shuffle of the fresh groups

        def call(table: str) -> object:
            self.store.sampling.rng.setstate(drawn)
            batch = self.store.sample(dataclasses.replace(spec, table=table), hold=kind == "hold")
            if batch is not None and kind in ("hold", "lease"):
                ids[table] = batch.lease_id
            return reply(batch)

        self.both(f"take {kind} {spec.delivery} {spec.num_groups} {spec.order} from {fresh}", call)
        if ids:
            self.held.append((kind, ids, spec))

    def end(self) -> None:
        kind, ids, spec = self.held.pop(self.rng.randrange(len(self.held)))
        good, store = self.rng.random() < 0.5, self.store
        self.leases = ids
        drawn = store.sampling.rng.getstate()  # a confirmed replay's noise on its groups' new priorities

        def call(table: str) -> object:
            store.sampling.rng.setstate(drawn)
            if kind == "hold":
                if good:
                    return store.confirm(ids[table], dataclasses.replace(spec, table=table))
                return store.give_back(ids[table], table)
            return store.ack(ids[table], table) if good else store.nack(ids[table], table)

        self.both(f"end {kind} {'confirmed' if good else 'given back'}", call)
        self.leases = {}

    def delete(self) -> None:
        """A Delete of a few runs, and now and then of a whole group, of the tasks in play."""
        rng, tasks = self.rng, range(self.low, self.low + 8)
        uids = [uid(rng.choice(tasks), rng.randrange(self.size + 2)) for _ in range(rng.randint(0, 3))]
        groups = [f"0/{rng.choice(tasks)}"] if rng.random() < 0.25 else []
        self.both(f"delete {uids} {groups}", lambda table: self.store.delete(table, uids, groups))

    def read(self) -> None:
        """A Get of a few runs of the tasks in play, and a page of the live experiences."""
        tasks = range(self.low, self.low + 8)
        uids = [uid(self.rng.choice(tasks), self.rng.randrange(self.size + 2)) for _ in range(6)]

        def call(table: str) -> object:
            page = self.store.reads.page(table, limit=1000)
            listed = [(e.uid, e.group, e.state, e.version, e.reward, e.times_sampled) for e in page.items]
            return sorted(self.store.reads.get(table, uids).items()), sorted(listed)

        self.both("read", call)

    def report(self) -> None:
        """A trainer's version (with evict_stale, the groups it leaves stale are dropped)."""
        version = self.rng.randint(0, 5)
        self.both(f"version {version}", lambda table: self.store.set_trainer_version(table, version))

    def steps(self) -> list[tuple[Callable[[], None], float]]:
        """The steps to choose from, with their weights (a subclass adds its own)."""
        return [
            (self.push, 10), (self.push_in_order, 1), (self.fail, 2), (self.seal, 1), (self.tick, 3),
            (self.take, 6 if self.replays else 3), (self.restart, 0.3), (self.end, 2 if self.held else 0),
            (self.report, 0.5), (self.compute, 2 if self.computes else 0), (self.delete, 1), (self.read, 0.5),
        ]  # fmt: skip

    def step(self) -> None:
        steps = self.steps()
        if self.rng.random() < 0.08:
            self.low += 1
        self.rng.choices([s for s, _ in steps], [w for _, w in steps])[0]()
        self.check()


def walk(
    root: Path, settings: dict[str, object], seed: int, steps: int = 250, kind: type[RandomSteps] = RandomSteps
) -> None:
    """`steps` of RandomSteps (or of its `kind`) over tables of `settings` in `root`."""
    walker = kind(root, settings, seed)
    try:
        for _ in range(steps):
            walker.step()
    finally:
        walker.store.close()


@pytest.mark.parametrize(
    ("settings", "seed"),
    [
        ({"group_size": 4}, 1),
        ({"group_size": 8, "min_group_size": 5}, 2),
        ({"group_size": 4, "drop_zero_variance": True, "group_timeout_seconds": 6, "on_group_timeout": "drop"}, 3),
        ({"group_size": 8, "group_timeout_seconds": 10, "min_group_size": 3, "drop_zero_variance": True}, 4),
        ({"group_size": 4, "group_timeout_seconds": 10, "min_group_size": 2}, 5),
        ({"group_size": 8, "capacity_experiences": 40, "min_group_size": 4}, 6),
        ({"group_size": 4, "estimator": "grpo", "min_group_size": 2, "group_timeout_seconds": 10}, 7),
        (
            {
                "group_size": 8,
                "estimator": "grpo",
                "estimator_params": {"std_threshold": 0.5},
                "in_push": True,
                "drop_zero_variance": True,
                "group_timeout_seconds": 6,
                "min_group_size": 3,
            },
            8,
        ),
        ({"group_size": 4, "estimator": "rloo", "min_group_size": 3, "group_timeout_seconds": 10}, 9),
        ({"group_size": 4, "evict_stale": True, "max_staleness": 1, "group_timeout_seconds": 8}, 10),
        ({"group_size": 4, "priority_decay": 0.5, "max_times_sampled": 3, "min_group_size": 2}, 11),
        (
            {
                "group_size": 4,
                "priority_decay": 1.0,
                "priority_noise": 0.5,
                "reuse_cooldown_seconds": 5,
                "max_times_sampled": 4,
                "group_timeout_seconds": 10,
                "min_group_size": 2,
            },
            12,
        ),
        ({"group_size": 8, "reuse_cooldown_seconds": 3, "capacity_experiences": 40, "min_group_size": 4}, 13),
    ],
)
def test_random_steps_leave_a_rows_table_as_a_records_tables(
    tmp_path: Path, settings: dict[str, object], seed: int
) -> None:
    walk(tmp_path, settings, seed)


@pytest.mark.parametrize(
    ("settings", "seed"),
    [
        ({"group_size": 8, "group_timeout_seconds": 10, "min_group_size": 3, "drop_zero_variance": True}, 21),
        ({"group_size": 8, "estimator": "grpo", "min_group_size": 2, "group_timeout_seconds": 10}, 22),
        ({"group_size": 8, "capacity_experiences": 40, "min_group_size": 4}, 23),
    ],
)
def test_random_steps_with_heads_that_spill_leave_a_rows_table_as_a_records_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: dict[str, object], seed: int
) -> None:
    """The random steps where a pending head keeps 150 bytes of rows, one or two members: its rows
    spill into fragments at most pushes, through failed runs, Deletes, timeouts, computing groups and
    restarts (a head of this shape is what a group of many runs, or of long uids, keeps)."""
    monkeypatch.setattr(directory, "SPILL_BYTES", 150)
    walk(tmp_path, settings, seed)


def test_tombstones_are_forgotten_after_tombstone_seconds_as_a_records_tables(tmp_path: Path) -> None:
    """A segment whose groups all retired is forgotten tombstone_seconds later, with its groups'
    directory entries (a retried push of one is stored again, its state counts uncounted) as a
    records table's groups are; a segment with a live group keeps its retired groups' tombstones
    until it retires whole; a dropped pending group's segment is forgotten as well."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **EIGHTS, tombstone_seconds=60, group_timeout_seconds=10, on_group_timeout="drop")
        put_both(store, "t", [run(task, n) for task in range(3) for n in range(8)])  # one segment of 3 groups
        take_both(store, "t", num_groups=3)  # the first segment retires whole
        # a segment of their own (the newest is not untouched: no group joins it)
        put_both(store, "t", [run(3, n) for n in range(8)] + [run(4, n) for n in range(8)] + [run(5, 0)])
        take_both(store, "t", num_groups=1)  # group 0/3 retires; 0/4 keeps its segment live
        clock.now += 11
        store.tick()  # group 0/5 times out: dropped into a retired segment of its own
        clock.now += 30
        store.tick()
        assert stats(store, "t_rows") == stats(store, "t") and store.stats("t_rows")["consumed"] == 32
        clock.now += 40  # past 60 s for all of them
        assert store.tick()["tombstones_pruned"] == 33 + 25  # records: 24 + 8 + 1; rows: 24 + 1, not 0/3's 8
        records, rows = store.stats("t"), store.stats("t_rows")
        assert (records["consumed"], records["dropped"]) == (0, 0)
        assert (rows["consumed"], rows["dropped"]) == (8, 0), "0/3's tombstones wait for 0/4's segment"
        again = [run(0, n) for n in range(8)] + [run(5, 0)]
        for table in ("t", "t_rows"):
            assert len(store.put(table, again).stored) == 9, "forgotten: stored again"
        assert store.put("t", [run(3, 0)]).stored and store.put("t_rows", [run(3, 0)]).duplicates
        clean(store, "t", "t_rows")


def test_verify_names_a_retired_segment_the_retired_index_does_not(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        store.put("t_rows", [run(task, n) for task in range(2) for n in range(8)])
        assert store.sample(TakeSpec(table="t_rows", num_groups=2)) is not None
        prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])
        env: lmdb.Environment = store.environment.env
        with env.begin(write=True) as txn, txn.cursor(db=store.db["retired"]) as cur:
            assert cur.set_range(prefix) and cur.key().startswith(prefix)
            cur.delete()
            txn.put(prefix + layout.micros(5.0) + layout.u64(77), b"", db=store.db["retired"])
        problems = store.verify("t_rows")
        assert problems == [
            "segment 0 retired at 1000000.0 but the retired index does not name it so",
            "the retired index names segment 77, not retired then",
        ]


def test_a_piece_into_a_full_rows_table_that_evicts_makes_room_as_a_whole_push_does(tmp_path: Path) -> None:
    """A piece that needs room in a rows table of when_full = evict evicts the oldest ready group, as
    a rollout pushed whole does and as a records table's piece does: never left to wait for room as
    in a table that blocks."""
    with Store(tmp_path, clock=Clock()) as store:
        whole = [trxp.from_experience(rollout(run=n)) for n in range(2)]
        room = sum(Entry.of(item).size for item in whole)
        both(store, "t", estimator="none", group_size=2, capacity_bytes=room, when_full="evict")
        put_both(store, "t", whole)
        piece = trxp.from_experience(split(rollout(task=1), [4, 8])[0])
        for items in ([piece], [trxp.from_experience(rollout(task=1, run=1))]):
            put_both(store, "t", items)
        rows = store.stats("t_rows")
        assert (rows["evicted"], rows["partials"], rows["pushed"]) == (2, 1, 3)
        clean(store, "t", "t_rows")


def test_a_damaged_payload_fails_a_cooling_or_requeued_rows_group_whole(tmp_path: Path) -> None:
    """`quarantine` of a rows table that reuses: a cooling group (leased to no one) with a damaged
    member fails whole and does not come back when its cooldown ends; a group requeued at its new
    place fails there; `verify` finds nothing wrong, before and after."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "cool", **EIGHTS, reuse_cooldown_seconds=5.0)
        both(store, "decay", **EIGHTS, priority_decay=1.0)
        for table in ("cool_rows", "decay_rows"):
            store.put(table, [run(task, n) for task in range(3) for n in range(8)])
            spec = TakeSpec(table=table, num_groups=1, delivery="replay", wait_seconds=0)
            assert (batch := store.sample(spec)) is not None and set(batch.group_ids) == {"0/0"}
            damage(store, table, uid(0, 3))
            assert store.quarantine(table, [uid(0, 3)]) == 1
            assert store.verify(table) == []
        clock.now += 6
        served = store.sample(TakeSpec(table="cool_rows", num_groups=3, wait_seconds=0, allow_partial=True))
        assert served is not None and sorted(set(served.group_ids)) == ["0/1", "0/2"]
        served = store.sample(TakeSpec(table="decay_rows", num_groups=3, wait_seconds=0, allow_partial=True))
        assert served is not None and set(served.group_ids) == {"0/1", "0/2"}
        for table in ("cool_rows", "decay_rows"):
            counts = store.stats(table)
            assert (counts["groups_failed"], counts["failed"], counts["quarantined"], counts["ready"]) == (1, 7, 1, 0)
            assert counts["leased"] == 0
            assert store.verify(table) == []


def test_verify_names_a_rows_tables_cooling_row_that_holds_no_priority(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS, reuse_cooldown_seconds=5.0)
        store.put("t_rows", [run(task, n) for task in range(2) for n in range(8)])
        assert store.sample(TakeSpec(table="t_rows", num_groups=1, delivery="replay")) is not None
        assert store.verify("t_rows") == []
        prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])
        env: lmdb.Environment = store.environment.env
        with env.begin(write=True) as txn, txn.cursor(db=store.db["cooling"]) as cur:
            assert cur.set_range(prefix) and cur.key().endswith(b"0/0")
            cur.put(cur.key(), b"\x01")
        assert store.verify("t_rows") == ["the cooling row of group 0/0 holds 1 bytes, not a priority's 8"]


def test_a_damaged_payload_found_by_a_check_fails_its_group_whole_ready_leased_or_pending(tmp_path: Path) -> None:
    """`quarantine` (the scrub's, and a check's) of a rows table: a damaged member's group fails whole
    (the damaged member's payload gone, the others' kept), ready, under a lease (which goes on without it) or
    pending, the damaged counted; an undamaged uid, or one of a group gone, is left alone."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        store.put("t_rows", [run(task, n) for task in range(4) for n in range(8)] + [run(9, 0)])
        leased = store.sample(TakeSpec(table="t_rows", num_groups=1, delivery="lease"))
        assert leased is not None and set(leased.group_ids) == {"0/0"}
        for task, number in ((0, 2), (1, 5), (9, 0)):
            damage(store, "t_rows", uid(task, number))
        found = store.quarantine("t_rows", [uid(0, 2), uid(1, 5), uid(9, 0), uid(2, 1), "0/7/0/0/x"])
        stats = store.stats("t_rows")
        assert found == 3 and (stats["groups_failed"], stats["damaged"], stats["failed"]) == (3, 3, 14)
        assert stats["quarantined"] == 3
        assert (stats["ready"], stats["leased"], stats["pending"], stats["bytes"] > 0) == (16, 0, 0, True)
        assert store.verify("t_rows") == []
        assert store.ack(leased.lease_id, "t_rows") == 0  # its group failed meanwhile
        served = store.sample(TakeSpec(table="t_rows", num_groups=4, wait_seconds=0, allow_partial=True))
        assert served is not None and sorted(set(served.group_ids)) == ["0/2", "0/3"]
        assert store.quarantine("t_rows", [uid(1, 5)]) == 0  # failed: found once
        clean(store, "t_rows")
