"""A push: validated entries stored in the writer's transaction, durably when it returns.

A table full in block mode, or a rate limit that holds the push, is waited out until the
push's timeout, the push tried again at each change of the environment. Where the server gives
a table a computation (`in_push`: one-value estimators), the groups the push completes get
their advantages in its transaction, computed before it where the push's groups can be
foreseen (pushed_advantages.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

from . import admission, deliverable, groups, limiter, pushed_advantages
from .catalog import TableCatalog
from .environment import Environment
from .errors import InsertLimited, TableFull
from .kinds import Ahead, Compute, Entry, PutResult
from .table_config import TableConfig
from .table_state import TableState

Stored = PutResult | InsertLimited
InTable = Callable[[str, Callable[[TableState], Stored]], Stored]


class Pushing:
    """Pushes into a data directory's tables; `in_table` runs a function on one table in the
    writer's next transaction (Store._in_table)."""

    def __init__(
        self, environment: Environment, catalog: TableCatalog, in_table: InTable, max_reply_bytes: int | None
    ) -> None:
        self.environment, self.catalog, self._in_table = environment, catalog, in_table
        self.max_reply_bytes = max_reply_bytes  # a group that would not fit in one Sample reply is refused
        self.in_push: Callable[[TableConfig], Compute | None] | None = None

    def put(self, table: str, entries: Sequence[Entry], *, timeout: float | None = None) -> PutResult:
        """Store validated entries durably. A full table in block mode, or a rate limit that holds
        the push, waits until timeout."""
        _, config = self.catalog.lookup(table)
        limit = self.max_reply_bytes
        compute = self.in_push(config) if self.in_push is not None else None
        ahead = pushed_advantages.compute_ahead(config, entries, compute) if compute is not None else None
        start = time.monotonic()
        deadline = start + (timeout if timeout is not None else 0.0)
        held = False  # whether the rate limit held this push
        while True:
            generation = self.environment.generation
            final = time.monotonic() >= deadline
            blocked = time.monotonic() - start if held else 0.0
            try:
                put = functools.partial(
                    self._put,
                    entries=entries,
                    final=final,
                    blocked=blocked,
                    reply_limit=limit,
                    in_push=self.in_push,
                    ahead=ahead,
                )
                result = self._in_table(table, put)
            except TableFull:
                if config.capacity.when_full != "block" or final:
                    raise
            else:
                if not isinstance(result, InsertLimited):
                    return result
                if final:
                    raise result
                held = True
            self.environment.wait_for_change(generation, deadline)

    @staticmethod
    def _put(
        tt: TableState,
        entries: Sequence[Entry],
        final: bool,
        blocked: float,
        reply_limit: int | None,
        in_push: Callable[[TableConfig], Compute | None] | None,
        ahead: Ahead | None,
    ) -> PutResult | InsertLimited:
        """Store entries, or the rate limit that holds them (with the time it held them,
        counted when it lets them go or at the deadline); refuse them if a group would not
        fit in one Sample reply of reply_limit bytes. With `in_push`, the groups the push
        completes get their advantages in its transaction where it gives the table a computation
        (`ahead`: computed before it, for the groups the push was expected to complete)."""
        deliverable.check(tt, entries, reply_limit)
        held = limiter.insert_limit(tt, entries)
        if blocked and (held is None or final):
            tt.counters.insert_blocked_seconds += blocked
            tt.save()
        if held is not None:
            return held
        kept, stale = admission.screen(tt, entries)
        tt.compute = in_push(tt.config) if in_push is not None else None
        tt.ahead = ahead
        result = groups.put(tt, kept)
        result.stale = stale
        return result
