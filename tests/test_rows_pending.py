"""Groups of a rows table that arrive over many pushes (issue 64, step 2.8: GRPO's rollout workers each
pushing their own runs of a task): a pending group keeps a head and one fragment a push until it
completes into a segment; it is joined, completed, sealed, timed out, reported short, dropped and
answered for retried pushes exactly as a records table of the same settings does it, every reply and
counter equal, `verify` clean after every step and across a restart; and a push to a pending group
writes its fragment and its head, no record per experience."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import lmdb
import pytest

from expbuf.client import trxp
from expbuf.client.rollout_pieces import split
from expbuf.server.store import Entry, Moved, Retired, Store, TableExtension
from expbuf.server.store.core.table_state.state import TableState
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.rows import PendingHead, directory_entry
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.errors import Conflict, StoreError
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.states import DROPPED, PENDING, READY
from expbuf.server.store.schema.views import Groups

from helpers import StoppedClock as Clock
from helpers import both_layouts as both
from helpers import layouts_stats as stats
from helpers import make_experience, take_both
from test_partial_rollouts import rollout

EIGHTS = {"estimator": "none", "group_by": "task", "group_size": 8}


def run(task: int, number: int, reward: float | None = None) -> trxp.RawItem:
    """Run `number` of task `task` (batch 0), its reward varied across the group's runs."""
    return trxp.from_experience(
        make_experience(0, task, number, reward=float((task + number) % 3) if reward is None else reward)
    )


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


def test_a_push_to_a_pending_group_writes_a_fragment_and_its_head(tmp_path: Path) -> None:
    """The rows a push to a pending group writes: its payloads, one fragment a group and its head;
    the group's completion writes its segment and deletes its fragments; no records."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])

        def counted() -> dict[str, int]:
            found = {}
            with store.environment.read() as txn:
                for name in ("frags", "gdir", "segs", "pending", "blobs", "items", "groups"):
                    with txn.cursor(db=store.db[name]) as cur:
                        n, at = 0, cur.set_range(prefix)
                        while at and cur.key().startswith(prefix):
                            n, at = n + 1, cur.next()
                    found[name] = n
            return found

        store.put("t_rows", [run(task, n) for task in range(3) for n in range(2)])
        assert counted() == {"frags": 3, "gdir": 3, "segs": 0, "pending": 3, "blobs": 6, "items": 0, "groups": 0}
        store.put("t_rows", [run(task, n) for task in range(3) for n in range(2, 5)])
        assert counted() == {"frags": 6, "gdir": 3, "segs": 0, "pending": 3, "blobs": 15, "items": 0, "groups": 0}
        assert [len(head.hashes) for head in heads(store, "t_rows").values()] == [5, 5, 5]
        store.put("t_rows", [run(task, n) for task in range(3) for n in range(5, 8)])
        assert counted() == {"frags": 0, "gdir": 3, "segs": 1, "pending": 0, "blobs": 24, "items": 0, "groups": 0}


def test_verify_names_a_pending_groups_damaged_rows(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        store.put("t_rows", [run(0, n) for n in range(3)])
        store.put("t_rows", [run(0, n) for n in range(3, 5)])
        store.put("t_rows", [run(1, n) for n in range(2)])
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
        problems = store.verify("t_rows")
        assert "pending group 0/0: its fragment 1 is not stored" in problems
        assert "pending group 0/1 is not in the pending index" in problems
        assert any("fragment" in p and "0/7" in p and "of no pending group" in p for p in problems), problems
        assert "counter pending is 7 but 2 were found" in problems


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


@pytest.mark.parametrize("delivery", ["consume", "lease"])
def test_a_consumed_groups_rollouts_in_pieces_are_dropped_as_a_records_tables(tmp_path: Path, delivery: str) -> None:
    """A rollout in pieces whose group filled without it: the group's take (consumed, or leased
    and acked) drops it, as a records table's retire does, and the table counts no pieces."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", estimator="none", group_size=2)
        first = trxp.from_experience(split(rollout(run=2), [4, 8])[0])
        put_both(store, "t", [first, trxp.from_experience(rollout(run=0)), run(0, 1)])
        assert store.stats("t_rows")["partials"] == 1 and store.stats("t_rows")["ready"] == 2
        for table in ("t", "t_rows"):
            batch = store.sample(TakeSpec(table=table, num_groups=1, delivery=delivery))
            assert batch is not None
            if delivery == "lease":
                assert store.ack(batch.lease_id, table) == 2
        assert stats(store, "t_rows") == stats(store, "t")
        assert store.stats("t_rows")["partials"] == 0 and store.stats("t_rows")["partial_bytes"] == 0
        clean(store, "t", "t_rows")
