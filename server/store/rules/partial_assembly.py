"""A LARGE rollout held in pieces (partials.py) put together off the writer: the writer, its checks
passed, asks for it (partials.OffWriter), the push reads the pieces from snapshots (`plan`,
`read_section`) into a staged chunk set as a push in chunks stages a large experience
(services/assembly.py), and the writer then stores that experience in their place, once it finds
the rollout holds the pieces it was put together from (`PutTogether`): no transaction holds the
rollout whole, nor the writer for its copy.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import lmdb

from expbuf.client.trxp.codec import partial
from expbuf.client.trxp.codec.build import pack_head
from expbuf.client.trxp.codec.common import RawItem, RawTensor, TrxpError, count_nonzero
from expbuf.client.trxp.codec.parse import head_length, parse, parse_head
from expbuf.client.trxp.stored.pieces import Bytes

from ..disk import piece_rows
from ..disk.kinds import Entry
from ..schema.errors import InvalidPayload, clip
from . import partials

# A span of a rollout's section as it is put together: the piece it is read from (a stored piece's
# number, or the payload of one of the push's own), and where in that piece's payload.
Span = tuple[int | Bytes, int, int]


@dataclass(frozen=True)
class Plan:
    """A LARGE rollout to be put together off the writer, as read from a snapshot: the head it was
    read with (which must not change while its section is copied), the pieces it is put together
    from as the head will list them, its payload up to its tensor section (pack_head), that
    section's spans in order (and where each ends in it), the experience it makes (its tensors'
    data left out), checked as a push checks one, and that experience's response tokens under its
    action mask."""

    head: bytes
    pieces: tuple[tuple[int, str, int], ...]
    prefix: list[bytes | memoryview]
    spans: list[Span]
    ends: list[int]
    item: RawItem
    generated: int

    @property
    def section_len(self) -> int:
        return self.ends[-1] if self.ends else 0


def plan(
    txn: lmdb.Transaction[memoryview],
    dbs: Mapping[str, lmdb._Database],
    key: bytes,
    last: Entry,
    earlier: Sequence[Entry],
    read: Callable[[int], None],
) -> Plan | None:
    """How to put together the rollout that the last piece `last` finishes, its head under `key`,
    after this push's `earlier` entries of the same uid (pieces the writer stores before it), from
    a read transaction: pieces' heads parsed, their tensors' data left where it is (`read(size)`
    hears of each stored piece read, for its pages in the map), each stored piece checked against
    its head (DamagedPiece where one is lost or damaged). None where the rollout is not as the
    writer will find it (gone, or not at the last piece's offset: the writer says why);
    InvalidPayload where the rollout put together is refused."""
    raw = piece_rows.head_raw(txn, dbs, key)
    head_raw = b"" if raw is None else bytes(raw)  # none stored: its first piece is the push's
    head = None if raw is None else piece_rows.decoded(head_raw, last.uid)
    sources: list[tuple[int | Bytes, int, dict[str, tuple[int, int]]]] = []  # (piece, data start, spans)
    hollow: list[RawItem] = []
    masked = 0
    if head is not None:
        for number in range(len(head.pieces)):
            blob = piece_rows.checked(txn, dbs, key, last.uid, head, number)
            masked += _hollow(number, blob, sources, hollow)
            read(len(blob))
    for piece in [*earlier, last]:
        if piece.piece is None:  # pushed whole before it: the pieces it replaces are gone
            return None
        offset, tokens = piece.piece[0], 0 if head is None else head.tokens
        if head is not None and offset < tokens and (offset, piece.digest.hex(), piece.size) in head.pieces:
            continue  # sent again: the writer takes it as a duplicate
        if offset != tokens:
            return None
        (item,) = parse(piece.blob, trusted=True)
        versions = partials.follows(piece.uid, head, item)
        masked += _hollow(piece.blob, piece.blob, sources, hollow)
        if piece is not last:
            head = partials.head_grown(head, piece, item, versions)
    if head is None:  # no rollout to finish: the writer says so
        return None
    merged = partial.merge(hollow)
    prefix, order = pack_head(merged)
    section: list[Span] = []
    for name in order:
        for source, start, places in sources if name in head.layout else sources[:1]:
            low, high = places[name]
            section.append((source, start + low, start + high))
    ends = list(itertools.accumulate(end - start for _, start, end in section))
    size = sum(map(len, prefix)) + (ends[-1] if ends else 0)
    try:
        (checked,), _ = parse_head(b"".join(prefix), size, received=size)
    except TrxpError as exc:
        where = f"rollout {clip(last.uid)}, piece at token {head.tokens}"
        raise InvalidPayload(f"{where}: the rollout put together is refused: {exc}") from None
    generated = masked if "action_mask" in merged.tensors else checked.response_length
    pieces = tuple((offset, digest, size) for offset, digest, size in head.pieces)
    return Plan(head_raw, pieces, prefix, section, ends, checked, generated)


def _hollow(
    source: int | Bytes,
    blob: Bytes,
    sources: list[tuple[int | Bytes, int, dict[str, tuple[int, int]]]],
    hollow: list[RawItem],
) -> int:
    """A piece's payload read for a plan: its item with its tensors' data left out (onto `hollow`),
    where each tensor's data lies in it (onto `sources`); returns its action mask's tokens set."""
    view = memoryview(blob)
    start = head_length(view, len(view))
    (item,), places = parse_head(view[:start], len(view), received=len(view))
    spans = {name: (low, high) for low, high, _, name in places}
    sources.append((source, start, spans))
    hollow.append(RawItem(item.meta, {name: RawTensor(t.dtype, t.shape, b"") for name, t in item.tensors.items()}))
    mask = item.tensors.get("action_mask")
    if mask is None:
        return 0
    low, high = spans["action_mask"]
    return count_nonzero(RawTensor(mask.dtype, mask.shape, view[start + low : start + high]))


def read_section(
    txn: lmdb.Transaction[memoryview],
    dbs: Mapping[str, lmdb._Database],
    key: bytes,
    planned: Plan,
    at: int,
    out: bytearray,
    read: Callable[[int], None],
) -> bool:
    """Fill `out` with the planned rollout's section from byte `at`, its stored pieces read in this
    transaction (`read(size)` hears of each); False, `out` unfilled, where the rollout's head is not
    the one planned from (its pieces changed)."""
    raw = piece_rows.head_raw(txn, dbs, key)
    if (b"" if raw is None else bytes(raw)) != planned.head:
        return False
    index = bisect.bisect_right(planned.ends, at)
    filled = 0
    blobs: dict[int, Bytes] = {}
    while filled < len(out) and index < len(planned.spans):
        source, start, end = planned.spans[index]
        begin = planned.ends[index] - (end - start)  # the span's place in the section
        skip = at + filled - begin
        take = min(end - start - skip, len(out) - filled)
        if isinstance(source, int):
            if source not in blobs:
                found = piece_rows.piece(txn, dbs, key, source)
                if found is None:
                    return False
                blobs[source] = found
                read(len(found))
            blob = blobs[source]
        else:
            blob = source
        out[filled : filled + take] = memoryview(blob)[start + skip : start + skip + take]
        filled += take
        index += 1
    return filled == len(out)
