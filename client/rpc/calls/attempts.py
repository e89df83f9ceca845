"""How a client makes a call again: after a refusal that did nothing (the server's calls that wait
were as many as it lets), a push in chunks after UNAVAILABLE, or as the call an older server
answers instead (`Attempts`); and the one reply of a call answered over a stream (`one_reply`).
Both clients' runners use them (client.py, aio.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Generic, TypeVar

import grpc

from ...errors import ExpbufError
from ...schema.call_limits import LARGE_REPLIES
from ...schema.reasons import Reason
from ..connection import BACKOFF
from ..declare import Chunked, Unary

R = TypeVar("R")

# What a call kept out, then made again and unanswered at its deadline, says of that last attempt
# (Attempts.answer, a pusher's push: pipeline.Pending.unanswered).
LAST_UNANSWERED = (
    "made again until its deadline; the last attempt was not answered by then, so whether it got in is unknown"
)


class Attempts(Generic[R]):
    """The attempts of one call, `call` the next. The server lets only so many calls wait at once
    (each holds a server thread while it waits) and refuses the others at once, as having done
    nothing (ExpbufError.busy). Such a refusal of a call that waits there is not its caller's
    answer: the call is made again after a pause, as gRPC's retry policy pauses
    (connection.BACKOFF). A claim or an admit with a `wait` (its request's wait_seconds) waits
    what is left of it; once its wait is spent, it is made once more without waiting, so that it
    answers with what there is. A push, which waits for room in a full table in block mode, or
    for the rate limit (or, as a PutValues does, for max_inflight_bytes), is made as it was: it
    stored nothing, and is stored once however often it is sent. So is a read whose reply the
    server would not hold beside the replies its clients have not taken (`replies_full`). No attempt ends past the first
    one's deadline (the call's timeout, else the client's `timeout`); the refusal that comes when
    none may start before it is the caller's, and so it is when the last one started has too
    little of that deadline left for its answer to come back (`answer`).

    A push in chunks goes over a channel without gRPC's retries (connection.RETRIED_METHODS says
    why), so it is made again here after UNAVAILABLE (the server stopped, or went away, while it
    was on its way), whole from its first chunk, as the retry policy would: up to the client's
    `retries` times, after its pauses. The server stores nothing of a push in chunks it did not
    read to its end, and one it stored comes back as duplicates."""

    def __init__(self, call: Unary[R] | Chunked[R], timeout: float, retries: int = 0) -> None:
        self.call = call
        start = time.monotonic()
        self._pushes = isinstance(call, Chunked) or call.method in ("Push", "PutValues")
        self._reads = isinstance(call, Unary) and call.method in LARGE_REPLIES  # made again after replies_full
        self._waits_until = start + _wait(call)
        self._deadline = start + (call.timeout or timeout)
        self._made = 0  # attempts made again
        self._kept_out: ExpbufError | None = None  # the last refusal that kept the call out
        self._resends = retries if isinstance(call, Chunked) and call.retry else 0  # after UNAVAILABLE, left

    def after(self, error: ExpbufError) -> float | None:
        """The pause before the call is made again (`call` is then that attempt), or None when
        `error` is the call's answer."""
        call = self.call
        if error.code == grpc.StatusCode.UNIMPLEMENTED and isinstance(call, Unary) and call.fallback is not None:
            self.call = replace(call.fallback, timeout=call.timeout)
            return 0.0
        waits = _wait(call) > 0  # not once it is made without waiting
        resend = error.code == grpc.StatusCode.UNAVAILABLE and self._resends > 0
        unsent = self._reads and error.reason == Reason.REPLIES_FULL  # the replies of reads not yet taken
        if not (error.busy and (waits or self._pushes or unsent)) and not resend:
            return None
        if error.busy:
            self._kept_out = error
        now = time.monotonic()
        pause = BACKOFF.pause(self._made)
        self._made += 1
        if resend:
            self._resends -= 1
        if waits:
            pause = max(0.0, min(pause, self._waits_until - now))
        start = now + pause
        if start >= self._deadline:
            return None
        if isinstance(call, Unary) and waits:
            request = type(call.request)()
            request.CopyFrom(call.request)
            request.wait_seconds = max(0.0, self._waits_until - start)
            call = replace(call, request=request)
        self.call = replace(call, timeout=self._deadline - start)
        return pause

    def answer(self, error: ExpbufError) -> ExpbufError:
        """What the caller gets when `error` ends the call (`after` returned None): `error`, but
        for an attempt made again after the server kept the call out that reached the call's
        deadline unanswered (DEADLINE_EXCEEDED with no reason of the server's: the client's own).
        How much of the deadline that attempt had is down to where the pauses fell and to how
        loaded the machines are, so the caller gets what kept the call out, whatever it was, with
        the refusal's code and reason, saying that the last attempt went unanswered. Not `busy`:
        whether that attempt got in is unknown (a push made again is stored once)."""
        kept_out = self._kept_out
        if kept_out is None or error.code != grpc.StatusCode.DEADLINE_EXCEEDED or error.reason is not None:
            return error
        return ExpbufError(kept_out.code, f"{kept_out.details} ({LAST_UNANSWERED})", kept_out.reason)


def _wait(call: Unary[Any] | Chunked[Any]) -> float:
    """The seconds `call` asks the server to wait (a claim's or an admit's wait_seconds), 0 for none."""
    return float(getattr(call.request, "wait_seconds", 0.0)) if isinstance(call, Unary) else 0.0


def one_reply(replies: list[Any], method: str = "PushStream") -> Any:
    """The reply to a push sent in chunks, or to a ReadFields once put together: its stream answers it once."""
    if len(replies) != 1:
        raise ExpbufError(grpc.StatusCode.INTERNAL, f"{method} answered one call {len(replies)} times")
    return replies[0]
