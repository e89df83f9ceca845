"""The replies of reads that gRPC holds until their clients take them, bounded.

A unary call's handler ends once its reply is made; gRPC then holds the reply's bytes until its
client takes them, however long that is. A client that stops reading with reads in flight (a
process stopped or swapped out, a trainer hung in a collective, a hostile caller) kept their
replies in the server's memory for as long as its connection lived, each of Get, GetPartials,
GetValues, ListExperiences and ListPrompts up to max_message_bytes, and nothing bounded how many:
the server grew until the kernel killed it, every trainer's stream with it. `ReplyMemory` counts
each such reply from its handler's end to its call's end (gRPC's `add_callback`), against `limit`
for the server and half of it for the calls of one address (a peer's host, whatever its ports).
A reply that would pass either is refused RESOURCE_EXHAUSTED (`replies_full`, busy: nothing was
done, and the clients make a read so refused again within its deadline), unless nothing of the
server's, or the address's, is held: a reply of any size goes alone. A reply under SMALL is not
counted. What a call holds is given back when its client takes the reply, or its call ends
otherwise (cancelled, its connection gone, or cut by max_confirm_seconds: sample/stalled_sends.py).
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from expbuf.client.schema.call_limits import LARGE_REPLIES
from expbuf.client.schema.reasons import Reason

from .base import ServiceInterceptor, refuse

SMALL = 64 << 10  # bytes of a reply too few to count


def address_of(peer: str) -> str:
    """A peer's address without its port ("ipv4:10.0.0.5:43120" -> "ipv4:10.0.0.5"), so that the
    calls of one client count together whichever connections they come on."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return f"{kind}:{rest.rpartition(':')[0]}"
    if kind == "ipv6":  # ipv6:[::1]:43120, or ipv6:%5B::1%5D:43120 as some versions write it
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


class ReplyMemory(ServiceInterceptor):
    """The bytes the replies of LARGE_REPLIES' calls hold until their clients take them: `held`,
    and each address's share; `limit` (the server's max_inflight_bytes) for them all, half of it
    for one address."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._by_address: dict[str, int] = {}
        self._lock = threading.Lock()

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if method not in LARGE_REPLIES or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            reply = behavior(request, context)
            size = reply.ByteSize()
            if size >= SMALL:
                self._hold(method, context, size)
            return reply

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )

    def _hold(self, method: str, context: grpc.ServicerContext, size: int) -> None:
        """Count a reply of `size` bytes until its call ends, or refuse it where it would pass a bound."""
        address = address_of(context.peer())
        with self._lock:
            mine, held = self._by_address.get(address, 0), self.held
            over = (mine and mine + size > self.limit // 2) or (held and held + size > self.limit)
            if not over:
                self.held, self._by_address[address] = held + size, mine + size
        if over:
            refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {method} reply of {size} bytes was not sent: the replies of reads that their clients have "
                f"not taken yet hold {held} bytes of the server's {self.limit} (max_inflight_bytes), {mine} of them "
                f"this client's address, of the half of it one address may hold; a client that reads no more holds "
                "its replies until its calls end. Nothing was done: read again",
                Reason.REPLIES_FULL,
                busy=True,
            )
        if not context.add_callback(lambda: self._give(address, size)):  # the call ended already
            self._give(address, size)

    def _give(self, address: str, size: int) -> None:
        with self._lock:
            self.held -= size
            left = self._by_address[address] - size
            if left:
                self._by_address[address] = left
            else:
                del self._by_address[address]
