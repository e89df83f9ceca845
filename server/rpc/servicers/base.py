"""What every servicer of a service has of the servicer it is mixed into (rpc/service.py): the
store, the largest message it sends or reads, and whom a call is made by (leases, claims and
keyed values are bound to the caller's token when the server binds them)."""

from __future__ import annotations

import hashlib

import grpc

from ...store import Store


class ServicerBase:
    """The fields rpc/service.py's servicer sets, and the caller's fingerprint from them."""

    store: Store
    max_message_bytes: int
    bind_leases: bool

    def _owner(self, context: grpc.ServicerContext) -> str:
        """Who takes a lease: a fingerprint of the caller's token when tokens are on, so
        that only that caller can ack or nack it."""
        if not self.bind_leases:
            return ""
        token = dict(context.invocation_metadata()).get("authorization", "")
        return hashlib.sha256(token.encode() if isinstance(token, str) else token).hexdigest()[:16]
