"""Sample replies serialised once: a batch's bytes go into the reply as they are.

A sampled batch is megabytes of stored payloads. Built as a protobuf message and then
serialised, each byte would be copied into the message and again out of it; here the
reply's bytes are written directly (the payload field first, then the rest of the message,
which protobuf allows in any order), and `PassBytes` lets such bytes through gRPC's
serialiser untouched.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import grpc

from expbuf.client.trxp.columns import ColumnParts
from expbuf.proto.v1 import buffer_pb2 as pb

from ..store import Sampled
from ..store.disk.stored_advantages import send_apart
from ..store.schema.sample_spec import SampleSpec
from .interceptor import ServiceInterceptor

_PAYLOAD_TAG = b"\x0a"  # field 1 (payload), length-delimited
_COLUMN_TAG = b"\x62"  # SampleReply field 12 (columns), length-delimited
_VALUES_TAG = b"\x32"  # Column field 6 (values), length-delimited
# glibc's mallopt parameters, and what keep_reply_memory sets them to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 128 << 20


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def sample_reply(batch: Sampled, spec: SampleSpec, confirm_seconds: float) -> bytes:
    """The serialised SampleReply of a batch taken for `spec`, its payload copied once (from
    the store's map into the reply); the batch is released then, its payload is not read
    again. A table's batch stage runs here, on the RPC's thread (`Sampled.finish`), not in
    the store's write transaction. With `spec.compact_advantages`, advantages of one value
    per experience go beside the payload, not into it (store/stored_advantages.send_apart).
    `confirm_seconds`: how long the stream waits for its confirmation (rpc/sample_stream.py)."""
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
    try:
        if spec.fields:
            return batch.columns(spec.fields, lambda columns: b"".join([*_framed(columns), rest]))
        return batch.render(
            lambda parts: b"".join([_PAYLOAD_TAG, _varint(sum(len(part) for part in parts)), *parts, rest])
        )
    finally:
        batch.release()


def _framed(columns: list[ColumnParts]) -> list[bytes | memoryview]:
    """The reply's `columns` as the runs of bytes they are made of: each Column's small fields
    serialised by protobuf, its values written after them (protobuf reads fields in any order)
    as the stored bytes, which the caller's join copies once."""
    runs: list[bytes | memoryview] = []
    for column in columns:
        head = pb.Column(
            name=column.name, dtype=column.dtype, items=column.items, ndim=column.ndim, shapes=column.shapes
        ).SerializeToString()
        size = column.size
        values_head = _VALUES_TAG + _varint(size)
        runs += [_COLUMN_TAG, _varint(len(head) + len(values_head) + size), head, values_head, *column.values]
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
    """Replies that a method returns already serialised (bytes) go out as they are."""

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if not handler.stream_stream or method != "Sample":
            return handler
        return grpc.stream_stream_rpc_method_handler(
            handler.stream_stream, handler.request_deserializer, _pass_bytes(handler.response_serializer)
        )
