"""A held batch consumed in the commit that takes the next one (Store.sample's `ack`, what
a consume stream does between its batches): one durable write for both, and nothing taken
when the lease cannot be consumed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from expbuf.server.store import Store
from expbuf.server.store.schema.errors import Forbidden, NotFound, SpecError
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items

PLAIN = TableConfig.of(name="plain", estimator="none", group_size=2)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store(tmp_path / "data", map_size=16 << 20, seed=5) as s:
        s.create_table(PLAIN)
        for task in range(3):
            s.put("plain", group_items(1, task, 2))
        yield s
        assert s.verify("plain") == []


def test_the_last_batch_is_consumed_in_the_commit_of_the_next(store: Store) -> None:
    spec = TakeSpec("plain", num_groups=1)
    first = store.sample(spec, hold=True, owner="me")
    assert store.stats("plain")["leased"] == 2
    commits = store.environment.batches
    second = store.sample(spec, hold=True, owner="me", confirm=first.lease_id)
    assert store.environment.batches == commits + 1
    assert set(second.uids).isdisjoint(first.uids)
    stats = store.stats("plain")
    assert (stats["consumed"], stats["leased"], stats["ready"]) == (2, 2, 2)
    with pytest.raises(NotFound, match="already acked"):
        store.ack(first.lease_id, "plain", "me")


def test_a_windows_confirmed_batches_are_consumed_in_one_commit(store: Store) -> None:
    """A stream with a window of 2 has two held batches confirmed: both are consumed in the
    commit that takes the next; one lease that cannot be consumed keeps both, takes nothing."""
    spec = TakeSpec("plain", num_groups=1, window=2)
    first, second = store.sample(spec, hold=True, owner="me"), store.sample(spec, hold=True, owner="me")
    with pytest.raises(NotFound):
        store.sample(spec, hold=True, owner="me", confirm=[first.lease_id, "nope"])
    assert (store.stats("plain")["leased"], store.stats("plain")["consumed"]) == (4, 0)
    commits = store.environment.batches
    third = store.sample(spec, hold=True, owner="me", confirm=[first.lease_id, second.lease_id])
    assert store.environment.batches == commits + 1
    stats = store.stats("plain")
    assert (stats["consumed"], stats["leased"], stats["ready"]) == (4, 2, 0)
    assert set(third.uids).isdisjoint(first.uids + second.uids)


def test_the_last_batch_is_consumed_when_nothing_is_left_to_take(store: Store) -> None:
    spec = TakeSpec("plain", num_groups=3)
    batch = store.sample(spec, hold=True, owner="me")
    assert store.sample(spec, hold=True, owner="me", confirm=batch.lease_id, timeout=0) is None
    assert store.stats("plain")["consumed"] == 6


@pytest.mark.parametrize(("lease", "owner", "error"), [("nope", "me", NotFound), (None, "other", Forbidden)])
def test_nothing_is_taken_when_the_lease_cannot_be_consumed(
    store: Store, lease: str | None, owner: str, error: type[Exception]
) -> None:
    spec = TakeSpec("plain", num_groups=1)
    held = store.sample(spec, hold=True, owner="me")
    before = store.stats("plain")
    with pytest.raises(error):
        store.sample(spec, hold=True, owner=owner, confirm=lease or held.lease_id)
    after = store.stats("plain")
    assert (after["leased"], after["ready"], after["consumed"]) == (before["leased"], before["ready"], 0)


def test_a_waiting_sample_finds_its_table_dropped(tmp_path: Path) -> None:
    """Each attempt of a waiting sample looks its table up by name: once the table is
    dropped, the wait ends with NOT_FOUND rather than polling the dropped table's id."""
    with Store(tmp_path / "data", map_size=16 << 20) as store:
        store.create_table(PLAIN)
        result: dict[str, object] = {}

        def wait() -> None:
            try:
                result["batch"] = store.sample(TakeSpec("plain", num_groups=1, wait_seconds=10))
            except NotFound as exc:
                result["error"] = exc

        commits = store.environment.batches
        sampler = threading.Thread(target=wait)
        sampler.start()
        deadline = time.monotonic() + 20
        while store.environment.batches == commits and time.monotonic() < deadline:
            time.sleep(0.005)  # until its first attempt found nothing
        store.drop_table("plain")
        sampler.join(30)
        assert "batch" not in result and "does not exist" in str(result["error"])


def test_dropping_a_table_ends_the_batches_held_from_it(tmp_path: Path) -> None:
    """A stream's held batch is a lease keyed by its id: dropping the table ends it, and
    leaves the held batches of other tables as they are."""
    with Store(tmp_path / "data", map_size=16 << 20) as store:
        for name in ("plain", "other"):
            store.create_table(TableConfig.of(name=name, estimator="none", group_size=2))
            store.put(name, group_items(1, 0, 2))
        store.sample(TakeSpec("plain", num_groups=1), hold=True, owner="me")
        kept = store.sample(TakeSpec("other", num_groups=1), hold=True, owner="me")
        store.drop_table("plain")
        with store.environment.read() as txn:
            leases = [bytes(key).decode() for key, _ in txn.cursor(db=store.db["leases"])]
        assert leases == [kept.lease_id]
        assert store.release_holds() == 2
        assert store.verify("other") == []


