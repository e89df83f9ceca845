"""Whether a client's server answers a call made again as it answered the first (`Repeats`): a claim
by its id, an admit by its grant's name, a writer's open or close by its id, an ack, a nack or a
grant's finish by what it saw end. A server before those names answers a repeat as a new call, so
both clients (client.py, aio.py) retry such a call only once their server has said it answers it."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from ...errors import ExpbufError
from ..declare import Chunked, Unary

R = TypeVar("R")

# What a server that will not say (a token without the scope ServerInfo needs on a server before it
# took any token, or no such method) is taken to answer again: nothing.
_SILENT = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)


class Repeats:
    """The calls a client's server answers again as the first (ServerInfoReply.repeats_answered),
    asked before the first call that needs to know, and again after the server was unavailable: a
    remembered call (Unary.remembered) is retried only where its server names its method, and
    made once otherwise, as clients before these names made it. Where the ask itself fails (the
    server unavailable past the client's retries), the call is not made: the ask's error is its."""

    def __init__(self) -> None:
        self.known: frozenset[str] | None = None  # None: not asked yet

    def ask(self, call: Unary[R] | Chunked[R]) -> Unary[None] | None:
        """The ServerInfo call to make before `call`, or None where there is nothing to ask."""
        if self.known is not None or not (isinstance(call, Unary) and call.remembered and call.retry):
            return None

        def read(reply: pb.ServerInfoReply) -> None:
            self.known = frozenset(reply.repeats_answered)

        return Unary("ServerInfo", pb.ServerInfoRequest(), read, retry=True)

    def unanswered(self, error: ExpbufError) -> None:
        """The ask refused with `error`: a server that will not say answers nothing again; any
        other refusal (the server unavailable) is the call's."""
        if error.code not in _SILENT:
            raise error
        self.known = frozenset()

    def lost(self, error: ExpbufError) -> None:
        """A call refused with `error`: a server gone (UNAVAILABLE) may come back another release (a
        rollback restores the one before, which answers nothing again), so it is asked again."""
        if error.code == grpc.StatusCode.UNAVAILABLE:
            self.known = None

    def made(self, call: Unary[R] | Chunked[R]) -> Unary[R] | Chunked[R]:
        """`call` as its server takes it: a remembered call not retried where the server does not
        answer its method again."""
        if isinstance(call, Unary) and call.remembered and call.retry and call.method not in (self.known or ()):
            return replace(call, retry=False)
        return call
