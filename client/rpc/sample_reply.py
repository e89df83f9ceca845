"""Sample replies read with one copy of their payload.

A batch is megabytes. Read as a protobuf message, its payload would be copied from gRPC's
bytes into the message and again out of it into the `bytes` a Batch holds; here the payload
field, which the server writes first (as protobuf's own serialiser does, field 1 first), is
cut from gRPC's bytes at once, and only the rest of the message is parsed. Anything else (no
payload first, a payload field repeated later, a malformed length) is read as a whole message,
as before.

A columnar reply (the server writes its columns first) is kept as one writable buffer, copied
once from gRPC's bytes (not at all when it came in parts, which are put together in one), and
each column's values are a view of it, at a multiple of 64 bytes from its start: the client's
tensors are made on those views, with no copy of their own.

A batch too large for one message comes in parts (SampleReply.part: the whole reply's bytes
cut in order, the first part saying how many there are in all); `Parts` puts them back
together, and the whole is read as any reply is.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from typing import Any, NamedTuple

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from ..errors import DataLossError
from ..trxp.varints import read as _varint
from .wire import ALIGN, COLUMN_TAG, PART_TAG, PAYLOAD_TAG, VALUES_TAG, WHOLE_TAG

SAMPLE_METHOD = "/expbuf.v1.ExperienceBuffer/Sample"
# The calls of one request answered by a stream of SampleReply, one reply in one message or in
# parts: the method and its request's type.
PARTS_METHODS: dict[str, type[Any]] = {"ReadFields": pb.ReadFieldsRequest, "ReadPartials": pb.GetPartialsRequest}


class SampleReplyParts(NamedTuple):
    """A SampleReply as its payload and the rest of the message (whose payload is empty); for
    a part of a reply in parts, its bytes as a view of the message (`part`), not copied; for a
    columnar reply read in place, each column's values as a writable view (`values`, in the
    order of `rest.columns`, whose own values are empty)."""

    payload: bytes
    rest: pb.SampleReply
    part: memoryview | None = None
    values: tuple[memoryview, ...] | None = None


def read_sample_reply(raw: bytes | memoryview) -> SampleReplyParts:
    """The parts of a serialised SampleReply, its payload copied once (a part's, not at all)."""
    first = raw[0] if len(raw) else None
    if first in (WHOLE_TAG, PART_TAG):  # a part: [whole_bytes,] part, as the server writes it
        head = _varint(raw, 1) if first == WHOLE_TAG else (0, 0)
        if head is not None and head[1] < len(raw) and raw[head[1]] == PART_TAG:
            length = _varint(raw, head[1] + 1)
            if length is not None and length[0] + length[1] == len(raw):
                return SampleReplyParts(b"", pb.SampleReply(whole_bytes=head[0]), memoryview(raw)[length[1] :])
    if first == COLUMN_TAG:
        buffer = raw if isinstance(raw, memoryview) and not raw.readonly else aligned(raw)
        columnar = _columns_in_place(buffer)
        if columnar is not None:
            return columnar
    if first == PAYLOAD_TAG and (length := _varint(raw, 1)) is not None:
        size, at = length
        end = at + size
        if end <= len(raw):
            rest = pb.SampleReply.FromString(bytes(raw[end:]))
            if not rest.payload:  # a later payload field would replace this one: the last one wins
                return SampleReplyParts(bytes(raw[at:end]), rest)
    whole = pb.SampleReply.FromString(bytes(raw))
    payload = whole.payload
    whole.ClearField("payload")
    return SampleReplyParts(payload, whole)


def aligned(data: bytes | memoryview | int) -> memoryview:
    """A writable buffer that starts at a multiple of ALIGN bytes in memory: a copy of `data`, or
    of that size (its bytes to be written). The server aligns each column's values to ALIGN from
    the reply's start, so in such a buffer their tensors are aligned in memory too."""
    size = data if isinstance(data, int) else len(data)
    view = _BUFFERS.take(size) if size >= ReplyBuffers.LEAST else _fresh(size)
    if not isinstance(data, int):
        view[:] = data
    return view


def _fresh(size: int) -> memoryview:
    space = bytearray(size + ALIGN)
    shift = -ctypes.addressof(ctypes.c_char.from_buffer(space)) % ALIGN
    return memoryview(space)[shift : shift + size]


class ReplyBuffers:
    """Buffers of large replies, used again once nothing holds them. A fresh buffer of 64 MiB
    costs about 27 ms of page faults and zeroing before a byte is copied into it, the copy into
    one already used about 3 ms: a trainer's batches of long rollouts come one after another,
    each one's buffer let go (with its tensors) before the next but one. A buffer is free once
    only this pool refers to it: a tensor or view made on it holds it. The process keeps those
    it holds (KEPT_BYTES at most) between streams too."""

    # Smaller buffers are fresh each time: glibc's malloc keeps freed blocks up to 32 MiB for the
    # next (its mmap threshold rises to the size freed), a larger one it maps anew each time.
    LEAST = 32 << 20
    KEPT = 3  # buffers kept at most: the batch in the caller's hands, the one decoded ahead, the next
    KEPT_BYTES = 1 << 30

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[mmap.mmap] = []

    def take(self, size: int) -> memoryview:
        """A buffer of `size` bytes aligned to ALIGN (its earlier bytes are not cleared)."""
        with self._lock:
            for space in self._kept:
                if size + ALIGN <= len(space) <= 2 * size + ALIGN and sys.getrefcount(space) <= _FREE:
                    break
            else:
                # private: a forked process (a data loader's worker) writes its own copy of a page, never ours
                space = mmap.mmap(-1, size + ALIGN, mmap.MAP_PRIVATE)  # page-aligned: ALIGN divides the page
                self._kept.append(space)
                while len(self._kept) > self.KEPT or sum(map(len, self._kept)) > self.KEPT_BYTES:
                    self._kept.pop(0)  # no longer kept: gone once its holders let it go
            return memoryview(space)[:size]


# The references to a free buffer while take() looks at it: the pool's list, the loop's name and
# getrefcount's own argument.
_FREE = 3
_BUFFERS = ReplyBuffers()


def _columns_in_place(raw: memoryview) -> SampleReplyParts | None:
    """A reply whose columns come first, as the server writes them: each column's values a view
    of `raw`, its other fields and the rest of the reply parsed by protobuf. None for any other
    layout, which is then read as a whole message."""
    heads: list[bytes] = []
    values: list[memoryview] = []
    at = 0
    while at < len(raw) and raw[at] == COLUMN_TAG:
        length = _varint(raw, at + 1)
        if length is None or length[0] + length[1] > len(raw):
            return None
        fields = _values_apart(raw, length[1], length[0] + length[1])
        if fields is None:
            return None
        heads.append(fields[0])
        values.append(fields[1])
        at = length[0] + length[1]
    rest = pb.SampleReply.FromString(bytes(raw[at:]))
    if rest.columns or rest.payload:
        return None
    rest.columns.extend(pb.Column.FromString(head) for head in heads)
    return SampleReplyParts(b"", rest, values=tuple(values))


def _values_apart(raw: memoryview, start: int, end: int) -> tuple[bytes, memoryview] | None:
    """A Column message's fields but its values (as bytes, to parse), and its values (a view);
    None where the message does not parse."""
    head = bytearray()
    values = raw[start:start]
    at = start
    while at < end:
        key = _varint(raw, at)
        if key is None:
            return None
        tag, body = key
        kind, data = tag & 7, body
        if kind == 0:
            number = _varint(raw, body)
            if number is None:
                return None
            after = number[1]
        elif kind == 2:
            length = _varint(raw, body)
            if length is None:
                return None
            data, after = length[1], length[1] + length[0]
        elif kind in (1, 5):
            after = body + (8 if kind == 1 else 4)
        else:
            return None
        if after > end:
            return None
        if tag == VALUES_TAG:
            values = raw[data:after]  # a later one replaces it, as protobuf reads it
        else:
            head += raw[at:after]
        at = after
    return bytes(head), values


class Parts:
    """The replies of one stream as whole replies: one in a message passes as it is, and one in
    parts is put together in a buffer of its size, each part copied once. A stream whose parts
    do not add up (a server's fault) raises DataLossError: the stream ends, and its batches
    not confirmed return to the buffer."""

    def __init__(self) -> None:
        self._whole: memoryview | None = None
        self._filled = 0

    def add(self, reply: SampleReplyParts) -> SampleReplyParts | None:
        """The whole reply that `reply` is or completes; None while parts of it are to come."""
        rest = reply.rest
        part = reply.part if reply.part is not None else rest.part
        if not part and not rest.whole_bytes:
            if self._whole is not None:
                self._broken(f"a whole reply came {self._filled} bytes into a reply of {len(self._whole)} in parts")
            return reply
        if rest.whole_bytes:
            if self._whole is not None:
                self._broken(f"a reply in parts began {self._filled} bytes into one of {len(self._whole)}")
            self._whole, self._filled = aligned(rest.whole_bytes), 0
        elif self._whole is None:
            self._broken("a part came that no first part (whole_bytes) began")
        whole = self._whole
        assert whole is not None
        end = self._filled + len(part)
        if end > len(whole):
            self._broken(f"its parts add up to {end} bytes, past the whole reply's {len(whole)}")
        whole[self._filled : end] = part
        self._filled = end
        if end < len(whole):
            return None
        self._whole = None
        return read_sample_reply(whole)

    def end(self) -> None:
        """The stream ended: None, unless a reply in parts was cut short."""
        if self._whole is not None:
            self._broken(f"the stream ended {self._filled} bytes into a reply of {len(self._whole)} in parts")

    def _broken(self, what: str) -> None:
        self._whole = None
        raise DataLossError(grpc.StatusCode.DATA_LOSS, f"a reply in parts is broken: {what}")


def sample_method(channel: Any) -> Any:
    """The Sample stream of `channel` (blocking or asyncio) with replies read by read_sample_reply."""
    return channel.stream_stream(
        SAMPLE_METHOD,
        request_serializer=pb.SampleRequest.SerializeToString,
        response_deserializer=read_sample_reply,
    )


def parts_method(channel: Any, name: str) -> Any:
    """The call `name` of PARTS_METHODS on `channel` (blocking or asyncio), its replies read as Sample's."""
    return channel.unary_stream(
        f"/expbuf.v1.ExperienceBuffer/{name}",
        request_serializer=PARTS_METHODS[name].SerializeToString,
        response_deserializer=read_sample_reply,
    )
