"""Deletes in a rows table that meet failed, computing and leased groups, each as a records table of the
same settings takes them: a failed group's kept payloads, a group's priority and version fixed when it
completed, and what the extensions hear."""

from __future__ import annotations

from pathlib import Path

from test_rows_pending import EIGHTS, Heard, clean, put_both, run, uid

from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store, scan_directory
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.sample_spec import TakeSpec

from helpers import StoppedClock as Clock
from helpers import both_layouts as both
from helpers import layouts_stats as stats
from helpers import take_both
from test_quarantine import damage


def failed_for_a_damaged_member(store: Store) -> None:
    """Group 0/0 of both tables, pending with 3 runs, fails whole for its damaged run 1: the payloads
    of the others are kept for Get."""
    put_both(store, "t", [run(0, n) for n in range(3)])
    for table in ("t", "t_rows"):
        damage(store, table, uid(0, 1))
        assert store.quarantine(table, [uid(0, 1)]) == 1


def test_a_failed_group_deleted_and_pushed_again_keeps_its_new_payloads_when_the_old_tombstones_go(
    tmp_path: Path,
) -> None:
    """A failed group deleted whole, its runs pushed again into a new group: when the failed group's
    tombstones are forgotten (tombstone_seconds later), the new group's payloads stay (its uids are
    the deleted members', which the failed segment still names) and it is served."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", estimator="none", group_by="task", group_size=4, tombstone_seconds=60)
        failed_for_a_damaged_member(store)
        assert [store.delete(table, [], ["0/0"]) for table in ("t", "t_rows")] == [0, 0]  # none was live
        assert put_both(store, "t", [run(0, n) for n in range(4)])[2] == ["0/0"]
        clean(store, "t", "t_rows")
        clock.now += 61
        store.tick()  # the failed group's tombstones forgotten
        with store.environment.read() as txn:
            report = scan_directory(txn, store.environment.db, clock.now)
        assert report["t_rows"] == report["t"] == []
        got = take_both(store, "t", num_groups=1)
        assert got is not None and got[0] == [uid(0, n) for n in range(4)]
        assert stats(store, "t_rows") == stats(store, "t")


def test_a_delete_of_a_failed_groups_member_deletes_its_kept_payload(tmp_path: Path) -> None:
    """A Delete of a member of a failed group forgets its tombstone and the payload kept for Get with
    it, where a rows table kept the payload, and a Get of the uid then logged damage that was none."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **EIGHTS)
        failed_for_a_damaged_member(store)
        kept = {}
        for table in ("t", "t_rows"):
            assert store.delete(table, [uid(0, 0)]) == 0
            key = layout.table_prefix(store.catalog.lookup(table)[0]) + uid(0, 0).encode()
            with store.environment.read() as txn:
                kept[table] = txn.get(key, db=store.db["blobs"]) is not None
            assert store.get(table, [uid(0, 0), uid(0, 2)]).keys() == {uid(0, 2)}
        assert kept == {"t": False, "t_rows": False}
        assert stats(store, "t_rows") == stats(store, "t")
        clean(store, "t", "t_rows")


def computing_group_loses_a_member(store: Store) -> None:
    """Group 0/0 (priorities 5 and 0, versions 1 and 3) completes and waits for its advantages; a
    Delete takes its priority-5, version-1 member while it computes; group 0/1 (priority 1, version 3)
    completes after it; the worker computes both."""
    both(store, "t", estimator="grpo", group_by="task", group_size=2)
    first = [run(0, 0, reward=1.0, priority=5.0, version=1), run(0, 1, reward=0.0, priority=0.0, version=3)]
    put_both(store, "t", first)
    assert [store.delete(table, [uid(0, 0)]) for table in ("t", "t_rows")] == [1, 1]
    assert stats(store, "t_rows") == stats(store, "t")
    put_both(store, "t", [run(1, n, reward=float(n), priority=1.0, version=3) for n in range(2)])
    assert AdvantageWorker(store).run_once() == 4
    clean(store, "t", "t_rows")


def test_a_computing_group_that_lost_a_member_keeps_the_priority_it_completed_with(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        computing_group_loses_a_member(store)
        got = {t: store.sample(TakeSpec(table=t, num_groups=1, order="priority")) for t in ("t", "t_rows")}
        assert [batch.group_ids for batch in got.values() if batch is not None] == [["0/0"], ["0/0"]]  # priority 5


def test_a_computing_group_that_lost_a_member_keeps_the_version_it_completed_with(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        computing_group_loses_a_member(store)
        spec = {"num_groups": 2, "min_model_version": 2, "allow_partial": True}
        got = take_both(store, "t", **spec)
        assert got is not None and got[1] == ["0/1", "0/1"]  # 0/0 is of version 1, as when it completed


def test_a_restart_keeps_a_computing_groups_priority_and_version(tmp_path: Path) -> None:
    """The priority and version a computing group completed with are in its head: a restart between
    the Delete and the computation keeps them."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", estimator="grpo", group_by="task", group_size=2)
        put_both(store, "t", [run(0, 0, reward=1.0, priority=5.0, version=1), run(0, 1, reward=0.0, version=3)])
        assert [store.delete(table, [uid(0, 0)]) for table in ("t", "t_rows")] == [1, 1]
        put_both(store, "t", [run(1, n, reward=float(n), priority=1.0, version=3) for n in range(2)])
    with Store(tmp_path, clock=Clock()) as store:
        assert AdvantageWorker(store).run_once() == 4  # groups, of both tables
        got = take_both(store, "t", num_groups=1, order="priority")
        assert got is not None and got[1] == ["0/0"]  # priority 5 (its member left has 0; 0/1's is 1)
        clean(store, "t", "t_rows")


def test_a_nack_of_a_lease_whose_groups_were_deleted_is_heard_of_by_no_one(tmp_path: Path) -> None:
    """A lease whose group a Delete took whole, then given back: no group moves, so the extensions hear
    nothing, where a rows table's heard a Moved(leased -> ready) of no groups."""
    with Store(tmp_path, clock=Clock(), extensions={"heard": Heard}) as store:
        both(store, "t", estimator="none", group_by="task", group_size=2, extensions=["heard"])
        put_both(store, "t", [run(0, 0), run(0, 1)])
        leases = {}
        for table in ("t", "t_rows"):
            batch = store.sample(TakeSpec(table=table, num_groups=1, delivery="lease"))
            assert batch is not None
            leases[table] = batch.lease_id
            assert store.delete(table, [], ["0/0"]) == 2
        heard = {t: next(e for e in store.extensions_of(t) if isinstance(e, Heard)).events for t in ("t", "t_rows")}
        for events in heard.values():
            events.clear()
        assert [store.nack(leases[table], table) for table in ("t", "t_rows")] == [0, 0]
        assert heard["t_rows"] == heard["t"] == []
