"""Bounds on concurrent calls, so that waiting Sample streams cannot take every worker thread.

Each call in progress holds one worker thread, and a Sample stream holds its thread while it
waits for data. Open Sample streams are capped at `max_sample_streams` (below `workers`), so
that Push, Ack and Stats always find a thread, and the service's calls together at `workers`.
The thread pool has RESERVED_THREADS more than that, so health checks, reflection and the
refusals themselves are always answered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from .interceptor import ServiceInterceptor

RESERVED_THREADS = 4


class CallLimits(ServiceInterceptor):
    """Refuses, with RESOURCE_EXHAUSTED naming the limit and its setting, calls beyond the bounds."""

    def __init__(self, workers: int, max_sample_streams: int) -> None:
        self.workers = workers
        self.max_sample_streams = max_sample_streams
        self._lock = threading.Lock()
        self._calls = 0
        self._streams = 0

    def _acquire(self, method: str) -> Callable[[], None] | str:
        """A release function for the slot taken, or the reason no slot is free."""
        sample = method == "Sample"
        with self._lock:
            if sample and self._streams >= self.max_sample_streams:
                return (
                    f"{self._streams} Sample streams are open, the limit is max_sample_streams = "
                    f"{self.max_sample_streams} (raise it with EXPBUF_MAX_SAMPLE_STREAMS or in the config file; "
                    f"it must stay below workers = {self.workers})"
                )
            if self._calls >= self.workers:
                return (
                    f"all workers = {self.workers} threads are taken by calls in progress "
                    "(raise it with EXPBUF_WORKERS or workers in the config file)"
                )
            self._calls += 1
            self._streams += sample
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._calls -= 1
                    self._streams -= sample

        return release

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        def limited_unary(behavior: Callable) -> Callable:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                release = self._acquire(method)
                if isinstance(release, str):
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, release)
                try:
                    return behavior(request, context)
                finally:
                    release()

            return run

        def limited_stream(behavior: Callable) -> Callable:
            def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                release = self._acquire(method)
                if isinstance(release, str):
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, release)
                context.add_callback(release)  # also when the stream ends without resuming this generator
                try:
                    yield from behavior(request, context)
                finally:
                    release()

            return run

        serializers = (handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(limited_unary(handler.unary_unary), *serializers)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(limited_unary(handler.stream_unary), *serializers)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(limited_stream(handler.unary_stream), *serializers)
        return grpc.stream_stream_rpc_method_handler(limited_stream(handler.stream_stream), *serializers)


class TableStreams:
    """Open Sample streams per table, capped, so that the trainers of one table cannot take
    every stream the server allows (the cap on all of them is CallLimits')."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    def enter(self, table: str) -> str | None:
        """Take a stream slot of `table`; the reason if none is free."""
        with self._lock:
            open_ = self._open.get(table, 0)
            if open_ >= self.limit:
                return (
                    f"{open_} Sample streams are open on table '{table}', the limit is max_table_streams = "
                    f"{self.limit} (raise it with EXPBUF_MAX_TABLE_STREAMS or in the config file)"
                )
            self._open[table] = open_ + 1
            return None

    def leave(self, table: str) -> None:
        with self._lock:
            self._open[table] -= 1
            if not self._open[table]:
                del self._open[table]
