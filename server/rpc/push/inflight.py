"""The payload bytes pushes in progress hold, counted against `max_inflight_bytes`, which new
pushes wait for room under (InFlight; push_memory.py admits them), and the memory freed by large
pushes handed back to the system once pushes pause. A call whose client declared
the most its messages will be reserves that before each read (push_memory.py), so calls that
arrive together cannot each read a whole message past the cap.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

from expbuf.client.rpc.wire import MESSAGE_BYTES

from ...store import STOP_POLL_SECONDS

Stop = Callable[[], bool]  # whether the call a wait is for has ended (call_context.ended)
TRIM_AFTER = 16 << 20  # payload bytes pushed since the last trim that make one worth it
# How long no push may have held memory before it is handed back. A trim at the moment the last push
# in flight ended gave a lone pusher's stream its heap back every 16 MiB, and its next pushes
# faulted every page in again (2.5 faults an 8 KB experience, some 3 µs of the server's CPU).
TRIM_IDLE = 0.5

_M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2


def few_arenas() -> bool:
    """Let every thread allocate from at most ARENAS malloc arenas (glibc). By default each busy
    thread gets an arena of its own, and the free memory at the top of one (up to 64 MiB) goes
    back to the system only past the trim threshold that keep_reply_memory raises: each worker
    thread that received a large push kept that much. In two arenas malloc_trim hands it back.
    False where the C library is not glibc."""
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, ARENAS))
    except (OSError, AttributeError):
        return False


def _malloc_trim() -> Callable[[], None]:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return lambda: None
    return lambda: trim(0)


MIN_WINDOW, MAX_WINDOW = 64 << 10, 16 << 20  # what gRPC may take in of a call's messages unasked


def receive_window(max_inflight_bytes: int, workers: int) -> list[tuple[str, int]]:
    """The server's gRPC options that bound what it takes in of a call's messages before they are
    read: a share of max_inflight_bytes per worker (64 KiB to 16 MiB), where gRPC's probes of the
    link (BDP) let any stream take in tens of MB unasked, whole messages that max_inflight_bytes,
    counting what is read, never saw. A message being read still opens its stream's window to its
    own size. On a link of long round trips a stream's pushes then come at about this window a
    round trip (16 MiB by default: 320 MiB/s at 50 ms)."""
    window = max(MIN_WINDOW, min(MAX_WINDOW, max_inflight_bytes // max(1, workers)))
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window)]


class InFlight:
    """The payload bytes held by pushes in progress, and the cap that makes new ones wait."""

    def __init__(self, limit: int, trim: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self._changed = threading.Condition()
        self._held = 0
        self._reading = [0, 0]  # of what is held: the reads begun for a declared message, and their bytes
        self._waiting = 0  # pushes waiting for room
        self._owners: dict[object, int] = {}  # pushes holding memory, by the stream they came on
        self._since_trim = 0
        self._quiet_from = 0.0  # when the last push holding memory gave it back (time.monotonic)
        self._trimmer: threading.Timer | None = None  # the trim waiting for pushes to pause
        self._trim = _malloc_trim() if trim is None else trim

    @property
    def held(self) -> int:
        return self._held

    @property
    def waiting(self) -> int:
        return self._waiting

    def admit(self, timeout: float, owner: object = None, stop: Stop | None = None) -> str | None:
        """Wait until a push may read its message, up to `timeout` or until `stop()` says its call
        ended; the refusal if it may not. The time is counted only while `owner` (a stream) holds
        nothing: its own pushes give back theirs."""
        with self._changed:
            return self._wait_for(lambda: self._held < self.limit, timeout, owner, "", stop)

    def fits(self, size: int) -> bool:
        """Whether `size` bytes fit beside what is held now."""
        return self._held + size <= self.limit

    def reserve(
        self,
        size: int,
        timeout: float,
        owner: object = None,
        what: str = "",
        reading: bool = False,
        stop: Stop | None = None,
    ) -> Callable[[], None] | str:
        """Hold `size` bytes (at most the limit: what a push in chunks announces, or, `reading`, what
        a message to be read may be) once they fit beside what is held, waiting as admit() does;
        the function that gives them back, or the refusal (after `what`)."""
        with self._changed:
            refused = self._wait_for(lambda: self._held + size <= self.limit, timeout, owner, what, stop)
            if refused is not None:
                return refused
            release = self.hold(size, owner)
            if not reading:
                return release
            self._reading[0] += 1
            self._reading[1] += size

        def read() -> None:
            with self._changed:
                self._reading[0] -= 1
                self._reading[1] -= size
            release()

        return read

    def hold_now(self, size: int, owner: object = None) -> Callable[[], None] | None:
        """Hold `size` bytes (of `owner`'s) if they fit beside what is held now; None if not."""
        with self._changed:
            return self.hold(size, owner) if self._held + size <= self.limit else None

    def holders(self) -> str:
        """What holds the room, for a refusal: the payload of the pushes and PutValues in progress,
        and what the reads begun for a declared message hold for it."""
        calls, reading = self._reading
        line = f"pushes and PutValues in progress hold {self._held - reading} bytes of payload"
        if calls:
            line += (
                f", and reads begun hold {reading} bytes for the next message of {calls} call{'s' * (calls != 1)} "
                f"(what the call declared a message may be, {MESSAGE_BYTES}; a PushStream open but silent holds "
                "it until its message comes, it ends, or push_stream_idle_seconds)"
            )
        return line

    def _wait_for(
        self, fits: Callable[[], bool], timeout: float, owner: object, what: str, stop: Stop | None = None
    ) -> str | None:
        """Wait (the lock held) until `fits()`, as admit() says; the refusal, after `what`, if not in
        time, or once `stop()` (looked at every STOP_POLL_SECONDS) says its call ended."""
        deadline = None
        poll = None if stop is None else STOP_POLL_SECONDS
        self._waiting += 1
        try:
            while not fits():
                if stop is not None and stop():
                    return f"{what}the call ended while it waited for room under max_inflight_bytes"
                if self._owners.get(owner):
                    deadline = None
                    self._changed.wait(poll)
                    continue
                if deadline is None:
                    deadline = time.monotonic() + timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    return (
                        f"{what}{self.holders()}, the limit is max_inflight_bytes = {self.limit} (raise it with "
                        "EXPBUF_MAX_INFLIGHT_BYTES or in the config file, or retry later)"
                    )
                self._changed.wait(left if poll is None else min(left, poll))
            return None
        finally:
            self._waiting -= 1

    def hold(self, size: int, owner: object = None) -> Callable[[], None]:
        """Count a read payload (of `owner`'s) until the function returned is called."""
        with self._changed:
            self._held += size
            self._since_trim += size
            if owner is not None:
                self._owners[owner] = self._owners.get(owner, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            with self._changed:
                self._held -= size
                if owner is not None:
                    self._owners[owner] -= 1
                    if not self._owners[owner]:
                        del self._owners[owner]
                self._changed.notify_all()
                if self._held == 0 and self._since_trim >= TRIM_AFTER:
                    self._quiet_from = time.monotonic()
                    if self._trimmer is None:
                        self._arm(TRIM_IDLE)

        return release

    def _arm(self, delay: float) -> None:
        """Trim after `delay` if no push held memory meanwhile (the lock held). Where no thread can
        start now, the next push's release tries again."""
        trimmer = threading.Timer(delay, self._trim_if_quiet)
        trimmer.daemon = True
        try:
            trimmer.start()
        except RuntimeError:  # can't start new thread
            return
        self._trimmer = trimmer

    def _trim_if_quiet(self) -> None:
        """The heap keeps freed blocks of large pushes for the pushes that follow; once none has
        held memory for TRIM_IDLE, they go back to the system."""
        with self._changed:
            self._trimmer = None
            if self._held:  # the release that ends it arms the next
                return
            quiet = time.monotonic() - self._quiet_from
            if quiet < TRIM_IDLE:
                self._arm(TRIM_IDLE - quiet)
                return
            self._since_trim = 0
        self._trim()
