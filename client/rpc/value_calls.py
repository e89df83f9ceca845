"""The calls of keyed values (PutValues, GetValues, ClearValues: bytes under names of the
caller's own, server/store/services/values.py), described as `Unary` calls (calls.py) for the
blocking and the asyncio client. Each is safe to retry: a put stores the same bytes again, a
clear of what is gone clears nothing."""

from __future__ import annotations

from collections.abc import Sequence

from expbuf.proto.v1 import buffer_pb2 as pb

from . import frames
from .calls import Unary


def put_values(keys: Sequence[str], values: Sequence[bytes], table: str) -> Unary[int]:
    """Store each value under its key, durable on return; a ValueError before the call when the
    two are not as many."""
    if len(keys) != len(values):
        raise ValueError(f"put_values: {len(keys)} keys for {len(values)} values, one value a key")
    return Unary("PutValues", frames.put_values_request(table, keys, values), lambda r: r.stored, retry=True)


def get_values(keys: Sequence[str], table: str) -> Unary[list[bytes | None]]:
    """The value of each key, in the order asked, None for one not stored."""
    asked = list(keys)

    def read(reply: pb.GetValuesReply) -> list[bytes | None]:
        missing = set(reply.missing_keys)
        found = iter(reply.values)
        return [None if key in missing else next(found) for key in asked]

    return Unary("GetValues", pb.GetValuesRequest(table=table, keys=asked), read, retry=True)


def clear_values(keys: Sequence[str], table: str) -> Unary[int]:
    """Remove the values of these keys; how many held one."""
    return Unary("ClearValues", pb.ClearValuesRequest(table=table, keys=list(keys)), lambda r: r.cleared, retry=True)
