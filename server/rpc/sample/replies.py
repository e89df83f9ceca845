"""Sample replies serialised once: a batch's bytes go into the reply as they are.

A sampled batch is megabytes of stored payloads. Built as a protobuf message and then
serialised, each byte would be copied into the message and again out of it; here the
reply's bytes are written directly (the payload field first, then the rest of the message,
which protobuf allows in any order), and `PassBytes` lets such bytes through gRPC's
serialiser untouched.

A reply larger than one message (a group of long rollouts can pass gRPC's 2 GiB, and any
server's `max_message_bytes`) goes in parts (SampleReply.part): its runs of bytes are made
once and kept by the batch's snapshot (copied, should the snapshot have to end first), and
each part is cut from them as it is sent, under the snapshot only while it is cut, so the
server holds one part of the batch at a time, not the batch, while its client reads, and a slow
reader never holds the snapshot that a map resize waits for. A part its client is slow to take
(one that waits in gRPC's send stalled_sends.SNAPSHOT_SECONDS) lets go of the snapshot: the rest of
the reply is copied out of the map first, and held until the client reads it or the call ends.
Every message is a copy, so the snapshot ends before the last is sent.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar

import grpc

from expbuf.client.rpc.wire import ALIGN, ALIGN_TAG, COLUMN_TAG, PART_TAG, PAYLOAD_TAG, VALUES_TAG, WHOLE_TAG
from expbuf.client.trxp.stored.columns import ColumnParts
from expbuf.client.trxp.stored.pieces import Run, concatenated, realized_span
from expbuf.client.trxp.varints import write as varint
from expbuf.proto.v1 import buffer_pb2 as pb

from ...store import Sampled, send_apart
from ...store.schema.errors import ReplyLetGo
from ...store.schema.sample_spec import TakeSpec
from ..call_context import when_sent_slowly
from ..interceptors.base import ServiceInterceptor
from ..interceptors.reply_memory import Budget, reply_budget

# The tags of the fields written here (client/rpc/wire.py), as the bytes written.
_PAYLOAD, _COLUMN, _VALUES, _PAD, _PART, _WHOLE = (
    bytes((tag,)) for tag in (PAYLOAD_TAG, COLUMN_TAG, VALUES_TAG, ALIGN_TAG, PART_TAG, WHOLE_TAG)
)
PART_FRAMING = 32  # a part's tags and lengths: with them, a part's message is at most the limit
# The largest part: a reply over this goes in parts, for a client that takes them, so a stream
# holds about two parts of its batch (the one cut, and gRPC's copy of the one before).
PART_BYTES = 8 << 20
T = TypeVar("T")
# What a reply's runs of bytes are given to: the runs, and the bytes they add up to.
Cut = Callable[[list[Run], int], T]


class ReplyTooLarge(Exception):
    """A batch's reply is larger than one message, and the client cannot take it in parts."""


# glibc's mallopt parameters, and what keep_reply_memory sets them to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 128 << 20


def sample_reply(batch: Sampled, spec: TakeSpec, confirm_seconds: float, limit: int, parts: bool) -> Iterator[bytes]:
    """The messages of a batch taken for `spec`: its serialised SampleReply, its payload copied
    once (from the store's map into the reply), or, when the client takes `parts` and that is
    larger than `limit` bytes or PART_BYTES, the reply cut into parts of at most both
    (ReplyTooLarge when the client does not and it is larger than `limit`). The batch is
    released after the last, its payload is not read again. A table's batch stage runs here,
    on the RPC's thread (`Sampled.finish`), not in the store's write transaction. With
    `spec.compact_advantages`, advantages of one value per experience go beside the payload,
    not into it (store/stored_advantages.send_apart). `confirm_seconds`: how long the stream
    waits for its confirmation (rpc/sample/sample_stream.py)."""
    values: list[float] = []
    lengths: list[int] = []
    lease = spec.delivery == "lease"
    if spec.compact_advantages and not spec.fields:
        batch.finish()
        apart = send_apart(batch.advantages)
        if apart is not None:
            batch.advantages, values, lengths = apart
    rest = pb.SampleReply(
        uids=batch.uids,
        group_ids=batch.group_ids,
        lease_id=batch.lease_id if lease else "",
        lease_expires_unix=batch.lease_expires if lease else 0.0,
        partial=batch.partial,
        times_sampled=batch.times_sampled,
        advantages=values,
        response_lengths=lengths,
        confirm_seconds=confirm_seconds,
        lease_seconds=spec.lease_seconds if lease else 0.0,
    ).SerializeToString()

    return _messages(batch, partial(_render, batch, spec.fields, rest), limit, parts)


