"""A lease rewrites no member record (format 4): the group's record says leased while its
members' records stay ready, and a batch counts as sampled in them when it comes back (a
consumed one's tombstone needs no count). Listing still shows the members leased, counters
and `verify` agree, and a format-3 directory's leased group is brought to that form (and, since
format 10, to a rows table's: the group leased in its segment's state, its members untouched)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lmdb
import pytest

from expbuf.server.store import ItemRecord, Store
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.records import Lease
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from conftest import FIXTURES
from helpers import group_items, stored_members, take

V3 = FIXTURES / "datadir_v3"


def _records(store: Store, table: str) -> dict[str, bytes]:
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    with store.environment.read() as txn, txn.cursor(db=store.db["items"]) as cur:
        found = cur.set_range(prefix)
        out = {}
        while found and cur.key().startswith(prefix):
            out[bytes(cur.key()[4:]).decode()] = bytes(cur.value())
            found = cur.next()
        return out


def _listed(store: Store, table: str) -> dict[str, tuple[str, int]]:
    return {e.uid: (e.state, e.times_sampled) for e in store.list_experiences(table).items}


def test_a_lease_leaves_member_records_as_they_were_and_counts_the_batch_when_it_comes_back(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        store.put("t", group_items(1, 0, 2, reward=0.0) + group_items(1, 1, 2, reward=1.0))
        before = _records(store, "t")
        batch = take(store, "t", num_groups=2, delivery="lease", lease_seconds=60)
        assert batch is not None and batch.times_sampled == [1, 1, 1, 1]
        assert _records(store, "t") == before  # not one member record rewritten
        assert set(_listed(store, "t").values()) == {("leased", 0)}
        stats = store.stats("t")
        assert (stats["ready"], stats["leased"], stats["groups_leased"]) == (0, 4, 2)
        assert store.verify("t") == []
        assert store.nack(batch.lease_id) == 4  # sent, then given back: sampled once
        assert set(_listed(store, "t").values()) == {("ready", 1)}
        assert all(ItemRecord.decode(raw).times_sampled == 1 for raw in _records(store, "t").values())
        assert (store.stats("t")["ready"], store.stats("t")["leased"]) == (4, 0) and store.verify("t") == []
        again = take(store, "t", num_groups=2, delivery="lease")
        assert again is not None and again.times_sampled == [2, 2, 2, 2]
        assert store.ack(again.lease_id) == 4
        assert store.stats("t")["consumed"] == 4 and store.verify("t") == []


def test_a_batch_held_for_a_stream_that_never_confirmed_it_comes_back_uncounted(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        store.put("t", group_items(1, 0, 2, reward=0.0))
        before = _records(store, "t")
        batch = store.sample(TakeSpec("t", num_groups=1), hold=True)
        assert batch is not None and store.stats("t")["sampled"] == 0  # counted once its client has it
        assert store.release_holds() == 2
        assert _records(store, "t") == before and set(_listed(store, "t").values()) == {("ready", 0)}
        assert store.stats("t")["sampled"] == 0 and store.verify("t") == []


@pytest.mark.parametrize("end", ["confirm_lease", "confirm_consume", "confirm_replay", "ack", "nack", "renew"])
def test_a_held_batch_counts_as_sampled_once_its_client_has_it(tmp_path: Path, end: str) -> None:
    """A batch held for a stream counts as sampled (the counters Prometheus exports as counters,
    which must never go down) when its client has it: confirmed, or acked, nacked or renewed by
    it first; then once only, whatever follows."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        store.put("t", group_items(1, 0, 2, reward=0.0))
        delivery = end.removeprefix("confirm_") if end.startswith("confirm_") else "lease"
        spec = TakeSpec("t", num_groups=1, delivery=delivery)
        batch = store.sample(spec, hold=True)
        assert batch is not None and store.stats("t")["sampled"] == 0
        size = sum(len(blob) for blob in batch.blobs)
        if end.startswith("confirm_"):
            store.confirm(batch.lease_id, spec)
        elif end == "renew":
            store.renew(batch.lease_id, 60, "t")
        else:
            assert getattr(store, end)(batch.lease_id) == 2
        assert (store.stats("t")["sampled"], store.stats("t")["bytes_sampled"]) == (2, size)
        if end in ("confirm_lease", "renew"):
            assert store.ack(batch.lease_id) == 2
        assert (store.stats("t")["sampled"], store.stats("t")["bytes_sampled"]) == (2, size)
        assert store.verify("t") == []


