"""The LMDB storage engine: groups, states, selection, leases, capacity, restart."""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from pathlib import Path

import pytest

from expbuf.client import decode, trxp
from expbuf.server.store import Entry, Store
from expbuf.server.store.schema.clock import SteadyClock
from expbuf.server.store.schema.errors import (
    Conflict,
    GroupClosed,
    InvalidRequest,
    NotFound,
    TableFull,
    TooLarge,
)
from expbuf.server.store.schema.table_config import ConfigError, TableConfig
from expbuf.server.store.services import upkeep

from conftest import payload
from helpers import both_layouts, group_items, take, take_both

# Most tests are about storage, not advantages: their table stores groups as pushed.
PLAIN = TableConfig.of(name="plain", estimator="none")


class Clock:
    """A settable wall clock, so lease and group timeouts need no sleeping."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Store:
    with Store(tmp_path / "data", map_size=1 << 20, clock=clock, seed=7) as s:
        s.create_table(PLAIN)
        yield s
        for table in s.list_tables():
            assert s.verify(table.name) == []


def test_default_table_exists_and_survives_restart(tmp_path: Path) -> None:
    with Store(tmp_path) as s:
        assert [t.name for t in s.list_tables()] == ["default"]
        assert s.table("default") == TableConfig.of(name="default")
        s.create_table(TableConfig.of(name="runs", group_by="run", group_size=3, max_times_sampled=2))
    with Store(tmp_path) as s:
        assert [t.name for t in s.list_tables()] == ["default", "runs"]
        assert s.table("runs").grouping.size == 3


def test_table_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="group_by"):
        TableConfig.of(name="x", group_by="episode")
    with pytest.raises(ConfigError, match="table name"):
        TableConfig.of(name="bad name!")
    with pytest.raises(ConfigError, match="unknown table setting"):
        TableConfig.from_settings({"name": "x", "capacity": 3})


def test_fixture_round_trip_through_the_store(store: Store) -> None:
    data = payload("mixed_batch.trxp")
    result = store.put("plain", trxp.parse(data))
    assert result.completed_groups == ["11/0", "11/1"]
    batch = take(store, "plain", num_groups=2)
    assert batch.uids == result.stored
    assert trxp.parse(batch.payload) == trxp.parse(data)
    assert [e.eid.uid for e in decode(batch.payload)] == result.stored


class Entries(list):
    """A list of entries whose life a test can watch (a weak reference to it)."""


def test_a_put_keeps_no_reference_to_its_entries_once_committed(store: Store) -> None:
    """The writer thread lets a push's packed experiences go with its commit, not at the next
    write: they are a push's size, and an idle server would hold the last push's."""
    entries = Entries(Entry.of(item) for item in trxp.parse(payload("grpo_group.trxp")))
    watched = weakref.ref(entries)
    stored = store.put_entries("plain", entries).stored
    del entries
    assert watched() is None and len(stored) == 8


def test_duplicate_is_noop_and_different_bytes_refused(store: Store) -> None:
    items = trxp.parse(payload("grpo_group.trxp"))
    first = store.put("plain", items)
    assert len(first.stored) == 8 and first.duplicates == []
    before = store.stats("plain")
    again = store.put("plain", items)
    assert again.stored == [] and again.duplicates == first.stored
    after = store.stats("plain")
    assert {k: v for k, v in after.items() if k not in ("duplicates", "oldest_age_seconds")} == {
        k: v for k, v in before.items() if k not in ("duplicates", "oldest_age_seconds")
    }
    changed = trxp.parse(payload("grpo_group.trxp"))
    changed[5].meta["reward"] = 0.75
    with pytest.raises(Conflict, match="7/3/5/0/r5s0t3 already exists with different content"):
        store.put("plain", changed)
    assert store.stats("plain")["ready"] == 8


def test_a_uid_twice_in_one_push_with_other_content_is_refused_as_such(store: Store) -> None:
    """Nothing of the uid is stored: the refusal says it is the push itself that holds it twice."""
    items = trxp.parse(payload("grpo_group.trxp"))
    twice = trxp.parse(payload("grpo_group.trxp"))[5]
    twice.meta["reward"] = 0.75
    with pytest.raises(Conflict, match="7/3/5/0/r5s0t3 is in this push twice, with different content: nothing stored"):
        store.put("plain", [*items, twice])
    assert store.stats("plain")["pushed"] == 0
    same = store.put("plain", [*items, items[5]])  # the same bytes twice: one stored, the other a duplicate
    assert len(same.stored) == 8 and same.duplicates == [items[5].uid]


def test_duplicate_is_recognised_after_consumption(store: Store) -> None:
    items = group_items(1, 1, 4)
    store.put("plain", items)
    assert take(store, "plain", num_groups=1) is not None
    again = store.put("plain", items)
    assert again.stored == [] and len(again.duplicates) == 4
    assert take(store, "plain", num_groups=1) is None


def test_refused_push_stores_nothing(store: Store) -> None:
    store.put("plain", group_items(1, 1, 2))
    mixed = group_items(2, 0, 3) + trxp.parse(payload("grpo_group.trxp"))
    mixed[-1].meta["reward"] = 0.123
    store.put("plain", trxp.parse(payload("grpo_group.trxp")))
    before = store.stats("plain")
    with pytest.raises(Conflict):
        store.put("plain", mixed)
    assert store.get("plain", [it.uid for it in mixed[:3]]) == {}
    assert store.stats("plain") | {"oldest_age_seconds": 0} == before | {"oldest_age_seconds": 0}


def test_groups_complete_at_size_and_seal(store: Store) -> None:
    store.create_table(TableConfig.of(name="g4", estimator="none", group_size=4))
    items = group_items(1, 1, 4)
    assert store.put("g4", items[:3]).completed_groups == []
    assert take(store, "g4", num_groups=1) is None
    assert store.stats("g4")["pending"] == 3
    assert store.put("g4", items[3:]).completed_groups == ["1/1"]
    assert store.stats("g4")["ready"] == 4
    with pytest.raises(GroupClosed, match="group 1/1 is already complete"):
        store.put("g4", group_items(1, 1, 5)[4:])
    store.put("g4", group_items(1, 2, 2))
    assert store.seal("g4", "1/2") == 2
    batch = take(store, "g4", num_groups=2)
    assert batch.group_ids == ["1/1"] * 4 + ["1/2"] * 2
    with pytest.raises(GroupClosed, match="overfill"):
        store.put("g4", group_items(1, 3, 5))
    assert store.verify("g4") == []


def test_group_by_run_step_and_none(store: Store) -> None:
    multi = trxp.parse(payload("multi_turn.trxp"))
    for by, want in (("run", ["2/1/0"]), ("step", ["2/1/0", "2/1/1", "2/1/2"]), ("none", [i.uid for i in multi])):
        store.create_table(TableConfig.of(name=f"by_{by}", estimator="none", group_by=by))
        assert store.put(f"by_{by}", multi).completed_groups == want
        assert store.verify(f"by_{by}") == []
    assert take(store, "by_run", num_groups=1).uids == [i.uid for i in multi]
    by_step = [take(store, "by_step", num_groups=1) for _ in range(3)]
    assert [(b.group_ids[0], b.uids) for b in by_step][1] == ("2/1/1", ["2/1/0/1/mt1"])


def test_batch_size_never_splits_groups(store: Store) -> None:
    for task in range(3):
        store.put("plain", group_items(5, task, 4))
    batch = take(store, "plain", batch_size=6)
    assert Counter(batch.group_ids) == {"5/0": 4, "5/1": 4}
    assert take(store, "plain", batch_size=6) is None
    partial = take(store, "plain", batch_size=6, allow_partial=True)
    assert partial.partial and partial.group_ids == ["5/2"] * 4


def test_orders(store: Store) -> None:
    for task, prio in enumerate([0.5, 3.0, 1.0, 3.0]):
        store.put("plain", group_items(9, task, 2, priority=prio))
    first = lambda order: take(store, "plain", num_groups=1, order=order, delivery="replay").group_ids[0]  # noqa: E731
    assert first("fifo") == "9/0"
    assert first("lifo") == "9/3"
    assert first("priority") == "9/1"
    picks = Counter(first("uniform") for _ in range(400))
    assert set(picks) == {"9/0", "9/1", "9/2", "9/3"} and min(picks.values()) > 50
    taken = [take(store, "plain", num_groups=1, order="priority").group_ids[0] for _ in range(4)]
    assert taken == ["9/1", "9/3", "9/2", "9/0"]


def test_a_priority_of_minus_zero_ties_with_zero_in_fifo_order(tmp_path: Path) -> None:
    """-0.0 == 0.0 (a priority made as -loss of a loss of 0): the group pushed first is taken first."""
    with Store(tmp_path / "data", clock=Clock()) as store:
        both_layouts(store, "zero", estimator="none")
        for table in ("zero", "zero_rows"):
            store.put(table, group_items(1, "a", 1, priority=-0.0))
            store.put(table, group_items(1, "b", 1, priority=0.0))
        assert take_both(store, "zero", num_groups=2, order="priority", delivery="replay")[1] == ["1/a", "1/b"]
        assert take_both(store, "zero", num_groups=1, order="priority", min_model_version=1)[1] == ["1/a"]
        assert store.verify("zero") == store.verify("zero_rows") == []


def test_uniform_consume_takes_each_group_once(store: Store) -> None:
    for task in range(50):
        store.put("plain", group_items(3, task, 2))
    seen = []
    while (batch := take(store, "plain", num_groups=3, order="uniform", allow_partial=True)) is not None:
        seen += batch.group_ids[::2]
        assert store.verify("plain") == []
    assert sorted(seen) == sorted(f"3/{t}" for t in range(50))


def test_replay_respects_max_times_sampled(store: Store) -> None:
    store.create_table(TableConfig.of(name="replay", estimator="none", max_times_sampled=3))
    store.put("replay", group_items(1, 0, 2))
    for _ in range(3):
        assert take(store, "replay", num_groups=1, delivery="replay") is not None
    assert take(store, "replay", num_groups=1, delivery="replay") is None
    assert store.stats("replay")["consumed"] == 2
    assert store.verify("replay") == []


def test_min_model_version_skips_stale_groups_in_every_order(store: Store) -> None:
    for task in range(8):
        store.put("plain", group_items(1, task, 1, version=1 if task < 6 else 9))
    assert take(store, "plain", num_groups=1, min_model_version=5).group_ids == ["1/6"]  # 6 stale groups ahead
    assert take(store, "plain", num_groups=1, min_model_version=5, order="lifo").group_ids == ["1/7"]
    assert take(store, "plain", num_groups=1, min_model_version=5, order="priority") is None
    assert store.verify("plain") == []


def test_min_model_version(store: Store) -> None:
    store.put("plain", group_items(1, 0, 2, version=3))
    store.put("plain", group_items(1, 1, 2, version=5))
    store.put("plain", group_items(1, 2, 2, version=None))
    batch = take(store, "plain", num_groups=2, min_model_version=4, allow_partial=True)
    assert batch.group_ids == ["1/1", "1/1"]


@pytest.mark.parametrize("step", [600.0, -3600.0])
def test_a_step_of_the_wall_clock_moves_no_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: float
) -> None:
    """The store's own clock (SteadyClock) reads the wall clock at its start and counts elapsed
    time from there: a wall clock stepped 10 minutes forward (NTP, a resumed VM) expired a 300 s
    lease at the next upkeep pass, the batch served again while its trainer trained it, and timed
    out a group pending a second; stepped back, the sweep of tombstones stopped for the step."""
    wall = time.time
    with Store(tmp_path) as s:
        s.create_table(TableConfig.of("t", estimator="none", group_size=2, group_timeout_seconds=300))
        s.put("t", group_items(1, 0, 2))
        s.put("t", group_items(1, 1, 1))  # a pending group
        leased = take(s, "t", num_groups=1, delivery="lease", lease_seconds=300)
        expires = leased.lease_expires
        assert abs(expires - (wall() + 300)) < 5
        monkeypatch.setattr(time, "time", lambda: wall() + step)
        done = s.tick()
        assert (done["leases_expired"], done["groups_timed_out"]) == (0, 0)
        assert take(s, "t", num_groups=1, wait_seconds=0) is None
        assert s.ack(leased.lease_id) == 2
        assert abs(s.clock() - wall()) < 5
    assert abs(SteadyClock()() - (wall() + step)) < 5  # a start reads the wall clock again


def test_leases_due_at_once_end_a_bounded_number_a_pass(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first pass after a long stop found every lease due and ended them all in the writer's one
    transaction, every push and sample waiting; it ends upkeep.ENDS_A_PASS now, the next the rest."""
    monkeypatch.setattr(upkeep, "ENDS_A_PASS", 2)
    with Store(tmp_path, clock=clock) as s:
        s.create_table(PLAIN)
        for task in range(5):
            s.put("plain", group_items(1, task, 2))
        for _ in range(5):
            take(s, "plain", num_groups=1, delivery="lease", lease_seconds=30)
    clock.now += 60
    with Store(tmp_path, clock=clock) as s:
        assert [s.tick()["leases_expired"] for _ in range(4)] == [2, 2, 1, 0]
        assert s.stats("plain")["ready"] == 10


