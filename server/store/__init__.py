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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core.ordering.indexes import Index as Index
    from .core.ordering.indexes import KeyedIndex as KeyedIndex
    from .core.ordering.indexes import ReadyGroup as ReadyGroup
    from .core.ordering.orders import Order as Order
    from .core.ordering.orders import register as register
    from .core.ordering.orders import unregister as unregister
    from .core.ordering.ready import ReadyIndex as ReadyIndex
    from .core.table_state.counters import SHAPING_COUNTERS as SHAPING_COUNTERS
    from .core.table_state.events import Inserted as Inserted
    from .core.table_state.events import Moved as Moved
    from .core.table_state.events import Pushed as Pushed
    from .core.table_state.events import Resent as Resent
    from .core.table_state.events import Retired as Retired
    from .core.table_state.events import TableExtension as TableExtension
    from .core.table_state.events import Taken as Taken
    from .core.whole_table.pages import Page as Page
    from .disk.chunk_heads import CHUNK_BYTES as CHUNK_BYTES
    from .disk.chunked import Staging as Staging
    from .disk.environment import STOP_POLL_SECONDS as STOP_POLL_SECONDS
    from .disk.environment import Environment as Environment
    from .disk.environment import directory
    from .disk.kinds import Compute as Compute
    from .disk.kinds import Computed as Computed
    from .disk.kinds import ComputeJob as ComputeJob
    from .disk.kinds import Entry as Entry
    from .disk.kinds import FailResult as FailResult
    from .disk.kinds import MayWait as MayWait
    from .disk.kinds import Push as Push
    from .disk.kinds import PutResult as PutResult
    from .disk.kinds import Sampled as Sampled
    from .disk.kinds import ShapingUpdate as ShapingUpdate
    from .disk.layout import FORMAT as FORMAT
    from .disk.layout import index_databases as index_databases
    from .disk.layout import u64 as u64
    from .disk.layout import version_key as version_key
    from .disk.records import ItemRecord as ItemRecord
    from .disk.stored_advantages import Advantage as Advantage
    from .disk.stored_advantages import SentApart as SentApart
    from .disk.stored_advantages import StageCounts as StageCounts
    from .disk.stored_advantages import send_apart as send_apart
    from .disk.stored_advantages import token_parts as token_parts
    from .disk.stored_advantages import token_record as token_record
    from .engine import Store as Store
    from .ledger.claimed import Claimed as Claimed
    from .ledger.prompt_stats import PASS_BANDS as PASS_BANDS
    from .ledger.prompt_stats import KeptStats as KeptStats
    from .ledger.records import MAX_SIZE as MAX_SIZE
    from .ledger.records import DatasetRecord as DatasetRecord
    from .ledger.records import PromptRecord as PromptRecord
    from .ledger.records import prompt_eid as prompt_eid
    from .ledger.settings import MAX_ATTEMPTS as MAX_ATTEMPTS
    from .ledger.settings import MAX_EPOCHS as MAX_EPOCHS
    from .ledger.states import PROMPT_STATES as PROMPT_STATES
    from .schema.states import COMPUTING as COMPUTING
    from .schema.states import CONSUMED as CONSUMED
    from .schema.states import DROPPED as DROPPED
    from .schema.states import EVICTED as EVICTED
    from .schema.states import FAILED as FAILED
    from .schema.states import LEASED as LEASED
    from .schema.states import LIVE as LIVE
    from .schema.states import PENDING as PENDING
    from .schema.states import QUARANTINED as QUARANTINED
    from .schema.states import READY as READY
    from .schema.states import RETIRED as RETIRED
    from .schema.states import STATES as STATES
    from .schema.states import IllegalMove as IllegalMove
    from .schema.states import State as State
    from .schema.views import GroupView as GroupView
    from .schema.views import MemberView as MemberView
    from .services.claims import MAX_OWNER_BYTES as MAX_OWNER_BYTES
    from .services.claims import MAX_PAGE as MAX_PAGE
    from .services.claims import RecordPage as RecordPage
    from .services.claims import check_claim as check_claim
    from .services.claims import check_refs as check_refs
    from .services.claims import shown_owner as shown_owner
    from .services.index_builds import IndexBuild as IndexBuild
    from .services.scrub import ScrubStatus as ScrubStatus
    from .services.staged import StagedShare as StagedShare
    from .tables import integrity
    from .tables.admission import RolloutGrant as RolloutGrant
    from .tables.integrity import newer_format as newer_format
    from .tables.integrity import older_format as older_format

    quarantined_by_table, repair_directory, scan_directory = integrity.quarantined, integrity.repair, integrity.scan
    copy_directory = directory.copy

