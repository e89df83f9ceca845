"""A lease's life, in one place: granted with a batch, confirmed, renewed, and ended.

A leased batch's groups are LEASED and name their lease; the lease is a record under its id
(its table, groups, expiry and owner) and, while its clock runs, a row of the expiry index:

- granted when a batch is taken (`grant`): running at once (`expires` set), or held for a
  Sample stream (no expiry), invisible to others, until the stream's client confirms it has
  the batch;
- confirmed (`confirm`): as the stream asked, consumed, its clock started, or its replay counted;
- renewed (`renew`): it now ends that long from now (a held one's clock starts);
- ended (`end`): by an ack (consumed), a nack or its expiry (back to the buffer, counted as
  sampled), by its stream for a batch its client did not confirm, or at the next start for a
  hold whose stream is gone (`release_holds`): back, uncounted. Groups no longer under the
  lease (deleted meanwhile) are left alone.

A caller's request names its table and token: a lease of another table is not found, and one
taken with another token is refused (`checked`). Every step runs in the writer's transaction
it is given. The sampling service asks this module for each step (services/sampling.py), and
the upkeep for the expired ones (services/upkeep.py).
"""

from __future__ import annotations

import random

import lmdb

from ..core import rate_counts
from ..core.leases import read_lease
from ..core.retire import retire
from ..core.state import TableState
from ..disk import layout
from ..disk.kinds import Sampled
from ..disk.records import Counted, GroupRecord, Lease
from ..rules import reuse
from ..schema.errors import Forbidden, InvalidRequest, NotFound, clip
from ..schema.sample_spec import MAX_LEASE_SECONDS, SampleSpec, check_seconds
from ..schema.states import CONSUMED, LEASED, READY
from .catalog import TableCatalog


def leased_groups(tt: TableState, lease_id: str, gkeys: list[str]) -> list[tuple[str, GroupRecord]]:
    """The groups still held under a lease (a group deleted meanwhile is not)."""
    held = []
    for gkey in gkeys:
        grp = tt.group(gkey)
        if grp is not None and grp.state == LEASED and grp.lease == lease_id:
            held.append((gkey, grp))
    return held


class Leases:
    """Every lease of a data directory's tables, over its catalog (the tables' states)."""

    def __init__(self, catalog: TableCatalog) -> None:
        self.catalog = catalog
        self.db = catalog.db

    def grant(self, txn: lmdb.Transaction[bytes], batch: Sampled, table_id: int, *, hold: bool, owner: str) -> None:
        """The lease of a batch just taken (its groups LEASED under `batch.lease_id`): held
        until confirmed, or running until `batch.lease_expires`."""
        expires = None if hold else batch.lease_expires
        groups = list(dict.fromkeys(batch.group_ids))
        counted = batch.counted if hold else None  # what a give-back unsent takes back
        lease = Lease(table_id=table_id, groups=groups, expires=expires, owner=owner, counted=counted)
        txn.put(batch.lease_id.encode(), lease.encode(), db=self.db["leases"])
        if expires is not None:
            txn.put(layout.expiry_key(expires, batch.lease_id), b"", db=self.db["lease_exp"])

    def checked(self, txn: lmdb.Transaction[bytes], lease_id: str, table: str | None, owner: str) -> Lease:
        """A lease that exists; with a table (a caller's request), of that table and owner."""
        if not lease_id:
            raise InvalidRequest("lease_id is empty")
        lease = read_lease(txn, self.db["leases"], lease_id)
        if lease is None:
            raise NotFound(f"lease '{clip(lease_id)}' is unknown, already acked, or expired and requeued")
        if table is not None:
            table_id, _ = self.catalog.lookup(table)
            if lease.table_id != table_id:
                raise NotFound(f"lease '{clip(lease_id)}' is not a lease of table '{clip(table)}'")
            if lease.owner != owner:
                raise Forbidden(f"lease '{clip(lease_id)}' was taken with another token")
        return lease

    def renew(
        self, txn: lmdb.Transaction[bytes], lease_id: str, seconds: float, table: str, owner: str
    ) -> tuple[float, int]:
        """The lease now ends `seconds` from now (a held one's clock starts); when it ends, and
        the experiences it holds."""
        check_seconds("lease_seconds", seconds, low=0.0, high=MAX_LEASE_SECONDS, low_open=True)
        lease = self.checked(txn, lease_id, table, owner)
        tt = self.catalog.state_of(txn, lease.table_id)
        now = self.catalog.clock() if tt is None else tt.now
        self._set_expiry(txn, lease_id, lease, now + seconds)
        count = 0 if tt is None else sum(len(grp.members) for _, grp in leased_groups(tt, lease_id, lease.groups))
        return now + seconds, count

    def confirm(
        self, txn: lmdb.Transaction[bytes], lease_id: str, spec: SampleSpec, owner: str, rng: random.Random
    ) -> int:
        """A held batch its stream's client confirmed it has, delivered as the stream asked:
        consumed; leased, the lease's clock starting now (`spec.lease_seconds`); or
        replayed, its deliveries counted. A lease whose batch the client already acked,
        nacked or renewed (it may, once it has the batch) is left as that made it."""
        if spec.delivery == "consume":
            return self.end(txn, lease_id, requeue=False, table=spec.table, owner=owner)
        lease = read_lease(txn, self.db["leases"], lease_id)
        if lease is None or lease.expires is not None:
            return 0
        lease = self.checked(txn, lease_id, spec.table, owner)
        tt = self.catalog.state_of(txn, lease.table_id)
        if tt is None:  # the table was dropped
            return 0
        if spec.delivery == "lease":
            self._set_expiry(txn, lease_id, lease, tt.now + spec.lease_seconds)
            return sum(len(grp.members) for _, grp in leased_groups(tt, lease_id, lease.groups))
        txn.delete(lease_id.encode(), db=self.db["leases"])
        count = _replay_confirmed(tt, lease_id, lease.groups, rng)
        tt.save()
        return count

    def end(
        self,
        txn: lmdb.Transaction[bytes],
        lease_id: str,
        *,
        requeue: bool,
        unsent: bool = False,
        expired: bool = False,
        table: str | None = None,
        owner: str = "",
    ) -> int:
        """End a lease: its groups consumed (an ack), or back to the buffer (`requeue`: a nack,
        its expiry, a hold released); returns the experiences. `unsent`: a Sample stream gives
        back a batch its client did not confirm (or a start, one held by an earlier run), which
        then goes back uncounted as sampled while it is held; a client's nack counts it, as the
        client has it (its confirmation may not have been delivered yet)."""
        lease = self.checked(txn, lease_id, table, owner)
        txn.delete(lease_id.encode(), db=self.db["leases"])
        if lease.expires is not None:
            txn.delete(layout.expiry_key(lease.expires, lease_id), db=self.db["lease_exp"])
        tt = self.catalog.state_of(txn, lease.table_id)
        if tt is None:  # the table was dropped
            return 0
        held = lease.expires is None  # a batch held for its stream: not confirmed, or its confirmation on its way
        count = _groups_back(tt, lease_id, lease, requeue=requeue, unsent=requeue and unsent and held)
        if expired:
            tt.counters.leases_expired += 1
        tt.save()
        return count

    def release_holds(self, txn: lmdb.Transaction[bytes]) -> int:
        """Every batch held for a stream of an earlier run of the server goes back; the streams
        that held them are gone. Returns the experiences requeued."""
        holds = [key.decode() for key, raw in txn.cursor(db=self.db["leases"]) if Lease.decode(raw).expires is None]
        return sum(self.end(txn, lease_id, requeue=True, unsent=True) for lease_id in holds)

    def _set_expiry(self, txn: lmdb.Transaction[bytes], lease_id: str, lease: Lease, expires: float) -> None:
        if lease.expires is not None:
            txn.delete(layout.expiry_key(lease.expires, lease_id), db=self.db["lease_exp"])
        lease.expires = expires
        txn.put(lease_id.encode(), lease.encode(), db=self.db["leases"])
        txn.put(layout.expiry_key(expires, lease_id), b"", db=self.db["lease_exp"])


