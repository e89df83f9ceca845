"""A rows table's lease or held batch whose groups left it (retired, deleted, failed for damage) while
it held them, as a records table of the same settings takes it: the rate limiter's count, and the
lease's end, expiry and a start's give-back once the groups' segment is forgotten."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_rows_pending import run, uid

from expbuf.server.store import Store
from expbuf.server.store.schema.sample_spec import TakeSpec

from helpers import StoppedClock as Clock
from helpers import both_layouts as both
from helpers import layouts_stats as stats
from test_quarantine import damage

FOURS = {"estimator": "none", "group_by": "task", "group_size": 4}


def test_a_leased_group_failed_for_a_damaged_member_takes_its_lease_s_sample_out_of_the_count(
    tmp_path: Path,
) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **FOURS)
        for table in ("t", "t_rows"):
            store.put(table, [run(task, n) for task in range(2) for n in range(4)])
            batch = store.sample(TakeSpec(table=table, num_groups=1, delivery="lease"))
            assert batch is not None and set(batch.group_ids) == {"0/0"}
            damage(store, table, uid(0, 1))
            assert store.quarantine(table, [uid(0, 1)]) == 1
        assert store.stats("t_rows")["rate_sampled"] == store.stats("t")["rate_sampled"] == 0
        assert stats(store, "t_rows") == stats(store, "t")


def leased_then_left(store: Store, clock: Clock, kind: str, gone: str) -> dict[str, str]:
    """Group 0/0 of both tables leased (or held, `kind`), then retired or deleted (`gone`) under it,
    its tombstones forgotten (its segment too, in the rows table): each table's lease id."""
    both(store, "t", **FOURS, tombstone_seconds=4)
    ids = {}
    for table in ("t", "t_rows"):
        store.put(table, [run(0, n) for n in range(4)])
        spec = TakeSpec(table=table, num_groups=1, delivery="lease" if kind == "lease" else "consume", lease_seconds=30)
        batch = store.sample(spec, hold=kind == "hold")
        assert batch is not None
        ids[table] = batch.lease_id
        assert (store.retire(table, ["0/0"]) if gone == "retire" else store.delete(table, [], ["0/0"])) in (1, 4)
    clock.now += 10
    store.tick()
    return ids


@pytest.mark.parametrize("gone", ["retire", "delete"])
@pytest.mark.parametrize("kind", ["lease", "hold"])
def test_a_lease_whose_groups_left_ends_after_their_segment_is_forgotten(tmp_path: Path, gone: str, kind: str) -> None:
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        ids = leased_then_left(store, clock, kind, gone)
        assert store.verify("t") == store.verify("t_rows") == []
        ended = [
            store.nack(ids[table], table) if kind == "lease" else store.give_back(ids[table], table)
            for table in ("t", "t_rows")
        ]
        assert ended == [0, 0]
        assert stats(store, "t_rows") == stats(store, "t")


def test_a_lease_whose_groups_left_expires_after_their_segment_is_forgotten(tmp_path: Path) -> None:
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        leased_then_left(store, clock, "lease", "delete")
        clock.now += 30
        assert store.tick()["failed"] == 0 and store.maintenance_failures == 0
        assert stats(store, "t_rows") == stats(store, "t")


def test_a_start_gives_back_a_hold_whose_groups_left_and_segment_was_forgotten(tmp_path: Path) -> None:
    """A server's start gives every held batch back (server/app.py: release_holds) in one transaction:
    one naming a forgotten segment failed it, and the server did not start."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        leased_then_left(store, clock, "hold", "retire")
    with Store(tmp_path, clock=clock) as store:
        assert store.release_holds() == 0
        assert store.verify("t_rows") == []
