"""The calls of keyed values (PutValues, GetValues, ClearValues: bytes under names of the
caller's own, server/store/services/values.py), described as `Unary` calls (calls.py) for the
blocking and the asyncio client. Each is safe to retry: a put stores the same bytes again, a
clear of what is gone clears nothing."""

from __future__ import annotations

from collections.abc import Sequence

from expbuf.proto.v1 import buffer_pb2 as pb

from ..schema.call_limits import MAX_KEYS_PER_CALL, in_parts
from . import frames
from .calls import Several, Unary


def put_values(keys: Sequence[str], values: Sequence[bytes], table: str) -> Several[int, int]:
    """Store each value under its key, durable on return, MAX_KEYS_PER_CALL a call (each call all or
    none); a ValueError before the call when the two are not as many."""
    if len(keys) != len(values):
        raise ValueError(f"put_values: {len(keys)} keys for {len(values)} values, one value a key")
    most = MAX_KEYS_PER_CALL
    requests = [
        frames.put_values_request(table, keys[start : start + most], values[start : start + most])
        for start in (range(0, len(keys), most) if keys else range(1))
    ]
    return Several([Unary("PutValues", request, lambda r: r.stored, retry=True) for request in requests], sum)


def get_values(keys: Sequence[str], table: str, only_own: bool = False) -> Unary[list[bytes | None]]:
    """The value of each key, in the order asked, None for one not stored; with `only_own`,
    refused (PERMISSION_DENIED) for a key whose value another token wrote."""
    asked = list(keys)

    def read(reply: pb.GetValuesReply) -> list[bytes | None]:
        missing = set(reply.missing_keys)
        found = iter(reply.values)
        return [None if key in missing else next(found) for key in asked]

    return Unary("GetValues", pb.GetValuesRequest(table=table, keys=asked, only_own=only_own), read, retry=True)


def clear_values(keys: Sequence[str], table: str) -> Several[int, int]:
    """Remove the values of these keys, MAX_KEYS_PER_CALL a call; how many held one."""
    clears = [
        Unary("ClearValues", pb.ClearValuesRequest(table=table, keys=part), lambda r: r.cleared, retry=True)
        for part in in_parts(list(keys), MAX_KEYS_PER_CALL)
    ]
    return Several(clears, sum)
