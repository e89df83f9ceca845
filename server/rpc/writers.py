"""Open writers per table, and whether a table's writers are done: the end of data.

Trinity-RFT's queue ends its trainer (StopAsyncIteration) when the last writer releases
and the queue is empty. Explorer and trainer are separate processes (Ray actors, often
machines), so the release must reach the server: each writer opens (+1) before its first
push and closes (-1) after its last, and a table whose every opened writer has closed is
done until a writer opens again. The count lives in the server's memory: a server restart
forgets it (readers then wait for their timeout, as before), and a writer that dies
without closing keeps its table open. A writer that names itself (its id) is counted once
whatever its calls' repeats, and its close counts only against the table it opened.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..store.schema.errors import InvalidRequest

# A writer's id, as the clients make it (a uuid's hex digits) or the caller's own.
MAX_WRITER_ID_BYTES = 64


@dataclass
class WriterCount:
    open: int = 0
    done: bool = False


@dataclass
class _TableWriters:
    """One table's writers, for one life of its name (`table_id`): those open under an id, and
    those opened and closed without one (counted as made)."""

    table_id: int
    ids: set[str] = field(default_factory=set)
    unnamed: int = 0
    done: bool = False

    def count(self) -> WriterCount:
        return WriterCount(self.unnamed + len(self.ids), self.done)


class Writers:
    """The open-writer counts of the server's tables."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[str, _TableWriters] = {}

    def change(self, table: str, change: int, table_id: int, writer_id: str = "") -> WriterCount:
        """Open (+1), close (-1) or read (0) the writers of a table, the one of id `table_id` under
        its name (one made again since starts with none); returns its count. A writer with an id
        opens and closes once, whatever the repeats; its close of a table it did not open (an
        earlier table of the name) changes nothing. A close without an id closes any writer (a
        Trinity-RFT writer released by another than the one that acquired: its count is global)."""
        if change not in (-1, 0, 1):
            raise InvalidRequest(f"change is {change}; expected +1 (a writer opens), -1 (closes) or 0 (read)")
        if len(writer_id.encode()) > MAX_WRITER_ID_BYTES:
            raise InvalidRequest(f"writer_id is {len(writer_id.encode())} bytes; at most {MAX_WRITER_ID_BYTES}")
        with self._lock:
            writers = self._tables.get(table)
            if writers is None or writers.table_id != table_id:
                writers = self._tables[table] = _TableWriters(table_id)
            if change > 0:
                if writer_id:
                    writers.ids.add(writer_id)
                else:
                    writers.unnamed += 1
                writers.done = False
            elif change < 0 and (writer_id in writers.ids if writer_id else writers.count().open > 0):
                if writer_id:
                    writers.ids.discard(writer_id)
                elif writers.unnamed:
                    writers.unnamed -= 1
                else:  # a close without an id closes one that has one, as a count of writers does
                    writers.ids.pop()
                writers.done = writers.count().open == 0
            return writers.count()

    def forget(self, table: str) -> None:
        """A dropped table's writers are gone with it."""
        with self._lock:
            self._tables.pop(table, None)
