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

    def run(
        self,
        txn: lmdb.Transaction,
        now: float,
        tables: list[tuple[int, TableConfig]],
        end_lease: Callable[[lmdb.Transaction, str], int],
        expire_grant: Callable[[lmdb.Transaction, bytes], int],
    ) -> dict[str, int]:
        """One round of upkeep: expired leases (`end_lease` requeues one) and grants
        (`expire_grant` returns one's rollouts), then every table; counts of what was done."""
        done = dict.fromkeys(
            (
                "leases_expired",
                "requeued",
                "rollouts_returned",
                "groups_timed_out",
                "groups_stale_evicted",
                "tombstones_pruned",
                "failed",
            ),
            0,
        )

        def expire(t: lmdb.Transaction, key: bytes) -> int:
            lease_id = key[8:]
            if t.get(lease_id, db=self.db["leases"]) is None:  # an expiry without its lease
                t.delete(key, db=self.db["lease_exp"])
                return 0
            return end_lease(t, lease_id.decode())

        for key in self.expired(txn, now):
            requeued = self.isolated(txn, f"lease {key[8:]!r}", lambda t, k=key: expire(t, k))
            done["failed"] += requeued is None
            done["leases_expired"] += requeued is not None
            done["requeued"] += requeued or 0
        for key in self.expired(txn, now, "grant_exp"):
            returned = self.isolated(txn, f"grant {key[8:]!r}", lambda t, k=key: expire_grant(t, k))
            done["failed"] += returned is None
            done["rollouts_returned"] += returned or 0
        for table_id, config in tables:
            where = f"table {config.name}"
            result = self.isolated(txn, where, lambda t, i=table_id, c=config: self.table(t, i, c, now))
            if result is None:
                done["failed"] += 1
                continue
            done["groups_timed_out"] += result[0]
            done["tombstones_pruned"] += result[1]
            done["groups_stale_evicted"] += result[2]
        return done

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
