"""The store's periodic upkeep: expired leases return their groups, expired grants their
room for rollouts, incomplete groups time out, stale ready groups are evicted (tables with
evict_stale, staleness.py), old tombstones are forgotten.

Each lease and each table runs in a nested transaction of its own: one that fails (a
damaged record, say) is undone, logged once per distinct reason, counted, and skipped,
and the others go on, so one table can never stop the upkeep of every table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import lmdb

from ..errors import clip
from ..tables import TableConfig
from . import layout, retirement
from .groups import TableTxn
from .staleness import evict_stale

T = TypeVar("T")
log = logging.getLogger("expbuf.store")


class Upkeep:
    """Runs the upkeep inside the writer's transaction, isolating each piece."""

    def __init__(self, env: lmdb.Environment, dbs: dict[str, lmdb._Database]) -> None:
        self.env, self.db = env, dbs
        self.failures = 0  # pieces skipped because they failed
        self._reported: set[str] = set()

    def expired(self, txn: lmdb.Transaction, now: float, index: str = "lease_exp") -> list[bytes]:
        """The keys of an expiry index (leases', grants') due by `now`, oldest first."""
        expired = []
        with txn.cursor(db=self.db[index]) as cur:
            for key, _ in cur:
                if layout.expiry_of(key) > now:
                    break
                expired.append(bytes(key))
        return expired

    def table(self, txn: lmdb.Transaction, table_id: int, config: TableConfig, now: float) -> tuple[int, int, int]:
        """Time out incomplete groups, evict stale ready groups and prune tombstones of one table."""
        tt = TableTxn(txn, self.db, table_id, config, now)
        timed_out = tt.expire_groups(now - config.group_timeout_seconds) if config.group_timeout_seconds > 0 else 0
        stale = evict_stale(tt)
        pruned = retirement.prune_tombstones(tt, now - config.tombstone_seconds) if config.tombstone_seconds > 0 else 0
        tt.save()
        return timed_out, pruned, stale

    def isolated(self, txn: lmdb.Transaction, what: str, fn: Callable[[lmdb.Transaction], T]) -> T | None:
        """Run one piece in a nested transaction; on failure undo it, log it once per
        distinct reason, count it, and return None."""
        child = self.env.begin(write=True, parent=txn)
        try:
            result = fn(child)
        except lmdb.MapFullError:
            child.abort()
            raise
        except Exception as exc:
            child.abort()
            self.failures += 1
            reason = f"{what}: {type(exc).__name__}: {exc}"
            if reason not in self._reported:
                self._reported.add(reason)
                log.error("maintenance skipped %s", clip(reason, 300))
            return None
        child.commit()
        return result
