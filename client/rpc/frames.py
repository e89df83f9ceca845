"""The requests that carry large bytes (Push, PushStream's messages, PutValues), written by hand:
the very bytes protobuf makes of the same message, with each payload copied once, into the request.

A protobuf message copies a payload into its arena when it is made and out again when gRPC
serialises it, and the arena's fresh pages fault in each time: a 1 MiB push cost its client
about 2.5 ms of CPU that way, where writing the request around the payload costs one copy
(bench/bench_push_frames.py). The stubs of these methods take the bytes as they are
(connection.FRAMED_METHODS); the server reads them as any PushRequest or PutValuesRequest.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..trxp.varints import write as varint

Bytes = bytes | bytearray | memoryview
_LENGTH_DELIMITED = 2
_MOST = 2**64 - 1  # the largest uint64: a varint field's longest


def _head(number: int, length: int) -> bytes:
    """A length-delimited field's key and length."""
    return varint(number << 3 | _LENGTH_DELIMITED) + varint(length)


def _field(number: int, data: Bytes) -> list[Bytes]:
    """A length-delimited field (bytes, string), as the runs of bytes that make it."""
    return [_head(number, len(data)), data]


def _number(number: int, value: int) -> bytes:
    """A varint field (uint64); protobuf writes nothing for 0."""
    return varint(number << 3) + varint(value) if value else b""


def push_request(payload: Bytes, table: str = "", *, seq: int = 0, total_bytes: int = 0, offset: int = 0) -> bytes:
    """PushRequest(table=table, payload=payload, seq=seq, total_bytes=total_bytes, offset=offset), serialised."""
    runs = _field(1, table.encode()) if table else []
    if len(payload):
        runs += _field(2, payload)
    runs += [_number(3, seq), _number(4, total_bytes), _number(5, offset)]
    return b"".join(runs)


def most_push_request(payload_bytes: int, table: str) -> int:
    """The most bytes a PushRequest for `table` with a payload of `payload_bytes` takes, whatever its
    seq and total_bytes: what a PushStream of such messages declares (wire.MESSAGE_BYTES). A chunk
    after a push's first sets its offset alone, no larger than the first's total_bytes."""
    return len(push_request(b"", table, seq=_MOST, total_bytes=_MOST)) + len(_head(2, payload_bytes)) + payload_bytes


def put_values_request(table: str, keys: Sequence[str], values: Sequence[Bytes]) -> bytes:
    """PutValuesRequest(table=table, keys=keys, values=values), serialised."""
    runs = _field(1, table.encode()) if table else []
    for key in keys:
        runs += _field(2, key.encode())
    for value in values:
        runs += _field(3, value)
    return b"".join(runs)
