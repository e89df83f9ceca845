"""A durable journal in an expbuf table's keyed values: entries appended one put at a time, each
durable when `append` returns, and snapshots that stand for every entry before them. TransferQueue's
controller (controller.py) keeps its state changes here, so that a controller started again comes
back to the state the last acknowledged request left.

Keys, under "controller/" in the table (TransferQueue's own keys are "{index}@{field}"):
- `controller/journal/{seq}`: entry `seq`, numbered from 1 with no gaps;
- `controller/snapshot/{generation}/{part}`: a snapshot cut in parts of at most half a message;
- `controller/head`: which snapshot stands, how many parts it has, the last entry it covers, and
  the snapshot before it (so that a clean-up a crash cut short is done again on load).

The head is written after the snapshot's parts and before anything is cleared: a crash at any
point leaves either the old head with all its entries, or the new one.

A put the server may have kept without saying so (its answer lost, or the server away past the
client's timeout) is made again, the same key and bytes, until the server answers: the controller
answers its request after that, so it never tells a client a change failed that a restart would
replay (a fetch's samples consumed, never handed out).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import grpc

from ..client import BufferClient, BufferError
from ..kit.retry import Retry
from ..shards.blocking import ShardedBufferClient
from .storage import get_in_halves

PREFIX = "controller/"
HEAD = PREFIX + "head"
READ_AHEAD = 64  # entries asked for in one GetValues on load
CLEAR_AT_ONCE = 4096
# A put failed so may still have been kept: the server away past the timeout, its answer lost, or
# the call cancelled as the server stopped. Any other code is a refusal, which keeps nothing.
UNSETTLED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})

log = logging.getLogger("expbuf.transferqueue")


def entry_key(seq: int) -> str:
    return f"{PREFIX}journal/{seq:020d}"


def part_key(generation: int, part: int) -> str:
    return f"{PREFIX}snapshot/{generation}/{part}"


@dataclass(frozen=True)
class JournalHead:
    """The standing snapshot: its generation and parts, the last entry it covers (`seq`), and the
    previous snapshot's generation, parts and first uncovered entry, cleared after it."""

    generation: int = 0
    parts: int = 0
    seq: int = 0
    previous_generation: int = 0
    previous_parts: int = 0
    previous_seq: int = 0


class Journal:
    """Entries and snapshots of one controller in `table`. Not thread-safe: one writer."""

    def __init__(self, client: BufferClient | ShardedBufferClient, table: str, snapshot_every: int = 1000) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be at least 1, not {snapshot_every}")
        self.client = client
        self.table = table
        self.snapshot_every = snapshot_every
        self.limit = client.max_message_bytes // 2
        self.head = JournalHead()
        self.seq = 0

    def load(self) -> tuple[bytes | None, list[bytes]]:
        """The standing snapshot (None before the first) and the entries after it, in order; also
        ends a clean-up that a crash cut short."""
        (raw,) = self.client.get_values([HEAD], self.table, only_own=True)  # another token's is refused
        self.head = JournalHead(**json.loads(raw)) if raw is not None else JournalHead()
        self._clear_before(self.head)
        snapshot = None
        if self.head.parts:
            keys = [part_key(self.head.generation, part) for part in range(self.head.parts)]
            parts = get_in_halves(self.client, keys, self.table)
            if any(part is None for part in parts):
                raise RuntimeError(f"expbuf table {self.table!r}: the controller's snapshot {self.head} lacks a part")
            snapshot = b"".join(part for part in parts if part is not None)
        entries = list(self._entries_after(self.head.seq))
        self.seq = self.head.seq + len(entries)
        return snapshot, entries

    def _entries_after(self, seq: int) -> Iterator[bytes]:
        while True:
            keys = [entry_key(n) for n in range(seq + 1, seq + 1 + READ_AHEAD)]
            for value in get_in_halves(self.client, keys, self.table):
                if value is None:
                    return
                seq += 1
                yield value

    def append(self, entry: bytes) -> bool:
        """Store the next entry, durable on return. False, storing nothing, where the entry is more
        than one put carries: the caller takes a snapshot instead, which covers it."""
        if len(entry) > self.limit:
            return False
        self._put(entry_key(self.seq + 1), entry)
        self.seq += 1
        return True

    @property
    def due(self) -> bool:
        """Whether entries enough have gathered since the snapshot to take another."""
        return self.seq - self.head.seq >= self.snapshot_every

    def snapshot(self, state: bytes) -> None:
        """Store `state`, which covers every entry appended so far, as the standing snapshot, then
        clear what it replaces."""
        generation = self.head.generation + 1
        parts = [state[at : at + self.limit] for at in range(0, len(state), self.limit)] or [b""]
        for part, blob in enumerate(parts):
            self._put(part_key(generation, part), blob)
        head = JournalHead(generation, len(parts), self.seq, self.head.generation, self.head.parts, self.head.seq)
        self._put(HEAD, json.dumps(asdict(head)).encode())
        self.head = head
        with contextlib.suppress(BufferError):  # what is left, the next load clears
            self._clear_before(head)

    def _put(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, made again while the server has not said whether it kept it
        (each try waits for it up to the client's timeout), or refused it busy (it did nothing: a
        server short of room for the moment): which the put settles, either way, before the caller
        answers anyone. Any other refusal is raised at once."""
        retry = Retry()
        while True:
            try:
                self.client.put_values([key], [value], self.table)
                return
            except BufferError as exc:
                if exc.code not in UNSETTLED and not exc.busy:  # busy: refused having done nothing, made again
                    raise
                pause = retry.pause()
                assert pause is not None  # a Retry without a bound always pauses
                log.warning(
                    "expbuf table %r: the controller's put of %s is unsettled (%s: %s); it is made again, "
                    "and the controller answers nothing until the server answers it",
                    self.table, key, exc.code.name, exc.details,
                )  # fmt: skip
                time.sleep(pause)

    def _clear_before(self, head: JournalHead) -> None:
        """Clear the previous snapshot's parts and the entries the standing one covers (clearing
        what is gone clears nothing, so this is safe to do again)."""
        keys = [part_key(head.previous_generation, part) for part in range(head.previous_parts)]
        keys += [entry_key(n) for n in range(head.previous_seq + 1, head.seq + 1)]
        for at in range(0, len(keys), CLEAR_AT_ONCE):
            self.client.clear_values(keys[at : at + CLEAR_AT_ONCE], self.table)
