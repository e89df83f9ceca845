"""Calls whose client takes no more of their replies: a streamed reply's message that waits in
gRPC's send longer than max_confirm_seconds, counted from the later of its send's start and the
client's last message that moved its call on (a Sample stream's confirmation of a batch not
confirmed before, or its stop), ends its call; so does the reply of a read that may be large
(call_limits.LARGE_REPLIES: Get, GetValues, ...), which gRPC holds once its handler has ended,
counted from that end until its call's (add_callback), and whose bytes are bounded meanwhile
(interceptors/reply_memory.py).

A client that hangs with its call open (a stuck trainer, a receive thread behind a deadlock) and
reads no more leaves the server's thread in gRPC's send, waiting for flow-control room that never
comes, where no wait of the call's own sees it: a Sample stream's batch stays held, invisible to
every other trainer, a read keeps the snapshot its reply is cut from (LMDB reuses no page freed
after it, so the data file grows with every write), and either keeps a worker. `StalledSends`
watches every message a streaming method has given gRPC and not yet seen taken, and cancels a
call whose message is past its bound; the call then gives back what it holds, as any broken call
does. A message of a Sample stream that confirms nothing new (the count confirmed before, sent
again) is no sign of a client that reads: it does not move the bound.

The bound is long (a trainer's step), the snapshot's cost grows with every write meanwhile: a
message that has waited SNAPSHOT_SECONDS has its maker let go of what the rest of its reply reads
from the store's map (call_context.when_sent_slowly: replies.py copies it out and ends the
snapshot), on a thread of its own. One thread watches for the whole server, while messages are
being sent.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from expbuf.client.schema.call_limits import LARGE_REPLIES

from ..call_context import made_watched
from ..interceptors.base import ServiceInterceptor

log = logging.getLogger("expbuf")
IDLE_SECONDS = 30.0  # the watch's thread ends after this long with no message being sent
# How long a message waits in gRPC's send before what the rest of its reply reads from the store's
# map is copied out of it and its read snapshot ends: a reply of a client that reads as it comes
# (a part of 8 MiB takes milliseconds) never waits this long, one that waits is likely to wait
# a trainer's step.
SNAPSHOT_SECONDS = 1.0
# Which of a call's requests move its bound on, by method: a new rule per call, given each request
# in turn (a method not named here: every request).
Heard = Callable[[Any], bool]
_END = object()


class StalledSends(ServiceInterceptor):
    """Every streaming method's messages are watched while gRPC sends them (`seconds`: the
    server's max_confirm_seconds)."""

    def __init__(self, seconds: float, heard: Mapping[str, Callable[[], Heard]] | None = None) -> None:
        self.seconds = seconds
        self._heard = dict(heard or {})
        self._changed = threading.Condition()
        self._sending: dict[int, _Sending] = {}  # each message being sent
        self._serial = itertools.count()
        self._watching = False  # the watch's thread runs
        self._idle = False  # and waits for a first message (it sleeps until the first due otherwise)
        self._wakes = math.inf  # when the watch's thread wakes next, while it sleeps until a due

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if handler.stream_stream:
            behavior = handler.stream_stream

            def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                call = _Call(method, context)
                heard = self._heard[method]() if method in self._heard else None
                return self._watched(behavior(_Heard(requests, call, heard), context), call)

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
        if handler.unary_unary and method in LARGE_REPLIES:
            answer = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                reply = answer(request, context)
                serial = self._start(_Call(method, context), [])
                if not context.add_callback(lambda: self._taken(serial)):  # the call ended already
                    self._taken(serial)
                return reply

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        return handler

    def _watched(self, messages: Iterator[Any], call: _Call) -> Iterator[Any]:
        """`messages`, each watched from when gRPC is given it until it asks for the next (the
        generator waits at its yield while gRPC sends)."""
        try:
            while True:
                message, let_go = made_watched(messages, _END)
                if message is _END:
                    return
                serial = self._start(call, let_go)
                try:
                    yield message
                finally:
                    with self._changed:
                        self._sending.pop(serial, None)  # the watch's already, where it cancelled the call
        finally:
            close = getattr(messages, "close", None)
            if close is not None:  # a generator's own clean-up (a Sample stream gives back its batches) runs now
                close()

    def _taken(self, serial: int) -> None:
        """A unary reply's call ended: its client took it, or the call was cancelled."""
        with self._changed:
            self._sending.pop(serial, None)

    def _start(self, call: _Call, let_go: list[Callable[[], None]]) -> int:
        serial = next(self._serial)
        with self._changed:
            sending = self._sending[serial] = _Sending(time.monotonic(), call, let_go)
            if not self._watching:
                self._watching = True
                threading.Thread(target=self._watch, name="expbuf-stalled-sends", daemon=True).start()
            elif self._idle or self._due(sending) < self._wakes:
                self._changed.notify()
        return serial

    def _due(self, sending: _Sending) -> float:
        """When a message is next due something: SNAPSHOT_SECONDS after its send's start while its
        maker has something to let go of, and overdue max_confirm_seconds after the later of that
        start and the last message of the call's client that moved it on (a Sample stream's
        confirmation: a batch waits that long from the confirmation before it, sample_stream.py)."""
        overdue = max(sending.started, sending.call.heard) + self.seconds
        return min(sending.started + SNAPSHOT_SECONDS, overdue) if sending.let_go else overdue

    def _watch(self) -> None:
        """Cancel each call whose message is past its due, and let go of what a message that has
        waited SNAPSHOT_SECONDS reads. A due only moves later (a client's message): the thread
        sleeps until the first, or until a message comes whose due is earlier (or comes to an idle
        watch), and ends after IDLE_SECONDS with none."""
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
                let_go = [hook for sending in self._sending.values() if sending.slow(now) for hook in sending.taken()]
                dues = {serial: self._due(sending) for serial, sending in self._sending.items()}
                cancel = [self._sending.pop(serial).call for serial, due in dues.items() if due <= now]
                if not (cancel or let_go) and dues:
                    self._wakes = min(dues.values())
                    self._changed.wait(self._wakes - now)
                    self._wakes = math.inf
            if let_go:  # copies of what replies read, perhaps large: off this thread, which every call waits on
                threading.Thread(target=_run_each, args=(let_go,), name="expbuf-slow-send", daemon=True).start()
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
    message that moved it on (monotonic clock; its start, for a call whose client sends one)."""

    __slots__ = ("context", "heard", "method")

    def __init__(self, method: str, context: grpc.ServicerContext) -> None:
        self.method, self.context, self.heard = method, context, time.monotonic()


class _Sending:
    """A message being sent: its send's start, its call, and what its maker lets go of when it
    waits SNAPSHOT_SECONDS (emptied once taken)."""

    __slots__ = ("call", "let_go", "started")

    def __init__(self, started: float, call: _Call, let_go: list[Callable[[], None]]) -> None:
        self.started, self.call, self.let_go = started, call, let_go

    def slow(self, now: float) -> bool:
        return bool(self.let_go) and now >= self.started + SNAPSHOT_SECONDS

    def taken(self) -> list[Callable[[], None]]:
        let_go, self.let_go = self.let_go, []
        return let_go


def _run_each(hooks: list[Callable[[], None]]) -> None:
    for hook in hooks:
        try:
            hook()
        except Exception:  # one reply's failure to let go keeps its snapshot, as before; the others go on
            log.exception("a reply waiting in gRPC's send could not let go of its read snapshot")


class _Heard:
    """A call's requests, noting when one comes that moves the call on (`heard`'s say; without
    it, every one): an iterator, not a generator, so that whatever threads read gRPC's requests
    read these as they did those."""

    def __init__(self, requests: Iterator[Any], call: _Call, heard: Heard | None) -> None:
        self._requests, self._call, self._news = requests, call, heard

    def __iter__(self) -> _Heard:
        return self

    def __next__(self) -> Any:
        request = next(self._requests)
        if self._news is None or self._news(request):
            self._call.heard = time.monotonic()
        return request