class Clock:
    """The store's clock, moved by the test: lease expiry without waiting."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_held_lease_runs_no_clock_until_its_batch_is_confirmed(tmp_path: Path) -> None:
    """A stream's leased batch waiting in the credit window is held: however long the
    client's caller takes to reach it, it never expires; its lease runs from the
    confirmation, lease_seconds long."""
    clock = Clock()
    with Store(tmp_path / "data", map_size=16 << 20, clock=clock) as store:
        store.create_table(PLAIN)
        store.put("plain", group_items(1, 0, 2))
        spec = TakeSpec("plain", num_groups=1, delivery="lease", lease_seconds=10)
        held = store.sample(spec, hold=True, owner="me")
        clock.now += 3600
        store.tick()
        assert (store.stats("plain")["leased"], store.stats("plain")["leases_expired"]) == (2, 0)
        assert store.confirm(held.lease_id, spec, "me") == 2
        clock.now += 9
        store.tick()
        assert store.stats("plain")["leased"] == 2
        clock.now += 2
        store.tick()
        stats = store.stats("plain")
        assert (stats["leased"], stats["ready"], stats["leases_expired"]) == (0, 2, 1)


def test_a_confirmed_lease_the_client_already_acked_or_renewed_is_left_as_it_is(tmp_path: Path) -> None:
    """The client may ack or renew a batch before its stream's confirmation reaches the store."""
    clock = Clock()
    with Store(tmp_path / "data", map_size=16 << 20, clock=clock) as store:
        store.create_table(PLAIN)
        for task in range(2):
            store.put("plain", group_items(1, task, 2))
        spec = TakeSpec("plain", num_groups=1, delivery="lease", lease_seconds=10)
        acked, renewed = store.sample(spec, hold=True, owner="me"), store.sample(spec, hold=True, owner="me")
        assert store.ack(acked.lease_id, "plain", "me") == 2
        assert store.renew(renewed.lease_id, 100, "plain", "me") == (clock.now + 100, 2)
        assert store.sample(spec, hold=True, owner="me", confirm=[acked.lease_id, renewed.lease_id], timeout=0) is None
        clock.now += 50
        store.tick()
        stats = store.stats("plain")
        assert (stats["consumed"], stats["leased"], stats["leases_expired"]) == (2, 2, 0)


def test_renew_moves_a_leases_end_and_names_what_it_refuses(tmp_path: Path) -> None:
    clock = Clock()
    with Store(tmp_path / "data", map_size=16 << 20, clock=clock) as store:
        store.create_table(PLAIN)
        store.put("plain", group_items(1, 0, 2))
        batch = store.sample(TakeSpec("plain", num_groups=1, delivery="lease", lease_seconds=10), owner="me")
        clock.now += 8
        assert store.renew(batch.lease_id, 10, "plain", "me") == (clock.now + 10, 2)
        clock.now += 9
        store.tick()
        assert store.stats("plain")["leased"] == 2
        with pytest.raises(NotFound, match="unknown"):
            store.renew("nope", 10, "plain", "me")
        with pytest.raises(Forbidden, match="another token"):
            store.renew(batch.lease_id, 10, "plain", "other")
        with pytest.raises(SpecError, match="lease_seconds"):
            store.renew(batch.lease_id, 0, "plain", "me")
        with pytest.raises(SpecError, match="lease_seconds"):
            store.renew(batch.lease_id, 10 * 86400, "plain", "me")
        clock.now += 2
        store.tick()
        assert store.stats("plain")["leases_expired"] == 1
        with pytest.raises(NotFound):
            store.renew(batch.lease_id, 10, "plain", "me")


def test_a_replayed_batch_counts_only_once_confirmed(tmp_path: Path) -> None:
    """With max_times_sampled = 1, a replayed batch given back unconfirmed (a stream stopped
    before its client had it) leaves its group ready and uncounted; confirmed, it retires."""
    with Store(tmp_path / "data", map_size=16 << 20, seed=3) as store:
        store.create_table(TableConfig.of(name="once", estimator="none", group_size=2, max_times_sampled=1))
        store.put("once", group_items(1, 0, 2))
        spec = TakeSpec("once", num_groups=1, delivery="replay")
        first = store.sample(spec, hold=True, owner="me")
        assert first.times_sampled == [1, 1]
        assert store.stats("once")["leased"] == 2  # held: no other stream gets it meanwhile
        store.give_back(first.lease_id, "once", "me")
        stats = store.stats("once")
        assert (stats["ready"], stats["consumed"], stats["sampled"]) == (2, 0, 0)
        again = store.sample(spec, hold=True, owner="me")
        assert again.uids == first.uids and again.times_sampled == [1, 1]
        assert store.confirm(again.lease_id, spec, "me") == 2
        stats = store.stats("once")
        assert (stats["ready"], stats["leased"], stats["consumed"], stats["sampled"]) == (0, 0, 2, 2)
        assert store.verify("once") == []


def test_a_confirmed_replay_under_reuse_is_lowered_and_stays_until_spent(tmp_path: Path) -> None:
    """Replayed groups confirmed go back ready, their deliveries counted in their records."""
    with Store(tmp_path / "data", map_size=16 << 20, seed=3) as store:
        config = TableConfig.of(name="reuse", estimator="none", group_size=2, max_times_sampled=2, priority_decay=1.0)
        store.create_table(config)
        store.put("reuse", group_items(1, 0, 2))
        spec = TakeSpec("reuse", num_groups=1, delivery="replay", order="priority")
        first = store.sample(spec, hold=True, owner="me")
        second = store.sample(spec, hold=True, owner="me", confirm=first.lease_id)
        assert second.uids == first.uids and second.times_sampled == [2, 2]
        store.confirm(second.lease_id, spec, "me")
        stats = store.stats("reuse")
        assert (stats["ready"], stats["consumed"]) == (0, 2)
        assert store.verify("reuse") == []
