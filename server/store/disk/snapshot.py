"""Read transactions whose values are views into the LMDB map, for sampled batches.

A sampled batch is megabytes of stored payloads that are read once, into its reply.
Copied out of LMDB when the batch is taken, each byte would be copied twice; read from a
snapshot (a read transaction opened while the batch is taken, so it sees the last
committed state) they are memoryviews into the map, copied once, into the reply. The
views are valid only while the snapshot's transaction is open: they are used under its
lock (`reading`), and the transaction ends when the batch is released, when it is
garbage, or when the environment must end it (a map resize or a close, or too many open:
`detach` then copies the views first, so the batch stays readable). The writer that opens
one too many does not wait for a reply being built from the oldest: it marks it, and the
reply's thread detaches it as its reading ends. The views of a reply whose client reads slowly
are copied only where their `charge` (the server's memory bound on replies) has room: else
they are let go, and the reply's next read raises ReplyLetGo (its call ends, its batch back).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import lmdb

from expbuf.client.trxp.stored.pieces import SplitPayload

from ..schema.errors import ReplyLetGo, StoreError
from .layout import next_prefix

Value = bytes | memoryview | SplitPayload
T = TypeVar("T")
# What counts a detach's copy of held views against a bound: given their bytes, whether they fit
# (counted then, until their holder gives them back), or not (the views are let go, not copied).
Charge = Callable[[int], bool]


class Snapshot:
    """One read transaction with buffers, and the lists of views read from it."""

    def __init__(self, txn: lmdb.Transaction[memoryview], done: Callable[[], None]) -> None:
        self._txn: lmdb.Transaction[memoryview] | None = txn
        self._done = done
        self._lock = threading.Lock()
        self._held: list[tuple[list[Any], Charge | None]] = []
        self._released = False
        self._let_go = False  # views a charge had no room to copy were dropped: a read raises ReplyLetGo
        self._detach_asked = False  # by an opener of another that found it being read
        self.pinned = True  # until its opener has held the views it read (unpin): none detaches it then

    @property
    def open(self) -> bool:
        return self._txn is not None

    def get(self, key: bytes, db: lmdb._Database) -> memoryview | None:
        """A value as a view into the map (only while the snapshot is open)."""
        assert self._txn is not None
        return self._txn.get(key, db=db)

    def get_all(self, keys: Iterable[bytes], db: lmdb._Database) -> list[memoryview | None]:
        """`get` of each key, in one call (a take reads hundreds): through one cursor, which finds a
        key on the page it is on without a search from the root, and whose calls take no keyword.
        Its views stay valid while the snapshot is open, as `get`'s do."""
        assert self._txn is not None
        with self._txn.cursor(db=db) as cur:
            found, value = cur.set_key, cur.value
            return [value() if found(key) else None for key in keys]

    def last_key(self, prefix: bytes, db: lmdb._Database) -> bytes | None:
        """The greatest key that starts with prefix, or None."""
        assert self._txn is not None
        end = next_prefix(prefix)
        with self._txn.cursor(db=db) as cur:
            found = (cur.prev() if cur.set_range(end) else cur.last()) if end is not None else cur.last()
            return bytes(cur.key()) if found and cur.key()[: len(prefix)] == prefix else None

    def unpin(self) -> None:
        """Its opener has held (`hold`) what it read, or reads under `reading`: from now on the
        opening of another may detach it (a map resize or a close detaches it whatever)."""
        self.pinned = False

    def hold(self, values: list[T], charge: Charge | None = None) -> list[T]:
        """Values (views of this snapshot among them) that `detach` turns into copies; with a
        `charge`, only where it has room for them (else they are let go: a read raises)."""
        self._held.append((values, charge))
        return values

    def forget(self, values: list[Any]) -> None:
        """Held values no longer read (emptied here), while reading (`reading`: no detach runs
        meanwhile): a detach copies them no more."""
        self._held = [(held, charge) for held, charge in self._held if held is not values]
        values.clear()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """The held views stay valid inside; a released snapshot's are gone."""
        with self._lock:
            if self._released:
                raise StoreError("the batch's payload was released once its reply was built")
            if self._let_go:
                raise ReplyLetGo(
                    "the reply was ended: its client read none of it while the store ended the snapshot it was read"
                    " from (the map grew, or more snapshots were open than the server keeps), and the replies"
                    " its clients have not taken held the server's max_inflight_bytes, so the rest could not be"
                    " copied; the batch went back to the buffer, to be served again"
                )
            try:
                yield
            finally:
                if self._detach_asked:
                    self._detach()

    def detach(self, wait: bool = True) -> None:
        """Copy every view still held, then end the transaction; without `wait`, a snapshot
        being read is detached by its reader as the reading ends (or, should that reading be
        ending as this asks, by the next call)."""
        if wait:
            self._lock.acquire()
        else:
            self._detach_asked = True
            if not self._lock.acquire(blocking=False):
                return
        try:
            self._detach()
        finally:
            self._lock.release()

    def _detach(self) -> None:
        self._detach_asked = False
        if self._txn is None:
            return
        for values, charge in self._held:
            if charge is not None and not charge(sum(len(v) for v in values if not isinstance(v, bytes))):
                values.clear()
                self._let_go = True
            else:
                values[:] = [_owned(v) for v in values]
        self._end()

    def release(self) -> None:
        """End the transaction without copying: the views are dropped, not to be read again."""
        with self._lock:
            if self._txn is not None:
                self._released = True
                for values, _ in self._held:
                    values.clear()
                self._end()

    def _end(self) -> None:
        txn, self._txn = self._txn, None
        self._held = []
        if txn is not None:
            txn.abort()
            self._done()

    def __del__(self) -> None:
        if self._txn is not None:  # garbage: nothing can read its views any more
            self._end()


def _owned(value: Any) -> Any:
    """A value copied out of the map, if it is a view of it (or made of views, or reads them:
    chunk_reads.Deferred, which has a `detach`)."""
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, SplitPayload):
        return value.owned()
    detach = getattr(value, "detach", None)
    return detach() if detach is not None else value
