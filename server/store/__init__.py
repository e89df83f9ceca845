"""Durable storage of experiences in LMDB, in parts that each do one thing:

- environment.py: the LMDB environment, its single writer thread and group commit;
- layout.py: the named databases and the keys in them; records.py: the typed records
  (ItemRecord, GroupRecord, Lease) and their binary encoding; migrate.py: the data
  directory's format, checked at open and brought up to date;
- groups.py: the rules of a table in a transaction, the group state machine; capacity.py:
  eviction or refusal when a table is full; deliverable.py: refusal of a group too large for
  one Sample reply;
- leases.py: taking a batch (selection orders are selection.py's) and its leases;
- admission.py: admission of rollouts (AReaL's bound), grants, the staleness screen of
  pushes; limiter.py: the rate limits between inserts and samples (Reverb's);
  staleness.py: eviction of ready groups that fell below the staleness bound;
- upkeep.py: lease and grant expiry, group timeouts, stale-group eviction, tombstone
  pruning, isolated per table, visiting only the tables with something to do;
- integrity.py: the checks of a data directory, at open and behind `expbuf check`;
- engine.py: `Store`, the one object the server uses (through backend.Backend).
"""

from .engine import Store
from .records import (
    COMPUTING,
    CONSUMED,
    DROPPED,
    EVICTED,
    FAILED,
    LEASED,
    LIVE,
    PENDING,
    READY,
    RETIRED,
    STATES,
    ItemRecord,
)
from .types import SHAPING_COUNTERS, ComputeJob, Entry, PutResult, Sampled, ShapingUpdate

__all__ = [
    "COMPUTING",
    "CONSUMED",
    "DROPPED",
    "EVICTED",
    "FAILED",
    "LEASED",
    "LIVE",
    "PENDING",
    "READY",
    "RETIRED",
    "SHAPING_COUNTERS",
    "STATES",
    "ComputeJob",
    "Entry",
    "ItemRecord",
    "PutResult",
    "Sampled",
    "ShapingUpdate",
    "Store",
]