def fields_reply(
    batch: Sampled, fields: Sequence[str], missing: Sequence[str], limit: int, parts: bool
) -> Iterator[bytes]:
    """The messages of a ReadFields reply: the columns of `fields` of `batch` (Store.read_fields),
    or without fields its TRXP payload, and the `missing` uids, cut as sample_reply cuts a batch's."""
    rest = pb.SampleReply(uids=batch.uids, group_ids=batch.group_ids, missing_uids=missing).SerializeToString()

    return _messages(batch, partial(_render, batch, fields, rest), limit, parts)


def _render(batch: Sampled, fields: Sequence[str], rest: bytes, cut: Cut[T]) -> T:
    """`cut` of the whole reply's runs of bytes, valid only during the call: the columns of
    `fields`, or without fields the batch's TRXP payload, then `rest`."""
    if fields:
        return _columnar(batch, fields, rest, cut)
    return batch.render(partial(_payload_first, rest=rest, cut=cut))


def _payload_first(runs: list[Run], *, rest: bytes, cut: Cut[T]) -> T:
    """`cut` of a reply of a TRXP payload made of `runs`, written first, and `rest` (the reply's
    other fields, serialised); the payload's length is summed once, for its prefix and the whole."""
    size = sum(map(len, runs))
    head = varint(size)
    return cut([_PAYLOAD, head, *runs, rest], len(_PAYLOAD) + len(head) + size + len(rest))


def _columnar(batch: Sampled, fields: Sequence[str], rest: bytes, cut: Cut[T]) -> T:
    """`cut` of the runs of a columnar reply of `fields` of `batch`: its columns, `rest` (the
    reply's other fields, serialised), and the fields asked for that no column holds (no
    experience of the batch has them) as `missing_fields`."""

    def framed(columns: list[ColumnParts]) -> T:
        present = {column.name for column in columns}
        missing = [name for name in fields if name not in present]
        tail = pb.SampleReply(missing_fields=missing).SerializeToString() if missing else b""
        runs = [*_framed(columns), rest, tail]
        return cut(runs, sum(map(len, runs)))

    return batch.columns(fields, framed)


class _Built:
    """A reply's bytes built whole beforehand (a payload of rollouts put together from their
    pieces): nothing to keep readable, nothing to release."""

    snapshot = None

    @staticmethod
    def keep(runs: list[Run], charge: Callable[[int], bool] | None = None) -> list[Run]:
        return runs

    @staticmethod
    def read(use: Callable[[], T]) -> T:
        return use()

    @staticmethod
    def release() -> None:
        return None


def payload_reply(payload: bytes, missing: Sequence[str], limit: int, parts: bool) -> Iterator[bytes]:
    """The messages of a SampleReply of a TRXP `payload` made beforehand and `missing` uids
    (ReadPartials), cut as sample_reply cuts a batch's."""
    rest = pb.SampleReply(missing_uids=missing).SerializeToString()
    return _messages(_Built(), lambda cut: _payload_first([payload], rest=rest, cut=cut), limit, parts)


