"""The store's side of the advantage worker (server/advantages/worker.py): the backlog of completed
groups waiting for their advantages, read a table at a time, and the computed values stored. What
the backlog cannot compute is dealt with here, each in its table's transaction: damaged payloads
quarantined, groups whose members' records are lost failed, and groups whose own records are lost
failed (a records table's) or logged once (a rows table's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from ..core.table_state.state import TableState
from ..core.verbs.compute import backlog
from ..disk.environment import Environment
from ..disk.kinds import ComputeJob, ShapingUpdate
from ..rules import groups
from ..rules.quarantine import fail_lost_computing, quarantine_lost
from ..schema.errors import NotFound
from ..schema.states import COMPUTING
from ..schema.table_config import TableConfig
from ..tables.catalog import TableCatalog

log = logging.getLogger("expbuf.store")
T = TypeVar("T")


class InTable(Protocol):
    """Run a function on one table in the writer's next transaction (Store._in_table)."""

    def __call__(self, table: str, fn: Callable[[TableState], T], /) -> T: ...


class Computing:
    """The compute backlog and its results, over the store's writer (`in_table`: Store._in_table);
    `quarantine_found` quarantines the damaged payloads the backlog met (Store._quarantine_found)."""

    def __init__(
        self,
        environment: Environment,
        catalog: TableCatalog,
        in_table: InTable,
        quarantine_found: Callable[[str, list[str]], int],
    ) -> None:
        self.environment = environment
        self.catalog = catalog
        self._in_table = in_table
        self._quarantine_found = quarantine_found
        self._last_computed = 0  # the table whose backlog was read last (tables take turns)
        self._unreadable: set[tuple[str, str]] = set()  # computing groups the backlog passed over, logged

    def compute_backlog(self, limit: int = 8192) -> list[ComputeJob]:
        """Completed groups waiting for advantages, oldest first within each table, up to
        about `limit` experiences, as one job per table. Tables take turns being first, so a
        table with a long backlog cannot keep the others waiting. The compute index is read
        from table to table with a backlog, never over the tables without one. Payloads are read
        only for estimators that need token-level data, each checked against its digest: a group
        with a damaged one is not computed, its damaged members are quarantined (quarantine.py),
        and one with a member whose record is lost fails alike; one whose own record is lost or
        does not decode is passed over, so that it holds up no other group or table, and fails (a
        records table's) or is logged once (a rows table's); the others work from the item records."""

        def table_of(table_id: int) -> tuple[str, TableConfig] | None:
            return self.catalog.by_id(table_id)

        damaged: dict[str, list[str]] = {}
        lost: dict[str, list[str]] = {}
        unreadable: dict[str, dict[str, str]] = {}
        with self.environment.read() as txn:
            jobs, self._last_computed = backlog(
                txn, self.environment.db, table_of, self._last_computed, limit, damaged, lost, unreadable
            )
        for table, whys in unreadable.items():
            self._passed_over(table, whys)
        for table, uids in damaged.items():
            self._quarantine_found(table, uids)
        for table, gkeys in lost.items():
            self._fail_lost(table, gkeys)
        return jobs

    def finish_compute(
        self,
        table: str,
        advantages: dict[str, float | bytes],
        ready: Sequence[str],
        dropped: Sequence[str] = (),
        failed: dict[str, str] | None = None,
        shaping: ShapingUpdate | None = None,
        places: Mapping[str, int] | None = None,
        table_id: int | None = None,
    ) -> bool:
        """Store computed advantages and release their groups; drop or fail the others.
        Groups deleted or evicted meanwhile are left alone. What reward shaping did (its
        counts and running moments) is saved in the same transaction. `places`: each group's place
        in the compute queue as the computation read it (`ComputeJob.queued`): a group no longer
        there was deleted and pushed again meanwhile, and stays computing for the worker's next pass.
        `table_id`: the table the computation read (`ComputeJob.table_id`); where the table of that
        name is another by the write (the one read dropped, one made again under its name: its queue
        starts over, and the same group at the same place would take values not its own), NotFound,
        as for a table dropped. Returns whether the computation was stored: one whose shaping took
        in such a group is not (its groups stay computing), so that no group is counted twice."""

        def op(tt: TableState) -> bool:
            if table_id is not None and self.catalog.stored_id(tt.txn, table) != table_id:
                raise NotFound(f"table '{table}' was dropped (and made again) while its groups were computed")
            return groups.finish_compute(tt, advantages, ready, dropped, failed or {}, shaping, places)

        return self._in_table(table, op)

    def _passed_over(self, table: str, whys: dict[str, str]) -> None:
        """Computing groups the backlog could not read (their own record lost or undecodable): a
        records table's fail, their records remade from their members' (quarantine.py); a rows
        table's head names no member to fail, so each is logged once (the worker passes over it at
        every pass) and left to `expbuf check` and to a Delete naming it (core/verbs/rows/deletes.py)."""

        def fail(tt: TableState) -> bool:
            if tt.config.storage.layout == "rows":
                return False
            if fail_lost_computing(tt, list(whys)):
                tt.save()
            return True

        try:
            if self._in_table(table, fail):
                return
        except NotFound:
            return
        for gkey, why in whys.items():
            if (table, gkey) not in self._unreadable:
                self._unreadable.add((table, gkey))
                log.error(
                    "table %s: computing group %s cannot be read (%s): its advantages are not computed; "
                    "run `expbuf check` on the data directory",
                    table, gkey, why,
                )  # fmt: skip

    def _fail_lost(self, table: str, gkeys: list[str]) -> None:
        """Computing groups the backlog found a member's record lost of fail (quarantine.py), so
        that the advantage worker's next pass does not meet them again; a table dropped meanwhile
        has nothing to fail."""

        def fail(tt: TableState) -> None:
            computing = [(gkey, grp) for gkey in gkeys if (grp := tt.view(gkey)) is not None and grp.state == COMPUTING]
            quarantine_lost(tt, computing)
            tt.save()

        try:
            self._in_table(table, fail)
        except NotFound:
            return
