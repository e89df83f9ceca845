"""Stored one-item payloads whose tensor section lies in pieces.

The store keeps a large experience's tensor section out of line, in chunks of its own
(server/store/disk/chunked.py), so that neither a push nor a read holds the experience whole,
and hands the payload on as a `SplitPayload`: the bytes before the section and the section's
pieces, views of the store's map. The splice (build.join_parts) and the columns
(columns.column_parts) read such a payload as they read one in one piece and copy no byte of
it: a tensor is the runs of the pieces it spans, copied once, by whoever frames the reply.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from .common import HEADER, HEADER_SIZE, RawTensor

Run = bytes | memoryview


@dataclass(slots=True)
class SplitPayload:
    """A one-item payload as its head (the TRXP header, the metadata pickle and the safetensors
    header: everything before the tensor section) and its tensor section's pieces, in order."""

    head: Run
    pieces: list[Run]

    def __len__(self) -> int:
        return len(self.head) + sum(map(len, self.pieces))

    def runs(self) -> list[Run]:
        """The payload's bytes as runs, in order."""
        return [self.head, *self.pieces]

    def owned(self) -> SplitPayload:
        """The same bytes, copied out of whatever the views are views of."""
        return SplitPayload(bytes(self.head), [bytes(piece) for piece in self.pieces])


Stored = bytes | memoryview | SplitPayload
# A tensor section: one view, or the pieces of a SplitPayload's.
Section = memoryview | list[Run]


def parts_of(payload: Stored) -> tuple[memoryview, bytes, Section, int]:
    """A stored one-item payload's metadata pickle, safetensors header (its JSON text), tensor
    section and the section's length, read from its framing without a parse."""
    if isinstance(payload, SplitPayload):
        head = memoryview(payload.head)
        section: Section = payload.pieces
        section_len = sum(map(len, payload.pieces))
    else:
        head = memoryview(payload)
    _, _, meta_len, _ = HEADER.unpack_from(head)
    meta = head[HEADER_SIZE : HEADER_SIZE + meta_len]
    blob = head[HEADER_SIZE + meta_len :]
    (header_len,) = struct.unpack_from("<Q", blob)
    header = bytes(blob[8 : 8 + header_len])
    if not isinstance(payload, SplitPayload):
        section = blob[8 + header_len :]
        section_len = len(section)
    return meta, header, section, section_len


def section_at(payload: Run) -> int:
    """Where a one-item payload's tensor section starts, read from its framing (struct.error
    when it is too short to hold it)."""
    _, _, meta_len, _ = HEADER.unpack_from(payload)
    (header_len,) = struct.unpack_from("<Q", payload, HEADER_SIZE + meta_len)
    start: int = HEADER_SIZE + meta_len + 8 + header_len
    return start


def cut(section: Section, start: int, end: int) -> list[Run]:
    """The bytes `start` to `end` of a section, as views of the pieces they span."""
    if isinstance(section, memoryview):
        return [section[start:end]]
    runs: list[Run] = []
    at = 0
    for piece in section:
        after = at + len(piece)
        if after > start:
            view = piece if type(piece) is memoryview else memoryview(piece)
            runs.append(view[start - at if start > at else 0 : end - at])
            if after >= end:
                break
        at = after
    return runs or [b""]


def joined(runs: Sequence[Run]) -> Run:
    """Runs as one buffer: the run itself when there is one, else a copy of them end to end."""
    return runs[0] if len(runs) == 1 else b"".join(runs)


def whole(payload: Stored) -> Run:
    """A stored payload in one buffer (a SplitPayload copied end to end), for what parses it."""
    return b"".join(payload.runs()) if isinstance(payload, SplitPayload) else payload


class SectionTensors(Mapping[str, RawTensor]):
    """The tensors of a section in pieces, by name, each made when looked up: a tensor that
    spans pieces is copied into one buffer then, and only then (the server's advantages read an
    item's action mask, not the rest)."""

    def __init__(self, entries: dict[str, tuple[str, tuple[int, ...], int, int]], section: list[Run]) -> None:
        self._entries, self._section = entries, section

    def __getitem__(self, name: str) -> RawTensor:
        dtype, shape, start, end = self._entries[name]
        return RawTensor(dtype, shape, joined(cut(self._section, start, end)))

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
