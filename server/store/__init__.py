"""Durable storage of experiences in LMDB, in layers that import only downward:

- the environment and the formats: environment.py (the LMDB environment, its single writer
  thread and group commit), layout.py (the named databases and the keys in them), records.py
  (ItemRecord, GroupRecord, Lease and their binary encoding), kinds.py (what goes in and comes
  out: Entry, Push, PutResult, Sampled, ComputeJob), snapshot.py, batch_rows.py;
- the table state: table_state.py (one table in one transaction: its record cache, counters,
  ready index and `save`), counters.py (the counters and their stored form), extensions.py
  (the table extension hooks, after Reverb's TableExtension);
- the rules, functions over a table's state: limiter.py (the rate limits between inserts and
  samples), retirement.py (how experiences leave), capacity.py (eviction or refusal when
  full), groups.py (the group state machine), pushed_advantages.py (advantages a push computes
  and stores itself), staleness.py (the trainer version, stale-group eviction),
  compute_queue.py (groups waiting for advantages), deliverable.py, admission.py (AReaL's
  bound), leases.py (taking a batch and its leases), quarantine.py (damaged payloads found by
  a read), browse.py, integrity.py, migrate.py;
- the services: catalog.py (the tables), sampling.py (sample, ack, nack), upkeep.py (lease and
  grant expiry, group timeouts, extensions' upkeep, tombstone pruning, per table, isolated),
  scrub.py (every payload checked in the background, residency.py keeping RSS small);
- engine.py: `Store`, the façade the server uses (through backend.Backend).
"""

from .counters import SHAPING_COUNTERS
from .engine import Store
from .extensions import TableExtension
from .kinds import ComputeJob, Entry, Push, PutResult, Sampled, ShapingUpdate
from .records import ItemRecord
from .scrub import ScrubStatus
from .states import (
    COMPUTING,
    CONSUMED,
    DROPPED,
    EVICTED,
    FAILED,
    LEASED,
    LIVE,
    PENDING,
    QUARANTINED,
    READY,
    RETIRED,
    STATES,
    IllegalMove,
    State,
)

__all__ = [
    "COMPUTING",
    "CONSUMED",
    "DROPPED",
    "EVICTED",
    "FAILED",
    "LEASED",
    "LIVE",
    "PENDING",
    "QUARANTINED",
    "READY",
    "RETIRED",
    "SHAPING_COUNTERS",
    "STATES",
    "ComputeJob",
    "Entry",
    "IllegalMove",
    "ItemRecord",
    "Push",
    "PutResult",
    "Sampled",
    "ScrubStatus",
    "ShapingUpdate",
    "State",
    "Store",
    "TableExtension",
]
