"""What every part of the service shares at its bottom: a base for the server's interceptors,
which act on the ExperienceBuffer methods only (leaving health checking and reflection alone),
and `refuse`, the one way a call is refused, with its reason beside its message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from expbuf.client.rpc.wire import BUSY, refusal_trailer
from expbuf.client.schema.reasons import Reason

SERVICE_PREFIX = "/expbuf.v1.ExperienceBuffer/"


class ServiceInterceptor(grpc.ServerInterceptor):
    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """The handler to run for `method` (e.g. "Push") instead of `handler`."""
        raise NotImplementedError

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if handler is None or not details.method.startswith(SERVICE_PREFIX):
            return handler
        return self.wrap(details.method[len(SERVICE_PREFIX) :], handler, details)


def refuse(
    context: grpc.ServicerContext, code: grpc.StatusCode, message: str, reason: Reason, busy: bool = False
) -> NoReturn:
    """End the call with `code` and `message`, its `reason` in the status details for the client
    (wire.refusal_trailer), and, when `busy` or marked so before (limits), saying it did nothing
    (wire.BUSY)."""
    marked = any(key == BUSY for key, _ in context.trailing_metadata() or ())
    context.set_trailing_metadata(refusal_trailer(code.value[0], message, reason, busy or marked))
    context.abort(code, message)