def test_a_format_3_leased_group_stays_leased_and_its_lease_counts_when_it_ends(
    tmp_path: Path,
) -> None:
    shutil.copy(V3 / "data.mdb", tmp_path / "data.mdb")
    manifest = json.loads((V3 / "manifest.json").read_text())
    lease = manifest["lease"]
    with Store(tmp_path, clock=lambda: manifest["now"]) as store:
        prefix = layout.table_prefix(store.catalog.lookup("grpo4")[0])
        members = stored_members(store.environment)  # a rows table since format 10: its group leased in its segment
        leased = {key[4:].decode(): row for key, row in members.items() if key[:4] == prefix and row.group == "1/1"}
        assert len(leased) == 4 and {(row.state, row.payload is not None) for row in leased.values()} == {
            ("leased", True)
        }
        assert len({row.seg for row in leased.values()}) == 1
        assert {_listed(store, "grpo4")[uid] for uid in leased} == {("leased", 0)}
        assert store.verify("grpo4") == []
        assert store.nack(lease["id"], lease["table"]) == 4
        assert {_listed(store, "grpo4")[uid] for uid in leased} == {("ready", 1)}  # sampled once, as in format 3
        assert store.verify("grpo4") == []


def test_a_held_batch_whose_groups_are_deleted_before_it_comes_back_unsent_is_uncounted(tmp_path: Path) -> None:
    """A batch held for a stream, one of its groups deleted, a member of another deleted too, then
    given back unsent: the client never had any of it, so nothing of it stays counted as sampled,
    neither in the table's counters nor in its rate limiter's count (where a sample counts against
    samples_per_insert)."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        store.put("t", group_items(1, 0, 2, reward=0.0) + group_items(1, 1, 2, reward=1.0))
        batch = store.sample(TakeSpec("t", num_groups=2), hold=True)
        assert batch is not None and store.stats("t")["sampled"] == 0
        assert store.delete("t", uids=[batch.uids[3]], group_ids=[batch.group_ids[0]]) == 3
        assert store.release_holds() == 1
        stats = store.stats("t")
        assert (stats["sampled"], stats["bytes_sampled"], stats["ready"]) == (0, 0, 1)
        assert stats["rate_sampled"] == 0
        assert store.verify("t") == []


@pytest.mark.usefixtures("records_layout")  # a lease of groups an earlier release wrote, before rows
@pytest.mark.parametrize("wrote", ["nothing", "its count"])
def test_a_held_batch_an_earlier_release_leased_comes_back_uncounted(tmp_path: Path, wrote: str) -> None:
    """A hold whose lease an earlier release wrote, which counted it as sampled at its take, comes
    back at the next start uncounted: by what its take counted, or, a release before that wrote
    nothing of it, by the members still under it, as those releases did. (Made here from a hold
    whose client renewed it, so counted, its lease written back as theirs.)"""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        store.put("t", group_items(1, 0, 2, reward=0.0))
        batch = store.sample(TakeSpec("t", num_groups=1), hold=True)
        assert batch is not None
        store.renew(batch.lease_id, 60, "t")
        assert store.stats("t")["sampled"] == 2
    env = lmdb.open(str(tmp_path), max_dbs=layout.MAX_DBS)
    with env.begin(write=True) as txn:
        leases = env.open_db(b"leases", txn=txn)
        lease = Lease.decode(txn.get(batch.lease_id.encode(), db=leases))
        assert lease.counted == (2, sum(len(blob) for blob in batch.blobs), 0) and not lease.deferred
        lease.expires = None  # held, as the earlier release left it (its expiry row goes too)
        lease.counted = None if wrote == "nothing" else lease.counted
        txn.put(batch.lease_id.encode(), lease.encode(), db=leases)
        expiry = env.open_db(b"lease_exp", txn=txn)
        assert [key for key, _ in txn.cursor(db=expiry)]
        txn.drop(expiry, delete=False)
    env.close()
    with Store(tmp_path) as store:
        assert store.release_holds() == 2
        stats = store.stats("t")
        assert (stats["sampled"], stats["bytes_sampled"], stats["rate_sampled"], stats["ready"]) == (0, 0, 0, 2)
        assert store.verify("t") == []


@pytest.mark.parametrize("end", ["ack", "nack", "confirm_consume"])
def test_a_leased_batch_whose_group_is_deleted_leaves_the_rate_limiter_counts_even(tmp_path: Path, end: str) -> None:
    """A member deleted while its group is under a lease leaves the rate limiter's count with its
    samples, the lease's included: its record does not count that one until the lease ends, so it
    stayed in rate_sampled for good after an ack, a nack or a held batch confirmed, and
    samples_per_insert held samples back for an experience that is gone."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2))
        store.put("t", group_items(1, 0, 2, reward=0.0) + group_items(1, 1, 2, reward=1.0))
        hold = end == "confirm_consume"
        spec = TakeSpec("t", num_groups=2, delivery="consume" if hold else "lease")
        batch = store.sample(spec, hold=hold)
        assert batch is not None
        assert store.delete("t", group_ids=[batch.group_ids[0]]) == 2
        if end == "ack":
            store.ack(batch.lease_id, "t")
        elif end == "nack":
            store.nack(batch.lease_id, "t")
        else:
            store.confirm(batch.lease_id, spec)
        stats = store.stats("t")
        # the group left standing: inserted 2, and sampled 2 (its take) whatever became of it
        assert (stats["rate_inserted"], stats["rate_sampled"]) == (2, 2), stats
