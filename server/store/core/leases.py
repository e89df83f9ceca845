"""A table's leases as records: a lease under its id (its table, groups, expiry, owner and, for
one held for a stream, what its take counted; disk/records.Lease).
"""

from __future__ import annotations

import lmdb

from ..disk.records import Lease
from .state import TableState


def read_lease(txn: lmdb.Transaction[bytes], db: lmdb._Database, lease_id: str) -> Lease | None:
    raw = txn.get(lease_id.encode(), db=db) if 0 < len(lease_id) <= 64 else None
    return None if raw is None else Lease.decode(raw)


def owner_of(tt: TableState, lease_id: str) -> str | None:
    """The owner of a lease (the token fingerprint it was taken with); None: no such lease."""
    lease = read_lease(tt.txn, tt.db["leases"], lease_id)
    return None if lease is None else lease.owner
