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
  hold whose stream is gone (`release_holds`): back, uncounted; or by its stream for a batch
  whose batch stage raised, back uncounted and the groups it raised on failed (`fail_stage`).
  Groups no longer under the lease (deleted meanwhile) are left alone.

A held batch counts as sampled (the table's counters, which Prometheus exports as counters) only
once its client has it: confirmed, or acked, nacked or renewed (core/verbs/leases.delivered), so
that a batch sent ahead and given back leaves no count to take back.

A caller's request names its table and token: a lease of another table is not found, and one
taken with another token is refused (`checked`). Every step runs in the writer's transaction
it is given. The sampling service asks this module for each step (services/sampling.py), and
the upkeep for the expired ones (services/upkeep.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import lmdb

from expbuf.client.schema.call_limits import MAX_LEASE_SECONDS

from ..core.verbs import leases
from ..disk.kinds import Sampled
from ..rules import reuse
from ..rules.quarantine import fail_ready, quarantine_lost
from ..schema.errors import Forbidden, InvalidRequest, NotFound, clip, taken_with
from ..schema.sample_spec import TakeSpec, check_seconds
from .catalog import TableCatalog
from .ended import RecentEnds

# What each remembered end did, for a call that meets it.
ENDINGS = {
    "acked": "its groups are consumed",
    "nacked": "its groups went back to the buffer",
    "expired": "its lease_seconds passed before an ack, and its groups went back to the buffer, to be served again",
}


@dataclass(frozen=True)
class EndedLease:
    """A lease an ack, a nack or its expiry ended: how, its table and owner, and what it answered."""

    how: str  # a key of ENDINGS
    table_id: int
    owner: str
    count: int


class TableLeases:
    """Every lease of a data directory's tables, over its catalog (the tables' states)."""

    def __init__(self, catalog: TableCatalog, requeued: Callable[[int], None]) -> None:
        self.catalog = catalog
        self.db = catalog.db
        self.requeued = requeued  # a table whose groups came back: the next upkeep pass visits it (evict_stale)
        self._ended = RecentEnds[EndedLease]()

    def grant(self, txn: lmdb.Transaction[bytes], batch: Sampled, table_id: int, *, hold: bool, owner: str) -> None:
        """The lease of a batch just taken (its groups LEASED under `batch.lease_id`): held
        until confirmed, or running until `batch.lease_expires`."""
        leases.grant_row(txn, self.db, batch, table_id, hold=hold, owner=owner)

    def checked(self, txn: lmdb.Transaction[bytes], lease_id: str, table: str | None, owner: str) -> leases.AnyLease:
        """A lease that exists; with a table (a caller's request), of that table and owner."""
        if not lease_id:
            raise InvalidRequest("lease_id is empty")
        lease = leases.lease_of(txn, self.db, lease_id)
        if lease is None:
            ended = self._ended.get(lease_id)  # where this server remembers how, said as an ack's is (a renew's)
            if ended is not None and (
                table is None or (self.catalog.lookup(table)[0] == ended.table_id and ended.owner == owner)
            ):
                raise NotFound(f"lease '{clip(lease_id)}' was {ended.how}: {ENDINGS[ended.how]}")
            raise NotFound(f"lease '{clip(lease_id)}' is unknown, already acked, or expired and requeued")
        if table is not None:
            table_id, _ = self.catalog.lookup(table)
            if lease.table_id != table_id:
                raise NotFound(f"lease '{clip(lease_id)}' is not a lease of table '{clip(table)}'")
            if lease.owner != owner:
                raise Forbidden(f"lease '{clip(lease_id)}' was taken with {taken_with(lease.owner, owner)}")
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
        if tt is not None and leases.delivered(tt, lease):
            tt.save()
        leases.set_expiry(txn, self.db, lease_id, lease, now + seconds)
        count = 0 if tt is None else leases.held(tt, lease_id, lease)
        return now + seconds, count

    def confirm(
        self, txn: lmdb.Transaction[bytes], lease_id: str, spec: TakeSpec, owner: str, rng: random.Random
    ) -> int:
        """A held batch its stream's client confirmed it has, delivered as the stream asked:
        consumed; leased, the lease's clock starting now (`spec.lease_seconds`); or
        replayed, its deliveries counted. A lease whose batch the client already acked,
        nacked or renewed (it may, once it has the batch) is left as that made it."""
        if spec.delivery == "consume":
            return self.end(txn, lease_id, requeue=False, table=spec.table, owner=owner)
        lease = leases.lease_of(txn, self.db, lease_id)
        if lease is None or lease.expires is not None:
            return 0
        lease = self.checked(txn, lease_id, spec.table, owner)
        tt = self.catalog.state_of(txn, lease.table_id)
        if tt is None:  # the table was dropped
            return 0
        counted = leases.delivered(tt, lease)
        if spec.delivery == "lease":
            if counted:
                tt.save()
            leases.set_expiry(txn, self.db, lease_id, lease, tt.now + spec.lease_seconds)
            return leases.held(tt, lease_id, lease)
        leases.delete(txn, self.db, lease_id, lease)
        quarantine_lost(tt, leases.leased_groups(tt, lease_id, lease))
        taken = leases.replayed_back(tt, lease_id, lease)
        reuse.replayed(tt, taken, rng)
        tt.save()
        if taken:  # back ready, as a lease's end puts them: the next upkeep pass visits the table
            self.requeued(lease.table_id)
        return sum(len(recs) for _, _, recs in taken)

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
        said: str = "",
    ) -> int:
        """End a lease: its groups consumed (an ack), or back to the buffer (`requeue`: a nack,
        its expiry, a hold released); returns the experiences. `unsent`: a Sample stream gives
        back a batch its client did not confirm (or a start, one held by an earlier run), which
        then goes back uncounted as sampled while it is held; a client's nack counts it, as the
        client has it (its confirmation may not have been delivered yet). `said`: "acked" or
        "nacked", a client's call, which made again for a lease it ended answers as it did (its
        reply was lost), and for a lease another end ended says which (NotFound)."""
        if said:
            again = self._again(txn, lease_id, table, owner, said)
            if again is not None:
                return again
        lease = self.checked(txn, lease_id, table, owner)
        leases.delete(txn, self.db, lease_id, lease)
        tt = self.catalog.state_of(txn, lease.table_id)
        if tt is None:  # the table was dropped
            return 0
        held = lease.expires is None  # a batch held for its stream: not confirmed, or its confirmation on its way
        if not (requeue and unsent):  # an ack or a nack (its client has it), or a confirmed consume
            leases.delivered(tt, lease)
        if requeue:
            quarantine_lost(tt, leases.leased_groups(tt, lease_id, lease))
        count = leases.groups_back(tt, lease_id, lease, requeue=requeue, unsent=requeue and unsent and held)
        if requeue and count:
            self.requeued(lease.table_id)
        if expired:
            tt.counters.leases_expired += 1
        tt.save()
        if said or expired:
            self._ended.add(lease_id, EndedLease(said or "expired", lease.table_id, lease.owner, count))
        return count

    def _again(
        self, txn: lmdb.Transaction[bytes], lease_id: str, table: str | None, owner: str, said: str
    ) -> int | None:
        """What an ack or a nack (`said`) of a lease that no longer exists answers where this server
        remembers its end: the first one's count where the same call ended it; else None (`checked`
        says it is unknown), or NotFound saying how it ended."""
        ended = self._ended.get(lease_id)
        if ended is None or leases.lease_of(txn, self.db, lease_id) is not None:
            return None
        if table is not None and (self.catalog.lookup(table)[0] != ended.table_id or ended.owner != owner):
            return None
        if ended.how == said:
            return ended.count
        raise NotFound(f"lease '{clip(lease_id)}' was {ended.how}: {ENDINGS[ended.how]}")

    def fail_stage(
        self, txn: lmdb.Transaction[bytes], lease_id: str, failed: dict[str, str], *, table: str, owner: str
    ) -> int:
        """A batch held for its stream whose batch stage raised (disk/kinds.Sampled.finish): it goes
        back to the buffer unsent, as `end` gives back a batch its client did not confirm, and then
        the groups of `failed` fail (group -> why; rules/quarantine.fail_ready), so that they are not
        taken, and fail, again. Returns the experiences failed."""
        lease = self.checked(txn, lease_id, table, owner)
        self.end(txn, lease_id, requeue=True, unsent=True, table=table, owner=owner)
        tt = self.catalog.state_of(txn, lease.table_id)
        if tt is None:
            return 0
        count = fail_ready(tt, failed)
        tt.save()
        return count

    def release_holds(self, txn: lmdb.Transaction[bytes]) -> int:
        """Every batch held for a stream of an earlier run of the server goes back; the streams
        that held them are gone. Returns the experiences requeued."""
        return sum(self.end(txn, lease_id, requeue=True, unsent=True) for lease_id in leases.holds(txn, self.db))