def _groups_back(tt: TableState, lease_id: str, lease: Lease, *, requeue: bool, unsent: bool) -> int:
    """The groups of a lease go back to ready (`requeue`) or are consumed; returns the
    experiences. Only a batch that goes back sampled rewrites its members' records (their times
    sampled). `unsent`: a batch held for a stream that never confirmed it is not sampled after
    all: what its take counted leaves the table's counters (a lease a release before
    `Lease.counted` wrote: the members still under it, as it did), and the members still under
    it leave the rate limiter's count (a member deleted meanwhile took its lease's sample out of
    that count as it left: rate_counts.forget)."""
    ended = leased_groups(tt, lease_id, lease.groups)
    for _, grp in ended:
        grp.lease = ""
    if not requeue:
        retire(tt, ended, CONSUMED)
        return sum(len(grp.members) for _, grp in ended)
    back = [(gkey, grp, tt.members(grp)) for gkey, grp in ended]
    if unsent:
        recs = [rec for _, _, members in back for rec in members.values()]
        counted = lease.counted or Counted(len(recs), sum(rec.size for rec in recs), 0)
        tt.counters.sampled -= counted.experiences
        tt.counters.bytes_sampled -= counted.nbytes
        tt.counters.tokens_masked -= counted.tokens_masked
        rate_counts.given_back(tt, len(recs))
    else:  # sampled: the records count it now (a consumed one's tombstone need not)
        for _, _, members in back:
            for uid, rec in members.items():
                rec.times_sampled += 1
                tt.put_item(uid, rec)
    tt.set_states(back, READY)
    tt.ready.add_many([(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in ended])
    return sum(len(grp.members) for _, grp in ended)


def _replay_confirmed(tt: TableState, lease_id: str, gkeys: list[str], rng: random.Random) -> int:
    """A held replay batch the client confirmed: its groups are ready again, then counted as
    replayed (reuse.replayed); returns the experiences."""
    groups = leased_groups(tt, lease_id, gkeys)
    for _, grp in groups:
        grp.lease = ""
    taken = [(gkey, grp, tt.members(grp)) for gkey, grp in groups]
    for _, _, recs in taken:
        for uid, rec in recs.items():
            rec.times_sampled += 1
            tt.put_item(uid, rec)
    tt.set_states(taken, READY)
    tt.ready.add_many([(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in groups])
    reuse.replayed(tt, taken, rng)
    return sum(len(recs) for _, _, recs in taken)
