"""Server reflection (what `grpcurl` asks to list and describe the services), open to every
client as health checks are, and bounded: its stream holds a worker thread while it is open,
and a client that opened many and sent nothing took every thread of the pool, health checks'
included. At most REFLECTION_STREAMS are open at once (the pool keeps threads for them:
limits.RESERVED_THREADS), one more is refused RESOURCE_EXHAUSTED, and each is cancelled
REFLECTION_SECONDS after it opened (grpcurl's take milliseconds).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc

REFLECTION_PREFIX = "/grpc.reflection."
REFLECTION_STREAMS = 2
REFLECTION_SECONDS = 10.0


class ReflectionLimits:
    """Bounds reflection's streams: how many are open at once, and for how long (base.Interceptors
    hands it the handlers of the methods outside expbuf's service)."""

    def __init__(self, streams: int = REFLECTION_STREAMS, seconds: float = REFLECTION_SECONDS) -> None:
        self._open = threading.BoundedSemaphore(streams)
        self.streams, self.seconds = streams, seconds

    def __call__(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` of `method`, bounded where it is reflection's stream."""
        if handler.stream_stream is None or not method.startswith(REFLECTION_PREFIX):
            return handler
        inner = handler.stream_stream

        def bounded(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            if not self._open.acquire(blocking=False):
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.streams} reflection streams are open, the most this server keeps open at once; "
                    "try again when one ends",
                )
            ends = threading.Timer(self.seconds, context.cancel)
            ends.daemon = True
            ends.start()
            try:
                yield from inner(requests, context)
            finally:
                ends.cancel()
                self._open.release()

        return grpc.stream_stream_rpc_method_handler(
            bounded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
