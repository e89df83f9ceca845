"""A held batch consumed in the commit that takes the next one (Store.sample's `ack`, what
a consume stream does between its batches): one durable write for both, and nothing taken
when the lease cannot be consumed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from expbuf.server.errors import Forbidden, NotFound
from expbuf.server.sample_spec import SampleSpec
from expbuf.server.store import Store
from expbuf.server.tables import TableConfig

from helpers import group_items

PLAIN = TableConfig(name="plain", estimator="none", group_size=2)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store(tmp_path / "data", map_size=16 << 20, seed=5) as s:
        s.create_table(PLAIN)
        for task in range(3):
            s.put("plain", group_items(1, task, 2))
        yield s
        assert s.verify("plain") == []


def test_the_last_batch_is_consumed_in_the_commit_of_the_next(store: Store) -> None:
    spec = SampleSpec("plain", num_groups=1)
    first = store.sample(spec, hold=True, owner="me")
    assert store.stats("plain")["leased"] == 2
    commits = store.environment.batches
    second = store.sample(spec, hold=True, owner="me", ack=first.lease_id)
    assert store.environment.batches == commits + 1
    assert set(second.uids).isdisjoint(first.uids)
    stats = store.stats("plain")
    assert (stats["consumed"], stats["leased"], stats["ready"]) == (2, 2, 2)
    with pytest.raises(NotFound, match="already acked"):
        store.ack(first.lease_id, "plain", "me")


def test_a_windows_confirmed_batches_are_consumed_in_one_commit(store: Store) -> None:
    """A stream with a window of 2 has two held batches confirmed: both are consumed in the
    commit that takes the next; one lease that cannot be consumed keeps both, takes nothing."""
    spec = SampleSpec("plain", num_groups=1, window=2)
    first, second = store.sample(spec, hold=True, owner="me"), store.sample(spec, hold=True, owner="me")
    with pytest.raises(NotFound):
        store.sample(spec, hold=True, owner="me", ack=[first.lease_id, "nope"])
    assert (store.stats("plain")["leased"], store.stats("plain")["consumed"]) == (4, 0)
    commits = store.environment.batches
    third = store.sample(spec, hold=True, owner="me", ack=[first.lease_id, second.lease_id])
    assert store.environment.batches == commits + 1
    stats = store.stats("plain")
    assert (stats["consumed"], stats["leased"], stats["ready"]) == (4, 2, 0)
    assert set(third.uids).isdisjoint(first.uids + second.uids)


def test_the_last_batch_is_consumed_when_nothing_is_left_to_take(store: Store) -> None:
    spec = SampleSpec("plain", num_groups=3)
    batch = store.sample(spec, hold=True, owner="me")
    assert store.sample(spec, hold=True, owner="me", ack=batch.lease_id, timeout=0) is None
    assert store.stats("plain")["consumed"] == 6


@pytest.mark.parametrize(("lease", "owner", "error"), [("nope", "me", NotFound), (None, "other", Forbidden)])
def test_nothing_is_taken_when_the_lease_cannot_be_consumed(
    store: Store, lease: str | None, owner: str, error: type[Exception]
) -> None:
    spec = SampleSpec("plain", num_groups=1)
    held = store.sample(spec, hold=True, owner="me")
    before = store.stats("plain")
    with pytest.raises(error):
        store.sample(spec, hold=True, owner=owner, ack=lease or held.lease_id)
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
                result["batch"] = store.sample(SampleSpec("plain", num_groups=1, wait_seconds=10))
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
            store.create_table(TableConfig(name=name, estimator="none", group_size=2))
            store.put(name, group_items(1, 0, 2))
        store.sample(SampleSpec("plain", num_groups=1), hold=True, owner="me")
        kept = store.sample(SampleSpec("other", num_groups=1), hold=True, owner="me")
        store.drop_table("plain")
        with store.environment.read() as txn:
            leases = [bytes(key).decode() for key, _ in txn.cursor(db=store.db["leases"])]
        assert leases == [kept.lease_id]
        assert store.release_holds() == 2
        assert store.verify("other") == []
