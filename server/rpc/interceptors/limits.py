"""Bounds on concurrent calls, so that no class of call, and no scope's calls, can take every
worker thread.

Each call in progress holds one worker thread, and some calls hold theirs while they wait idle:
a Sample stream for data, a PushStream for its next message, an Admit with a wait for room, a
Claim with a wait for prompts. Each of those classes has its own cap (`max_sample_streams`,
`max_push_streams`, `max_waiting_admits`, `max_waiting_claims`). Beyond the caps:

- each scope (rpc/interceptors/auth.py's push and sample) keeps a share of the workers, `push_scope_workers` and
  `sample_scope_workers`: a call is refused if it would leave the other scope fewer free workers
  than the part of its share its own calls do not hold. Rollout workers that block or idle never
  take what trainers need, nor trainers' idle streams what rollout workers need;
- calls that wait idle also leave the last `reserved_workers` free, for the calls that do not:
  Push and every call that answers at once (Ack, Get, ListTables, Seal, admin calls, ...). A
  Push that finds it must wait (for room in a full table, for the rate limit, or, as a PutValues,
  for max_inflight_bytes: rpc/push/inflight.py) becomes a call that waits idle: it waits only if the
  calls that wait idle, with it, leave the reserve (`MAY_WAIT`), and is refused at once
  otherwise, so that blocked pushes never take the reserve that makes a scope's share usable.
  Such a push stored nothing and its refusal says so, as a call refused before it began does
  (below). A PushStream waits idle from its start, so its pushes wait for room as it does;
- Ack, Nack, Renew, Retire and Stats never wait, and have ACK_THREADS of their own beyond `workers`, so a
  trainer's ack, which may be what makes room, is answered even when its scope's share is full;
  admin calls have ADMIN_THREADS of their own beyond those, so they always get in.

The thread pool has RESERVED_THREADS more than `workers` (those included, and reflection's few
streams: reflection.py), so health checks, reflection and the refusals themselves are always
answered. A call refused here did nothing: its refusal carries the trailing metadata `wire.BUSY`,
and the clients make a waiting claim or admit so refused again while its wait lasts, and a push
until its deadline (client/rpc/calls/attempts.py; a pusher's, client/pushers/pipeline.py).
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from expbuf.client.rpc.wire import BUSY
from expbuf.client.schema.reasons import Reason

from ...store import MayWait
from .auth import scope_of
from .base import ServiceInterceptor, refuse
from .reflection import REFLECTION_STREAMS

if TYPE_CHECKING:
    from ...config import ServerConfig

ACK_THREADS = 2
ADMIN_THREADS = 2
RESERVED_THREADS = ACK_THREADS + ADMIN_THREADS + REFLECTION_STREAMS + 2  # and health checks, refusals
# The calls that never wait, and may take ACK_THREADS beyond the workers.
NEVER_WAITING = frozenset({"Ack", "Nack", "Renew", "Retire", "Stats"})
# The calls that wait only when asked to (a request's wait_seconds), each class with its own cap.
WAITING_WHEN_ASKED = {"Admit": "waiting_admit", "Claim": "waiting_claim"}
# Asked by the call in progress (a unary call let in as one that does not wait idle) once it finds
# it must wait: None if it may (Slot.may_wait); else why not.
MAY_WAIT: ContextVar[MayWait | None] = ContextVar("expbuf_may_wait", default=None)


@dataclass(frozen=True)
class WaitingCap:
    """A cap on one class of calls that may hold a worker while they wait."""

    what: str  # the calls, in words: "Sample streams are open"
    setting: str  # its name in the config file
    limit: int

    def refusal(self, count: int) -> str:
        env = f"EXPBUF_{self.setting.upper()}"
        return (
            f"{count} {self.what}, the limit is {self.setting} = {self.limit} "
            f"(raise it with {env} or in the config file)"
        )


def call_class(method: str, request: Any) -> str:
    """The capped class of a call that may wait idle ("" for none): Admit and Claim wait only
    when asked to, each class under its own cap (a fleet of rollout workers waiting for prompts
    must not take the room of those waiting for a staleness bound)."""
    if method in WAITING_WHEN_ASKED:
        return WAITING_WHEN_ASKED[method] if getattr(request, "wait_seconds", 0) > 0 else ""
    return {"Sample": "sample_stream", "PushStream": "push_stream"}.get(method, "")


@dataclass(eq=False)
class Slot:
    """A call's place among the calls in progress, taken by CallLimits.acquire."""

    limits: CallLimits
    method: str
    kind: str  # its capped class (call_class), "" for none
    scope: str
    own: bool  # an admin call on one of ADMIN_THREADS
    waiting: bool = False  # counted among the calls that wait idle
    released: bool = False

    def may_wait(self) -> str | None:
        """The call, let in as one that does not wait idle (a Push), is about to wait: None if it
        may, the calls that wait idle with it leaving the reserve and the other scopes' shares (it
        is then counted as one of them until it ends), else why not (it is then refused, not left waiting)."""
        return self.limits._may_wait(self)

    def release(self) -> None:
        """The call ended (a second release counts nothing)."""
        self.limits._release(self)


