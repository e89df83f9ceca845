"""What every call of the ExperienceBuffer servicer shares: how a refusal becomes its gRPC
status, metric and log line (`refusals`), the table a call is on, and the time left before
its deadline."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any

import grpc
from google.protobuf.message import Message

from expbuf.client import trxp
from expbuf.client.schema.reasons import Reason

from ..store.schema.errors import InvalidRequest, StoreError, clip
from .interceptors.base import CALL_TABLE, refuse, table_of

log = logging.getLogger("expbuf.service")

# What a wait to the caller's deadline leaves of it (remaining): its answer's way back, and gRPC's
# rounding of the timeout on the wire, up to a hundredth of it.
DEADLINE_MARGIN, DEADLINE_ROUNDING = 0.05, 0.01
# The least max_reply_bytes a client may say it receives (a SampleRequest's, a ClaimRequest's), as
# the least max_message_bytes; 0 says nothing, the server's max_message_bytes alone bounds a reply.
MIN_REPLY_BYTES = 1024


class RefusalLog:
    """Logs refusals, at most `per_second` lines a second: a client that sends garbage in
    a loop must not flood the log. Lines held back are counted in the next one."""

    def __init__(self, per_second: float = 10.0) -> None:
        self.per_second = per_second
        self._lock = threading.Lock()
        self._window = 0.0
        self._logged = 0
        self._held_back = 0

    def __call__(self, level: int, message: str, *args: object, exc_info: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._window >= 1.0:
                self._window, self._logged = now, 0
            if self._logged >= self.per_second:
                self._held_back += 1
                return
            self._logged += 1
            held_back, self._held_back = self._held_back, 0
        if held_back:
            message += f" ({held_back} refusals not logged before this one)"
        log.log(level, message, *args, exc_info=exc_info)


def refusals(method: Callable) -> Callable:
    """Map refusals (store/schema/errors.py) to the status code and metric reason their class carries, with
    their message; count and log them. Anything else is a fault of the server: INTERNAL,
    logged with its traceback, never UNKNOWN."""

    def abort(self: Any, request: Any, context: grpc.ServicerContext, exc: Exception) -> None:
        # grpcio's server context has code(); types-grpcio omits it
        if context.code() is not None:  # type: ignore[attr-defined]  # the method aborted with its own status
            raise exc
        table = CALL_TABLE.get()
        if isinstance(exc, StoreError):
            code, reason = grpc.StatusCode[exc.status], exc.reason
            self.refusal_log(logging.INFO, "refused %s on table %s: %s (%s): %s", method.__name__, clip(table),
                             code.name, reason, clip(str(exc), 500))  # fmt: skip
        else:
            code, reason = grpc.StatusCode.INTERNAL, Reason.INTERNAL
            self.refusal_log(logging.ERROR, "%s on table %s failed", method.__name__, clip(table), exc_info=True)
            exc = RuntimeError(f"internal error in {method.__name__}: {type(exc).__name__}: {clip(str(exc), 300)}")
        refuse(context, code, clip(str(exc), 1000), reason)  # counted by its trailer (interceptors/metrics.py)

    if inspect.isgeneratorfunction(method):  # a stream's reply: its refusals come as it is iterated

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if isinstance(request, Message):  # a stream of requests names its table as it is read
                CALL_TABLE.set(table_of(request))
            try:
                yield from method(self, request, context)
            except Exception as exc:
                abort(self, request, context, exc)

        return stream

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        CALL_TABLE.set(table_of(request))
        try:
            return method(self, request, context)
        except Exception as exc:
            abort(self, request, context, exc)

    return unary


def remaining(context: grpc.ServicerContext, limit: float | None = None) -> float:
    """Seconds left before the caller's deadline (bounded by limit), less what gRPC adds to it on
    the wire: a timeout travels rounded up to three digits (30 s arrives as 30.1, 100 s as 101),
    so a wait to the deadline the server sees, less a margin of 50 ms, ended after the client's,
    whose call ended DEADLINE_EXCEEDED without the refusal that names the table's limit (a push
    waiting for room under the client's default 30 s, every time)."""
    left = context.time_remaining()
    left = 3600.0 if left is None else max(0.0, left - DEADLINE_MARGIN - left * DEADLINE_ROUNDING)
    return left if limit is None else min(left, limit)


def ended(context: grpc.ServicerContext) -> Callable[[], bool]:
    """Whether a call has ended (its client cancelled, went away or passed its deadline): what a
    call that waits for room or data looks at, so that it stops waiting, and gives back the memory,
    the worker and the slot it holds, once no one waits for its answer."""
    return lambda: not context.is_active()


def max_wait_note(seconds: float) -> str:
    """What a refusal at the end of a wait adds when the server's max_wait_seconds ended it."""
    return f" (the server's max_wait_seconds = {seconds:g}, EXPBUF_MAX_WAIT_SECONDS)"


def room_wait(context: grpc.ServicerContext, most: float) -> tuple[float, str]:
    """How long a push may wait for room in a full table or under the rate limit: until its
    deadline, at most the server's max_wait_seconds `most` (it holds a worker thread meanwhile);
    and what its refusal then adds (max_wait_note) when `most` is what ends the wait."""
    left = remaining(context)
    return (left, "") if left <= most else (most, max_wait_note(most))


def noted(refusal: StoreError, note: str) -> StoreError:
    """`refusal`, with `note` after its message (a refusal of its class made anew) if there is one."""
    return type(refusal)(f"{refusal}{note}") if note else refusal


def distinct(names: list[str], what: str = "uids") -> list[str]:
    """The names a read names, each once: named twice, it would be read (and sent) twice."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidRequest(f"{what}: {clip(name)!r} is named more than once")
        seen.add(name)
    return names


def ids_of(values: Iterable[str], what: str) -> list[str]:
    """Uids or group ids of a request: each non-empty and no longer than a stored one can be."""
    ids = list(values)
    for value in ids:
        if not value or len(value.encode()) > trxp.MAX_UID_BYTES:
            raise InvalidRequest(
                f"{what}: {clip(value)!r} is not an id (ids are 1 to {trxp.MAX_UID_BYTES} bytes of UTF-8)"
            )
    return ids


# What the streamed reply's message being made now can give up should it wait long in gRPC's send
# (stalled_sends.py runs them): each copies out of the store's map what the rest of its reply still
# reads, and ends the read snapshot it was cut from (replies.py). None: no call watched.
_SLOW_SENDS: ContextVar[list[Callable[[], None]] | None] = ContextVar("expbuf_slow_sends", default=None)


def when_sent_slowly(let_go: Callable[[], None]) -> None:
    """`let_go` is to run, on a thread of its own, should the message being made now wait in
    gRPC's send longer than stalled_sends.SNAPSHOT_SECONDS; a call nobody watches runs none."""
    hooks = _SLOW_SENDS.get()
    if hooks is not None:
        hooks.append(let_go)


def made_watched(messages: Iterator[Any], end: object) -> tuple[Any, list[Callable[[], None]]]:
    """The next of `messages` (`end` after the last), and what its maker asked `when_sent_slowly`."""
    hooks: list[Callable[[], None]] = []
    token = _SLOW_SENDS.set(hooks)
    try:
        return next(messages, end), hooks
    finally:
        _SLOW_SENDS.reset(token)
