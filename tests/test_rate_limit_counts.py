"""The rate limiter counts only what can still be sampled (core/table_state/rate_counts.py): an experience counts as
inserted when its group becomes ready, and one that leaves unsampled (dropped, evicted,
deleted, failed, timed out) is taken out in the same transaction, so no such path can hold a
table's pushes or samples for good; a table stuck by an older build recovers at open."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from expbuf.client import trxp
from expbuf.server.store import Entry, Store
from expbuf.server.store.core.table_state.rate_counts import INSERTED, SAMPLED
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.errors import InsertLimited, SampleLimited, TableFull
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items, make_experience


def varied(batch: str, task: int, size: int = 4, version: int = 1) -> list[Entry]:
    """A whole group whose rewards differ (kept by the zero-variance filter)."""
    experiences = [make_experience(batch, task, run, reward=float(run % 2), version=version) for run in range(size)]
    return [Entry.of(trxp.from_experience(e)) for e in experiences]


def equal(batch: str, task: int, size: int = 4) -> list[Entry]:
    """A whole group whose rewards are all equal (dropped by the zero-variance filter)."""
    return [Entry.of(item) for item in group_items(batch, task, size)]


def limited(**settings: object) -> TableConfig:
    base = {"estimator": "none", "group_size": 4, "samples_per_insert": 1.0, "samples_per_insert_error": 4.0}
    return TableConfig.of(name="t", **(base | settings))


def diff(store: Store) -> float:
    stats = store.stats("t")
    return stats[INSERTED] * store.table("t").rate_limiter.samples_per_insert - stats[SAMPLED]


def take_all(store: Store, groups: int = 1) -> int:
    batch = store.sample(TakeSpec("t", num_groups=groups, wait_seconds=0))
    assert batch is not None
    return len(batch.uids)


def test_a_pending_group_counts_once_it_is_ready(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(limited(group_size=8, samples_per_insert_error=1.0))
        for entry in varied("b", 0, size=8):  # one experience per push: the group is pending until the 8th
            store.put_entries("t", [entry])
        assert diff(store) == 8
        with pytest.raises(InsertLimited, match="8 inserted, 0 sampled"):
            store.put_entries("t", varied("b", 1, size=8)[:1])
        assert take_all(store) == 8 and diff(store) == 0
        store.put_entries("t", varied("b", 1, size=8)[:1])
        assert store.verify("t") == []


def test_a_zero_variance_drop_holds_no_valid_group(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(limited(drop_zero_variance=True))
        assert store.put_entries("t", equal("b", 0)).dropped_groups
        assert diff(store) == 0
        for task in (1, 2, 3):
            store.put_entries("t", varied("b", task))
            assert take_all(store) == 4
        assert diff(store) == 0 and store.stats("t")["groups_dropped"] == 1


@pytest.mark.parametrize("on_timeout", ["drop", "release"])
def test_a_group_timeout_takes_or_counts_the_pending_experiences(tmp_path: Path, on_timeout: str) -> None:
    now = [1000.0]
    with Store(tmp_path, clock=lambda: now[0]) as store:
        store.create_table(limited(group_timeout_seconds=10.0, on_group_timeout=on_timeout))
        store.put_entries("t", varied("b", 0)[:3])
        now[0] += 11
        assert store.tick()["groups_timed_out"] == 1
        if on_timeout == "release":  # a partial group is ready: its 3 count
            assert diff(store) == 3
            assert take_all(store) == 3
        assert diff(store) == 0
        store.put_entries("t", varied("b", 1))
        assert take_all(store) == 4 and diff(store) == 0


def test_a_delete_takes_its_experiences_out(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(limited())
        store.put_entries("t", varied("b", 1)[:2])  # pending: never counted
        ready = varied("b", 0)
        store.put_entries("t", ready)
        assert diff(store) == 4
        assert store.delete("t", uids=[e.uid for e in ready[:2]]) == 2  # part of a ready group
        assert diff(store) == 2
        assert store.delete("t", group_ids=["b/0", "b/1"]) == 4
        assert diff(store) == 0
        store.put_entries("t", varied("b", 2))
        assert take_all(store) == 4 and diff(store) == 0
        assert store.verify("t") == []


def test_capacity_eviction_takes_the_evicted_out(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(limited(samples_per_insert_error=8.0, capacity_experiences=4, when_full="evict"))
        for task in range(3):  # each push evicts the group before it
            store.put_entries("t", varied("b", task))
            assert diff(store) == 4
        assert store.stats("t")["evicted_total"] == 8
        assert take_all(store) == 4 and diff(store) == 0


def test_stale_eviction_takes_the_evicted_out(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(limited(max_staleness=0, evict_stale=True))
        store.set_trainer_version("t", 0)
        store.put_entries("t", varied("b", 0, version=0))
        store.set_trainer_version("t", 1)  # the group falls stale and leaves
        assert store.stats("t")["dropped_stale"] == 1 and diff(store) == 0
        store.put_entries("t", varied("b", 1, version=1))
        assert take_all(store) == 4 and diff(store) == 0


def test_failed_and_std_dropped_groups_never_count(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(limited(estimator="grpo"))
        for task in range(3):
            store.put_entries("t", varied("b", task))  # computing until finish_compute
        assert diff(store) == 0
        store.finish_compute("t", {}, [], dropped=["b/0"], failed={"b/1": "no estimate"})
        ready = varied("b", 2)
        store.finish_compute("t", {e.uid: 0.5 for e in ready}, ["b/2"])
        assert diff(store) == 4
        assert take_all(store) == 4 and diff(store) == 0
        assert store.stats("t")["groups_failed"] == 1 and store.stats("t")["dropped_std_threshold"] == 1


def test_a_replayed_group_evicted_takes_its_samples_out_with_it(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(
            limited(samples_per_insert=2.0, samples_per_insert_error=12.0, capacity_experiences=4, when_full="evict")
        )
        store.put_entries("t", varied("b", 0))
        assert store.sample(TakeSpec("t", num_groups=1, delivery="replay", wait_seconds=0)) is not None
        assert diff(store) == 4  # 4 inserted, owed 2 samples each, 4 taken
        store.put_entries("t", varied("b", 1))  # evicts the replayed group: its owed samples go with it
        assert diff(store) == 8


@pytest.mark.usefixtures("records_layout")  # the counters an older build left, before rows
def test_a_table_stuck_by_an_older_build_recovers_at_open(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(limited(drop_zero_variance=True))
        store.put_entries("t", equal("b", 0))  # dropped
        store.put_entries("t", varied("b", 1))  # ready, never sampled
        table_id = store.catalog.lookup("t")[0]

        def as_an_older_build_left_them(txn: object) -> None:
            """Counters as an older build wrote them: no limiter counts; the dropped group was counted."""
            key, db = layout.table_prefix(table_id), store.db["counters"]
            counters = json.loads(txn.get(key, db=db))
            del counters[INSERTED], counters[SAMPLED]
            txn.put(key, json.dumps(counters).encode(), db=db)

        store.environment.submit(as_an_older_build_left_them)
    with Store(tmp_path) as store:
        assert diff(store) == 4  # the ready group, not the dropped one
        with pytest.raises(InsertLimited):
            store.put_entries("t", varied("b", 2))
        assert take_all(store) == 4
        for task in (2, 3, 4):
            store.put_entries("t", varied("b", task))
            assert take_all(store) == 4
        assert diff(store) == 0
    with Store(tmp_path) as store:  # counted once: a later open leaves the counters alone
        assert diff(store) == 0


ITEM_BYTES = Entry.of(group_items(1, 0, 1)[0]).size
# (table settings, runs a push): groups of 1 and experiences bounded; groups pushed whole (group_size 0)
# of 2 into 9 places; bytes bounded with room for less than one more.
FULL_SHAPES = {
    "places": ({"group_size": 1, "capacity_experiences": 8}, 1),
    "whole groups": ({"group_size": 0, "capacity_experiences": 9}, 2),
    "bytes": ({"group_size": 1, "capacity_bytes": ITEM_BYTES * 17 // 2}, 1),
}


@pytest.mark.parametrize("layout", ["records", "rows"])
@pytest.mark.parametrize("shape", FULL_SHAPES)
def test_a_full_blocking_table_lets_the_samples_go_that_would_make_room(
    tmp_path: Path, layout: str, shape: str
) -> None:
    """samples_per_insert holds samples until more is inserted; a full blocking table holds inserts
    until a sample makes room (replayed groups leave after max_times_sampled). Once the table is
    full of groups sampled fewer times than that, each side waited for the other for good (a
    helper's audit): samples now go while no insert can come, however the table is bounded."""
    settings, runs = FULL_SHAPES[shape]
    config = TableConfig.of(
        name="t", estimator="none", when_full="block", samples_per_insert=1.0, samples_per_insert_error=2.0,
        max_times_sampled=3, **settings,
    )  # fmt: skip
    with Store(tmp_path) as store:
        store.create_table(dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout=layout)))
        pushed, moved = 0, []
        for step in range(80):  # a push and a replay a step, as a rollout worker and a trainer side by side
            try:
                store.put("t", group_items(1, pushed, runs), timeout=0)
                pushed += 1
                moved.append((step, "push"))
            except (TableFull, InsertLimited):
                pass
            try:
                store.sample(TakeSpec("t", num_groups=1, delivery="replay", order="uniform"))
                moved.append((step, "sample"))
            except SampleLimited:
                pass
        later = {kind for step, kind in moved if step >= 40}
        assert later == {"push", "sample"}, moved[-6:]  # both still move: neither holds the other
        assert store.verify("t") == []