def test_lease_ack_nack_and_expiry_across_restart(tmp_path: Path, clock: Clock) -> None:
    with Store(tmp_path, clock=clock) as s:
        s.create_table(PLAIN)
        s.put("plain", group_items(1, 0, 2))
        s.put("plain", group_items(1, 1, 2))
        leased = take(s, "plain", num_groups=1, delivery="lease", lease_seconds=30)
        assert leased.lease_expires == clock.now + 30
        assert s.stats("plain")["leased"] == 2
        acked = take(s, "plain", num_groups=1, delivery="lease", lease_seconds=30)
        assert s.ack(acked.lease_id) == 2
        assert s.ack(acked.lease_id) == 2  # made again, its reply lost: answered as the first was
        with pytest.raises(NotFound, match="was acked: its groups are consumed"):
            s.nack(acked.lease_id)
    clock.now += 10
    with Store(tmp_path, clock=clock) as s:
        assert s.tick()["leases_expired"] == 0
        assert take(s, "plain", num_groups=1) is None
        clock.now += 25
        # the expired lease's groups back ready mark the table, which the same pass visits
        assert s.tick() == {
            "leases_expired": 1,
            "requeued": 2,
            "rollouts_returned": 0,
            "groups_timed_out": 0,
            "groups_stale_evicted": 0,
            "tombstones_pruned": 0,
            "failed": 0,
            "tables_visited": 1,
            "tables_worked": 0,
        }
        with pytest.raises(NotFound, match="was expired: its lease_seconds passed before an ack"):
            s.ack(leased.lease_id)
        with pytest.raises(NotFound, match="is unknown, already acked"):  # ended before the restart: forgotten
            s.ack(acked.lease_id)
        again = take(s, "plain", num_groups=1, delivery="lease")
        assert again.group_ids == leased.group_ids
        assert s.nack(again.lease_id) == 2
        final = take(s, "plain", num_groups=5, allow_partial=True)
        assert final.group_ids == leased.group_ids
        stats = s.stats("plain")
        assert (stats["consumed"], stats["leases_expired"], stats["ready"]) == (4, 1, 0)
        assert s.verify("plain") == []


