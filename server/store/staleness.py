"""Eviction of stale ready groups, through the version index.

With `evict_stale`, a ready group whose lowest model version fell below trainer version -
max_staleness leaves the buffer as dropped (reason `stale`): the trainer would never take
it. The version index (`byver`, selection.py) orders ready groups by their lowest version,
so the stale ones are the front of the table's part of it, read up to the bound and never
past it: the cost is that of the stale groups found, whatever fresh data the table holds.
Each pass takes at most `limit` groups, so one write never grows without bound; the store's
upkeep takes the rest on its next passes.
"""

from __future__ import annotations

from .groups import TableTxn
from .records import DROPPED, READY

# Stale groups evicted per table in one pass (one write transaction).
EVICT_LIMIT = 10_000


def stale_bound(tt: TableTxn) -> int | None:
    """The lowest version a ready group may have; None when the table evicts nothing."""
    cfg, version = tt.config, tt.counters["trainer_version"]
    if not cfg.evict_stale or cfg.max_staleness is None or version is None:
        return None
    return version - cfg.max_staleness


def evict_stale(tt: TableTxn, limit: int = EVICT_LIMIT) -> int:
    """Drop up to `limit` ready groups below the table's staleness bound; returns how many."""
    bound = stale_bound(tt)
    if bound is None:
        return 0
    stale = tt.ready.below_version(bound, limit)
    for gkey in stale:
        grp = tt.group(gkey)
        if grp is None or grp.state != READY:
            continue
        tt.retire(gkey, grp, DROPPED)
        tt.counters["groups_dropped"] += 1
        tt.counters["dropped_stale"] += 1
    if stale:
        tt.save()
    return len(stale)