# Each exported name's module, imported at the name's first use (PEP 562): a command that reads only
# the store's schema (the command line's client commands, the config) loads none of the rest.
_HOMES: dict[str, tuple[str | tuple[str, str], ...]] = {
    ".core.ordering.indexes": ("Index", "KeyedIndex", "ReadyGroup"),
    ".core.ordering.orders": ("Order", "register", "unregister"),
    ".core.ordering.ready": ("ReadyIndex",),
    ".core.table_state.counters": ("SHAPING_COUNTERS",),
    ".core.table_state.events": ("Inserted", "Moved", "Pushed", "Resent", "Retired", "TableExtension", "Taken"),
    ".core.whole_table.pages": ("Page",),
    ".disk.chunk_heads": ("CHUNK_BYTES",),
    ".disk.chunked": ("Staging",),
    ".disk.environment": ("STOP_POLL_SECONDS", "Environment", ("copy", "copy_directory")),
    ".disk.kinds": (
        "Compute",
        "Computed",
        "ComputeJob",
        "Entry",
        "FailResult",
        "MayWait",
        "Push",
        "PutResult",
        "Sampled",
        "ShapingUpdate",
    ),
    ".disk.layout": ("FORMAT", "index_databases", "u64", "version_key"),
    ".disk.records": ("ItemRecord",),
    ".disk.stored_advantages": ("Advantage", "SentApart", "StageCounts", "send_apart", "token_parts", "token_record"),
    ".engine": ("Store",),
    ".ledger.claimed": ("Claimed",),
    ".ledger.prompt_stats": ("PASS_BANDS", "KeptStats"),
    ".ledger.records": ("MAX_SIZE", "DatasetRecord", "PromptRecord", "prompt_eid"),
    ".ledger.settings": ("MAX_ATTEMPTS", "MAX_EPOCHS"),
    ".ledger.states": ("PROMPT_STATES",),
    ".schema.states": (
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
        "STATES",
        "IllegalMove",
        "State",
    ),
    ".schema.views": ("GroupView", "MemberView"),
    ".services.claims": ("MAX_OWNER_BYTES", "MAX_PAGE", "RecordPage", "check_claim", "check_refs", "shown_owner"),
    ".services.index_builds": ("IndexBuild",),
    ".services.scrub": ("ScrubStatus",),
    ".services.staged": ("StagedShare",),
    ".tables.admission": ("RolloutGrant",),
    ".tables.integrity": (
        "newer_format",
        "older_format",
        ("quarantined", "quarantined_by_table"),
        ("repair", "repair_directory"),
        ("scan", "scan_directory"),
    ),
}
_WHERE = {
    (name if isinstance(name, str) else name[1]): (module, name if isinstance(name, str) else name[0])
    for module, names in _HOMES.items()
    for name in names
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """An exported name, imported from its module; or anything else the package held when it
    imported every exported name's module at once (a room, `store.disk.layout`), so imported."""
    where = _WHERE.get(name)
    if where is None:
        if not name.startswith("__"):
            for module in _HOMES:
                importlib.import_module(module, __name__)
        if name in globals():
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where[0], __name__), where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
