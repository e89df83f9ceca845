"""Stored one-item payloads whose tensor section lies in pieces.

The store keeps a large experience's tensor section out of line, in chunks of its own
(server/store/disk/chunked.py), so that neither a push nor a read holds the experience whole,
and hands the payload on as a `SplitPayload`: the bytes before the section and the section's
pieces, views of the store's map. The splice (splice.join_parts) and the columns
(columns.column_parts) read such a payload as they read one in one piece and copy no byte of
it: a tensor is the runs of the pieces it spans, copied once, by whoever frames the reply.

A piece may also be a `Window` of bytes made only when read (a chunk a table keeps as a zstd
frame, decompressed as the part of a reply that holds it is cut): the splice and the columns cut
windows as they cut views, and whatever reads bytes reads a run through `realized`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar, final, overload

from ..codec.common import HEADER, HEADER_SIZE, RawTensor

# Final, as what `located` reads for each item of a reply of columns: compiled, a Final name is a C
# static, where any other module name is a lookup in the module's dict.
_LENGTH: Final = struct.Struct("<Q")  # a safetensors header's length
_META_LENGTH: Final = struct.Struct("<5xQ")  # HEADER's metadata length, read alone
_HEADER_SIZE: Final[int] = HEADER_SIZE
# The memoryview type, asked of each stored item (`type(x) is VIEW`): the builtin's name is a lookup
# in the builtins module at each use (about 270 instructions), a Final one a C static.
VIEW: Final = memoryview

Bytes = bytes | memoryview
T = TypeVar("T")


class Lazy(Protocol):
    """Bytes made only when read (server/store/disk/chunk_reads.Frame)."""

    def __len__(self) -> int: ...

    def read(self, start: int, end: int) -> Bytes:
        """Its bytes `start` to `end`."""
        ...

    def detach(self) -> Lazy:
        """The same bytes, no longer reading from whatever they are read from now."""
        ...


@final
@dataclass(slots=True)
class Window:
    """Bytes `start` to `end` of a Lazy, made when read."""

    source: Lazy
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    def read(self) -> Bytes:
        return self.source.read(self.start, self.end)

    def detach(self) -> Window:
        self.source = self.source.detach()
        return self


Run = bytes | memoryview | Window


def realized(run: Run) -> Bytes:
    """A run's bytes: a Window read now."""
    return run.read() if isinstance(run, Window) else run


def concatenated(runs: Iterable[Run]) -> bytes:
    """Runs end to end, copied into one bytes (a Window read as it comes): no call for each run, where a
    reply of thousands of them would spend more on the calls than on the copy, and `type(run) is`, as
    `isinstance` of a run that is not one looks up its `__class__` (some 500 instructions)."""
    return b"".join([run.read() if type(run) is Window else run for run in runs])


def realized_span(run: Run, start: int, end: int) -> Bytes:
    """A run's bytes `start` to `end`, read now (of a Window, those alone)."""
    if isinstance(run, Window):
        return run.source.read(run.start + start, run.start + end)
    return (run if type(run) is memoryview else memoryview(run))[start:end]


@final
@dataclass(slots=True)
class SplitPayload:
    """A one-item payload as its head (the TRXP header, the metadata pickle and the safetensors
    header: everything before the tensor section) and its tensor section's pieces, in order."""

    head: Bytes
    pieces: list[Run]

    def __len__(self) -> int:
        return len(self.head) + sum(map(len, self.pieces))

    def runs(self) -> list[Run]:
        """The payload's bytes as runs, in order."""
        return [self.head, *self.pieces]

    def owned(self) -> SplitPayload:
        """The same bytes, copied out of whatever the views are views of (a Window detached, not read)."""
        return SplitPayload(bytes(self.head), [_owned(piece) for piece in self.pieces])


def _owned(piece: Run) -> Run:
    return piece.detach() if isinstance(piece, Window) else bytes(piece)


Stored = bytes | memoryview | SplitPayload
# A tensor section: one view, or the pieces of a SplitPayload's.
Section = memoryview | list[Run]


def parts_of(payload: Stored) -> tuple[memoryview, bytes, Section, int]:
    """A stored one-item payload's metadata pickle, safetensors header (its JSON text), tensor
    section and the section's length, read from its framing without a parse."""
    header, section, section_len, at = located(payload)
    head = payload.head if type(payload) is SplitPayload else payload
    return memoryview(head)[HEADER_SIZE:at], header, section, section_len


def located(payload: Stored) -> tuple[bytes, Section, int, int]:
    """parts_of() but the metadata pickle, which a reply of columns does not read: the header, the
    section and its length, and where the pickle ends."""
    head = payload.head if type(payload) is SplitPayload else payload
    view = head if type(head) is VIEW else memoryview(head)
    meta_len: int
    header_len: int
    (meta_len,) = _META_LENGTH.unpack_from(view)
    at = _HEADER_SIZE + meta_len
    try:
        (header_len,) = _LENGTH.unpack_from(view, at)
    except OverflowError as error:  # past any buffer, as past the end of this one
        raise struct.error(f"no safetensors header length at {at}") from error
    start = at + 8 + header_len
    header = bytes(view[at + 8 : start])
    if type(payload) is SplitPayload:
        return header, payload.pieces, sum(map(len, payload.pieces)), at
    section = view[start:]
    return header, section, len(section), at


def section_at(payload: Bytes) -> int:
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
            low, high = start - at if start > at else 0, min(end - at, len(piece))
            if isinstance(piece, Window):
                runs.append(Window(piece.source, piece.start + low, piece.start + high))
            else:
                runs.append((piece if type(piece) is memoryview else memoryview(piece))[low:high])
            if after >= end:
                break
        at = after
    return runs or [b""]


def joined(runs: Sequence[Run]) -> Bytes:
    """Runs as one buffer: the run itself (read) when there is one, else a copy of them end to end."""
    return realized(runs[0]) if len(runs) == 1 else concatenated(runs)


def whole(payload: Stored) -> Bytes:
    """A stored payload in one buffer (a SplitPayload copied end to end), for what parses it."""
    return concatenated(payload.runs()) if isinstance(payload, SplitPayload) else payload


class SectionTensors(Mapping[str, RawTensor]):
    """The tensors of a section by name (`entries`: dtype, shape, start and end of each, read once a
    batch for each header), each made when looked up, a view of the section or, for a tensor that
    spans its pieces, copied into one buffer then, and only then: the server's advantages read an
    item's action mask, not the rest, and a tensor made for each would cost each item more."""

    __slots__ = ("_entries", "_section")

    def __init__(self, entries: dict[str, tuple[str, tuple[int, ...], int, int]], section: Section) -> None:
        self._entries, self._section = entries, section

    def __getitem__(self, name: str) -> RawTensor:
        dtype, shape, start, end = self._entries[name]
        return RawTensor(dtype, shape, joined(cut(self._section, start, end)))

    @overload
    def get(self, name: str, /) -> RawTensor | None: ...

    @overload
    def get(self, name: str, /, default: RawTensor | T) -> RawTensor | T: ...

    def get(self, name: str, /, default: object = None) -> object:
        """Mapping's get, without its KeyError for a tensor the item does not have (its action mask)."""
        return self[name] if name in self._entries else default

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
