"""A stopping server's end of its long-lived streams.

gRPC's stop refuses new calls and lets those in flight run until its grace is over, then cancels
them. A PushStream idles between a rollout worker's pushes and a Sample stream waits for data, so
each would hold the stop for the whole grace and then end CANCELLED, which a client cannot tell
from a cancel of its own. So once the stop begins, each ends at its next safe point with
UNAVAILABLE, the status of a server that went away, which the clients answer by sending again to
the restarted server: a PushStream once it has answered every push it had read, a Sample stream
between batches (a batch not yet confirmed returns to the buffer, as on any broken stream). The
stop then lasts as long as the work in flight.

A Sample stream with batches sent ahead first tells a client that answers it that it is stopping,
and waits for the client's count of the batches it handed over, within the grace less
ANSWER_MARGIN (`answer_seconds`): the client may be handing one over as the status travels, and
that batch would be trained on and, back in the buffer, served again.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc

from expbuf.client.schema.reasons import Reason

from .interceptors.base import refuse

# What a stopping stream keeps of the grace for its status to reach the client before gRPC cancels
# the call: a wait for a client's answer ends this long before the grace does.
ANSWER_MARGIN = 1.0
SHUTTING_DOWN = (
    "the server is shutting down; send again on a new stream (the expbuf clients do so for UNAVAILABLE), "
    "to this server once it is back or to another"
)


def calls_left(server: grpc.Server) -> bool:
    """Whether `server`, stopping, still has calls to finish: calls in flight, or calls gRPC had
    begun to take when its stop came. gRPC keeps this in its server's state, not in its API; a
    gRPC that keeps it otherwise reads as having calls left, and its stop waits out the grace."""
    state = getattr(server, "_state", None)
    calls, due = getattr(state, "rpc_states", None), getattr(state, "due", None)
    if state is None or not isinstance(calls, set) or not isinstance(due, set):
        return True
    with state.lock:
        return bool(calls) or len(due) > 1  # its own shutdown's tag is due until the stop ends


class Draining:
    """Whether the server is stopping, told to each open stream as it begins, and the streams it ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopping = False
        self._until = math.inf  # when the stop's grace ends (monotonic clock)
        self._wakes: set[Callable[[], None]] = set()
        self.ended: Counter[str] = Counter()  # streams ended by the stop, by method

    @property
    def stopping(self) -> bool:
        return self._stopping

    def begin(self, grace: float | None) -> None:
        """The stop began, with `grace` seconds for the calls in flight (None: none): wake every
        open stream, so that each ends at its next safe point."""
        with self._lock:
            self._stopping = True
            self._until = time.monotonic() + (grace or 0.0)
            wakes = list(self._wakes)
        for wake in wakes:
            wake()

    def answer_seconds(self) -> float:
        """How long a stopping stream may wait for its client's answer: the grace left, less
        ANSWER_MARGIN (0 when none is left)."""
        return max(0.0, self._until - time.monotonic() - ANSWER_MARGIN)

    @contextlib.contextmanager
    def watching(self, wake: Callable[[], None]) -> Iterator[None]:
        """While open, a stream's `wake` is called when the stop begins (at once if it has)."""
        with self._lock:
            self._wakes.add(wake)
            stopping = self._stopping
        if stopping:
            wake()
        try:
            yield
        finally:
            with self._lock:
                self._wakes.discard(wake)

    def end(self, method: str, context: grpc.ServicerContext) -> NoReturn:
        """End a stream at its safe point: UNAVAILABLE, saying that the server is shutting down."""
        with self._lock:
            self.ended[method] += 1
        refuse(context, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN, Reason.SHUTTING_DOWN)
