"""Durable storage of experiences in LMDB, in layers that import only downward:

- what every layer reads: errors.py (every refusal, its gRPC status named, not imported),
  ready_indexes.py (the ready-group indexes, one `Index` class each), selection.py (the orders,
  one registered `Order` class each, and a table's `ReadyIndex`), estimator_registry.py (the
  estimators a table can name), table_config.py (`TableConfig`, composed of the parts of
  table_parts.py, each checking its settings), sample_spec.py
  (`SampleSpec`, a sample request checked once), states.py (the group state machine);
- the environment and the formats: environment.py (the LMDB environment, its single writer
  thread and group commit), layout.py (the named databases and the keys in them), records.py
  (ItemRecord, GroupRecord, Lease and their binary encoding), kinds.py (what goes in and comes
  out: Entry, Push, PutResult, Sampled, ComputeJob), stored_advantages.py (advantages' stored
  forms, spliced into a batch), snapshot.py, batch_rows.py;
- the table state: table_state.py (one table in one transaction: its record cache, counters,
  ready index and `save`), counters.py (the counters and their stored form), extensions.py
  (the table extension hooks, after Reverb's TableExtension, and the kinds tables name);
- the rules, functions over a table's state: limiter.py (the rate limits between inserts and
  samples), retirement.py (how experiences leave), capacity.py (eviction or refusal when
  full), groups.py (the group state machine), pushed_advantages.py (advantages a push computes
  and stores itself), staleness.py (the trainer version, stale-group eviction),
  compute_queue.py (groups waiting for advantages), admission.py (AReaL's
  bound), taking.py (taking a batch), leases.py (a lease's life), quarantine.py (damaged payloads found by
  a read), browse.py, integrity.py, migrate.py;
- the services: catalog.py (the tables and each one's extensions), sampling.py (sample, ack, nack), upkeep.py (lease and
  grant expiry, group timeouts, extensions' upkeep, tombstone pruning, per table, isolated),
  scrub.py (every payload checked in the background, residency.py keeping RSS small),
  index_builds.py (the indexes a table lacks, built in the background from the open);
- engine.py: `Store`, the façade the server uses (through backend.Backend).

The store is the bottom layer of the server, fenced: no chain of imports from it reaches grpc or
torch (the import contracts in pyproject.toml; tests/test_fence.py). It reads payloads with the
codec's torch-free submodules (expbuf.client.trxp.parse, .build, .common, .checks, .advantages),
never the expbuf.client.trxp package. What computes with torch is given to it by the server: the
batch stage (`Store(batch_stage=...)`, bound to each batch taken and run where the reply is
built) and the advantages a push computes (`Store.in_push`).
"""

import sys

from expbuf.client.moved import alias

from .core.counters import SHAPING_COUNTERS
from .core.events import TableExtension
from .core.indexes import Index, KeyedIndex, ReadyGroup
from .core.orders import Order, register, unregister
from .core.ready import ReadyIndex
from .disk.kinds import ComputeJob, Entry, Push, PutResult, Sampled, ShapingUpdate
from .disk.layout import u64, version_key
from .disk.records import ItemRecord
from .engine import Store
from .schema.states import (
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
from .services.index_builds import IndexBuild
from .services.scrub import ScrubStatus

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
    "Index",
    "IndexBuild",
    "ItemRecord",
    "KeyedIndex",
    "Order",
    "Push",
    "PutResult",
    "ReadyGroup",
    "ReadyIndex",
    "Sampled",
    "ScrubStatus",
    "ShapingUpdate",
    "State",
    "Store",
    "TableExtension",
    "register",
    "u64",
    "unregister",
    "version_key",
]

# The old paths of the order registry's names (an order and its index, docs/internals/storage.md),
# modules no more: each name read from them is this package's, with a DeprecationWarning, for
# one release (client/moved.py; CHANGELOG.md).
for _old in ("schema.ready_indexes", "schema.selection", "ready_indexes", "selection"):
    alias(f"{__name__}.{_old}", sys.modules[__name__])
