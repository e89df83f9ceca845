"""A stopping server's end of its long-lived streams.

gRPC's stop refuses new calls and lets those in flight run until its grace is over, then cancels
them. A PushStream idles between a rollout worker's pushes and a Sample stream waits for data, so
each would hold the stop for the whole grace and then end CANCELLED, which a client cannot tell
from a cancel of its own. So once the stop begins, each ends at its next safe point with
UNAVAILABLE, the status of a server that went away, which the clients answer by sending again to
the restarted server: a PushStream once it has answered every push it had read, a Sample stream
between batches (a batch not yet confirmed returns to the buffer, as on any broken stream). The
stop then lasts as long as the work in flight.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc

from expbuf.client.schema.reasons import Reason

from .interceptors.base import refuse

SHUTTING_DOWN = (
    "the server is shutting down; send again on a new stream (the expbuf clients do so for UNAVAILABLE), "
    "to this server once it is back or to another"
)


class Draining:
    """Whether the server is stopping, told to each open stream as it begins, and the streams it ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopping = False
        self._wakes: set[Callable[[], None]] = set()
        self.ended: Counter[str] = Counter()  # streams ended by the stop, by method

    @property
    def stopping(self) -> bool:
        return self._stopping

    def begin(self) -> None:
        """The stop began: wake every open stream, so that each ends at its next safe point."""
        with self._lock:
            self._stopping = True
            wakes = list(self._wakes)
        for wake in wakes:
            wake()

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
