"""The calls of keyed values as the clients make them (ValueCalls, declared once: rpc/declare.py):
PutValues, GetValues, ClearValues, bytes under names of the caller's own
(server/store/services/values.py). Each is safe to retry: a put stores the same bytes again, a
clear of what is gone clears nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from expbuf.proto.v1 import buffer_pb2 as pb

from ...schema.call_limits import MAX_KEYS_PER_CALL, in_parts
from .. import frames
from ..declare import ClientSettings, Plan, Several, Unary, declare


class ValueCalls(ClientSettings):
    """The calls of keyed values, as the clients make them (rpc/declare.py). Sharded, each key is
    on one shard, the rendezvous of the key over the shards of the map's first epoch: a key's
    shard never changes as shards are added (values are not groups: they do not move)."""

    @declare(shards=lambda s: s._put_values)
    def put_values(self, keys: Sequence[str], values: Sequence[bytes], table: str = "default") -> Plan[int]:
        """Store each value under its key (bytes under names of your own, in the table's key
        range), durable on return, all or none (in calls of at most MAX_KEYS_PER_CALL keys,
        expbuf.client.schema.call_limits, each all or none); a key stored already is replaced.
        Needs the push scope. With tokens on, a value is its writer's token's: another token's put
        or clear of it is refused (PermissionDeniedError, reason forbidden). Values count against
        the table's capacity_bytes: a put past it is refused (ResourceExhaustedError).

        Sharded: each key on its shard; a shard that did not answer or refused raises ShardError
        naming it, its `result` what the others stored (a retry is safe)."""
        if len(keys) != len(values):
            raise ValueError(f"put_values: {len(keys)} keys for {len(values)} values, one value a key")
        most = MAX_KEYS_PER_CALL
        requests = [
            frames.put_values_request(table, keys[start : start + most], values[start : start + most])
            for start in (range(0, len(keys), most) if keys else range(1))
        ]
        return Several([Unary("PutValues", request, lambda r: r.stored, retry=True) for request in requests], sum)

    @declare(shards=lambda s: s._get_values)
    def get_values(
        self, keys: Sequence[str], table: str = "default", *, only_own: bool = False
    ) -> Plan[list[bytes | None]]:
        """The value of each key, in the order asked, None for one not stored (in calls of at most
        MAX_KEYS_PER_CALL keys, each one message's worth: the server refuses more, naming its
        max_message_bytes). With `only_own`, a key whose value another token wrote is refused
        (PermissionDeniedError), for a reader that trusts only what its own token stored.
        Sharded: each key from its shard; a shard that did not answer raises ShardError naming it."""

        def read(asked: Sequence[str]) -> Callable[[pb.GetValuesReply], list[bytes | None]]:
            def values(reply: pb.GetValuesReply) -> list[bytes | None]:
                missing = set(reply.missing_keys)
                found = iter(reply.values)
                return [None if key in missing else next(found) for key in asked]

            return values

        reads = [
            Unary("GetValues", pb.GetValuesRequest(table=table, keys=part, only_own=only_own), read(part), retry=True)
            for part in in_parts(list(keys), MAX_KEYS_PER_CALL)
        ]
        return Several(reads, lambda parts: [value for part in parts for value in part])

    @declare(shards=lambda s: s._clear_values)
    def clear_values(self, keys: Sequence[str], table: str = "default") -> Plan[int]:
        """Remove the values of these keys (in calls of at most MAX_KEYS_PER_CALL); how many held
        one. Sharded: each key on its shard, a failure raised as put_values raises it."""
        clears = [
            Unary("ClearValues", pb.ClearValuesRequest(table=table, keys=part), lambda r: r.cleared, retry=True)
            for part in in_parts(list(keys), MAX_KEYS_PER_CALL)
        ]
        return Several(clears, sum)
