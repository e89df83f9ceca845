"""The store's periodic upkeep: expired leases return their groups, expired grants their
room for rollouts, incomplete groups time out, stale ready groups are evicted (tables with
evict_stale) and ended claims send their prompts back (the extensions' `on_upkeep`,
staleness.py and ledger.py), old tombstones are forgotten.

Each lease and each table runs in a nested transaction of its own: one that fails (a
damaged record, say) is undone, logged once per distinct reason, counted, and skipped,
and the others go on, so one table can never stop the upkeep of every table.

Its cost grows with the tables that have something to do, not with all tables: a pass visits
the active ones (written to since they were last found idle, or with incomplete groups that
may time out, tombstones to forget, or stale groups left to evict), and one pass every
SWEEP_SECONDS visits every table, for what reached a table by another way (a sample's
tombstones). A visited table is worked on only when something is due: the oldest incomplete
group and the oldest tombstone are the first keys of their time-ordered indexes, one seek each.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import lmdb

from ..core.ordering.ready import IndexBuilding
from ..core.verbs import leases, retire
from ..core.verbs.groups import oldest_pending
from ..disk import layout
from ..ledger.records import oldest_claim
from ..rules.groups import expire_groups
from ..rules.staleness import EVICT_LIMIT
from ..schema.errors import clip
from ..schema.table_config import TableConfig
from ..tables import admission
from ..tables.catalog import TableCatalog
from ..tables.ended import RecentEnds

T = TypeVar("T")
log = logging.getLogger("expbuf.store")
SWEEP_SECONDS = 30.0
# The leases, and the grants, a pass ends at most: the first after a long stop (or a backlog) finds
# every one due at once, and each lease's end requeues its groups in the writer's one transaction,
# every push and sample waiting; the rest end in the passes after, each its own transaction.
ENDS_A_PASS = 1024


class Upkeep:
    """Runs the upkeep inside the writer's transaction, isolating each piece."""

    def __init__(
        self, env: lmdb.Environment, catalog: TableCatalog, ended_grants: RecentEnds[admission.EndedGrant]
    ) -> None:
        self.env, self.catalog, self.db = env, catalog, catalog.db
        self.ended_grants = ended_grants  # an expired grant's finish, made then, says it expired
        self.failures = 0  # pieces skipped because they failed
        self._reported: set[str] = set()
        self._active: set[int] = set()  # ids of the tables the next pass visits
        self._last_sweep = float("-inf")
        self._builds: list[IndexBuilding] = []  # indexes a piece needed that its table is still building
        self._attempt: _Before | None = None  # as the pass under way found them: `run`, `settled`
        self._by_table: collections.Counter[tuple[str, str]] = collections.Counter()  # the pass under way's
        self.by_table: dict[str, dict[str, int]] = {}  # the last committed pass's counts, by table then kind

    def mark(self, table_id: int) -> None:
        """A table was written to: the next pass visits it (called in the writer's transaction)."""
        self._active.add(table_id)

    def run(
        self,
        txn: lmdb.Transaction[bytes],
        now: float,
        end_lease: Callable[[lmdb.Transaction[bytes], str], int],
    ) -> dict[str, int]:
        """One round of upkeep: expired leases (`end_lease` requeues one, the sampling
        service's) and grants, then every table; counts of what was done. Run in the writer's
        batch, which a full map undoes and runs again once the map has grown: what the pass keeps
        in memory (the tables to visit, the time of the last sweep, the count of failures, the
        builds wanted) is taken back to how it found them before it runs again (`settled`)."""
        if self._attempt is not None:  # an earlier attempt of this pass was undone with its batch
            self._undo(self._attempt)
        self._attempt = _Before(set(self._active), self._last_sweep, self.failures, len(self._builds))
        self._by_table.clear()
        tables = self.catalog.entries()
        names = {table_id: config.name for table_id, config in tables}
        done = dict.fromkeys(
            (
                "leases_expired",
                "requeued",
                "rollouts_returned",
                "groups_timed_out",
                "groups_stale_evicted",
                "tombstones_pruned",
                "failed",
                "tables_visited",
                "tables_worked",
            ),
            0,
        )

        def expire(t: lmdb.Transaction[bytes], key: bytes) -> int:
            if leases.stray_expiry(t, self.db, key):
                return 0
            lease = leases.lease_of(t, self.db, key[8:].decode())
            requeued = end_lease(t, key[8:].decode())
            if lease is not None:  # by table, for the log: an operator asks which trainer's
                self._by_table[names.get(lease.table_id, "(dropped)"), "leases_expired"] += 1
                self._by_table[names.get(lease.table_id, "(dropped)"), "requeued"] += requeued
            return requeued

        for key in leases.expired(txn, self.db, now, ENDS_A_PASS):
            requeued = self.isolated(txn, f"lease {key[8:]!r}", functools.partial(expire, key=key))
            done["failed"] += requeued is None
            done["leases_expired"] += requeued is not None
            done["requeued"] += requeued or 0
        for key in layout.due(txn, self.db["grant_exp"], now, ENDS_A_PASS):
            returned = self.isolated(txn, f"grant {key[8:]!r}", functools.partial(self.expire_grant, key=key))
            done["failed"] += returned is None
            done["rollouts_returned"] += returned or 0
        if now - self._last_sweep >= SWEEP_SECONDS:
            self._last_sweep = now
        else:
            tables = [(table_id, config) for table_id, config in tables if table_id in self._active]
        done["tables_visited"] = len(tables)
        for table_id, config in tables:
            self._active.discard(table_id)
            if self.catalog.stored_id(txn, config.name) != table_id:  # dropped in this batch, before the pass
                continue
            if not self.due(txn, table_id, config, now):
                if self.waiting(txn, table_id, config):
                    self._active.add(table_id)
                continue
            done["tables_worked"] += 1
            where = f"table {config.name}"
            result = self.isolated(txn, where, functools.partial(self.table, table_id=table_id, config=config, now=now))
            if result is None:
                done["failed"] += 1
                self._active.add(table_id)  # tried again at the next pass
                continue
            done["groups_timed_out"] += result[0]
            done["tombstones_pruned"] += result[1]
            done["groups_stale_evicted"] += result[2]
            self._by_table[config.name, "groups_timed_out"] += result[0]
            self._by_table[config.name, "groups_stale_evicted"] += result[2]
            if result[2] >= EVICT_LIMIT or self.waiting(txn, table_id, config):
                self._active.add(table_id)
        return done

    def due(self, txn: lmdb.Transaction[bytes], table_id: int, config: TableConfig, now: float) -> bool:
        """Whether a table has upkeep to do now: an incomplete group to time out, a tombstone to
        forget, or (evict_stale) a trainer version that may have left stale groups."""
        prefix = layout.table_prefix(table_id)
        if config.staleness.evict_stale:
            return True
        claim = oldest_claim(txn, self.db["ledger"], table_id)
        if claim is not None and claim <= layout.micros(now):
            return True
        if config.grouping.timeout_seconds > 0:
            oldest = oldest_pending(txn, self.db, prefix)
            if oldest is not None and oldest <= layout.micros(now - config.grouping.timeout_seconds):
                return True
        if config.retention.tombstone_seconds > 0:
            oldest = retire.oldest_retired(txn, self.db, prefix)
            if oldest is not None and oldest < layout.micros(now - config.retention.tombstone_seconds):
                return True
        return False

    def waiting(self, txn: lmdb.Transaction[bytes], table_id: int, config: TableConfig) -> bool:
        """Whether a table holds what will fall due without another write: incomplete groups
        that time out, tombstones to forget, or claims on prompts that end."""
        prefix = layout.table_prefix(table_id)
        if oldest_claim(txn, self.db["ledger"], table_id) is not None:
            return True
        if config.grouping.timeout_seconds > 0 and oldest_pending(txn, self.db, prefix) is not None:
            return True
        return config.retention.tombstone_seconds > 0 and retire.oldest_retired(txn, self.db, prefix) is not None

    def expire_grant(self, txn: lmdb.Transaction[bytes], key: bytes) -> int:
        """An expired grant gives its rollouts back (admission.py); returns them."""
        grant_id = key[8:].decode()
        record = admission.read_grant(txn, self.db, grant_id)
        tt = None if record is None else self.catalog.state_of(txn, record["t"])
        if record is None or tt is None:  # an expiry without its grant, or the grant of a dropped table
            txn.delete(key, db=self.db["grant_exp"])
            txn.delete(grant_id.encode(), db=self.db["grants"])
            return 0
        returned = admission.finish(tt, grant_id, record, 0, expired=True)
        self.ended_grants.add(grant_id, admission.EndedGrant(True, record["t"], record.get("o", ""), 0, returned))
        self._by_table[tt.config.name, "rollouts_returned"] += returned
        return returned

    def table(
        self, txn: lmdb.Transaction[bytes], table_id: int, config: TableConfig, now: float
    ) -> tuple[int, int, int]:
        """Time out incomplete groups, run the extensions' upkeep (stale ready groups evicted)
        and prune tombstones of one table."""
        tt = self.catalog.state(txn, table_id, config, now)
        timed_out = (
            expire_groups(tt, now - config.grouping.timeout_seconds) if config.grouping.timeout_seconds > 0 else 0
        )
        stale = tt.extensions.on_upkeep(tt)
        pruned = (
            retire.prune_tombstones(tt, now - config.retention.tombstone_seconds)
            if config.retention.tombstone_seconds > 0
            else 0
        )
        if timed_out or pruned:
            tt.save()
        return timed_out, pruned, stale

    def settled(self, committed: bool) -> None:
        """The pass's batch is over: committed, what it keeps in memory stands; refused (a full map
        that could not grow, a failed disk), it is taken back, as the batch's writes were. Passes
        run one at a time (the server's upkeep loop, app.py), each settled before the next."""
        if not committed and self._attempt is not None:
            self._undo(self._attempt)
        self._attempt = None
        by_table: dict[str, dict[str, int]] = {}
        for (table, kind), count in self._by_table.items() if committed else ():
            if count:
                by_table.setdefault(table, {})[kind] = count
        self.by_table = by_table

    def _undo(self, before: _Before) -> None:
        """What the pass under way kept in memory taken back to how it found it: the tables it was to
        visit visited again (with those marked since: a table visited twice does nothing twice), the
        sweep it began not begun, its failures and builds not counted."""
        self._active |= before.active
        self._last_sweep, self.failures = before.last_sweep, before.failures
        del self._builds[before.builds :]

    def take_builds(self) -> list[IndexBuilding]:
        """The indexes pieces of the last pass needed and their tables did not keep yet: the
        store has them built in the background (index_builds.py), and a pass after that does
        the pieces."""
        builds, self._builds = self._builds, []
        return builds

    def isolated(self, txn: lmdb.Transaction[bytes], what: str, fn: Callable[[lmdb.Transaction[bytes]], T]) -> T | None:
        """Run one piece in a nested transaction; on failure undo it, log it once per
        distinct reason, count it, and return None. A piece that needs an index its table does
        not keep yet is undone and left for a pass after its build (`take_builds`)."""
        child = self.env.begin(write=True, parent=txn)
        try:
            result = fn(child)
        except lmdb.MapFullError:
            child.abort()
            raise
        except IndexBuilding as building:
            child.abort()
            self._builds.append(building)
            return None
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


class _Before(NamedTuple):
    """What an upkeep pass keeps in memory, as the pass found it: its tables to visit, the time of
    the last sweep, the failures counted and the builds wanted (their number)."""

    active: set[int]
    last_sweep: float
    failures: int
    builds: int
