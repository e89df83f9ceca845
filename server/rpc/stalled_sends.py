"""Calls whose client takes no more of their replies: a streamed reply's message that waits in
gRPC's send longer than max_confirm_seconds, counted from the later of its send's start and the
client's last message (a Sample stream's confirmation), ends its call.

A client that hangs with its call open (a stuck trainer, a receive thread behind a deadlock) and
reads no more leaves the server's thread in gRPC's send, waiting for flow-control room that never
comes, where no wait of the call's own sees it: a Sample stream's batch stays held, invisible to
every other trainer, a read keeps the snapshot its reply is cut from (LMDB reuses no page freed
after it, so the data file grows with every write), and either keeps a worker. `StalledSends`
watches every message a streaming method has given gRPC and not yet seen taken, and cancels a
call whose message is past its bound; the call then gives back what it holds, as any broken call
does. One thread watches for the whole server, while messages are being sent.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from .interceptor import ServiceInterceptor

log = logging.getLogger("expbuf")
IDLE_SECONDS = 30.0  # the watch's thread ends after this long with no message being sent


class StalledSends(ServiceInterceptor):
    """Every streaming method's messages are watched while gRPC sends them (`seconds`: the
    server's max_confirm_seconds)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._changed = threading.Condition()
        self._sending: dict[int, tuple[float, _Call]] = {}  # each message being sent: its send's start, its call
        self._serial = itertools.count()
        self._watching = False  # the watch's thread runs
        self._idle = False  # and waits for a first message (it sleeps until the first due otherwise)

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if handler.stream_stream:
            behavior = handler.stream_stream

            def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                call = _Call(method, context)
                return self._watched(behavior(_Heard(requests, call), context), call)

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            unary = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                return self._watched(unary(request, context), _Call(method, context))

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler

    def _watched(self, messages: Iterator[Any], call: _Call) -> Iterator[Any]:
        """`messages`, each watched from when gRPC is given it until it asks for the next (the
        generator waits at its yield while gRPC sends)."""
        try:
            for message in messages:
                serial = self._start(call)
                try:
                    yield message
                finally:
                    with self._changed:
                        self._sending.pop(serial, None)  # the watch's already, where it cancelled the call
        finally:
            close = getattr(messages, "close", None)
            if close is not None:  # a generator's own clean-up (a Sample stream gives back its batches) runs now
                close()

    def _start(self, call: _Call) -> int:
        serial = next(self._serial)
        with self._changed:
            self._sending[serial] = (time.monotonic(), call)
            if not self._watching:
                self._watching = True
                threading.Thread(target=self._watch, name="expbuf-stalled-sends", daemon=True).start()
            elif self._idle:
                self._changed.notify()
        return serial

    def _due(self, started: float, call: _Call) -> float:
        """When a message whose send began at `started` is overdue: max_confirm_seconds after the
        later of that and the last message the call's client sent (a Sample stream's
        confirmation: a batch waits that long from the confirmation before it, sample_stream.py)."""
        return max(started, call.heard) + self.seconds

    def _watch(self) -> None:
        """Cancel each call whose message is past its due. A due only moves later (a client's
        message), never earlier than a new message's: the thread sleeps until the first, or until
        a message comes to an idle watch, and ends after IDLE_SECONDS with none."""
        while True:
            with self._changed:
                if not self._sending:
                    self._idle = True
                    self._changed.wait(IDLE_SECONDS)
                    self._idle = False
                    if not self._sending:
                        self._watching = False
                        return
                now = time.monotonic()
                dues = {serial: self._due(*sending) for serial, sending in self._sending.items()}
                cancel = [self._sending.pop(serial)[1] for serial, due in dues.items() if due <= now]
                if not cancel and dues:
                    self._changed.wait(min(dues.values()) - now)
            for call in cancel:  # outside the lock: the calls end on their own threads
                self._cancel(call)

    def _cancel(self, call: _Call) -> None:
        log.warning(
            "%s call: a message of its reply waited %gs for its client to take it (max_confirm_seconds); "
            "the call is cancelled and gives back what it held",
            call.method, self.seconds,
        )  # fmt: skip
        call.context.cancel()


class _Call:
    """A streaming call watched: its method, its context, and when its client last sent a
    message (monotonic clock; its start, for a call whose client sends one)."""

    __slots__ = ("context", "heard", "method")

    def __init__(self, method: str, context: grpc.ServicerContext) -> None:
        self.method, self.context, self.heard = method, context, time.monotonic()


class _Heard:
    """A call's requests, noting when each comes: an iterator, not a generator, so that whatever
    threads read gRPC's requests read these as they did those."""

    def __init__(self, requests: Iterator[Any], call: _Call) -> None:
        self._requests, self._call = requests, call

    def __iter__(self) -> _Heard:
        return self

    def __next__(self) -> Any:
        request = next(self._requests)
        self._call.heard = time.monotonic()
        return request