class CallLimits(ServiceInterceptor):
    """Refuses, with RESOURCE_EXHAUSTED naming the limit and its setting, calls beyond the bounds."""

    def __init__(self, workers: int, reserved: int, caps: dict[str, WaitingCap], shares: dict[str, int]) -> None:
        self.workers = workers
        self.reserved = reserved
        self.caps = caps
        self.shares = shares  # scope -> workers kept for its calls
        self._lock = threading.Lock()
        self._calls = 0  # on the workers (and ACK_THREADS)
        self._admin_own = 0  # admin calls on ADMIN_THREADS
        self._open = dict.fromkeys(caps, 0)
        self._in_scope = dict.fromkeys(shares, 0)
        self._waiting = 0  # of _calls, those that wait idle (of a capped class, or a push let wait)

    def _kept(self, scope: str) -> dict[str, int]:
        """The free workers each other scope keeps: the part of its share its calls do not hold."""
        return {
            other: share - self._in_scope[other]
            for other, share in self.shares.items()
            if other != scope and share > self._in_scope[other]
        }

    def in_progress(self, kind: str) -> int:
        """The calls of a capped class (call_class) in progress."""
        with self._lock:
            return self._open[kind]

    def _refusal(self, method: str, idle: bool, kept: dict[str, int], joining: int = 1) -> str | None:
        """Why the call cannot take a worker now (`joining`: 1), or, holding one (0), begin to wait
        idle on it; None if it can.

        A call that comes to wait idle must leave the reserve free now. A call in progress that
        finds it must wait (a Push into a full table) is counted with the calls that wait idle
        only: whether it may wait must not depend on how many calls that answer at once are in
        progress beside it (they end by themselves), nor on whether the pushes arriving together
        all started before any of them found it must wait."""
        keep = sum(kept.values())
        if idle:
            counted, limit = (self._calls if joining else self._waiting) + 1, self.workers - self.reserved
        else:
            counted, limit = self._calls + joining, self.workers + (ACK_THREADS if method in NEVER_WAITING else 0)
        if counted + keep <= limit:
            return None
        held = [f"the last reserved_workers = {self.reserved} are kept for calls that do not wait idle"] if idle else []
        held += [
            f"{n} are kept for {scope}-scope calls ({scope}_scope_workers = {self.shares[scope]})"
            for scope, n in kept.items()
        ]
        if not held:
            return (
                f"all workers = {self.workers} threads are taken by calls in progress "
                "(raise it with EXPBUF_WORKERS or workers in the config file)"
            )
        return (
            f"{self._calls} calls are in progress, {self._waiting} of them waiting idle; of the workers = "
            f"{self.workers} threads, {' and '.join(held)} (raise workers with EXPBUF_WORKERS or in the config file)"
        )

    def acquire(self, method: str, request: Any) -> Slot | str:
        """The slot taken, or the reason no slot is free."""
        kind = call_class(method, request)
        scope = scope_of(method)
        with self._lock:
            cap = self.caps.get(kind)
            if cap is not None and self._open[kind] >= cap.limit:
                return cap.refusal(self._open[kind])
            refusal = self._refusal(method, bool(kind), self._kept(scope))
            own = False  # an admin call on one of its own threads, when no worker is free to it
            if refusal is not None:
                if scope != "admin" or self._admin_own >= ADMIN_THREADS:
                    return refusal if cap is None else f"{self._open[kind]} {cap.what}; {refusal}"
                own = True
            if own:
                self._admin_own += 1
            else:
                self._calls += 1
            if cap is not None:
                self._open[kind] += 1
            if scope in self._in_scope:
                self._in_scope[scope] += 1
            slot = Slot(self, method, kind, scope, own)
            if kind:
                self._waiting += 1
                slot.waiting = True
            return slot

    def _release(self, slot: Slot) -> None:
        with self._lock:
            if slot.released:
                return
            slot.released = True
            if slot.own:
                self._admin_own -= 1
            else:
                self._calls -= 1
            if slot.waiting:
                self._waiting -= 1
            if slot.kind in self._open:
                self._open[slot.kind] -= 1
            if slot.scope in self._in_scope:
                self._in_scope[slot.scope] -= 1

    def _may_wait(self, slot: Slot) -> str | None:
        with self._lock:
            if slot.waiting:
                return None
            refused = self._refusal(slot.method, True, self._kept(slot.scope), joining=0)
            if refused is None:
                self._waiting += 1
                slot.waiting = True
            return refused

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        def limited_unary(behavior: Callable) -> Callable:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                slot = self.acquire(method, request)
                if isinstance(slot, str):
                    _refuse(context, slot)

                def may_wait() -> str | None:
                    refused = slot.may_wait()
                    if refused is not None:  # the call ends refused before it waited: it did nothing
                        _mark_busy(context)
                    return refused

                waiting = MAY_WAIT.set(may_wait)
                try:
                    return behavior(request, context)
                finally:
                    MAY_WAIT.reset(waiting)
                    slot.release()

            return run

        def limited_stream(behavior: Callable) -> Callable:
            def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                slot = self.acquire(method, request)
                if isinstance(slot, str):
                    _refuse(context, slot)
                context.add_callback(slot.release)  # also when the stream ends without resuming this generator
                try:
                    yield from behavior(request, context)
                finally:
                    slot.release()

            return run

        serializers = (handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(limited_unary(handler.unary_unary), *serializers)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(limited_unary(handler.stream_unary), *serializers)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(limited_stream(handler.unary_stream), *serializers)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(limited_stream(handler.stream_stream), *serializers)
        raise ValueError(f"{method}: the handler has no behaviour to limit")


def _mark_busy(context: grpc.ServicerContext) -> None:
    """Say in the call's refusal to come that it did nothing (wire.BUSY): the same call later may get in."""
    context.set_trailing_metadata(((BUSY, "1"),))


def _refuse(context: grpc.ServicerContext, refusal: str) -> NoReturn:
    """End a call refused before it began, saying it did nothing (wire.BUSY): the same call later
    may get in."""
    refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, Reason.BUSY, busy=True)


