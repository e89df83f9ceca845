"""The one thread that writes to an environment, and the requests it runs.

It takes every request waiting in its queue, applies them in one write transaction (each in a
nested transaction, so one refused request leaves the others intact) and commits once with fsync:
concurrent callers share the cost of the fsync, and each returns only after that commit. Requests
of one kind that wait side by side may be run together (`together`: pushes of a few experiences,
which the store stores as one push, services/joined_pushes.py), each still answered alone. A full
map doubles (once no reader holds a transaction: readers.py) up to `max_map_size` and the batch is
retried. Pushes (`grows`) leave a reserve of the store's room free (room.py): a batch that would
leave less, or that fills the map or a full disk, runs again without its pushes, so that its
consumes, acks and deletes go on and a full store still empties. A full disk or an I/O error fails
a batch with no pushes, committing nothing, and so does a failure of the writer's own code (no
request's refusal), each of its callers told: the thread goes on to the next batch, and no caller
is left waiting. A request its caller cancelled before it ran is never
run. The garbage collector's passes wait while a batch's requests run
(client/trxp/codec/gc_pause.py): a push of hundreds of experiences makes thousands of tracked
objects (rows, groups, columns) that their reference counts free as it ends, which passes
mid-batch would only walk (3.6 k instructions an experience of a push of groups of one, 5 %:
bench/RESULTS.md, "A push's writer, fewer steps (issue 64, again)").

Background work (a chunk of an index build, index_builds.py) goes through the same writer with
`submit(fn, background=True)`: it runs in a transaction of its own, never in a batch with
requests, and after the requests that were waiting when the writer met it. So a request waits for
at most one background transaction, the one under way when it came, and two background
transactions in a row run only while no request waits.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from expbuf.client.trxp.codec.gc_pause import collector_paused

from ...schema.errors import StorageFull, StoreClosed, StoreError
from .directory import free_bytes
from .readers import Readers
from .room import Room

T = TypeVar("T")
log = logging.getLogger("expbuf.store")
Request = Callable[["lmdb.Transaction[bytes]"], Any]
# How often a caller that waits for a change (wait_for_change) looks whether its call has ended: a
# push waiting for room, a Sample waiting for data, an Admit or a Claim, whose client went away.
STOP_POLL_SECONDS = 0.25
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
    grows: bool = False  # a push: it leaves the room reserved for what makes room (room.py)


class _ReserveReached(Exception):
    """A batch's pushes would leave less than the reserve free: it is run again without them."""


