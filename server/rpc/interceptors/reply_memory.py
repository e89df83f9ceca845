"""The replies of reads that gRPC holds until their clients take them, bounded.

A unary call's handler ends once its reply is made; gRPC then holds the reply's bytes until its
client takes them, however long that is. A client that stops reading with reads in flight (a
process stopped or swapped out, a trainer hung in a collective, a hostile caller) kept their
replies in the server's memory for as long as its connection lived, each of Get, GetPartials,
GetValues, ListExperiences and ListPrompts up to max_message_bytes, and nothing bounded how many:
the server grew until the kernel killed it, every trainer's stream with it. `ReplyMemory` counts
each such reply from its handler's end to its call's end (gRPC's `add_callback`), against `limit`
for the server and half of it for the calls of one address (a peer's host, whatever its ports:
clients behind one proxy or NAT share it). A call whose address, or the server, holds its bound
already is refused before its reply is made; a reply that would pass either is refused once made.
Either refusal is RESOURCE_EXHAUSTED (`replies_full`, busy: nothing was done, and the clients make
a read so refused again within its deadline). A reply of any size goes where its address holds
nothing and the server has room for it, or the server holds nothing. A reply under SMALL is not
counted. The reply is serialised here, once (gRPC is given its bytes), so its size costs nothing
more. What a call holds is given back when its client takes the reply, or its call ends otherwise
(cancelled, its connection gone, or cut by max_confirm_seconds: sample/stalled_sends.py).

The streamed replies in parts (COPIED_REPLIES) count against the same bounds what their calls copy
out of the store's map when their client is slow to read (sample/replies.py lets go of a
snapshot so, and so does the store where it must end the snapshot): a copy that would pass either
is not made, whatever its size, and the reply reads on from its snapshot until its client reads or
max_confirm_seconds ends the call; one the store must end then is let go of, its call ended and its
batch back in the buffer (snapshot.py). Unbounded, each stalled ReadFields of
288 MB held its rest in memory for up to max_confirm_seconds: four grew the server by 1 GB.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from functools import partial
from typing import Any, NoReturn, Protocol

import grpc

from expbuf.client.schema.call_limits import LARGE_REPLIES
from expbuf.client.schema.reasons import Reason

from .base import ServiceInterceptor, refuse

SMALL = 64 << 10  # bytes of a reply too few to count
# The streamed replies whose rest a slow client's call copies out of the map, or which are built
# whole before they are sent (ReadPartials': rollouts put together from their pieces): what they
# hold is counted (`budgeted`).
COPIED_REPLIES = frozenset({"Sample", "ReadFields", "ReadPartials"})


class Budget(Protocol):
    """What a streamed reply's copy of its rest out of the store's map (replies.py, a client slow
    to read) may hold of the server's memory: given the copy's bytes, what gives them back once the
    copy goes, or None where holding them would pass the bound (the reply then reads on from its
    snapshot). `strict`: within the bounds, for a copy that can be done without (the rest read
    from the snapshot); else one of any size goes where its address holds nothing and the server
    has room, as a read's reply does."""

    def __call__(self, size: int, *, strict: bool = False) -> Callable[[], None] | None: ...


_REPLY_BUDGET: ContextVar[Budget | None] = ContextVar("expbuf_reply_budget", default=None)


def reply_budget() -> Budget | None:
    """The budget of the streamed reply being made now (`budgeted`), or None."""
    return _REPLY_BUDGET.get()


def budgeted(messages: Iterator[Any], budget: Budget) -> Iterator[Any]:
    """`messages`, each made with `budget` as its call's reply_budget; closed, it closes them."""
    try:
        while True:
            token = _REPLY_BUDGET.set(budget)
            try:
                message = next(messages, _NO_MORE)
            finally:
                _REPLY_BUDGET.reset(token)
            if message is _NO_MORE:
                return
            yield message
    finally:
        close = getattr(messages, "close", None)
        if close is not None:
            close()


_NO_MORE = object()


