"""A reader's leases, renewed while the reader lives, so that they can be short, and settled
(acknowledged or given back) in one way by every adapter.

A trainer holds a batch for a step, a checkpoint or an evaluation of any length, and a read of
groups of varying size holds what it has taken while it waits for more (up to Trinity's
`max_read_timeout`). A lease long enough for all of that would leave a killed trainer's groups
out of reach as long. Instead the lease is short and a background thread renews every lease
the reader holds a third of a lease apart: a renewal may fail twice (a server restart, a
network cut) before the lease ends. The thread stops when the reader is closed or collected,
and dies with its process, so a dead reader's groups return within one lease.

A lease found gone (at a renewal, or at the first attempt of its ack) had ended: its groups went
back to the table and may be trained again, which the keeper logs once and tells its `lost`
callback. An ack is not idempotent: one made again after an attempt whose reply was lost (a
restart) may find its lease gone because the first attempt consumed it, which is no loss.

Renewer is that thread, shared with the claims a Trinity-RFT taskset holds on its prompts
(expbuf.client.trinity.claims); what it renews, and how, is its subclass's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from expbuf.client.client import BufferClient
from expbuf.client.errors import ExpbufError, NotFoundError, UnavailableError

from .retry import Retry

log = logging.getLogger(__name__)
RENEWALS_PER_LEASE = 3
K = TypeVar("K")
V = TypeVar("V")


class Renewer(Generic[K, V]):
    """A thread that renews what its subclass holds (`_held`) every `seconds / 3`, from the
    first hold until closed, then closes its client (with `closes`: one of its own)."""

    def __init__(self, client: BufferClient, seconds: float, name: str, *, closes: bool = True) -> None:
        self._client = client  # its own channel, its calls bounded by the renewal period
        self._closes = closes
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
        if not running and self._closes:
            self._client.close()  # else the thread closes it, after any renewal in flight

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.period):
                self._renew_held()
        finally:
            if self._closes:
                self._client.close()

    def _renew_held(self) -> None:
        raise NotImplementedError


class LeaseKeeper(Renewer[str, float]):
    """Keeps the leases it holds: renews each every `seconds / 3`, for `seconds` more, over its
    own `renewals` client (closed with the keeper), and acks or gives one back over `client`.
    With no `renewals`, renewals go over `client` too, which the keeper then leaves open."""

    def __init__(
        self,
        client: BufferClient,
        table: str,
        seconds: float,
        *,
        renewals: BufferClient | None = None,
        lost: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(renewals or client, seconds, "expbuf-lease-keeper", closes=renewals is not None)
        self._settles = client
        self._table = table
        self._lost = lost or (lambda lease: None)
        self._gone: set[str] = set()  # leases found ended, told once

    def settle_over(self, client: BufferClient) -> None:
        """Acknowledge and give back over `client` from now: its owner's client, opened again
        after a close (the leases it holds are the same server's)."""
        self._settles = client

    def hold(self, lease_id: str, expires: float = 0.0) -> None:
        """Keep this lease until it is acknowledged, given back or dropped."""
        self._keep({lease_id: expires})

    def drop(self, lease_id: str) -> None:
        """Stop keeping a lease (settled some other way)."""
        with self._lock:
            self._held.pop(lease_id, None)

    def expires(self, lease_id: str) -> float | None:
        """When a held lease ends (Unix seconds) as its last renewal said; 0.0 before the first."""
        with self._lock:
            return self._held.get(lease_id)

    def ack(self, lease_id: str, *, retry_for: float = 0.0, tried: bool = False) -> int:
        """Acknowledge a lease: its groups were trained. Tried again while the server is
        unavailable, for `retry_for` seconds; `tried`: an attempt was made before and may have
        been committed. The experiences acknowledged; 0 for a lease found gone."""
        retry = Retry(retry_for)
        with self._lock:
            expires = self._held.pop(lease_id, None)  # no renewal races the ack
        try:
            while True:
                try:
                    return self._settles.ack(lease_id, self._table)
                except UnavailableError:
                    tried = True
                    pause = retry.pause()
                    if pause is None:
                        raise
                    time.sleep(pause)
        except NotFoundError:
            if not tried:
                self._ended(lease_id, "acknowledged")
            return 0
        except ExpbufError:
            if expires is not None and not getattr(self._settles, "closed", False):
                self.hold(lease_id, expires)  # kept while the ack is to be made again (never, on a closed client)
            raise

    def give_back(self, lease_id: str) -> bool:
        """Return a lease's groups to the table now; False when that failed (the server out of
        reach), and the lease, no longer renewed, returns them when it ends."""
        self.drop(lease_id)
        try:
            self._settles.nack(lease_id, self._table)
        except NotFoundError:
            return True  # ended already: its groups went back
        except ExpbufError as exc:
            log.warning(
                "expbuf table %s: lease %s not given back (%s); it returns when it ends", self._table, lease_id, exc
            )
            return False
        return True

    def _renew_held(self) -> None:
        with self._lock:
            leases = list(self._held)
        for lease in leases:
            if self._stop.is_set():
                return
            self._renew(lease)

    def _renew(self, lease: str) -> None:
        try:
            expires = self._client.renew(lease, self._seconds, table=self._table)
        except ExpbufError as exc:
            with self._lock:
                still_held = lease in self._held and not self._stop.is_set()
                if isinstance(exc, NotFoundError):
                    self._held.pop(lease, None)
            if not still_held:
                return  # settled meanwhile: acknowledged, given back or closed
            if isinstance(exc, NotFoundError):
                self._ended(lease, "renewed")
            else:
                log.warning("expbuf: lease %s not renewed (%s); retrying in %.3g s", lease, exc, self.period)
            return
        with self._lock:
            if lease in self._held:
                self._held[lease] = expires

    def _ended(self, lease: str, what: str) -> None:
        """A held lease was found gone: said once, and told to `lost`."""
        with self._lock:
            if lease in self._gone:
                return
            self._gone.add(lease)
        log.error(
            "expbuf table %s: lease %s ended before it was %s (not renewed for a whole lease_seconds): its groups "
            "went back to the table and may be trained again",
            self._table,
            lease,
            what,
        )
        self._lost(lease)
