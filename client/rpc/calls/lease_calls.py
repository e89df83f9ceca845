"""A trainer's leases as the clients end and keep them (LeaseCalls, declared once: rpc/declare.py):
a lease acknowledged (its groups consumed) or given back, renewed for a longer step, and groups
trained without a lease retired as an acknowledgement would consume them."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from expbuf.proto.v1 import buffer_pb2 as pb

from ...schema.call_limits import MAX_NAMES_PER_CALL, in_parts
from ..declare import ClientSettings, Plan, Several, Unary, declare


class LeaseCalls(ClientSettings):
    """The calls that end and keep a trainer's leases, as the clients make them (rpc/declare.py)."""

    @declare(shards=lambda s: partial(s._end, method="ack"))
    def ack(self, lease_id: str, table: str = "default") -> Plan[int]:
        """Consume the groups of a lease (of `table`, taken with this client's token).
        Returns the experiences it held. Made again after its reply was lost, it answers the
        same (the server remembers the leases it ended, for its run); for a lease that expired
        meanwhile it raises NotFoundError saying so. Sharded: on the shards that leased them."""
        request = pb.AckRequest(table=table, lease_id=lease_id)
        return Unary("Ack", request, lambda r: r.acked, retry=True, remembered=True)

    @declare(shards=lambda s: partial(s._end, method="nack"))
    def nack(self, lease_id: str, table: str = "default") -> Plan[int]:
        """Return the groups of a lease to the buffer now. Returns the experiences it held (again,
        made again after its reply was lost, as `ack`). Sharded: to the buffers of the shards
        that leased them."""
        request = pb.NackRequest(table=table, lease_id=lease_id)
        return Unary("Nack", request, lambda r: r.requeued, retry=True, remembered=True)

    @declare(shards=lambda s: s._retire)
    def retire(self, groups: Iterable[str], table: str = "default") -> Plan[int]:
        """Consume groups this trainer trained without a lease (a framework's own queue held them),
        as `ack` consumes a lease's: their payloads go and their tombstones stay, so a push of them
        again is a duplicate, and a prompt whose group it is is trained. Ready groups, and groups
        leased with this client's token, retire; absent or retired ones are skipped; an incomplete
        one is FailedPreconditionError (none of its call retires). Any number, in calls of at most
        MAX_NAMES_PER_CALL (expbuf.client.schema.call_limits). Returns the groups retired.

        Sharded: each group on the shard that owns it; a shard that did not answer or refused
        raises ShardError, its `result` what each of the others retired, by shard (a retry of the
        whole call is safe)."""
        requests = [
            pb.RetireRequest(table=table, group_ids=part) for part in in_parts(list(groups), MAX_NAMES_PER_CALL)
        ]
        # a retired group stays retired: retried safely
        return Several([Unary("Retire", request, lambda r: r.retired, retry=True) for request in requests], sum)

    @declare(shards=lambda s: s._renew)
    def renew(self, lease_id: str, seconds: float, table: str = "default") -> Plan[float]:
        """Keep a lease for `seconds` more from now, for a step that outlasts the lease it took.
        Returns when the lease now ends (Unix time, the server's clock). Sharded: on the shards
        that leased it; the earliest end."""
        request = pb.RenewRequest(table=table, lease_id=lease_id, lease_seconds=seconds)
        return Unary("Renew", request, lambda r: r.lease_expires_unix, retry=True)
