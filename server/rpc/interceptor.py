"""A base for the server's interceptors: they act on the ExperienceBuffer methods only,
leaving health checking and reflection alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

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
