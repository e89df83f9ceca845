"""The advantage worker, started in the background once torch has loaded, and only once a table
needs advantages computed.

torch's import takes 1.5-2.5 s of CPU on a few cores, most of a restart that otherwise serves in
well under a second (bench/RESULTS.md, "Restart at any size"), and far longer under load. The
server therefore listens first, and this starts the worker beside it, when something needs it: at
the start, where a table with an estimator holds groups still to compute (pending or computing,
left by the last run or an upgrade); after it, at the first push that stores experiences in a
table with an estimator (`stored`, once the push is durable). A push that stores nothing, held by
a rate limit or a full table until its deadline, needs nothing computed and loads nothing: its
refusal, due just before the deadline, would race the import, which holds the interpreter for up
to seconds at a time on a loaded machine (the loading of torch's libraries). Every server has the
default table, whose estimator is grpo: a table's mere existence is no need, or every server
would load torch. A server that is never pushed to a table with an
estimator never loads it (a replay buffer with estimator none, say). The setting
`advantage_worker = "at_start"` loads it at the start instead (a torch that cannot load then shows
at once, and the first pushes compute their advantages themselves). Until the worker runs no call
waits for it: a push to a table with an estimator is stored with its completed groups computing,
as where the worker computes them (on CUDA), and the worker computes them once it has started; a
push after that computes its groups' advantages itself where the table's estimator does
(`Store.in_push`, one-value estimators on the CPU). A table's batch stage imports torch where its
reply is built (a batch it finishes was computed before), and so waits for the same import. A stop
does not wait for it either: a worker whose torch loads after the stop is not started, and the
groups stay computing for the next start.

What the worker is doing is `state`: not needed yet (torch not loaded), loading, running, or
failed. Should torch fail to load, that is logged once at ERROR with its cause, `on_state` hears it
(ServerInfo's `advantage_worker_failure`, the gauge `expbuf_advantage_worker_up`), and each push
that needs advantages computed is refused naming it from then on; the rest of the server keeps
serving. The groups left computing (pushed while torch loaded, or before the start) fail, each
table's Stats naming the cause, as groups whose computation fails on every try do (worker.py):
no worker of this server will ever compute them. A worker that ends later (what its loop does not
retry, a SystemExit from an estimator, ends it) is the same state, said the same ways.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..store import Compute, ComputeJob, Store
from ..store.schema.errors import AdvantagesUnavailable
from ..store.schema.table_config import TableConfig

if TYPE_CHECKING:
    from .worker import AdvantageWorker

log = logging.getLogger("expbuf.server")

# What the worker is doing (AdvantageStart.state, ServerInfo's `advantage_worker_state`).
NOT_NEEDED, LOADING, RUNNING, FAILED = "not_needed", "loading", "running", "failed"


def freeze_loaded() -> None:
    """What the server has loaded by now (torch above all, once loaded: about 180,000 objects; the
    server's own modules, about 44,000) lives as long as the process. Out of the collector's sight,
    a full collection, which the records a take or a push makes and drops bring on every few
    batches, no longer walks it: those walks took a fifth of a consume stream's writer. Garbage is
    collected first, so that none is kept."""
    gc.collect()
    gc.freeze()


class AdvantageStart:
    """Loads torch and starts the store's advantage worker on a thread of its own once a table
    needs it; answers the store's `in_push` meanwhile. `on_state` hears each state the worker
    enters, with the device advantages are computed on (running) or why they cannot be (failed:
    the worker did not start, or ended); `on_computed` and `on_failed` each computation, as
    AdvantageWorker's."""

    def __init__(
        self,
        store: Store,
        *,
        torch_threads: int,
        at_start: bool = False,
        on_computed: Callable[[ComputeJob, float], None],
        on_failed: Callable[[ComputeJob, str, int], None],
        on_state: Callable[[str, str], None],
    ) -> None:
        self._store, self._torch_threads, self._at_start = store, torch_threads, at_start
        self._on_computed, self._on_failed, self._on_state = on_computed, on_failed, on_state
        self._ready = threading.Event()
        # The load is begun once; the worker is started, or the server stopped, not both.
        self._lock = threading.Lock()
        self._stopped = False
        self.state = NOT_NEEDED
        self._worker: AdvantageWorker | None = None
        self._failure = ""
        self._thread = threading.Thread(target=self._load, name="expbuf-advantages-start", daemon=True)
        store.in_push, store.on_stored = self.in_push, self.stored
        on_state(NOT_NEEDED, "")

    def start(self) -> None:
        """At the server's start (once it listens): load torch now where asked to (`at_start`), or
        where a table with an estimator holds groups still to compute, which no push of this server
        may come to complete (a group the last run left pending completes at its timeout); else
        at the first push that stores experiences in a table with an estimator (`stored`)."""
        if self._at_start:
            self.need("advantage_worker = at_start")
            return
        waiting = next((t.name for t in self._store.list_tables() if self._left_to_compute(t)), None)
        if waiting is not None:
            self.need(f"table '{waiting}' holds groups whose advantages are still to compute")
        elif self.state == NOT_NEEDED:
            freeze_loaded()  # the server's own objects, without torch's
            log.info(
                "advantage worker not needed yet: torch loads when a table first needs advantages computed"
                " (a push to a table with an estimator)"
            )

    def _left_to_compute(self, config: TableConfig) -> bool:
        if config.advantages.estimator == "none":
            return False
        counters = self._store.counters(config.name)  # two counters: not the stats' reads beside them
        return counters.pending + counters.computing > 0

    def need(self, why: str) -> None:
        """Load torch and start the worker, in the background, unless that has begun (or the
        server stopped); `why` is logged."""
        if self.state != NOT_NEEDED:
            return
        with self._lock:  # each state said in the order it is entered
            if self.state != NOT_NEEDED or self._stopped:
                return
            self.state = LOADING
            log.info("advantage worker loading torch: %s", why)
            self._on_state(LOADING, "")
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the worker started (or failed to, or the server stopped first) within timeout:
        one that nothing has needed yet does not start while this waits."""
        return self._ready.wait(timeout)

    def _load(self) -> None:
        try:
            from .estimators import resolve_device
            from .worker import AdvantageWorker, use_threads

            use_threads(self._torch_threads)
            device = str(resolve_device("auto"))
            worker = AdvantageWorker(
                self._store, on_computed=self._on_computed, on_failed=self._on_failed, on_ended=self._ended
            )
        except Exception as exc:
            self._fail("the advantage worker did not start", exc)
            return
        with self._lock:
            if self._stopped:
                return
            self._worker = worker.start()
        self._ready.set()
        freeze_loaded()  # torch's objects too
        with self._lock:
            if self.state == LOADING:  # not a worker that has ended meanwhile
                self.state = RUNNING
                self._on_state(RUNNING, device)
        log.info("advantage worker started: advantages computed on %s", device)

    def stored(self, config: TableConfig) -> None:
        """The store's `on_stored`: a push stored experiences in a table, whose estimator, if it
        has one, needs the worker."""
        if config.advantages.estimator != "none":
            self.need(f"table '{config.name}' computes advantages with {config.advantages.estimator}")

    def in_push(self, config: TableConfig) -> Compute | None:
        """The store's `in_push`: None (the groups computing, for the worker) for a table without
        an estimator, until the worker runs (nothing has needed it yet, or torch loads), or once
        the server stops; a refusal where the worker did not start or has ended; else the
        worker's answer."""
        if config.advantages.estimator == "none":
            return None
        if self._failure:
            raise AdvantagesUnavailable(
                f"table '{config.name}': advantages cannot be computed on this server ({self._failure})"
            )
        worker = self._worker
        return None if worker is None else worker.in_push(config)

    def stop(self) -> None:
        """Stop the worker if it has started; one still loading is never started (its thread,
        a daemon, ends with the process), nor one not needed yet."""
        with self._lock:
            self._stopped = True
            worker, failing = self._worker, bool(self._failure)
        self._ready.set()
        if worker is not None:
            worker.stop()
        if failing:  # the thread failing what is computing ends now (an ended worker's: joined above)
            self._store.wake()
            self._thread.join()

    @property
    def loading(self) -> bool:
        """Whether torch's import is under way on the load's thread (a stop never waits for it)."""
        return self._thread.is_alive() and self._worker is None

    def _ended(self, exc: BaseException) -> None:
        """The worker's `on_ended`, on its thread: from now on, as if it had not started."""
        self._fail("the advantage worker ended", exc)

    def _fail(self, what: str, exc: BaseException) -> None:
        """Say once, and to `on_state`, why advantages cannot be computed; then, on the calling
        thread (whose work has ended), fail the groups computing until the server stops."""
        cause = f"{type(exc).__name__}: {exc}"
        log.error(
            "%s: %s; advantages cannot be computed on this server: each push that needs them is refused,"
            " and the groups computing fail, until a restart",
            what, cause, exc_info=exc,
        )  # fmt: skip
        with self._lock:
            self._failure = f"{what}: {cause}"
            self.state = FAILED
            self._on_state(FAILED, self._failure)
            failing = not self._stopped
        self._ready.set()
        if failing:
            self._fail_computing()

    def _fail_computing(self) -> None:
        """Fail every group computing, as they come (a push whose in_push ran before the failure
        was known commits its groups computing after it), until the server stops."""
        why = f"advantages cannot be computed on this server ({self._failure})"
        while not self._stopped:
            generation = self._store.generation
            try:
                for job in self._store.compute_backlog():
                    log.error("table %s: %d groups failed: %s", job.table, len(job.groups), why)
                    failed = dict.fromkeys(job.groups, why)
                    self._store.finish_compute(job.table, {}, [], failed=failed, table_id=job.table_id)
                    self._on_failed(job, "failed", len(job.groups))
            except Exception:  # a table dropped meanwhile, say: the next pass finds what is left
                log.exception("failing the groups computing failed; retrying")
            self._store.wait_for_change(generation, 0.5)