def held_whole(context: grpc.ServicerContext, method: str, size: int) -> Callable[[], None]:
    """A streamed reply of `size` bytes built whole before it is sent, counted while its call
    holds it as a unary read's reply is (what gives it back), or refused RESOURCE_EXHAUSTED
    (`replies_full`, busy: nothing was done) where it would pass a bound."""
    budget = reply_budget()
    if budget is None or size < SMALL:
        return lambda: None
    give = budget(size)
    if give is not None:
        return give
    refuse(
        context,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the {method} reply of {size} bytes was not sent: the replies of reads that their clients have not "
        "taken yet hold the server's max_inflight_bytes, or this client's address half of it; a client that "
        "reads no more holds its replies until its calls end. Nothing was done: read again",
        Reason.REPLIES_FULL,
        busy=True,
    )


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
        if method in COPIED_REPLIES:
            return self._copies_bounded(handler)
        if method not in LARGE_REPLIES or handler.unary_unary is None or handler.response_serializer is None:
            return handler
        behavior, serialize = handler.unary_unary, handler.response_serializer

        def unary_unary(request: Any, context: grpc.ServicerContext) -> bytes:
            address = address_of(context.peer())
            with self._lock:
                mine, held = self._by_address.get(address, 0), self.held
            if mine >= self.limit // 2 or held >= self.limit:  # no room for any reply: refused before it is made
                self._refuse(method, context, 0, mine, held)
            data = serialize(behavior(request, context))
            if len(data) >= SMALL:
                self._hold(method, context, address, len(data))
            return data

        return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer, _as_is)

    def _copies_bounded(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A streaming method whose messages are made with the budget of its caller's address."""
        if handler.stream_stream:
            streams = handler.stream_stream

            def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                return budgeted(streams(requests, context), partial(self.copy, address_of(context.peer())))

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            unary = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                return budgeted(unary(request, context), partial(self.copy, address_of(context.peer())))

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler

    def copy(self, address: str, size: int, *, strict: bool = False) -> Callable[[], None] | None:
        """Count a streamed reply's copy of `size` bytes for `address`: what gives them back (once),
        or None where they would pass a bound (nothing counted); not `strict`, one of any size
        goes where the address holds nothing and the server has room (Budget)."""
        with self._lock:
            mine, held = self._by_address.get(address, 0), self.held
            over_mine, over_all = mine + size > self.limit // 2, held + size > self.limit
            if (over_mine and (strict or mine)) or (over_all and (strict or held)):
                return None
            self.held, self._by_address[address] = held + size, mine + size
        given = threading.Event()

        def give() -> None:
            if not given.is_set():
                given.set()
                self._give(address, size)

        return give

    def _hold(self, method: str, context: grpc.ServicerContext, address: str, size: int) -> None:
        """Count a reply of `size` bytes until its call ends, or refuse it where it would pass a bound."""
        with self._lock:
            mine, held = self._by_address.get(address, 0), self.held
            over = (mine and mine + size > self.limit // 2) or (held and held + size > self.limit)
            if not over:
                self.held, self._by_address[address] = held + size, mine + size
        if over:
            self._refuse(method, context, size, mine, held)
        if not context.add_callback(lambda: self._give(address, size)):  # the call ended already
            self._give(address, size)

    def _refuse(self, method: str, context: grpc.ServicerContext, size: int, mine: int, held: int) -> NoReturn:
        reply = f"the {method} reply of {size} bytes was not sent" if size else f"the {method} reply was not made"
        refuse(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{reply}: the replies of reads that their clients have not taken yet hold {held} bytes of the "
            f"server's {self.limit} (max_inflight_bytes), {mine} of them this client's address, of the half of it "
            "one address may hold; a client that reads no more holds its replies until its calls end. Nothing "
            "was done: read again",
            Reason.REPLIES_FULL,
            busy=True,
        )

    def _give(self, address: str, size: int) -> None:
        with self._lock:
            self.held -= size
            left = self._by_address[address] - size
            if left:
                self._by_address[address] = left
            else:
                del self._by_address[address]


def _as_is(data: bytes) -> bytes:
    """A reply serialised already (ReplyMemory's), given to gRPC as it is."""
    return data