def test_group_timeout_release_and_drop(store: Store, clock: Clock) -> None:
    store.create_table(TableConfig.of(name="rel", estimator="none", group_size=4, group_timeout_seconds=5))
    store.create_table(
        TableConfig.of(name="drop", estimator="none", group_size=4, group_timeout_seconds=5, on_group_timeout="drop")
    )
    for name in ("rel", "drop"):
        store.put(name, group_items(1, 0, 2))
    clock.now += 4
    assert store.tick()["groups_timed_out"] == 0
    clock.now += 2
    assert store.tick()["groups_timed_out"] == 2
    batch = take(store, "rel", num_groups=1)
    assert batch.partial is False and len(batch.uids) == 2
    assert take(store, "drop", num_groups=1) is None
    assert store.stats("drop")["groups_dropped"] == 1
    assert store.verify("rel") == [] and store.verify("drop") == []


def test_zero_variance_groups_are_dropped(store: Store) -> None:
    store.create_table(TableConfig.of(name="dapo", estimator="none", drop_zero_variance=True))
    store.put("dapo", group_items(1, 0, 4, reward=1.0))
    store.put("dapo", trxp.parse(payload("grpo_group.trxp")))
    stats = store.stats("dapo")
    assert (stats["dropped"], stats["groups_dropped"], stats["ready"]) == (4, 1, 8)


