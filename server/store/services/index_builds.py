"""The lazy indexes a table lacks, built in the background from the store's open.

Why: a table keeps every index of the registered orders from its creation (catalog.py). Earlier
releases kept the priority, uniform and version indexes only from the first request that read
them, and that request waited while its index was built from every ready group: 39 s for the
first uniform or priority request on a million ready groups, and pushes overlapping it waited
up to 175 ms (issue 39). An index built on demand always makes its first request wait, and no
other way serves that request right (a priority sample reads every ready group's priority), so
the indexes are kept from the start instead: a few more rows per ready group written by a push
(4 per experience with groups of 1: through a server, small experiences pushed 0.83x as fast;
bench/RESULTS.md, "Keeping every ready-group index"). A table that lacks one (made
by an earlier release, or an order registered since) has it built here, from the open, so that
by the time a trainer asks it is there.

How: one thread (`IndexBuilds`) takes the builds a chunk at a time: BUILD_CHUNK ready groups
indexed in a write transaction of the writer's background lane (disk/environment/writer.py), which runs
alone, after the requests waiting when it comes, so a request waits for at most one chunk.
While no request waits for it, a build takes at most BUILD_SHARE of the time (it pauses after
each chunk): it shares the writer and the interpreter with the requests, and at full pace it
made the server's own start and its pushes slower (bench_growth.py --first-uniform); a build a
request waits for goes first, at full pace. A request that reads an index still being built
waits for it (`wait`) up to its own deadline, then is refused with IndexNotReady
(DEADLINE_EXCEEDED, saying how far the build got); once the index is built the request is tried
again whole, so none is ever served from part of an index. A build's cursor is kept with the
chunk that moves it (core/ordering/ready.BUILDING), so a stop or a crash loses at most the chunk under way,
and the next open goes on from the cursor.

Progress: a log line when a build starts, every PROGRESS_SECONDS and when it ends; `status()`
(Store.index_builds, the `expbuf_index_build_*` metrics). The map's pages a build read are given
back every RELEASE_CHUNKS chunks and at its end (residency.py), so RSS does not keep them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import lmdb

from ..core.ordering.indexes import Index, ReadyOrder
from ..core.ordering.ready import BuildStep, IndexBuilding, ReadyIndex, builds
from ..disk import layout, residency
from ..disk.environment import STOP_POLL_SECONDS, Environment
from ..rules.quarantine import fail_lost_groups
from ..schema.errors import IndexNotReady, StoreClosed, clip
from ..tables.catalog import TableCatalog

T = TypeVar("T")
log = logging.getLogger("expbuf.store")
RELEASE_CHUNKS = 64  # some 16,000 ready groups' records between two releases of the map's pages
# The most of the time a build takes while no request waits for it.
BUILD_SHARE = 0.5
PROGRESS_SECONDS = 30.0


@dataclass(frozen=True)
class IndexBuild:
    """One build to do or under way, as `IndexBuilds.status` reports it."""

    table: str
    index: str  # its first database's name: prio, slots, byver, ...
    what: str  # how the log names it
    indexed: int  # ready groups indexed so far (about: groups come and go meanwhile)
    ready: int  # the table's ready groups when the build started in this run of the store
    seconds: float  # since it started in this run (0: not yet)
    waiting: int  # requests waiting for it
    failed: str  # why its last chunk failed; "" while it goes on


class _Job:
    """The build of one table's index: what status() reports of it, and who waits for it."""

    def __init__(self, table_id: int, index: type[Index], seq: int) -> None:
        self.table_id, self.index, self.seq = table_id, index, seq
        self.indexed = self.ready = self.waiting = 0
        self.started = self.logged = 0.0  # monotonic; 0: no chunk yet
        self.announced = False  # whether the log said it started (not for an index built meanwhile)
        self.error: Exception | None = None
        self.done = False


