"""What every part of the service shares at its bottom: a base for the server's interceptors,
which act on the ExperienceBuffer methods only (health checking is left alone, reflection only
bounded: reflection.py), `Interceptors`, which gives them to gRPC as one, `refuse`, the one way a call is refused, with
its reason beside its message, and the table a call is on (`CALL_TABLE`), which its refusal is
counted against."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, NoReturn

import grpc

from expbuf.client.rpc.wire import BUSY, refusal_trailer
from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb

SERVICE_PREFIX = "/expbuf.v1.ExperienceBuffer/"
# The table the current call is on, for a refusal's log line and metric: set when a call starts
# (none yet where its request is a stream, or is read later), and again by a stream once its first
# message names the table.
CALL_TABLE: ContextVar[str] = ContextVar("expbuf_call_table", default="")


def table_of(request: Any) -> str:
    """The table a request names (CreateTable and DropTable name it their own way)."""
    if isinstance(request, pb.CreateTableRequest):
        return request.config.name
    if isinstance(request, pb.DropTableRequest):
        return request.name
    return getattr(request, "table", "") or "default"


class ServiceInterceptor:
    """One of the server's interceptors, run by `Interceptors`, which gRPC asks for a call's handler
    on each call. One whose `wrap` reads nothing of the call (`per_call` False) makes its handler
    once for a method and the handler beneath it, and hands that one out again while the handler
    beneath is the same: the servicer's handler is, so is each such interceptor's above it, and a
    push of one experience does not pay for every interceptor's closures and handler again (issue 64)."""

    per_call = False  # True where `wrap` reads the call's details (its metadata): made on each call

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """The handler to run for `method` (e.g. "Push") instead of `handler`; from `details`
        only where `per_call`, else what reads a call's metadata reads it from its context."""
        raise NotImplementedError

    @functools.cached_property
    def _made(self) -> dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]]:
        """By method: the handler beneath, and the one `wrap` made of it."""
        return {}

    def handler(
        self, method: str, beneath: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """The handler of a call of `method` over the one `beneath` it: made by `wrap` on each call
        where `per_call`, else the one made before for the same handler beneath."""
        if self.per_call:
            return self.wrap(method, beneath, details)
        made = self._made.get(method)
        if made is None or made[0] is not beneath:  # a race makes it twice, alike: either serves
            made = self._made[method] = (beneath, self.wrap(method, beneath, details))
        return made[1]


class Interceptors(grpc.ServerInterceptor):
    """The server's interceptors as one for gRPC, in the order of gRPC's list (the first one's
    handler outermost): gRPC's pipeline runs a level (two closures and a call) for each interceptor
    of its list on every call, here one for them all (issue 64)."""

    def __init__(
        self,
        parts: Sequence[ServiceInterceptor],
        others: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler] | None = None,
    ) -> None:
        self.innermost_first = tuple(reversed(parts))
        self.others = others  # for the methods outside the service (reflection.py's bounds on reflection)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if handler is None:
            return None
        if not details.method.startswith(SERVICE_PREFIX):
            return handler if self.others is None else self.others(details.method, handler)
        method = details.method[len(SERVICE_PREFIX) :]
        for part in self.innermost_first:
            handler = part.handler(method, handler, details)
        return handler


def refuse(
    context: grpc.ServicerContext, code: grpc.StatusCode, message: str, reason: Reason, busy: bool = False
) -> NoReturn:
    """End the call with `code` and `message`, its `reason` in the status details for the client
    (wire.refusal_trailer), and, when `busy` or marked so before (limits), saying it did nothing
    (wire.BUSY)."""
    marked = any(key == BUSY for key, _ in context.trailing_metadata() or ())
    context.set_trailing_metadata(refusal_trailer(code.value[0], message, reason, busy or marked))
    context.abort(code, message)