def test_one_push_fills_opens_extends_and_drops_groups(store: Store, clock: Clock) -> None:
    """A push's groups are handled in passes over the whole push: each kind of group it
    touches ends in the same state, indexes and counters as when pushed alone."""
    config = TableConfig.of(
        name="mix", estimator="none", group_size=4, drop_zero_variance=True, group_timeout_seconds=5
    )
    store.create_table(config)
    store.put("mix", group_items(1, 0, 4)[:2], timeout=0)  # group 0 pending with 2 of 4
    clock.now += 1
    grp0 = group_items(1, 0, 4, reward=0.0)[2:]  # fills group 0
    grp1 = group_items(1, 1, 4, reward=2.0)  # opened and filled, one reward: dropped
    grp2 = [*group_items(1, 2, 2, reward=0.5), *group_items(1, 2, 4, reward=0.0)[2:]]  # opened and filled
    grp3 = group_items(1, 3, 4)[:3]  # opened, left pending
    result = store.put("mix", [*grp0, *grp1, *grp2, *grp3])
    assert result.completed_groups == ["1/0", "1/1", "1/2"] and result.dropped_groups == ["1/1"]
    stats = store.stats("mix")
    assert (stats["ready"], stats["pending"], stats["dropped"]) == (8, 3, 4)
    assert (stats["groups_ready"], stats["groups_pending"], stats["groups_dropped"]) == (2, 1, 1)
    # a rows table's dropped group takes a place in the ready order too (docs/internals/storage.md)
    assert (stats["next_seq"], stats["next_rseq"]) == (15, 3 if store.table("mix").storage.layout == "rows" else 2)
    assert store.verify("mix") == []
    taken = [take(store, "mix", num_groups=1, order="uniform").group_ids[0] for _ in range(2)]
    assert sorted(taken) == ["1/0", "1/2"] and take(store, "mix", num_groups=1) is None
    clock.now += 6
    assert store.tick()["groups_timed_out"] == 1  # the group left pending is in the timeout index


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"group_size": 4, "capacity_experiences": 3}, "capacity_experiences 3 is below group_size 4"),
        ({"capacity_experiences": 2, "min_size_to_sample": 3}, "min_size_to_sample 3 is above capacity_experiences 2"),
    ],
)
def test_a_table_that_could_never_serve_is_refused_at_its_creation(store: Store, settings: dict, message: str) -> None:
    """A table whose groups could never complete (pending ones are never evicted, and a push past
    the capacity is refused), or whose sampling could never start (it never holds as many as
    min_size_to_sample), stalled its pushers and trainers for good; it is refused, stores nothing."""
    for when_full in ("block", "evict"):
        with pytest.raises(ConfigError, match=message):
            store.create_table(TableConfig.of(name="never", estimator="none", when_full=when_full, **settings))
        assert "never" not in [table.name for table in store.list_tables()]
    edge = TableConfig.of(name="edge", estimator="none", group_size=4, capacity_experiences=4, min_size_to_sample=4)
    assert store.create_table(edge)


