"""The LMDB environment of a data directory, and the one thread that writes to it.

Every change goes through the writer thread, which takes every request waiting in its
queue, applies them in one write transaction (each in a nested transaction, so one
refused request leaves the others intact) and commits once with fsync: concurrent
callers share the cost of the fsync, and each returns only after that commit. A full
map doubles (once no reader holds a transaction) up to `max_map_size` and the batch is
retried; a full disk or an I/O error fails the batch, committing nothing. Only one
process may open a data directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from ..errors import StorageFull, StoreClosed, StoreError
from . import layout
from .snapshot import Snapshot

T = TypeVar("T")
# What brings a directory to the current format (migrate.py's `migrate`), given by the Store:
# it works on tables, a layer above the environment.
Migration = Callable[[lmdb.Transaction, lmdb.Environment, dict[str, lmdb._Database], Path], Any]
# Snapshots open at once (see snapshot()); each holds one of LMDB's reader slots.
MAX_SNAPSHOTS = 16


@dataclass(frozen=True)
class _Op:
    fn: Callable[[lmdb.Transaction], Any]
    future: Future


class Environment:
    """A data directory's LMDB environment, its named databases and its writer thread."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 1 << 30,
        max_map_size: int = 1 << 40,
        batch_limit: int = 512,
        migrate: Migration,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.path / "expbuf.lock", "a+")  # noqa: SIM115 - held for the store's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise StoreError(f"another expbuf process is using {self.path}") from None
        self.max_map_size = max_map_size
        self._batch_limit = batch_limit
        try:
            self.env = lmdb.open(
                str(self.path), map_size=map_size, max_dbs=layout.MAX_DBS, sync=True, metasync=True, readahead=False
            )
            self.db = {name: self.env.open_db(name.encode()) for name in layout.DBS}
            self._migrate(migrate)
        except BaseException:
            if hasattr(self, "env"):
                self.env.close()
            self._lock_file.close()
            raise
        self._readers = 0
        self._resizing = False
        self._snapshots: list[weakref.ref[Snapshot]] = []  # opened by the writer thread only
        self._gate = threading.Condition()
        self._changed = threading.Condition()
        self._generation = 0
        self.batches = 0  # batches of requests the writer has run, committed or not
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="expbuf-writer", daemon=True)
        self._writer.start()

    def _migrate(self, migrate: Migration) -> None:
        """Bring the directory to the current format, growing the map if the rewrite needs it."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    migrate(txn, self.env, self.db, self.path)
                return
            except lmdb.MapFullError:
                size = self.env.info()["map_size"]
                if size >= self.max_map_size:
                    raise StorageFull(f"upgrading {self.path} needs more than max_map_size ({size} bytes)") from None
                self.env.set_mapsize(min(size * 2, self.max_map_size))

    def close(self) -> None:
        """Finish and commit every queued request, then close the environment."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)  # after every request already queued: they are committed first
        self._writer.join()
        self._detach_snapshots()
        self.env.close()
        self._lock_file.close()

    # ---- writes ----------------------------------------------------------------------

    def submit(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run `fn` in the writer thread's next transaction; return once it is committed."""
        future: Future = Future()
        with self._closing:
            if self._closed:
                raise StoreClosed("the store is closed")
            self._queue.put(_Op(fn, future))
        return future.result()

    def _write_loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            ops = [op]
            stop = False
            while len(ops) < self._batch_limit:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                ops.append(more)
            self._apply(ops)
            if stop:
                return

    def _apply(self, ops: list[_Op]) -> None:
        """Run ops in one transaction, each nested so a refusal undoes only itself. Only a
        commit that changed something counts as a change for wait_for_change(): a caller
        that retries a request which changed nothing (a sample waiting for data, a push
        waiting for room) sleeps until someone else's change instead of spinning."""
        self.batches += 1
        before = self.env.info()["last_txnid"]
        while True:
            results: list[tuple[bool, Any]] = []
            parent = self.env.begin(write=True)
            try:
                if len(ops) == 1:  # nothing to protect from a refusal: no nested transaction
                    results.append(self._run(ops[0], parent))
                else:
                    for op in ops:
                        child = self.env.begin(write=True, parent=parent)
                        results.append(self._run(op, child))
                        (child.commit if results[-1][0] else child.abort)()
                if any(ok for ok, _ in results):
                    parent.commit()
                else:
                    parent.abort()
                break
            except lmdb.MapFullError:
                parent.abort()
                if not self._grow():
                    full = StorageFull(
                        f"the LMDB map of {self.path} is full: it reached max_map_size ({self.max_map_size} bytes)"
                    )
                    results = [(False, full)] * len(ops)
                    break
            except lmdb.Error as exc:  # a full disk or an I/O error: nothing was committed
                parent.abort()
                failed = StorageFull(
                    f"writing to {self.path} failed; nothing was stored (is its disk full or failing? "
                    f"free: {_free_bytes(self.path)} bytes; LMDB said: {exc})"
                )
                results = [(False, failed)] * len(ops)
                break
        if self.env.info()["last_txnid"] != before:
            with self._changed:
                self._generation += 1
                self._changed.notify_all()
        for op, (ok, value) in zip(ops, results, strict=True):
            if ok:
                op.future.set_result(value)
            else:
                op.future.set_exception(value)

    @staticmethod
    def _run(op: _Op, txn: lmdb.Transaction) -> tuple[bool, Any]:
        """Run one request; a refusal is its result, a full map aborts the whole batch."""
        try:
            return True, op.fn(txn)
        except lmdb.MapFullError:
            raise
        except Exception as exc:
            return False, exc

    def _grow(self) -> bool:
        """Double the map once no reader holds a transaction; False at max_map_size."""
        size = self.env.info()["map_size"]
        if size >= self.max_map_size:
            return False
        self._detach_snapshots()  # here in the writer thread, which alone opens them
        with self._gate:
            self._resizing = True
            self._gate.wait_for(lambda: self._readers == 0)
            try:
                self.env.set_mapsize(min(size * 2, self.max_map_size))
            finally:
                self._resizing = False
                self._gate.notify_all()
        return True

    # ---- reads and changes -------------------------------------------------------------

    @contextlib.contextmanager
    def read(self, *, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A read transaction (never while the map is being resized); with `buffers`, its
        values are views into the map, valid inside the block."""
        self._enter_reader()
        try:
            with self.env.begin(buffers=buffers) as txn:
                yield txn
        finally:
            self._leave_reader()

    def snapshot(self) -> Snapshot:
        """A read transaction of the last committed state whose values are views into the
        map, open until released (snapshot.py). For the writer thread, while it takes a
        batch: at most MAX_SNAPSHOTS stay open, opening another detaches the oldest."""
        live = [ref for ref in self._snapshots if (snap := ref()) is not None and snap.open]
        while len(live) >= MAX_SNAPSHOTS:
            oldest = live.pop(0)()
            if oldest is not None:
                oldest.detach()
        self._enter_reader()
        try:
            snap = Snapshot(self.env.begin(buffers=True), self._leave_reader)
        except BaseException:
            self._leave_reader()
            raise
        self._snapshots = [*live, weakref.ref(snap)]
        return snap

    def _detach_snapshots(self) -> None:
        """Copy what open snapshots hold and end them, before the map is resized or closed."""
        for ref in self._snapshots:
            snap = ref()
            if snap is not None:
                snap.detach()
        self._snapshots = []

    def _enter_reader(self) -> None:
        with self._gate:
            self._gate.wait_for(lambda: not self._resizing)
            self._readers += 1

    def _leave_reader(self) -> None:
        with self._gate:
            self._readers -= 1
            self._gate.notify_all()

    @property
    def generation(self) -> int:
        """Counts committed batches of requests; wait_for_change() waits for the next."""
        return self._generation

    def wait_for_change(self, generation: int, deadline: float) -> bool:
        """Wait until a batch after `generation` is committed, or the monotonic deadline."""
        with self._changed:
            return self._changed.wait_for(lambda: self._generation != generation, max(0.0, deadline - time.monotonic()))

    def storage_info(self) -> dict[str, float]:
        info, stat = self.env.info(), self.env.stat()
        used = (info["last_pgno"] + 1) * stat["psize"]
        return {"map_size": info["map_size"], "used_bytes": used, "map_used_ratio": used / info["map_size"]}


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return -1