class Writer:
    """An environment's writer thread (not started where the environment is read-only: every
    request is refused) and the count of the batches it committed, which callers wait on."""

    def __init__(
        self,
        env: lmdb.Environment,
        path: Path,
        readers: Readers,
        *,
        max_map_size: int,
        batch_limit: int,
        readonly: bool,
        room: Room | None = None,
    ) -> None:
        self.env, self.path, self._readers = env, path, readers
        self.max_map_size = max_map_size
        self.room = room  # None where read-only
        self.readonly = readonly
        self._batch_limit = batch_limit
        self._changed = threading.Condition()
        self._generation = 0
        self.batches = 0  # batches of requests the writer has run, committed or not
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._later: collections.deque[_Op] = collections.deque()  # background ops met, run after a batch
        self._closed = False
        self._closing = threading.Lock()
        # why the environment can take no more writes (LMDB's panic, a map it could not grow); None: it can
        self.broken: str | None = None
        self._thread = threading.Thread(target=self._write_loop, name="expbuf-writer", daemon=True)
        if not readonly:
            self._thread.start()

    def stop(self) -> bool:
        """Finish and commit every queued request, then end the thread; False where it was
        stopped before."""
        with self._closing:
            if self._closed:
                return False
            self._closed = True
            self._queue.put(None)  # after every request already queued: they are committed first
        if not self.readonly:
            self._thread.join()
        return True

    def submit(
        self,
        fn: Callable[[lmdb.Transaction[bytes]], T],
        *,
        background: bool = False,
        together: Together | None = None,
        grows: bool = False,
    ) -> T:
        """Run `fn` in the writer thread's next transaction; return once it is committed. With
        `background`, in a transaction of its own once the requests waiting now are committed
        (see the module's docstring); its commit wakes no wait_for_change(). With `together`, it
        and the requests of the same `together` queued right before or after it in one batch run
        as `together` runs them. With `grows` (a push), it is refused StorageFull rather than
        leave less than the room kept for what makes room (room.py)."""
        return self.queue(fn, background=background, together=together, grows=grows).result()

    def queue(
        self,
        fn: Callable[[lmdb.Transaction[bytes]], T],
        *,
        background: bool = False,
        together: Together | None = None,
        grows: bool = False,
    ) -> Future[T]:
        """submit() without waiting: the future of `fn`'s result, done once it is committed.
        Requests are applied in the order they are queued."""
        future: Future[T] = Future()
        with self._closing:
            if self._closed or self.readonly:
                raise StoreClosed("the store is closed" if self._closed else f"{self.path} is open read-only")
            if self.broken is not None:
                raise self._refusal()
            self._queue.put(_Op(fn, future, background, together, grows))
        return future

    def _refusal(self) -> StoreClosed:
        return StoreClosed(
            f"the store of {self.path} can take no more writes ({self.broken}); the server stops: "
            "what was acknowledged is on disk, and a restart serves it"
        )

    def _broke(self, why: str) -> None:
        """The environment can take no more writes: every request from now on is refused at once,
        and the server, which watches `broken`, stops."""
        if self.broken is None:
            self.broken = why
            log.critical("the store of %s can take no more writes: %s; the server stops", self.path, why)

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
            self._apply_or_fail(requests)
        while self._later:
            self._apply_or_fail([self._later.popleft()], background=True)
            if not closing:
                break
        return not closing

    def _apply_or_fail(self, ops: list[_Op], *, background: bool = False) -> None:
        """`_apply`, or, where the environment broke (now or before), each op refused at once: the
        thread lives on, so that no caller waits for good on a request queued to a writer gone."""
        if self.broken is None:
            try:
                self._apply(ops, background=background)
                return
            except BaseException as exc:  # outside any request: LMDB's panic, a map that could not grow
                self._broke(f"{type(exc).__name__}: {exc}")
                log.exception("the store's writer failed outside its requests")
        refusal = self._refusal()
        for op in ops:
            if not op.future.done():
                op.future.set_exception(refusal)

    def _apply(self, ops: list[_Op], *, background: bool = False) -> None:
        """Run ops in one transaction (`_committed`). Only a commit that changed something counts as
        a change for wait_for_change(): a caller that retries a request which changed nothing (a
        sample waiting for data, a push waiting for room) sleeps until someone else's change instead
        of spinning. A background op's commit does not count either: it changes nothing such a
        caller waits for. After it, the disk is looked at (Room.after_commit)."""
        self.batches += 1
        before = self.env.info()
        results = self._committed(ops)
        info = self.env.info()
        if self.room is not None:
            self.room.after_commit(info["last_pgno"], before["last_pgno"])
        if not background and info["last_txnid"] != before["last_txnid"]:
            with self._changed:
                self._generation += 1
                self._changed.notify_all()
        for op, (ok, value) in zip(ops, results, strict=True):
            if ok:
                op.future.set_result(value)
            else:
                op.future.set_exception(value)

    def _committed(self, ops: list[_Op]) -> list[Outcome]:
        """Each op's outcome, run in one transaction, each nested so a refusal undoes only itself,
        committed where any stored. A full map grows and the batch runs again; a batch whose pushes
        would leave less than the reserve free, or that fills the map at max_map_size, or that the
        disk failed, runs again without its pushes (`_without_pushes`)."""
        pushes = any(op.grows for op in ops)
        count = pushes and self.room is not None and self.room.near()
        if count and self.room is not None and self.room.was_short and self.room.still_short():
            return self._without_pushes(ops, self._full())  # still at the reserve: the pushes not run at all
        while True:
            try:
                return self._attempt(ops, count)
            except _ReserveReached:
                return self._without_pushes(ops, self._full())
            except lmdb.MapFullError:
                if self._grow():
                    continue
                if pushes:
                    return self._without_pushes(ops, self._full())
                return [(False, self._full(kept=False))] * len(ops)
            except lmdb.PanicError:  # the environment takes no more writes: _apply_or_fail's to say
                raise
            except lmdb.Error as exc:  # a full disk or an I/O error: nothing was committed
                refusal = self._failed_write(exc)
                return self._without_pushes(ops, refusal) if pushes else [(False, refusal)] * len(ops)
            except Exception as exc:  # the writer's own failure, no request's refusal: nothing kept, each told
                log.exception("the store's writer failed a batch of %d requests; nothing of it was stored", len(ops))
                return [(False, StoreError(f"the store's writer failed; nothing was stored: {exc!r}"))] * len(ops)

    def _attempt(self, ops: list[_Op], count_room: bool) -> list[Outcome]:
        """Each op's outcome, run in one transaction (in a nested one each where there are several),
        committed where any stored, else aborted; what LMDB raises aborts it all. With `count_room`,
        _ReserveReached where the batch would leave less than the reserve free (Room.short)."""
        results: list[Outcome] = []
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
            if not any(ok for ok, _ in results):
                parent.abort()
                return results
            if count_room and self.room is not None and self.room.short(parent):
                raise _ReserveReached
            parent.commit()
        except BaseException:
            parent.abort()
            raise
        return results

    def _without_pushes(self, ops: list[_Op], refusal: StorageFull) -> list[Outcome]:
        """A full batch's outcomes: its pushes refused with `refusal`, the rest run again in a
        transaction of their own, in the room kept for them."""
        rest = [op for op in ops if not op.grows]
        again = iter(self._committed(rest) if rest else [])
        return [(False, refusal) if op.grows else next(again) for op in ops]

    def _full(self, *, kept: bool = True) -> StorageFull:
        """The refusal of pushes that would leave less than the reserve (`kept`), or of what found
        the map full at max_map_size even so: a full disk's where the data file bounds the store."""
        room = self.room
        if room is not None and room.ahead and (room.tight or not kept):
            return self._disk_full()
        less = ""
        if kept and room is not None:
            less = f" less the {room.reserve} bytes kept for consumes, acks and deletes, which make room"
        return StorageFull(
            f"the LMDB map of {self.path} is full: it reached max_map_size ({self.max_map_size} bytes){less}; "
            "consume or delete experiences, or give the store a larger max_map_size"
        )

    def _disk_full(self, said: str = "") -> StorageFull:
        room = self.room
        assert room is not None
        return StorageFull(
            f"the disk of {self.path} is full (free: {free_bytes(self.path)} bytes): pushes are refused, and "
            f"the {room.left()} bytes of its data file past its last page are kept for consumes, acks and "
            f"deletes, which make room; free some of the disk, or consume or delete experiences{said}"
        )

    def _failed_write(self, exc: lmdb.Error) -> StorageFull:
        """The refusal of a batch whose write failed (nothing of it committed): a full disk's where the
        disk has no room for the data file to be written ahead (which bounds pushes to the file from
        now on), else an I/O error's."""
        if self.room is not None:
            self.room.write_ahead(self.room.used())
            if self.room.tight:
                return self._disk_full(f" (LMDB said: {exc})")
        return StorageFull(
            f"writing to {self.path} failed; nothing was stored (is its disk full or failing? "
            f"free: {free_bytes(self.path)} bytes; LMDB said: {exc})"
        )

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
        """Double the map once no reader holds a transaction (Readers.resize); False at max_map_size."""
        size = self.env.info()["map_size"]
        if size >= self.max_map_size:
            return False
        self._readers.resize(min(size * 2, self.max_map_size))
        return True

    @property
    def generation(self) -> int:
        """Counts committed batches of requests; wait_for_change() waits for the next."""
        return self._generation

    def wait_for_change(self, generation: int, deadline: float, *, poll: bool = False) -> bool:
        """Wait until a batch after `generation` is committed, wake() is called, or the monotonic
        deadline (with `poll`, at most STOP_POLL_SECONDS: its caller looks again whether its call
        has ended); whether a batch was committed."""
        if poll:
            deadline = min(deadline, time.monotonic() + STOP_POLL_SECONDS)
        with self._changed:
            if self._generation == generation:
                self._changed.wait(max(0.0, deadline - time.monotonic()))
            return self._generation != generation

    def wake(self) -> None:
        """End every wait_for_change() now, so that a loop being stopped sees its stop at once."""
        with self._changed:
            self._changed.notify_all()


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