def test_capacity_block_and_evict(store: Store) -> None:
    store.create_table(TableConfig.of(name="full", estimator="none", capacity_experiences=4))
    store.put("full", group_items(1, 0, 4))
    with pytest.raises(TableFull, match="is full"):
        store.put("full", group_items(1, 1, 2), timeout=0.05)
    unblocked = threading.Timer(0.2, lambda: take(store, "full", num_groups=1))
    unblocked.start()
    assert len(store.put("full", group_items(1, 1, 2), timeout=5).stored) == 2
    unblocked.join()
    store.create_table(TableConfig.of(name="ring", estimator="none", capacity_experiences=6, when_full="evict"))
    for task in range(5):
        store.put("ring", group_items(2, task, 2))
    leased = take(store, "ring", num_groups=1, delivery="lease")
    store.put("ring", group_items(2, 9, 4))
    stats = store.stats("ring")
    assert (stats["evicted"], stats["leased"], stats["ready"]) == (8, 2, 4)  # groups 0, 1, 3, 4; 2 is leased
    assert store.get("ring", [f"2/0/{r}/0/r{r}s0" for r in range(2)]) == {}
    assert store.ack(leased.lease_id) == 2
    with pytest.raises(TooLarge, match="on their own"):
        store.put("ring", group_items(3, 0, 7))
    assert store.verify("full") == [] and store.verify("ring") == []


