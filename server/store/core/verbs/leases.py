"""A table's leases as records: a lease under its id (its table, groups, expiry, owner and, for
one held for a stream, what its take counted; disk/records.Lease) and, while its clock runs, a row
of the expiry index; and what ending one does to its groups' records (`groups_back`,
`replayed_back`). What a lease's life is, step by step, is tables/leases.py's.
"""

from __future__ import annotations

from collections.abc import Mapping

import lmdb

from ...disk import layout
from ...disk.kinds import Sampled
from ...disk.records import Counted, GroupRecord, Lease, unpack_lease
from ...disk.rows import RowLease, decode_lease
from ...schema.states import CONSUMED, LEASED, READY
from ...schema.views import Members
from ..table_state import rate_counts
from ..table_state.state import TableState
from ..table_state.views import group_record, member_record
from .retire import retire
from .rows import leases as row_leases

Dbs = Mapping[str, lmdb._Database]
# A lease of a records table's groups, or of a rows table's runs (disk/rows/).
AnyLease = Lease | RowLease


def read_lease(txn: lmdb.Transaction[bytes], db: lmdb._Database, lease_id: str) -> AnyLease | None:
    raw = txn.get(lease_id.encode(), db=db) if 0 < len(lease_id) <= 64 else None
    return None if raw is None else decode_lease(raw)


def lease_of(txn: lmdb.Transaction[bytes], dbs: Dbs, lease_id: str) -> AnyLease | None:
    """The lease under an id (None: no such lease)."""
    return read_lease(txn, dbs["leases"], lease_id)


def owner_of(tt: TableState, lease_id: str) -> str | None:
    """The owner of a lease (the token fingerprint it was taken with); None: no such lease."""
    lease = lease_of(tt.txn, tt.db, lease_id)
    return None if lease is None else lease.owner


def grant_row(txn: lmdb.Transaction[bytes], dbs: Dbs, batch: Sampled, table_id: int, *, hold: bool, owner: str) -> None:
    """The lease of a batch just taken (its groups LEASED under `batch.lease_id`): held
    until confirmed, or running until `batch.lease_expires`."""
    expires = None if hold else batch.lease_expires
    counted = batch.counted if hold else None  # counted as sampled once the client has it (`delivered`)
    if batch.lease_runs:  # a rows table's batch
        value = row_leases.lease_row(table_id, batch.lease_runs, expires, owner, counted)
    else:
        groups = list(dict.fromkeys(batch.group_ids))
        lease = Lease(table_id=table_id, groups=groups, expires=expires, owner=owner, counted=counted, deferred=hold)
        value = lease.encode()
    txn.put(batch.lease_id.encode(), value, db=dbs["leases"])
    if expires is not None:
        txn.put(layout.expiry_key(expires, batch.lease_id), b"", db=dbs["lease_exp"])


def delivered(tt: TableState, lease: AnyLease) -> bool:
    """A batch held for its stream is the client's now (confirmed; or acked, nacked or renewed,
    which its client may do once it has it): what its take found counts as sampled now, where the
    take left it to this (`Lease.deferred`). Whether the counters changed."""
    if lease.expires is not None or not lease.deferred or lease.counted is None:
        return False
    counted, lease.deferred = lease.counted, False
    tt.counters.sampled += counted.experiences
    tt.counters.bytes_sampled += counted.nbytes
    tt.counters.tokens_masked += counted.tokens_masked
    return True


def set_expiry(txn: lmdb.Transaction[bytes], dbs: Dbs, lease_id: str, lease: AnyLease, expires: float) -> None:
    """The lease now ends at `expires` (a held one's clock starts)."""
    if lease.expires is not None:
        txn.delete(layout.expiry_key(lease.expires, lease_id), db=dbs["lease_exp"])
    lease.expires = expires
    txn.put(lease_id.encode(), lease.encode(), db=dbs["leases"])
    txn.put(layout.expiry_key(expires, lease_id), b"", db=dbs["lease_exp"])


def delete(txn: lmdb.Transaction[bytes], dbs: Dbs, lease_id: str, lease: AnyLease) -> None:
    """A lease's record and its expiry row go."""
    txn.delete(lease_id.encode(), db=dbs["leases"])
    if lease.expires is not None:
        txn.delete(layout.expiry_key(lease.expires, lease_id), db=dbs["lease_exp"])


def holds(txn: lmdb.Transaction[bytes], dbs: Dbs) -> list[str]:
    """The leases held for a stream (no expiry), of every table."""
    return [key.decode() for key, raw in txn.cursor(db=dbs["leases"]) if unpack_lease(raw)[1] is None]


def expired(txn: lmdb.Transaction[bytes], dbs: Dbs, now: float, limit: int) -> list[bytes]:
    """The keys of the lease expiry index due by `now`, oldest first, at most `limit`."""
    return layout.due(txn, dbs["lease_exp"], now, limit)


