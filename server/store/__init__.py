"""Durable storage of experiences in LMDB, in rooms that import only downward (each room's
`__init__.py` says what it holds; docs/internals/layout.md maps them):

- engine.py: `Store`, the façade the server uses, with its mixin service_calls.py (the calls
  its services answer as they are, forwarded: forward.py); this package exports the names code
  above the store reads (the Store, what goes in and comes out, the states, the extension class and the
  events it hears, the order and index API);
- services/: sampling, pushing, reads, keyed values, claims, upkeep, scrub, index builds, each a
  request's work in the writer's transaction or off it;
- tables/: the catalog (the tables and each one's extensions), a lease's life, taking a batch,
  AReaL's admission bound, a data directory's checks;
- ledger/: the prompt ledger's rules, records, checks and shards;
- rules/: the policy over one table's state: groups, capacity, staleness, reuse, quarantine, the
  advantages a push computes, the rate limiter, partial rollouts, the table extensions run;
- core/: the table core, the only code that reads and writes a table's records, in rooms: the
  reads, checks and upgrades of its records (whole_table/), the verbs of push, take, lease end,
  retire and requeue (verbs/), the table state with its counters and events (table_state/), the
  ready indexes and orders (ordering/);
- disk/: the LMDB environment (its single writer and group commit), the named databases and keys,
  the records and their binary form, payloads stored whole, in chunks or with a shared prompt;
- schema/: what every room reads: the group state machine, settings, a sample request, the
  estimators, every refusal, the order registry's names.

The store is the bottom layer of the server, fenced: no chain of imports from it reaches grpc or
torch (the import contracts in pyproject.toml; tests/test_fence.py). It reads payloads with the
codec's rooms that import no protobuf (expbuf.client.trxp.codec, .stored, .varints), never with its
convert.py or the expbuf.client.trxp package, which exports convert's names, nor with column_batch/
(a push as columns, read by the server's ingest). What computes with torch is given to it by the server: the
batch stage (`Store(batch_stage=...)`, bound to each batch taken and run where the reply is
built) and the advantages a push computes (`Store.in_push`).
"""

from .core.ordering.indexes import Index, KeyedIndex, ReadyGroup
from .core.ordering.orders import Order, register, unregister
from .core.ordering.ready import ReadyIndex
from .core.table_state.counters import SHAPING_COUNTERS
from .core.table_state.events import Inserted, Moved, Pushed, Resent, Retired, TableExtension, Taken
from .core.whole_table.reading import Page
from .disk.chunk_heads import CHUNK_BYTES
from .disk.chunked import Staging
from .disk.environment import Environment
from .disk.kinds import (
    Compute,
    Computed,
    ComputeJob,
    Entry,
    FailResult,
    MayWait,
    Push,
    PutResult,
    Sampled,
    ShapingUpdate,
)
from .disk.layout import FORMAT, index_databases, u64, version_key
from .disk.records import ItemRecord
from .disk.stored_advantages import Advantage, SentApart, StageCounts, send_apart, token_parts, token_record
from .engine import Store
from .ledger.claimed import Claimed
from .ledger.prompt_stats import PASS_BANDS, KeptStats
from .ledger.records import MAX_SIZE, DatasetRecord, PromptRecord, prompt_eid
from .ledger.settings import MAX_ATTEMPTS, MAX_EPOCHS
from .ledger.states import PROMPT_STATES
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
from .schema.views import GroupView, MemberView
from .services.claims import MAX_OWNER_BYTES, MAX_PAGE, RecordPage, check_claim, check_refs, shown_owner
from .services.index_builds import IndexBuild
from .services.scrub import ScrubStatus
from .services.staged import StagedShare
from .tables.admission import RolloutGrant
from .tables.integrity import older_format
from .tables.integrity import quarantined as quarantined_by_table
from .tables.integrity import repair as repair_directory
from .tables.integrity import scan as scan_directory

__all__ = [
    "CHUNK_BYTES",
    "COMPUTING",
    "CONSUMED",
    "DROPPED",
    "EVICTED",
    "FAILED",
    "FORMAT",
    "LEASED",
    "LIVE",
    "MAX_ATTEMPTS",
    "MAX_EPOCHS",
    "MAX_OWNER_BYTES",
    "MAX_PAGE",
    "MAX_SIZE",
    "PASS_BANDS",
    "PENDING",
    "PROMPT_STATES",
    "QUARANTINED",
    "READY",
    "RETIRED",
    "SHAPING_COUNTERS",
    "STATES",
    "Advantage",
    "Claimed",
    "Compute",
    "ComputeJob",
    "Computed",
    "DatasetRecord",
    "Entry",
    "Environment",
    "FailResult",
    "GroupView",
    "IllegalMove",
    "Index",
    "IndexBuild",
    "Inserted",
    "ItemRecord",
    "KeptStats",
    "KeyedIndex",
    "MayWait",
    "MemberView",
    "Moved",
    "Order",
    "Page",
    "PromptRecord",
    "Push",
    "Pushed",
    "PutResult",
    "ReadyGroup",
    "ReadyIndex",
    "RecordPage",
    "Resent",
    "Retired",
    "RolloutGrant",
    "Sampled",
    "ScrubStatus",
    "SentApart",
    "ShapingUpdate",
    "StageCounts",
    "StagedShare",
    "Staging",
    "State",
    "Store",
    "TableExtension",
    "Taken",
    "check_claim",
    "check_refs",
    "index_databases",
    "older_format",
    "prompt_eid",
    "quarantined_by_table",
    "register",
    "repair_directory",
    "scan_directory",
    "send_apart",
    "shown_owner",
    "token_parts",
    "token_record",
    "u64",
    "unregister",
    "version_key",
]
