"""Open writers per table, and whether a table's writers are done: the end of data.

Trinity-RFT's queue ends its trainer (StopAsyncIteration) when the last writer releases
and the queue is empty. Explorer and trainer are separate processes (Ray actors, often
machines), so the release must reach the server: each writer opens (+1) before its first
push and closes (-1) after its last, and a table whose every opened writer has closed is
done until a writer opens again. The count lives in the server's memory: a server restart
forgets it (readers then wait for their timeout, as before), and a writer that dies
without closing keeps its table open.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..store.schema.errors import InvalidRequest


@dataclass
class WriterCount:
    open: int = 0
    done: bool = False


class Writers:
    """The open-writer counts of the server's tables."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[str, WriterCount] = {}

    def change(self, table: str, change: int) -> WriterCount:
        """Open (+1), close (-1) or read (0) the writers of a table; returns its count."""
        if change not in (-1, 0, 1):
            raise InvalidRequest(f"change is {change}; expected +1 (a writer opens), -1 (closes) or 0 (read)")
        with self._lock:
            count = self._tables.setdefault(table, WriterCount())
            if change > 0:
                count.open += 1
                count.done = False
            elif change < 0 and count.open > 0:
                count.open -= 1
                count.done = count.open == 0
            return WriterCount(count.open, count.done)

    def forget(self, table: str) -> None:
        """A dropped table's writers are gone with it."""
        with self._lock:
            self._tables.pop(table, None)
