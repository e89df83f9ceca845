"""Reporter: the worker's thread that tells the table what the trainer did, whatever the
server's state: the trainer's version, the acks of trained batches and the leases given back.
The leases held meanwhile are the kit's LeaseKeeper's, which renews them and makes each ack
and give-back; the reporter makes them off the trainer's thread, in order.

Nothing here blocks the trainer: a call the server cannot take now (it restarts, say) is made
again at the next round, an ack as one tried before (LeaseKeeper.ack: a lease found gone then
was consumed by the attempt whose reply was lost), and a give-back until its lease would have
ended anyway: a batch whose stream broke when the server went away is given back once it is
back, not held from every trainer for the rest of its lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from ..client import BufferClient
from ..errors import ExpbufError
from ..kit.lease_keeper import LeaseKeeper
from ..kit.retry import Retry
from ..results import Batch

log = logging.getLogger("expbuf.trl")

# Codes a call may get from a server that is restarting, busy or cut off: try again later.
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
    }
)
MAX_PERIOD = 5.0  # seconds at most between the tries of what a server could not take


class Reporter:
    def __init__(
        self,
        client: BufferClient,
        table: str,
        leases: LeaseKeeper,
        *,
        answered: Callable[[], None],
        failed: Callable[[ExpbufError], None],
        metric: Callable[[str, float], None],
    ) -> None:
        self.client = client
        self.table = table
        self.leases = leases
        self._answered = answered
        self._failed = failed
        self._metric = metric
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._version: int | None = None
        self._version_told: int | None = None
        self._acks: dict[str, bool] = {}  # lease -> an attempt was made
        self._nacks: dict[str, float] = {}  # lease -> when it ends anyway (Unix time): given back until then
        self._thread: threading.Thread | None = None

    @property
    def period(self) -> float:
        """Seconds between the tries of what the server could not take."""
        return min(MAX_PERIOD, self.leases.period)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="expbuf-trl-reporter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread, then make the last rounds here: acks first, then what goes back; again
        while acks are left and the server is unavailable, for the client's timeout, so that a
        trained batch is not left to its lease's end (and served again) by a restart as training
        ends."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        retry = Retry(self.client.timeout)
        while True:
            self.round()
            with self._lock:
                left = len(self._acks)
            pause = retry.pause() if left else None
            if pause is None:
                break
            time.sleep(pause)
        if left:
            log.warning("expbuf table %s: %d trained batches not acked; back when their leases end", self.table, left)

    def set_version(self, version: int) -> None:
        with self._lock:
            self._version = version
        self._wake.set()

    def ack(self, batches: list[Batch]) -> None:
        with self._lock:
            self._acks.update((batch.lease_id, False) for batch in batches)
        if batches:
            self._wake.set()

    def give_back(self, batches: list[Batch]) -> None:
        with self._lock:
            for batch in batches:
                ends = max(batch.lease_expires, self.leases.expires(batch.lease_id) or 0.0)
                self._nacks.setdefault(batch.lease_id, ends)
        if batches:
            self._wake.set()

    def pending(self) -> int:
        """Acks and give-backs not yet made."""
        with self._lock:
            return len(self._acks) + len(self._nacks)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.period)
            self._wake.clear()
            if not self._stop.is_set():
                self.round()

    def round(self) -> None:
        """One pass: the version, the acks, then the give-backs."""
        try:
            self._tell_version()
            self._make_acks()
        except ExpbufError as exc:
            if exc.code not in TRANSIENT or self.client.closed:  # a closed client's refusal is for good
                self._failed(exc)
                return
            log.info("expbuf table %s: %s; trying again in %.1fs", self.table, exc, self.period)
        self._give_back()

    def _tell_version(self) -> None:
        with self._lock:
            version = self._version
        if version is not None and version != self._version_told:
            self.client.set_trainer_version(version, self.table)
            self._version_told = version
            self._answered()

    def _make_acks(self) -> None:
        with self._lock:
            acks = list(self._acks.items())
        for lease, tried in acks:
            try:
                acked = self.leases.ack(lease, tried=tried)
            except ExpbufError as exc:
                if exc.code in TRANSIENT:
                    with self._lock:
                        self._acks[lease] = True
                raise
            with self._lock:
                del self._acks[lease]
            self._answered()
            if acked:
                self._metric("expbuf/acked_total", float(acked))

    def _give_back(self) -> None:
        """Give back what goes back; one the server cannot take now is tried again at the next
        round, until its lease (which the keeper no longer renews) ends and returns it."""
        with self._lock:
            nacks = dict(self._nacks)
        for lease, ends in nacks.items():
            given = self.leases.give_back(lease)
            if given or time.time() >= ends:
                with self._lock:
                    self._nacks.pop(lease, None)
            if given:
                self._answered()