def drop_table(txn: lmdb.Transaction[bytes], dbs: Dbs, table_id: int) -> None:
    """A dropped table's leases go: they are keyed by id, not by table (a batch held by a stream
    of the table ends here)."""
    ended = [key for key, raw in txn.cursor(db=dbs["leases"]) if unpack_lease(raw)[0] == table_id]
    for key in ended:
        txn.delete(key, db=dbs["leases"])


def undecodable(txn: lmdb.Transaction[bytes], dbs: Dbs) -> list[str]:
    """The leases whose records do not decode (a full check names them; damage raises anything)."""
    problems = []
    for key, value in txn.cursor(db=dbs["leases"]):
        try:
            decode_lease(value)
        except Exception as exc:
            problems.append(f"lease {bytes(key)[:60]!r} does not decode ({exc})")
    return problems


def stray_expiry(txn: lmdb.Transaction[bytes], dbs: Dbs, key: bytes) -> bool:
    """Whether an expiry row names no lease (damage): then it goes."""
    if txn.get(key[8:], db=dbs["leases"]) is not None:
        return False
    txn.delete(key, db=dbs["lease_exp"])
    return True


def leased_groups(tt: TableState, lease_id: str, lease: AnyLease) -> list[tuple[str, GroupRecord]]:
    """The records of the groups still held under a lease (a group deleted meanwhile is not); a
    lease of runs names no records."""
    if isinstance(lease, RowLease):
        return []
    held = []
    for gkey in lease.groups:
        grp = tt.group(gkey)
        if grp is not None and grp.state == LEASED and grp.lease == lease_id:
            held.append((gkey, grp))
    return held


def held(tt: TableState, lease_id: str, lease: AnyLease) -> int:
    """The experiences still under a lease."""
    if isinstance(lease, RowLease):
        return row_leases.held(tt, lease_id, lease)
    return sum(len(grp.members) for _, grp in leased_groups(tt, lease_id, lease))


def groups_back(tt: TableState, lease_id: str, lease: AnyLease, *, requeue: bool, unsent: bool) -> int:
    """The groups of a lease go back to ready (`requeue`) or are consumed; returns the
    experiences. Only a batch that goes back sampled rewrites its members' records (their times
    sampled). `unsent`: a batch held for a stream that never confirmed it is not sampled after
    all: the members still under it leave the rate limiter's count (a member deleted meanwhile took
    its lease's sample out of that count as it left: rate_counts.forget); and where its take
    counted it (a hold of an earlier release: not `Lease.deferred`), what it counted leaves the
    table's counters (a lease a release before `Lease.counted` wrote: the members still under it,
    as it did)."""
    if isinstance(lease, RowLease):
        return row_leases.end(tt, lease_id, lease, requeue=requeue, unsent=unsent)
    ended = leased_groups(tt, lease_id, lease)
    for _, grp in ended:
        grp.lease = ""
    if not requeue:
        retire(tt, ended, CONSUMED)
        return sum(len(grp.members) for _, grp in ended)
    back: list[Members] = [(gkey, grp, tt.members(grp)) for gkey, grp in ended]
    if unsent:
        recs = [rec for _, _, members in back for rec in members.values()]
        if not lease.deferred:
            counted = lease.counted or Counted(len(recs), sum(rec.size for rec in recs), 0)
            tt.counters.sampled -= counted.experiences
            tt.counters.bytes_sampled -= counted.nbytes
            tt.counters.tokens_masked -= counted.tokens_masked
        rate_counts.given_back(tt, len(recs))
    _ready_again(tt, back, sampled=not unsent)  # sampled: the records count it now (a consumed one's need not)
    return sum(len(grp.members) for _, grp in ended)


def replayed_back(tt: TableState, lease_id: str, lease: AnyLease) -> list[Members]:
    """A held replay batch the client confirmed: its groups are ready again, their members'
    deliveries counted; returns them (with their members' views), for reuse to count as
    replayed (rules/reuse.replayed)."""
    if isinstance(lease, RowLease):
        return row_leases.replayed_back(tt, lease_id, lease)
    groups = leased_groups(tt, lease_id, lease)
    for _, grp in groups:
        grp.lease = ""
    taken: list[Members] = [(gkey, grp, tt.members(grp)) for gkey, grp in groups]
    _ready_again(tt, taken, sampled=True)
    return taken


def _ready_again(tt: TableState, back: list[Members], *, sampled: bool) -> None:
    """Groups a lease held are ready again, their members' deliveries counted where `sampled`."""
    if sampled:
        for _, _, members in back:
            for uid, view in members.items():
                rec = member_record(view)
                rec.times_sampled += 1
                tt.put_item(uid, rec)
    tt.set_states(back, READY)
    placed = [(gkey, group_record(grp)) for gkey, grp, _ in back]
    tt.ready.add_many([(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in placed])
