"""Pushes in chunks staging into a table (pushing.py's `stage`): the bytes each writes to disk
before its commit, bounded by the table's capacity_bytes and shown in its stats.

A push in chunks writes its large experiences' data to disk as it arrives, and only its commit
checks the table's capacity (capacity.py): unbounded, a push far larger than the table, or many
pushes at once, would fill the disk before their refusal. So such a push announces what it will
stage (its large experiences' bytes, from the head in its first chunk) before it stages any
(`open`), and with a capacity_bytes:

- a push that stages more than capacity_bytes on its own is refused at once (TooLarge);
- one that does not fit in what is left of capacity_bytes waits for room, up to its timeout, then
  is refused (TableFull). What is left is capacity_bytes less what the other pushes staging into
  the table announced, less its keyed values and pieces (which no commit evicts), and in block
  mode less its live bytes too (those only its consumers free); in evict mode its commit evicts
  those for it, as a push's does.

So a table's disk holds at most its capacity_bytes of live experiences and as much again staged.
What a push has staged durably counts in the table's stats (`staged_bytes`) until it is stored or
dropped.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from ..core.table_state.counters import read_counters
from ..disk import layout
from ..disk.environment import Environment
from ..rules.capacity import held_bytes
from ..schema.errors import TableFull, TooLarge
from ..tables.catalog import TableCatalog

# How often a push waiting for room looks at the table again (its consumers free room in block
# mode); the end of another staged push wakes it at once.
RECHECK_SECONDS = 0.5


class StagedShare:
    """One push's share of its table's staging: what it announced, and what it has staged."""

    def __init__(self, pushes: StagedPushes, table_id: int, announced: int) -> None:
        self._pushes, self.table_id, self.announced = pushes, table_id, announced
        self.staged = 0
        self.closed = False

    def add(self, nbytes: int) -> None:
        """Count `nbytes` more staged durably (a chunk's, once its commit is done)."""
        with self._pushes.changed:
            if not self.closed:
                self.staged += nbytes

    def close(self) -> None:
        """The push was stored or dropped: its staging no longer counts (again: nothing)."""
        self._pushes.close(self)


class StagedPushes:
    """The pushes in chunks staging into each table, by table id, and the room they wait for."""

    def __init__(self, environment: Environment, catalog: TableCatalog) -> None:
        self.environment, self.catalog = environment, catalog
        self.changed = threading.Condition()  # notified as a share closes
        self._shares: dict[int, list[StagedShare]] = defaultdict(list)

    def open(self, table: str, nbytes: int, timeout: float) -> StagedShare:
        """A share of `table`'s staging for a push that will stage `nbytes`, once they fit (see
        the module), waiting at most `timeout`; a refusal names capacity_bytes."""
        table_id, config = self.catalog.lookup(table)
        limit = config.capacity.bytes
        if limit and nbytes > limit:
            raise TooLarge(
                f"table '{config.name}': a push in chunks that stages {nbytes} bytes before its commit is larger than "
                f"its capacity_bytes = {limit} on its own: nothing of it is stored"
            )
        deadline = time.monotonic() + timeout
        while True:
            held = self._held(table_id, config.capacity.when_full == "block") if limit else 0
            with self.changed:
                others = sum(share.announced for share in self._shares.get(table_id, ()))
                if not limit or held + others + nbytes <= limit:
                    share = StagedShare(self, table_id, nbytes)
                    self._shares[table_id].append(share)
                    return share
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TableFull(
                        f"table '{config.name}': a push in chunks that stages {nbytes} bytes before its commit does "
                        f"not fit in its capacity_bytes = {limit} beside the {others} bytes other pushes are staging "
                        f"into it" + (f" and the {held} bytes it holds" if held else "") + ": nothing of it is stored"
                    )
                self.changed.wait(min(left, RECHECK_SECONDS))

    def _held(self, table_id: int, blocks: bool) -> int:
        """What the table holds, as its counters say, that a commit cannot evict for the push: its
        keyed values and pieces, and where it `blocks`, its live experiences too."""
        with self.environment.read() as txn:
            counters = read_counters(txn, self.environment.db, layout.table_prefix(table_id))
        return held_bytes(counters) if blocks else counters.partial_bytes + counters.value_bytes

    def close(self, share: StagedShare) -> None:
        with self.changed:
            if share.closed:
                return
            share.closed = True
            self._shares[share.table_id].remove(share)
            if not self._shares[share.table_id]:
                del self._shares[share.table_id]
            self.changed.notify_all()

    def staged_bytes(self, table_id: int) -> int:
        """What the pushes in chunks staging into a table have staged durably so far."""
        with self.changed:
            return sum(share.staged for share in self._shares.get(table_id, ()))
