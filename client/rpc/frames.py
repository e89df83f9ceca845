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


def _field(number: int, data: Bytes) -> list[Bytes]:
    """A length-delimited field (bytes, string), as the runs of bytes that make it."""
    return [varint(number << 3 | _LENGTH_DELIMITED) + varint(len(data)), data]


def _number(number: int, value: int) -> bytes:
    """A varint field (uint64); protobuf writes nothing for 0."""
    return varint(number << 3) + varint(value) if value else b""


def push_request(payload: Bytes, table: str = "", *, seq: int = 0, total_bytes: int = 0) -> bytes:
    """PushRequest(table=table, payload=payload, seq=seq, total_bytes=total_bytes), serialised."""
    runs = _field(1, table.encode()) if table else []
    if len(payload):
        runs += _field(2, payload)
    runs += [_number(3, seq), _number(4, total_bytes)]
    return b"".join(runs)


def put_values_request(table: str, keys: Sequence[str], values: Sequence[Bytes]) -> bytes:
    """PutValuesRequest(table=table, keys=keys, values=values), serialised."""
    runs = _field(1, table.encode()) if table else []
    for key in keys:
        runs += _field(2, key.encode())
    for value in values:
        runs += _field(3, value)
    return b"".join(runs)
