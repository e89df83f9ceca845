"""Reuse under replay delivery (server/store/rules/reuse.py): each delivery lowers a group's priority by the
table's priority_decay, sends it behind the groups of equal priority and keeps it out of reach for
reuse_cooldown_seconds, durably, until max_times_sampled retires it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from expbuf.server.store import Store
from expbuf.server.store.schema.table_config import ConfigError, TableConfig

from helpers import group_items, take
from test_store import Clock

LAYOUTS = ["records", "rows"]


def made(store: Store, layout: str, **settings: object) -> None:
    """Table "reuse" of these settings, its experiences kept as records or as rows (issue 64)."""
    config = TableConfig.of(name="reuse", estimator="none", **settings)  # type: ignore[arg-type]
    store.create_table(dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout=layout)))


def reused(store: Store, table: str = "reuse") -> tuple[str, list[int]] | None:
    """The group one replayed take of one group delivers, with its members' deliveries."""
    batch = take(store, table, num_groups=1, order="priority", delivery="replay")
    return None if batch is None else (batch.group_ids[0], batch.times_sampled)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_delivered_group_is_lowered_cooled_and_back_after_a_restart(tmp_path: Path, layout: str) -> None:
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        made(store, layout, priority_decay=2.0, reuse_cooldown_seconds=10.0, max_times_sampled=3)
        store.put("reuse", group_items(1, "a", 2, priority=5.0))
        store.put("reuse", group_items(1, "b", 2, priority=4.0))
        assert reused(store) == ("1/a", [1, 1])
        assert reused(store) == ("1/b", [1, 1])  # a (now 3) cools
        assert reused(store) is None
        stats = store.stats("reuse")
        assert (stats["leased"], stats["ready"]) == (4, 0)
        assert store.verify("reuse") == []
    clock.now += 9.9
    with Store(tmp_path, clock=clock) as store:
        assert reused(store) is None
        clock.now += 0.1
        assert [reused(store), reused(store)] == [("1/a", [2, 2]), ("1/b", [2, 2])]  # 5 - 2*1 above 4 - 2*1
        clock.now += 10
        assert [reused(store), reused(store), reused(store)] == [("1/a", [3, 3]), ("1/b", [3, 3]), None]
        stats = store.stats("reuse")
        assert (stats["consumed"], stats["leased"], stats["ready"]) == (4, 0, 0)  # spent at max_times_sampled
        assert store.verify("reuse") == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_cooldown_a_group_goes_behind_its_equals_at_once(tmp_path: Path, layout: str) -> None:
    """Trinity appends a returning item to the items of its priority: a (3, then 2) follows b (2)."""
    with Store(tmp_path, clock=Clock()) as store:
        made(store, layout, priority_decay=1.0)
        store.put("reuse", group_items(1, "a", 1, priority=3.0))
        store.put("reuse", group_items(1, "b", 1, priority=2.0))
        order = [reused(store) for _ in range(5)]
        assert order == [("1/a", [1]), ("1/b", [1]), ("1/a", [2]), ("1/b", [2]), ("1/a", [3])]
        assert store.verify("reuse") == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_cooling_group_deleted_meanwhile_does_not_come_back(tmp_path: Path, layout: str) -> None:
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        made(store, layout, reuse_cooldown_seconds=5.0)
        store.put("reuse", group_items(1, "a", 2))
        assert reused(store) == ("1/a", [1, 1])
        store.delete("reuse", group_ids=["1/a"])
        clock.now += 5
        assert reused(store) is None
        assert store.verify("reuse") == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_cooling_group_retired_as_trained_stays_retired(tmp_path: Path, layout: str) -> None:
    """A group cooling down after a replay is leased to no one: a trainer that trained it another
    way retires it (it failed INTERNAL, the whole Retire with it), and it does not come back."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        made(store, layout, reuse_cooldown_seconds=5.0)
        store.put("reuse", group_items(1, "a", 2))
        store.put("reuse", group_items(1, "b", 2))
        assert reused(store) == ("1/a", [1, 1])  # a cools
        assert store.retire("reuse", ["1/a", "1/b"], owner="someone") == 2
        clock.now += 5
        assert reused(store) is None
        stats = store.stats("reuse")
        assert (stats["consumed"], stats["leased"], stats["ready"]) == (4, 0, 0)
        assert store.verify("reuse") == []


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"priority_decay": -1.0}, "priority_decay must be a finite number >= 0, got -1.0"),
        ({"priority_decay": float("nan")}, "priority_decay must be a finite number >= 0"),
        ({"reuse_cooldown_seconds": -2.0}, "reuse_cooldown_seconds must be from 0"),
        ({"priority_noise": 0.5}, "priority_noise is added to a replayed group's lowered priority; it needs"),
        ({"priority_noise": "x", "priority_decay": 1.0}, "priority_noise must be a finite number >= 0"),
    ],
)
def test_reuse_settings_are_checked_by_name(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TableConfig.of(name="reuse", **settings)