def _messages(
    batch: Sampled | _Built,
    render: Callable[[Cut[tuple[int, bytes]]], tuple[int, bytes]],
    limit: int,
    parts: bool,
) -> Iterator[bytes]:
    """The messages of a reply that `render` makes of `batch`: one, or, when the client takes
    `parts` and it is larger than `limit` bytes or PART_BYTES, parts of at most both
    (ReplyTooLarge when the client does not and it is larger than `limit`). Each message is a
    copy: the batch is released before the last is sent, and a part that waits in gRPC's send
    lets go of the batch's snapshot (`_Rest.let_go`)."""
    kept: list[_Rest] = []  # a reply in parts: the parts after the first
    budget = reply_budget()

    def first(runs: list[Run], whole: int) -> tuple[int, bytes]:
        if whole <= cut:
            return whole, concatenated(runs)
        if not parts:
            raise ReplyTooLarge(whole)
        kept.append(_Rest(batch, runs, whole, step, budget))
        return whole, _part(runs, start=0, end=step, whole=whole)

    cut = min(limit, PART_BYTES) if parts else limit
    step = cut - PART_FRAMING
    try:
        whole, message = render(first)
        for start in range(step, whole if whole > cut else 0, step):
            if batch.snapshot is not None:
                when_sent_slowly(kept[0].let_go)
            yield message
            message = kept[0].cut(start, min(start + step, whole))
        for rest in kept:
            rest.end()
        batch.release()  # the last message is a copy: nothing reads the batch's snapshot while it is sent
        yield message
    finally:
        for rest in kept:
            rest.end()
        batch.release()


class _Rest:
    """The parts of a reply after its first, cut from its runs of bytes as each is sent: kept by
    the batch's snapshot (copied, should the snapshot have to end first) and read under it, until
    a part waits in gRPC's send long (stalled_sends.SNAPSHOT_SECONDS: its client reads no more
    for now, a trainer's step perhaps): then what is still to send is copied out of the map and
    the snapshot ends (`let_go`), so a client slow to read keeps no page of the map from reuse, at
    the cost of holding the rest of its reply in memory until it reads it or its call ends. That
    memory is counted against the call's `budget` (interceptors/reply_memory.py); where it has no
    room, the rest stays in the map, read from the snapshot, and a later slow part tries again.
    The store's own copy, where it must end the snapshot first (a map resize, too many open), is
    counted so too; where it has no room, the rest is let go, and the next part's cut raises
    ReplyLetGo: the call ends, its batch back in the buffer."""

    def __init__(self, batch: Sampled | _Built, runs: list[Run], whole: int, sent: int, budget: Budget | None) -> None:
        self._batch, self._whole, self._budget = batch, whole, budget
        self._give_back: list[Callable[[], None]] = []  # what the budget counts of the copies
        self._at = 0  # where the first of the runs starts in the reply
        self._sent = sent  # where the part after the one being sent starts
        self._lock = threading.Lock()  # the reply's thread cuts parts, the watch's lets go
        self._counting = threading.Lock()  # what the budget counts: taken alone, by a store's detach too
        self._own = False  # the runs are a copy of the rest: the snapshot is released
        self._ended = False  # the reply's last part is cut, or the reply failed: nothing to let go of
        self._runs = batch.keep(list(runs), self._charge)

    def cut(self, start: int, end: int) -> bytes:
        """The part of the reply's bytes `start` to `end`."""
        with self._lock:
            self._sent = end
            at = self._at
            if self._own:
                return _part(self._runs, start=start - at, end=end - at)
            return self._batch.read(partial(_part, self._runs, start=start, end=end))

    def let_go(self) -> None:
        """Copy the bytes still to send out of the map, and end the batch's snapshot; not where
        the call's budget has no room for them."""
        with self._lock:
            if self._own or self._ended:
                return
            if not self._charge(self._whole - self._sent):
                return
            try:
                rest = self._batch.read(lambda: b"".join(_span(self._runs, self._sent, self._whole)))
            except ReplyLetGo:  # the store let the rest go: the next cut ends the call
                with self._counting:
                    give_back = self._give_back.pop()
                give_back()
                return
            self._runs, self._at, self._own = [rest], self._sent, True
            self._batch.release()

    def end(self) -> None:
        """The last part is cut, or the reply failed: the copy goes, and what its budget counted."""
        with self._lock, self._counting:
            self._ended = True
            if self._own:
                self._runs = []
            given, self._give_back = self._give_back, []
        for give_back in given:
            give_back()

    def _charge(self, size: int) -> bool:
        """Count a copy of `size` bytes of the reply against the call's budget, until the reply
        ends; False where it has no room (nothing counted). The store's detach charges its copy
        here too, holding the snapshot's lock, not this one's."""
        if self._budget is None:
            return True
        with self._counting:
            if self._ended:  # the reply is sent: its snapshot ends without it
                return True
            give_back = self._budget(size, strict=True)
            if give_back is not None:
                self._give_back.append(give_back)
            return give_back is not None