class IndexBuilds:
    """The background builds of one store's lazy indexes (see the module's docstring)."""

    def __init__(self, environment: Environment, catalog: TableCatalog) -> None:
        self.environment, self.catalog = environment, catalog
        self._changed = threading.Condition()  # a job added, waited for, advanced, done or failed
        self._jobs: dict[tuple[int, type[Index]], _Job] = {}
        self._seq = itertools.count()
        self._current: _Job | None = None  # the build the last chunk was of
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._chunks = 0  # chunks run, for the release of the map's pages
        self._reported: set[str] = set()

    # ---- the thread ----------------------------------------------------------------------

    def start(self) -> None:
        """Queue every lazy index a table lacks (or is building since an earlier run; a rows table's
        only then: it keeps one from the first request that read it), and build them in the
        background."""
        with self.environment.read() as txn:
            for table_id, config in self.catalog.entries():
                rows = config.storage.layout == "rows"
                for cls in ReadyIndex(self.environment.db, txn, layout.table_prefix(table_id), rows=rows).wanted():
                    self._job(table_id, cls)
        self._thread = threading.Thread(target=self._loop, name="expbuf-index-builds", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the builds after the chunk under way (their cursors are kept: the next open goes
        on from them), and the thread; a request waiting for one is refused (StoreClosed)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._stopping or self._next() is not None)
                job = self._next()
                if self._stopping or job is None:
                    return
            self._chunk(job)

    def _next(self) -> _Job | None:
        """The build to take a chunk of: one a request waits for, then the one under way, then
        the oldest; never one whose last chunk failed (a request that waits for it asks again)."""
        todo = [job for job in self._jobs.values() if job.error is None]
        return max(todo, key=lambda job: (job.waiting > 0, job is self._current, -job.seq), default=None)

    def _chunk(self, job: _Job) -> None:
        """One chunk of a build in the writer's background lane, then (while no request waits for
        a build) a pause that keeps the builds to their share."""
        if not job.started:
            self._begin(job)
        began = time.monotonic()

        def step(txn: lmdb.Transaction[bytes]) -> BuildStep:
            nonlocal began
            began = time.monotonic()
            tt = self.catalog.state_of(txn, job.table_id)
            if tt is None:
                return BuildStep(True, 0)
            done = tt.build_index(job.index)
            if done.lost:  # ready groups whose records are lost fail, as a sample that meets them fails them
                fail_lost_groups(tt, done.lost)
                tt.save()
            return done

        try:
            done = self.environment.submit(step, background=True)
        except StoreClosed:
            with self._changed:
                self._stopping = True
            return
        except Exception as exc:
            self._failed(job, exc)
            return
        spent = time.monotonic() - began
        self._chunks += 1
        if done.kept or self._chunks % RELEASE_CHUNKS == 0:
            residency.release(self.environment.path / "data.mdb")  # the records it read: page cache, not RSS
        with self._changed:
            self._current = job
            job.indexed += done.groups
            if done.kept:
                job.done = True
                del self._jobs[(job.table_id, job.index)]
            self._changed.notify_all()
        self._report(job)
        if not done.kept:
            with self._changed:
                self._changed.wait_for(
                    lambda: self._stopping or any(j.waiting for j in self._jobs.values()),
                    spent * (1 - BUILD_SHARE) / BUILD_SHARE,
                )

    def _begin(self, job: _Job) -> None:
        """A build's first chunk in this run: how many ready groups it indexes, and how many it
        indexed before a restart cut it short."""
        job.started = job.logged = time.monotonic()
        with self.environment.read() as txn:
            tt = self.catalog.state_of(txn, job.table_id)
            if tt is None or job.index in tt.ready.kept():  # dropped, or built since the request asked
                return
            cursor = builds(txn, self.environment.db, tt.prefix).get(job.index.databases[0], 0)
            job.ready = tt.counters.groups_ready
            job.indexed = ReadyOrder(self.environment.db, txn, tt.prefix).before(cursor) if cursor > 0 else 0
        job.announced = True
        log.info(
            "table %s: building %s in the background from %s ready groups%s; a request that reads it waits for it",
            self._name(job), job.index.described(), f"{job.ready:,}",
            f" ({job.indexed:,} indexed before a restart)" if job.indexed else "",
        )  # fmt: skip

    def _report(self, job: _Job) -> None:
        now = time.monotonic()
        if not job.announced:
            return
        if job.done:
            log.info(
                "table %s: %s built, %s ready groups in %.1fs",
                self._name(job), job.index.described(), f"{job.indexed:,}", now - job.started,
            )  # fmt: skip
        elif now - job.logged >= PROGRESS_SECONDS:
            job.logged = now
            log.info(
                "table %s: %s %d%% built (%s of about %s ready groups, %.0fs)",
                self._name(job), job.index.described(), 100 * job.indexed // max(job.ready, 1),
                f"{job.indexed:,}", f"{job.ready:,}", now - job.started,
            )  # fmt: skip

    def _failed(self, job: _Job, exc: Exception) -> None:
        """A chunk failed (a full disk, a damaged record): the build stops, the requests waiting
        for it get the failure, and the next request that needs the index tries it again."""
        with self._changed:
            job.error = exc
            self._changed.notify_all()
        reason = f"{type(exc).__name__}: {exc}"
        if reason not in self._reported:
            self._reported.add(reason)
            log.error(
                "table %s: building %s failed (%s); a request that reads it tries again",
                self._name(job), job.index.described(), clip(reason, 300),
            )  # fmt: skip

    def _name(self, job: _Job) -> str:
        table = self.catalog.by_id(job.table_id)
        return f"#{job.table_id} (dropped)" if table is None else table[0]

    # ---- requests ------------------------------------------------------------------------

    def _job(self, table_id: int, index: type[Index]) -> _Job:
        """The build of a table's index, queued if it is not yet; called with the lock held or
        before the thread starts."""
        job = self._jobs.get((table_id, index))
        if job is None:
            job = self._jobs[(table_id, index)] = _Job(table_id, index, next(self._seq))
        return job

    def want(self, building: IndexBuilding) -> None:
        """Build the index a request found missing (the upkeep's), if no build of it is queued."""
        with self._changed:
            self._job(layout.table_of(building.prefix), building.index)
            self._changed.notify_all()

    def wait(
        self, building: IndexBuilding, deadline: float | None = None, stop: Callable[[], bool] | None = None
    ) -> bool:
        """Wait until the table keeps the index a request found missing, its build going first
        meanwhile; True then, False as soon as `stop()` says so. Past the monotonic `deadline`
        IndexNotReady, unless the build is the request's own (`IndexBuilding.first_use`: a rows
        table builds an index at the first request that reads it), which it waits for whatever its
        deadline; a failed build's failure (it is tried again first), StoreClosed at a stop."""
        if building.first_use:
            deadline = None
        with self._changed:
            job = self._job(layout.table_of(building.prefix), building.index)
            job.error = None
            job.waiting += 1
            self._changed.notify_all()
        try:
            while True:
                with self._changed:
                    if job.done:
                        return True
                    if job.error is not None:
                        raise job.error
                    if self._stopping:
                        raise StoreClosed("the store is closed")
                    poll = STOP_POLL_SECONDS
                    left = poll if deadline is None else min(poll, deadline - time.monotonic())
                    if left <= 0:
                        raise self._not_ready(job)
                    self._changed.wait(left)
                if stop is not None and stop():
                    return False
        finally:
            with self._changed:
                job.waiting -= 1

    def _not_ready(self, job: _Job) -> IndexNotReady:
        progress = f"{job.indexed:,} of about {job.ready:,} ready groups indexed" if job.started else "not started"
        return IndexNotReady(
            f"table '{self._name(job)}': {job.index.described()} is being built in the background ({progress}); "
            "the request's wait ended first: ask again, or wait longer"
        )

    def submit(self, fn: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """`fn` in the writer's next transaction; when it needs an index its table is still
        building, once the build is done (`wait`, with no deadline), then tried again."""
        while True:
            try:
                return self.environment.submit(fn)
            except IndexBuilding as building:
                self.wait(building)

    def status(self) -> list[IndexBuild]:
        """The builds to do or under way, oldest first."""
        now = time.monotonic()
        with self._changed:
            return [self._status(job, now) for job in sorted(self._jobs.values(), key=lambda job: job.seq)]

    def _status(self, job: _Job, now: float) -> IndexBuild:
        return IndexBuild(
            table=self._name(job),
            index=job.index.databases[0],
            what=job.index.described(),
            indexed=job.indexed,
            ready=job.ready,
            seconds=now - job.started if job.started else 0.0,
            waiting=job.waiting,
            failed="" if job.error is None else clip(f"{type(job.error).__name__}: {job.error}", 300),
        )
