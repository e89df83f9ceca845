"""The reads of unary calls' messages (a Push's, a PutValues') given a time to come, past which the
call is ended: gRPC's read of a message has no timeout, and a client that opens such a call and
never sends its message would hold a worker thread and what its read reserved of
max_inflight_bytes for as long as it keeps the call open (a few of them, and every push waits).

One thread of the server's own looks over the reads in progress once a second, and cancels the
call of each past its time (the read then raises, and its reservation is given back): a thread a
read would cost every push on its way. A PushStream's reads have theirs (limits.IdleMessages).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator

import grpc

log = logging.getLogger("expbuf.rpc")

TICK = 1.0  # how often the reads are looked over: a read ends at most this late


class SlowReads:
    """Reads in progress, each with the time it may take (`bounded`); the calls of those past it
    are cancelled (`expired` says whether a read's was)."""

    def __init__(self, tick: float = TICK) -> None:
        self.tick = tick
        self._reads: dict[int, tuple[float, grpc.ServicerContext]] = {}
        self._expired: set[int] = set()
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def bounded(self, context: grpc.ServicerContext, seconds: float) -> Iterator[int]:
        """Around a read of `context`'s message, which may take `seconds`: its key, for `expired`."""
        key = next(self._keys)
        with self._lock:
            self._reads[key] = (time.monotonic() + seconds, context)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="expbuf-slow-reads", daemon=True)
                self._thread.start()
        try:
            yield key
        finally:
            with self._lock:
                self._reads.pop(key, None)
                self._expired.discard(key)

    def expired(self, key: int) -> bool:
        """Whether the read of `key` ran past its time and its call was cancelled (inside `bounded`)."""
        with self._lock:
            return key in self._expired

    def _watch(self) -> None:
        while True:
            time.sleep(self.tick)
            now = time.monotonic()
            with self._lock:
                late = [(key, context) for key, (deadline, context) in self._reads.items() if deadline <= now]
                for key, _ in late:
                    del self._reads[key]
                    self._expired.add(key)
            for _, context in late:
                log.info("a call's message did not come in its time; the call is ended (%s)", context.peer())
                context.cancel()