def _part(runs: list[Run], *, start: int, end: int, whole: int = 0) -> bytes:
    """A SampleReply of the bytes `start` to `end` of the runs put end to end, as its `part`
    (and, for the first, the `whole_bytes` they add up to): copied once, into the message."""
    pieces: list[bytes | memoryview] = [_WHOLE, varint(whole)] if whole else []
    return b"".join([*pieces, _PART, varint(end - start), *_span(runs, start, end)])


def _span(runs: list[Run], start: int, end: int) -> list[bytes | memoryview]:
    """The bytes `start` to `end` of the runs put end to end, as views or reads of them."""
    pieces: list[bytes | memoryview] = []
    at = 0
    for run in runs:
        size = len(run)
        if at + size > start:
            pieces.append(realized_span(run, max(0, start - at), min(size, end - at)))
        at += size
        if at >= end:
            break
    return pieces


def _framed(columns: list[ColumnParts]) -> list[Run]:
    """The reply's `columns`, written first, as the runs of bytes they are made of: each
    Column's small fields serialised by protobuf, its values written after them (protobuf reads
    fields in any order) as the stored bytes, which the caller's join copies once, each
    starting at a multiple of ALIGN bytes from the reply's start (the `align` field's zeros
    before them), so a client reads them in place as tensors."""
    runs: list[Run] = []
    at = 0  # where the next column starts in the reply
    for column in columns:
        head = pb.Column(
            name=column.name, dtype=column.dtype, items=column.items, ndim=column.ndim, shapes=column.shapes
        ).SerializeToString()
        size = column.size
        values_head = _VALUES + varint(size)
        pad = b""
        for _ in range(3):  # a longer pad may lengthen the column's own length prefix: settle it
            body = len(head) + len(pad) + len(values_head) + size
            start = at + len(_COLUMN) + len(varint(body)) + len(head) + len(pad) + len(values_head)
            if start % ALIGN == 0:
                break
            width = len(pad) + -start % ALIGN
            width += ALIGN if width < 2 else 0  # the field's tag and length take two bytes
            pad = _PAD + varint(width - 2) + bytes(width - 2)
        column_head = _COLUMN + varint(body)
        runs += [column_head, head, pad, values_head, *column.values]
        at += len(column_head) + body
    return runs


def keep_reply_memory() -> bool:
    """Keep the memory of one batch's reply for the next (glibc's malloc). A reply of
    megabytes is allocated, copied by gRPC and freed batch after batch; given back to the
    system each time, as glibc does with blocks this large, every batch faults in fresh
    pages: about 3 ms per 10 MB copied here, as long as the copy itself. Blocks up to
    32 MB then come from the heap, and up to 128 MB freed at its top stays there. False
    where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def _pass_bytes(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    if serialize is None:
        return None
    return lambda reply: reply if isinstance(reply, bytes) else serialize(reply)


class PassBytes(ServiceInterceptor):
    """Replies that a streaming method yields already serialised (bytes: Sample's, ReadFields',
    ReadPartials') go out as they are; the others are serialised as usual."""

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                handler.stream_stream, handler.request_deserializer, _pass_bytes(handler.response_serializer)
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                handler.unary_stream, handler.request_deserializer, _pass_bytes(handler.response_serializer)
            )
        return handler
