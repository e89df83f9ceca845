"""Large rollouts held in pieces put together off the writer (rules/partial_assembly.py): the
last piece's push reads the rollout's pieces from snapshots, a chunk at a time, into a chunk set
it stages as a push in chunks stages a large experience (chunked.Staging, Pushing.stage: each chunk
written in the writer's next commit, shared with the requests waiting then), so that neither the
writer nor the server holds the rollout whole: the push holds a chunk being filled and WINDOW
waiting for the writer, and the map's pages of the pieces it read are given back every
RELEASE_BYTES (residency.py: they stay in the page cache; a read of a piece may bring all of it
into the process's RSS), so the server's RSS grows by those, not by the rollout. The experience
it makes is the head of that set, which the writer stores in the pieces' place (stored_value
keeps a staged head as it is) once it finds the rollout holds the pieces it was put together
from; a set no push stored is dropped (Pushing.drop_staged).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from ..disk import layout, piece_rows, residency
from ..disk.chunk_heads import CHUNK_BYTES
from ..disk.chunked import Staging
from ..disk.kinds import Entry, PutTogether
from ..rules import partial_assembly

if TYPE_CHECKING:
    from .pushing import Pushing

WINDOW = 2  # chunks of a rollout being put together that wait for the writer at once
RELEASE_BYTES = 32 << 20  # pieces read between two gives back of the map's pages


class _Pages:
    """The map's pages the pieces read bring into the RSS, given back every RELEASE_BYTES, in the
    read transaction (no resize moves the map meanwhile)."""

    def __init__(self, data: Path) -> None:
        self.data, self.read = data, 0

    def __call__(self, size: int) -> None:
        self.read += size
        if self.read >= RELEASE_BYTES:
            residency.release(self.data)
            self.read = 0


def put_together(
    pushing: Pushing, table: str, table_id: int, last: Entry, earlier: Sequence[Entry]
) -> tuple[Entry, int] | None:
    """The entry of the rollout that the last piece `last` finishes (after this push's `earlier`
    entries of its uid), put together off the writer as a staged chunk set, and that set; None
    where the rollout is not as planned, or changed while it was copied (the push goes on without,
    and the writer says what it finds)."""
    environment = pushing.environment
    db, key = environment.db, piece_rows.head_key(layout.table_prefix(table_id), last.uid)
    pages = _Pages(environment.path / "data.mdb")
    with environment.read(buffers=True) as txn:
        planned = partial_assembly.plan(txn, db, key, last, earlier, pages)
        pages(RELEASE_BYTES)
    if planned is None:
        return None
    staging = Staging(planned.prefix, planned.section_len)
    staging.set_id, staging.level = pushing.new_chunk_set(), pushing.zstd_level(table)
    writing: collections.deque[Future[None]] = collections.deque()
    done = False
    try:
        for index, at in enumerate(range(0, planned.section_len, CHUNK_BYTES)):
            chunk = bytearray(min(CHUNK_BYTES, planned.section_len - at))
            with environment.read(buffers=True) as txn:  # no snapshot held while the writer is waited for
                if not partial_assembly.read_section(txn, db, key, planned, at, chunk, pages):
                    return None
            while len(writing) >= WINDOW:
                writing.popleft().result()
            filled = memoryview(chunk)
            writing.append(pushing.stage(table, staging.set_id, index, filled, staging.level))
            staging.add(filled)
        while writing:
            writing.popleft().result()
        with environment.read(buffers=True):
            pages(RELEASE_BYTES)
        done = True
    finally:
        if not done:
            for pending in writing:
                pending.exception()
            pushing.drop_staged(table, [staging.set_id])
    made = Entry.staged(planned.item, staging.head(), staging.digest(), staging.size, planned.generated)
    return dataclasses.replace(made, piece=last.piece, together=PutTogether(last, planned.pieces)), staging.set_id
