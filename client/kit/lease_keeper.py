"""A reader's leases (Trinity-RFT's reader, TorchRL's sampler), renewed while the reader lives,
so that they can be short.

A trainer holds a batch for a step, a checkpoint or an evaluation of any length, and a read of
groups of varying size holds what it has taken while it waits for more (up to Trinity's
`max_read_timeout`). A lease long enough for all of that would leave a killed trainer's groups
out of reach as long. Instead the lease is short and a background thread renews every lease
the reader holds a third of a lease apart: a renewal may fail twice (a server restart, a
network cut) before the lease ends. The thread stops when the reader is closed or collected,
and dies with its process, so a dead reader's groups return within one lease.

Renewer is that thread, shared with the claims a Trinity-RFT taskset holds on its prompts
(expbuf.client.trinity.claims); what it renews, and how, is its subclass's.
"""

from __future__ import annotations

import logging
import threading
from typing import Generic, TypeVar

import grpc

from expbuf.client.client import BufferClient, BufferError

log = logging.getLogger(__name__)
RENEWALS_PER_LEASE = 3
K = TypeVar("K")
V = TypeVar("V")


class Renewer(Generic[K, V]):
    """A thread that renews what its subclass holds (`_held`) every `seconds / 3`, from the
    first hold until closed, then closes its client."""

    def __init__(self, client: BufferClient, seconds: float, name: str) -> None:
        self._client = client  # its own channel, its calls bounded by the renewal period
        self._seconds = seconds
        self._name = name
        self._held: dict[K, V] = {}  # insertion-ordered
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def period(self) -> float:
        return self._seconds / RENEWALS_PER_LEASE

    def _keep(self, items: dict[K, V]) -> None:
        """Hold these (nothing once closed), starting the thread at the first."""
        with self._lock:
            if self._stop.is_set():
                return
            self._held.update(items)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop renewing; what is still held ends within one lease. Idempotent."""
        with self._lock:
            self._stop.set()
            self._held.clear()
            running = self._thread is not None
        if not running:
            self._client.close()  # else the thread closes it, after any renewal in flight

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.period):
                self._renew_held()
        finally:
            self._client.close()

    def _renew_held(self) -> None:
        raise NotImplementedError


class LeaseKeeper(Renewer[str, None]):
    """Renews the leases it holds every `seconds / 3`, each for `seconds` more, until closed."""

    def __init__(self, client: BufferClient, table: str, seconds: float) -> None:
        super().__init__(client, seconds, "expbuf-lease-keeper")
        self._table = table

    def hold(self, lease_id: str) -> None:
        """Keep this lease until it is dropped."""
        self._keep({lease_id: None})

    def drop(self, lease_id: str) -> None:
        """Stop keeping a lease: acknowledged or given back."""
        with self._lock:
            self._held.pop(lease_id, None)

    def _renew_held(self) -> None:
        with self._lock:
            leases = list(self._held)
        for lease in leases:
            if self._stop.is_set():
                return
            self._renew(lease)

    def _renew(self, lease: str) -> None:
        try:
            self._client.renew(lease, self._seconds, table=self._table)
        except BufferError as exc:
            with self._lock:
                still_held = lease in self._held and not self._stop.is_set()
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    self._held.pop(lease, None)
            if not still_held:
                return  # settled meanwhile: acknowledged, given back or closed
            if exc.code == grpc.StatusCode.NOT_FOUND:
                log.warning("expbuf: lease %s ended before it was renewed; its groups may be read again", lease)
            else:
                log.warning("expbuf: lease %s not renewed (%s); retrying in %.3g s", lease, exc, self.period)