def test_delete_and_get(store: Store) -> None:
    store.put("plain", group_items(1, 0, 3))
    uids = [f"1/0/{r}/0/r{r}s0" for r in range(3)]
    assert set(store.get("plain", [*uids, "nope"])) == set(uids)
    assert store.delete("plain", uids=[uids[0]]) == 1
    assert take(store, "plain", num_groups=1, delivery="replay").uids == uids[1:]
    assert store.delete("plain", group_ids=["1/0"]) == 2
    assert take(store, "plain", num_groups=1) is None
    assert store.put("plain", group_items(1, 0, 3)).stored == uids


def test_map_grows_on_demand(tmp_path: Path) -> None:
    with Store(tmp_path, map_size=64 << 10) as s:
        s.create_table(PLAIN)
        for task in range(40):
            s.put("plain", group_items(1, task, 8, response=512))
        assert s.storage_info()["map_size"] > 64 << 10
        assert s.stats("plain")["ready"] == 320
        assert s.verify("plain") == []


def test_concurrent_pushes_share_commits(store: Store) -> None:
    errors: list[Exception] = []

    def push(worker: int) -> None:
        try:
            for task in range(20):
                store.put("plain", group_items(worker, task, 4))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.stats("plain")["ready"] == 6 * 20 * 4


def test_tables_interleaved_keep_their_indexes(store: Store) -> None:
    store.create_table(TableConfig.of(name="other", estimator="none"))
    for task in range(3):
        store.put("other", group_items(4, task, 2))
        store.put("plain", group_items(4, task, 2))
    assert store.verify("other") == [] and store.verify("plain") == []
    assert store.stats("plain")["oldest_age_seconds"] == 0.0
    assert take(store, "plain", num_groups=3).group_ids[::2] == ["4/0", "4/1", "4/2"]


def test_drop_table(store: Store) -> None:
    store.create_table(TableConfig.of(name="tmp", estimator="none"))
    store.put("tmp", group_items(1, 0, 3))
    assert store.drop_table("tmp") == 3
    with pytest.raises(NotFound, match="table 'tmp' does not exist"):
        store.put("tmp", group_items(1, 0, 3))
    store.create_table(TableConfig.of(name="tmp", estimator="none"))
    assert store.stats("tmp")["ready"] == 0 and store.verify("tmp") == []


def test_bad_sample_requests(store: Store) -> None:
    with pytest.raises(InvalidRequest, match="exactly one"):
        take(store, "plain", num_groups=1, batch_size=4)
    with pytest.raises(InvalidRequest, match="order"):
        take(store, "plain", num_groups=1, order="random")


def test_second_process_is_refused(tmp_path: Path) -> None:
    with Store(tmp_path), pytest.raises(Exception, match="another expbuf process"):
        Store(tmp_path)


def test_tombstones_are_pruned_after_their_time(store: Store, clock: Clock) -> None:
    store.create_table(TableConfig.of(name="short", estimator="none", tombstone_seconds=60))
    items = group_items(1, 0, 3)
    store.put("short", items)
    take(store, "short", num_groups=1)
    assert store.put("short", items).duplicates  # a retry soon after is still a duplicate
    clock.now += 30
    assert store.tick()["tombstones_pruned"] == 0
    clock.now += 31
    assert store.tick()["tombstones_pruned"] == 3
    assert store.stats("short")["consumed"] == 0
    assert store.verify("short") == []
    assert store.put("short", items).stored == [i.uid for i in items]  # forgotten: stored anew
    assert store.verify("short") == []


def test_waiting_for_data_or_room_sleeps_instead_of_spinning(store: Store) -> None:
    """A sample waiting for data retries only when something changed (or every 0.25 s):
    its own empty retries do not wake it, nor anyone else waiting."""
    store.create_table(TableConfig.of(name="full", estimator="none", capacity_experiences=2))
    store.put("full", group_items(1, 0, 2))
    before = store.environment.batches
    assert take(store, "plain", num_groups=1, wait_seconds=1.0) is None
    with pytest.raises(TableFull):
        store.put("full", group_items(1, 1, 2), timeout=1.0)
    assert store.environment.batches - before < 40  # a retry every 0.25 s or so, not thousands
