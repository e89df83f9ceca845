"""The LMDB environment of a data directory, and the one thread that writes to it.

Every change goes through the writer thread, which takes every request waiting in its queue, applies
them in one write transaction (each in a nested transaction, so one refused request leaves the
others intact) and commits once with fsync: concurrent callers share the cost of the fsync, and each
returns only after that commit. Requests of one kind that wait side by side may be run together
(`together`: pushes of a few experiences, which the store stores as one push,
services/joined_pushes.py), each still answered alone. A full map doubles (once no reader holds a
transaction) up to `max_map_size` and the batch is retried; a full disk or an I/O error fails the
batch, committing nothing, and so does a failure of the writer's own code (no request's refusal),
each of its callers told: the thread goes on to the next batch, and no caller is left waiting. A
request its caller cancelled before it ran is never run. The garbage collector's passes wait while a
batch's requests run (client/trxp/codec/gc_pause.py): a push of hundreds of experiences makes
thousands of tracked objects (rows, groups, columns) that their reference counts free as it ends,
which passes mid-batch would only walk (3.6 k instructions an experience of a push of groups of one,
5 %: bench/RESULTS.md, "A push's writer, fewer steps (issue 64, again)").

Background work (a chunk of an index build, index_builds.py) goes through the same writer
with `submit(fn, background=True)`: it runs in a transaction of its own, never in a batch
with requests, and after the requests that were waiting when the writer met it. So a request
waits for at most one background transaction, the one under way when it came, and two
background transactions in a row run only while no request waits.

Only one process may open a data directory: it holds an exclusive flock on the directory's
`data.mdb` for its life, a lock the kernel keeps on the open file itself and drops when the
process ends, however it ends. No file's existence stands for the lock, so deleting one
(`lock.mdb`, or the `expbuf.lock` of earlier releases) lets no second server in. A reader
that never writes (`readonly`, for `expbuf check`) takes a shared lock instead and opens
LMDB read-only without its lock file, so it works on a read-only copy and writes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
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
from typing import Any, Literal, TypeVar, overload

import lmdb

from expbuf.client.trxp.codec.gc_pause import collector_paused

from ..schema.errors import Damaged, StorageFull, StoreClosed, StoreError
from . import layout
from .snapshot import Snapshot

T = TypeVar("T")
V = TypeVar("V", bytes, memoryview)
# What brings a directory to the current format (migrate.py's `migrate`), given by the Store:
# it works on tables, a layer above the environment.
Migration = Callable[["lmdb.Transaction[bytes]", lmdb.Environment, dict[str, lmdb._Database], Path], Any]
# What LMDB, or the format's records, raise on a damaged page (a full disk or map is not damage).
_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.PanicError,
    lmdb.BadValsizeError,
    lmdb.IncompatibleError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
)
log = logging.getLogger("expbuf.store")
# Snapshots open at once (see snapshot()); each holds one of LMDB's reader slots.
MAX_SNAPSHOTS = 16
Request = Callable[["lmdb.Transaction[bytes]"], Any]
# A request's outcome: whether it stored (else its refusal), and its result or refusal.
Outcome = tuple[bool, Any]
# A way to run requests that wait side by side together, in one transaction (in queue order): each
# one's outcome, as `run_nested` gives one. It runs those it cannot run together one at a time
# (`run_nested`); a full map (lmdb.MapFullError) it lets out, and the writer runs the batch again.
Together = Callable[["lmdb.Transaction[bytes]", list[Any]], list[Outcome]]


@dataclass(frozen=True)
class _Op:
    fn: Request
    future: Future[Any]
    background: bool = False
    together: Together | None = None


class Environment:
    """A data directory's LMDB environment, its named databases and its writer thread."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 1 << 30,
        max_map_size: int = 1 << 40,
        batch_limit: int = 512,
        readonly: bool = False,
        migrate: Migration | None = None,
    ) -> None:
        self.path = Path(path)
        if migrate is None and not readonly:
            raise TypeError("a writable Environment needs the migration that brings its format up to date")
        self.readonly = readonly
        self._migration = migrate
        self.missing: list[str] = []  # databases a read-only open did not find (an older format)
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(self.path / "data.mdb", readonly)
        self.max_map_size = max_map_size
        self._batch_limit = batch_limit
        try:
            self._open(map_size)
        except BaseException:
            if hasattr(self, "env"):
                self.env.close()
            os.close(self._lock_fd)
            raise
        self._readers = 0
        self._resizing = False
        self._snapshots: list[weakref.ref[Snapshot]] = []  # those open, under _snapshots_lock
        self._snapshots_lock = threading.Lock()
        self._gate = threading.Condition()
        self._changed = threading.Condition()
        self._generation = 0
        self.batches = 0  # batches of requests the writer has run, committed or not
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._later: collections.deque[_Op] = collections.deque()  # background ops met, run after a batch
        self._closed = False
        self._closing = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="expbuf-writer", daemon=True)
        if not readonly:
            self._writer.start()

    def _open(self, map_size: int) -> None:
        """Open LMDB and its databases, and bring the format up to date (not when read-only).

        A directory LMDB or the format's records cannot read is Damaged, naming `expbuf check`.
        """
        names = layout.databases()  # the registered orders' indexes may be refused before anything opens
        try:
            if self.readonly:
                self.env = lmdb.open(
                    str(self.path), max_dbs=layout.MAX_DBS, readonly=True, lock=False, readahead=False, create=False
                )
                self.db = {}
                for name in names + layout.ROWS:
                    try:
                        self.db[name] = self.env.open_db(name.encode(), create=False)
                    except lmdb.NotFoundError:
                        if name not in layout.ROWS:  # the rows' are made only for a rows table
                            self.missing.append(name)
                return
            self.env = lmdb.open(
                str(self.path), map_size=map_size, max_dbs=layout.MAX_DBS, sync=True, metasync=True, readahead=False
            )
            self._migrate(names)
        except _DAMAGE as exc:
            raise Damaged(self.path, f"{type(exc).__name__}: {exc}") from None

    def _migrate(self, names: tuple[str, ...]) -> None:
        """Open the databases and bring the directory to the current format, growing the map if
        the rewrite needs it. The databases a newer format adds are created in the upgrade's own
        transaction: a start killed before its commit leaves the directory as it found it."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    self.db = {name: self.env.open_db(name.encode(), txn=txn) for name in names}
                    # the rows' databases where a rows table made them (open_rows), left absent elsewhere
                    made = [name for name in layout.ROWS if txn.get(name.encode()) is not None]
                    self.db |= {name: self.env.open_db(name.encode(), txn=txn) for name in made}
                    if self._migration is not None:
                        self._migration(txn, self.env, self.db, self.path)
                return
            except lmdb.MapFullError:
                size = self.env.info()["map_size"]
                if size >= self.max_map_size:
                    raise StorageFull(f"upgrading {self.path} needs more than max_map_size ({size} bytes)") from None
                self.env.set_mapsize(min(size * 2, self.max_map_size))

    def open_rows(self) -> None:
        """The databases of the rows (layout.ROWS), made where they are not yet, before the first
        table of layout "rows" is created: in a transaction of their own (a background one, never
        nested in a batch's, whose refusal would close a handle made in it), their handles shared
        once it has committed. Called off the writer thread."""
        if all(name in self.db for name in layout.ROWS):
            return

        def made(txn: lmdb.Transaction[bytes]) -> dict[str, lmdb._Database]:
            return {name: self.env.open_db(name.encode(), txn=txn) for name in layout.ROWS}

        self.db.update(self.submit(made, background=True))

    def close(self) -> None:
        """Finish and commit every queued request, then close the environment."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)  # after every request already queued: they are committed first
        if not self.readonly:
            self._writer.join()
        self._detach_snapshots()
        self.env.close()
        os.close(self._lock_fd)

    # ---- writes ----------------------------------------------------------------------

    def submit(
        self,
        fn: Callable[[lmdb.Transaction[bytes]], T],
        *,
        background: bool = False,
        together: Together | None = None,
    ) -> T:
        """Run `fn` in the writer thread's next transaction; return once it is committed. With
        `background`, in a transaction of its own once the requests waiting now are committed
        (see the module's docstring); its commit wakes no wait_for_change(). With `together`, it
        and the requests of the same `together` queued right before or after it in one batch run
        as `together` runs them."""
        return self.queue(fn, background=background, together=together).result()

    def queue(
        self,
        fn: Callable[[lmdb.Transaction[bytes]], T],
        *,
        background: bool = False,
        together: Together | None = None,
    ) -> Future[T]:
        """submit() without waiting: the future of `fn`'s result, done once it is committed.
        Requests are applied in the order they are queued."""
        future: Future[T] = Future()
        with self._closing:
            if self._closed or self.readonly:
                raise StoreClosed("the store is closed" if self._closed else f"{self.path} is open read-only")
            self._queue.put(_Op(fn, future, background, together))
        return future

    def _write_loop(self) -> None:
        while self._write_batch():
            pass

    def _write_batch(self) -> bool:
        """Apply the next batch of requests, then one background op met so far; False once the
        store closes (every op queued before the close applied). The requests, and what they
        carry (a push's packed experiences), go with the batch, not at the next one."""
        requests: list[_Op] = []
        closing = False
        while len(requests) < self._batch_limit:
            try:  # wait for a first op only when no background op is held
                op = self._queue.get_nowait() if requests or self._later else self._queue.get()
            except queue.Empty:
                break
            if op is None:
                closing = True
                break
            if not op.future.set_running_or_notify_cancel():  # its caller cancelled it: never run
                continue
            (self._later if op.background else requests).append(op)
        if requests:
            self._apply(requests)
        while self._later:
            self._apply([self._later.popleft()], background=True)
            if not closing:
                break
        return not closing

    def _apply(self, ops: list[_Op], *, background: bool = False) -> None:
        """Run ops in one transaction, each nested so a refusal undoes only itself. Only a
        commit that changed something counts as a change for wait_for_change(): a caller
        that retries a request which changed nothing (a sample waiting for data, a push
        waiting for room) sleeps until someone else's change instead of spinning. A background
        op's commit does not count either: it changes nothing such a caller waits for."""
        self.batches += 1
        before = self.env.info()["last_txnid"]
        while True:
            results: list[tuple[bool, Any]] = []
            parent = self.env.begin(write=True)
            try:
                with collector_paused():  # what a batch makes, its counts free: no pass need walk it
                    if len(ops) == 1:  # nothing to protect from a refusal: no nested transaction
                        results.append(self._run(ops[0].fn, parent))
                    else:
                        for run in runs(ops, _together_of):
                            results.extend(self._together(run, parent))
                if len(results) != len(ops):
                    raise RuntimeError(f"{len(results)} outcomes for {len(ops)} requests")
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
            except Exception as exc:  # the writer's own failure, no request's refusal: nothing kept, each told
                parent.abort()
                log.exception("the store's writer failed a batch of %d requests; nothing of it was stored", len(ops))
                results = [(False, StoreError(f"the store's writer failed; nothing was stored: {exc!r}"))] * len(ops)
                break
        if not background and self.env.info()["last_txnid"] != before:
            with self._changed:
                self._generation += 1
                self._changed.notify_all()
        for op, (ok, value) in zip(ops, results, strict=True):
            if ok:
                op.future.set_result(value)
            else:
                op.future.set_exception(value)

    def nested(self, parent: lmdb.Transaction[bytes]) -> lmdb.Transaction[bytes]:
        """A write transaction nested in `parent` (in the writer thread): committed, its changes
        join the parent's; aborted, it undoes only itself."""
        return self.env.begin(write=True, parent=parent)

    def views(self, parent: lmdb.Transaction[bytes]) -> lmdb.Transaction[memoryview]:
        """A write transaction nested in `parent` whose reads are views of the map (or of the
        pages `parent` wrote), not copies: for a read of a few bytes of large values
        (chunked.delete's), aborted once they are read, before `parent` is used again."""
        return self.env.begin(write=True, parent=parent, buffers=True)

    def run_nested(self, fn: Request, parent: lmdb.Transaction[bytes]) -> Outcome:
        """Run one request in a transaction nested in `parent`, committed where it stores and
        aborted where it is refused (its refusal its outcome); a full map aborts the whole batch."""
        child = self.nested(parent)
        outcome = self._run(fn, child)
        (child.commit if outcome[0] else child.abort)()
        return outcome

    def _together(self, run: list[_Op], parent: lmdb.Transaction[bytes]) -> list[Outcome]:
        """The outcomes of a run of requests (`_runs`), in a transaction nested in `parent`: one
        alone as `run_nested` runs it, several as their `together` runs them. A `together` that fails
        otherwise than on a full map fails them all, nothing of theirs kept."""
        together = run[0].together
        if len(run) == 1 or together is None:
            return [self.run_nested(op.fn, parent) for op in run]
        child = self.nested(parent)
        try:
            outcomes = together(child, [op.fn for op in run])
        except lmdb.MapFullError:
            raise
        except Exception as exc:
            child.abort()
            return [(False, exc)] * len(run)
        (child.commit if any(ok for ok, _ in outcomes) else child.abort)()
        return outcomes

    @staticmethod
    def _run(fn: Request, txn: lmdb.Transaction[bytes]) -> Outcome:
        """Run one request; a refusal is its result, a full map aborts the whole batch."""
        try:
            return True, fn(txn)
        except lmdb.MapFullError:
            raise
        except Exception as exc:
            return False, exc

    def _grow(self) -> bool:
        """Double the map once no reader holds a transaction; False at max_map_size."""
        size = self.env.info()["map_size"]
        if size >= self.max_map_size:
            return False
        with self._gate:
            self._resizing = True  # no reader begins from here on: none opens a snapshot after the detach
        try:
            self._detach_snapshots()
            with self._gate:
                self._gate.wait_for(lambda: self._readers == 0)
                self.env.set_mapsize(min(size * 2, self.max_map_size))
        finally:
            with self._gate:
                self._resizing = False
                self._gate.notify_all()
        return True

    # ---- reads and changes -------------------------------------------------------------

    @overload
    def read(
        self, *, buffers: Literal[False] = False
    ) -> contextlib.AbstractContextManager[lmdb.Transaction[bytes]]: ...
    @overload
    def read(self, *, buffers: Literal[True]) -> contextlib.AbstractContextManager[lmdb.Transaction[memoryview]]: ...
    def read(
        self, *, buffers: bool = False
    ) -> (
        contextlib.AbstractContextManager[lmdb.Transaction[bytes]]
        | contextlib.AbstractContextManager[lmdb.Transaction[memoryview]]
    ):
        """A read transaction (never while the map is being resized); with `buffers`, its
        values are views into the map, valid inside the block."""
        if buffers:
            return self._reading(lambda: self.env.begin(buffers=True))
        return self._reading(lambda: self.env.begin())

    @contextlib.contextmanager
    def _reading(self, begin: Callable[[], lmdb.Transaction[V]]) -> Iterator[lmdb.Transaction[V]]:
        self._enter_reader()
        try:
            with begin() as txn:
                yield txn
        finally:
            self._leave_reader()

    def snapshot(self) -> Snapshot:
        """A read transaction of the last committed state whose values are views into the
        map, open until released (snapshot.py): the writer's, while it takes a batch (the state
        its take saw), or any thread's (a ReadFields, which needs no writer's turn). It is pinned
        until its opener unpins it. At most MAX_SNAPSHOTS stay open: opening another detaches the
        oldest not pinned, or, for one whose reply is being built, has its reader detach it as it
        ends, so that no one waits for a reply (one more per reply being built, or pinned, may
        stay open until then)."""
        while True:
            self._enter_reader()  # a resize, which detaches every snapshot, lets none begin
            try:
                with self._snapshots_lock:
                    if self._resizing:  # began after this counted itself a reader: its detach may be past
                        opened = None
                    else:
                        live = [ref for ref in self._snapshots if (snap := ref()) is not None and snap.open]
                        loose = [snap for ref in live if (snap := ref()) is not None and not snap.pinned]
                        extra = loose[: max(0, len(live) + 1 - MAX_SNAPSHOTS)]
                        opened = Snapshot(self.env.begin(buffers=True), self._leave_reader)
                        self._snapshots = [*live, weakref.ref(opened)]
            except BaseException:
                self._leave_reader()
                raise
            if opened is None:
                self._leave_reader()
                continue
            for oldest in extra:  # copied, if so, outside the lock: it holds up no other opening
                oldest.detach(wait=False)
            return opened

    def _detach_snapshots(self) -> None:
        """Copy what open snapshots hold and end them, before the map is resized or closed."""
        with self._snapshots_lock:
            opened, self._snapshots = self._snapshots, []
        for ref in opened:
            snap = ref()
            if snap is not None:
                snap.detach()

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
        """Wait until a batch after `generation` is committed, wake() is called, or the monotonic
        deadline; whether a batch was committed."""
        with self._changed:
            if self._generation == generation:
                self._changed.wait(max(0.0, deadline - time.monotonic()))
            return self._generation != generation

    def wake(self) -> None:
        """End every wait_for_change() now, so that a loop being stopped sees its stop at once."""
        with self._changed:
            self._changed.notify_all()

    def storage_info(self) -> dict[str, float]:
        """The map's size, its bound (max_map_size) and use, the room on the data directory's disk
        (both bound what the store can hold: an operator's alerts read them), and the prompts stored
        once for the runs that share them (shared_prompts.py): how many, and the bytes of their pages."""
        info, stat = self.env.info(), self.env.stat()
        disk_bytes, disk_free = _disk_usage(self.path)
        used = (info["last_pgno"] + 1) * stat["psize"]
        prompts = prompt_bytes = 0
        if "shared" in self.db:
            with self.read() as txn:
                shared = txn.stat(self.db["shared"])
            prompts = shared["entries"]
            prompt_bytes = (shared["branch_pages"] + shared["leaf_pages"] + shared["overflow_pages"]) * shared["psize"]
        return {
            "map_size": info["map_size"],
            "max_map_size": self.max_map_size,
            "used_bytes": used,
            "map_used_ratio": used / info["map_size"],
            "disk_bytes": disk_bytes,
            "disk_free_bytes": disk_free,
            "shared_prompts": prompts,
            "shared_prompt_bytes": prompt_bytes,
        }


def _lock(data: Path, shared: bool) -> int:
    """An open descriptor of `data` (created empty when absent, which LMDB takes as a new
    environment) holding a flock: exclusive for a server, shared for a reader."""
    try:
        fd = os.open(data, os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"cannot open {data}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreError(f"another expbuf process is using {data.parent}") from None
    return fd


def _disk_usage(path: Path) -> tuple[int, int]:
    """The size and free bytes of the data directory's disk; -1 each where they cannot be read."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return -1, -1
    return usage.total, usage.free


def runs(items: list[T], key: Callable[[T], object]) -> Iterator[list[T]]:
    """Items as runs, in order: those side by side of one key in one run, each whose key is None a run
    of its own (a batch's requests by their `together`, joined_pushes' by table and holder)."""
    run: list[T] = []
    for item in items:
        if run and ((mine := key(item)) is None or mine != key(run[0])):
            yield run
            run = []
        run.append(item)
    if run:
        yield run


def _together_of(op: _Op) -> Together | None:
    return op.together


def _free_bytes(path: Path) -> int:
    return _disk_usage(path)[1]
