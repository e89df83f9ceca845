"""LeaseKeeper: the worker's thread that tells the table what the trainer did, whatever the
server's state: the trainer's version, the acks of trained batches, the leases given back,
and renewals of the leases still held, so that no step, however long, loses its batches.

Nothing here blocks the trainer: a call the server cannot take now (it restarts, say) is made
again at the next round. An ack is not idempotent, so an ack retried after an attempt whose
reply was lost may find its lease gone (NOT_FOUND): the first attempt consumed it. A lease
found gone at a first attempt had expired: its groups go to a trainer again, which the
worker counts (`expbuf/leases_lost_total`) and logs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from ..client import BufferClient
from ..errors import ExpbufError
from ..results import Batch
from .leases import LeaseBook

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


class LeaseKeeper:
    def __init__(
        self,
        client: BufferClient,
        table: str,
        book: LeaseBook,
        lease_seconds: float,
        *,
        answered: Callable[[], None],
        failed: Callable[[ExpbufError], None],
        metric: Callable[[str, float], None],
    ) -> None:
        self.client = client
        self.table = table
        self.book = book
        self.lease_seconds = lease_seconds
        self._answered = answered
        self._failed = failed
        self._metric = metric
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._version: int | None = None
        self._version_told: int | None = None
        self._acks: dict[str, tuple[Batch, bool]] = {}  # lease -> (batch, an attempt was made)
        self._nacks: dict[str, Batch] = {}
        self._gone: set[str] = set()  # leases found expired, counted once
        self._thread: threading.Thread | None = None

    @property
    def period(self) -> float:
        """Seconds between rounds: a lease is renewed when half of it is left."""
        return min(5.0, self.lease_seconds / 4)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="expbuf-trl-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread, then make one last round here: acks first, then what goes back."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.round(renew=False)

    def set_version(self, version: int) -> None:
        with self._lock:
            self._version = version
        self._wake.set()

    def ack(self, batches: list[Batch]) -> None:
        with self._lock:
            self._acks.update((batch.lease_id, (batch, False)) for batch in batches)
        if batches:
            self._wake.set()

    def give_back(self, batches: list[Batch]) -> None:
        with self._lock:
            self._nacks.update((batch.lease_id, batch) for batch in batches)
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
                self.round(renew=True)

    def round(self, *, renew: bool) -> None:
        """One pass: the version, the acks, the give-backs and (with `renew`) the renewals."""
        try:
            self._tell_version()
            self._make_acks()
            self._give_back()
            if renew:
                self._renew()
        except ExpbufError as exc:
            if exc.code not in TRANSIENT:
                self._failed(exc)
                return
            log.info("expbuf table %s: %s; trying again in %.1fs", self.table, exc, self.period)

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
        for lease, (batch, tried) in acks:
            try:
                acked = batch.ack()
            except ExpbufError as exc:
                if exc.code in TRANSIENT:
                    with self._lock:
                        self._acks[lease] = (batch, True)
                    raise
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
                if not tried:
                    self._lost(batch, "acked")
                acked = 0
            with self._lock:
                del self._acks[lease]
            self._answered()
            if acked:
                self._metric("expbuf/acked_total", float(acked))

    def _give_back(self) -> None:
        with self._lock:
            nacks = list(self._nacks.items())
        for lease, batch in nacks:
            try:
                batch.nack()
            except ExpbufError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
            with self._lock:
                del self._nacks[lease]
            self._answered()

    def _renew(self) -> None:
        for batch in self.book.held():
            if batch.lease_id in self._gone or batch.lease_expires - time.time() > self.lease_seconds / 2:
                continue
            try:
                batch.renew(self.lease_seconds)
            except ExpbufError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
                self._lost(batch, "renewed")
            self._answered()

    def _lost(self, batch: Batch, what: str) -> None:
        if batch.lease_id in self._gone:
            return
        self._gone.add(batch.lease_id)
        log.warning(
            "expbuf table %s: lease %s (groups %s) had expired when it was to be %s; its groups go to a trainer again",
            self.table,
            batch.lease_id,
            ", ".join(batch.groups[:4]),
            what,
        )
        self._metric("expbuf/leases_lost_total", 1.0)