def call_limits(config: ServerConfig) -> CallLimits:
    """The bounds on concurrent calls that `config` sets."""
    caps = {
        "sample_stream": WaitingCap("Sample streams are open", "max_sample_streams", config.sample_stream_limit),
        "push_stream": WaitingCap("PushStreams are open", "max_push_streams", config.push_stream_limit),
        "waiting_admit": WaitingCap("Admit calls wait for room", "max_waiting_admits", config.waiting_admit_limit),
        "waiting_claim": WaitingCap("Claim calls wait for prompts", "max_waiting_claims", config.waiting_claim_limit),
    }
    return CallLimits(config.workers, config.reserved_worker_count, caps, config.scope_shares)


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


# What a stream's messages may yield between two messages to say that one arrived which is
# not to be handed over (a chunk of a push not yet whole): the stream is not idle meanwhile.
PROGRESS: Any = object()


class Interrupted(Exception):
    """The call is to end now (the server is stopping), and no message read is left to take."""


class IdleMessages:
    """A stream's messages, read by a thread of their own so that the call can end one that
    sends nothing for `seconds` (a PushStream left open holds a worker thread): `seconds`
    without a message, or a PROGRESS.

    The reader reads up to `ahead` messages that the call has not yet said `done()` with, and
    makes each ready with `prepare` as it comes (a push's parse), so that the call works on one
    while the next are read and made ready. Messages, the end of the client's (None) and what
    reading or preparing one raised come out in the order they came; after an end or an error the
    reader reads no more, and none after `interrupt()`. Once the call closes it, what it made ready
    and no one took goes to `discard`."""

    def __init__(
        self,
        requests: Iterator[Any],
        seconds: float,
        *,
        ahead: int = 1,
        prepare: Callable[[Any], Any] | None = None,
        discard: Callable[[Any], None] | None = None,
    ) -> None:
        self.seconds = seconds
        self.ahead = ahead
        self._requests = requests
        self._prepare = prepare
        self._discard = discard
        self._changed = threading.Condition()
        self._closed = False
        self._interrupted = False
        self._ready: deque[Any] = deque()  # made ready, not yet taken
        self._open = 0  # messages read or being read that the call has not said done with
        self._progress = 0  # PROGRESS seen
        threading.Thread(target=self._read, name="expbuf-stream-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._open < self.ahead or self._closed or self._interrupted)
                if self._closed or self._interrupted:
                    return
                self._open += 1
            message = self._next()
            with self._changed:
                closed = self._closed
                if not closed:
                    self._ready.append(message)
                    self._changed.notify_all()
            if closed:
                self._drop(message)
            if closed or message is None or isinstance(message, Exception):
                return

    def _next(self) -> Any:
        """The next message made ready; None once the client closed its side or the call ended;
        what reading or preparing it raised (a refusal of it: the call raises it in its turn)."""
        try:
            while (message := next(self._requests)) is PROGRESS:  # still wanted: read on
                with self._changed:
                    self._progress += 1
                    self._changed.notify_all()
        except (StopIteration, grpc.RpcError):
            return None
        except Exception as exc:
            return exc
        if self._prepare is None:
            return message
        try:
            return self._prepare(message)
        except Exception as exc:
            return exc

    def _drop(self, message: Any) -> None:
        if self._discard is not None and message is not None and not isinstance(message, Exception):
            self._discard(message)

    def _moved(self, progress: int) -> bool:
        return bool(self._ready) or self._progress != progress or self._interrupted

    def next(self) -> Any:
        """The next message; None when the client closed its side; TimeoutError after `seconds` of
        silence; Interrupted once interrupted with none ready; what reading or preparing it raised."""
        with self._changed:
            while not self._ready:
                if self._interrupted:
                    raise Interrupted
                if not self._changed.wait_for(functools.partial(self._moved, self._progress), self.seconds):
                    raise TimeoutError
            message = self._ready.popleft()
        if isinstance(message, Exception):
            raise message
        return message

    def ready(self) -> list[Any]:
        """The messages made ready by now, without waiting (up to an end or an error, which next() gives)."""
        with self._changed:
            taken = []
            while self._ready and self._ready[0] is not None and not isinstance(self._ready[0], Exception):
                taken.append(self._ready.popleft())
            return taken

    def done(self, count: int = 1) -> None:
        """The call is done with `count` messages it took: the reader may read as many more."""
        with self._changed:
            self._open -= count
            self._changed.notify_all()

    def interrupt(self) -> None:
        """Read no more messages; next() gives those read already, then raises Interrupted."""
        with self._changed:
            self._interrupted = True
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            left = list(self._ready)
            self._ready.clear()
            self._changed.notify_all()
        for message in left:
            self._drop(message)
