"""The advantage worker, started in the background once torch has loaded.

torch's import takes 1.5-2.5 s on a few cores, most of a restart that otherwise serves in
well under a second (bench/RESULTS.md, "Restart at any size"). The server therefore listens
first, and this starts the worker beside it. Until then a push that computes its groups'
advantages itself (`Store.in_push`, one-value estimators) waits for the worker before it
takes the writer, so it is stored as it would have been; every other call is served at
once: a sample of stored groups, a push to a table without an estimator, Stats. A table's
batch stage imports torch where its reply is built, and so waits for the same import.

Should torch fail to load, that is logged once with its cause, and each push that needs
advantages computed is refused naming it; the rest of the server keeps serving.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..store import Store
from ..store.disk.kinds import Compute
from ..store.schema.errors import AdvantagesUnavailable
from ..store.schema.table_config import TableConfig

if TYPE_CHECKING:
    from .worker import AdvantageWorker

log = logging.getLogger("expbuf.server")


class AdvantageStart:
    """Loads torch and starts the store's advantage worker on a thread of its own; answers the
    store's `in_push` meanwhile. `on_device` hears the device advantages are computed on;
    `on_computed` and `on_failed` each computation, as AdvantageWorker's."""

    def __init__(
        self,
        store: Store,
        *,
        torch_threads: int,
        on_computed: Callable[[str, str, float], None],
        on_failed: Callable[[str, str, str, int], None],
        on_device: Callable[[str], None],
    ) -> None:
        self._store, self._torch_threads = store, torch_threads
        self._on_computed, self._on_failed, self._on_device = on_computed, on_failed, on_device
        self._ready = threading.Event()
        self._lock = threading.Lock()  # the worker is started, or the server stopped, not both
        self._stopped = False
        self._worker: AdvantageWorker | None = None
        self._failure = ""
        self._thread = threading.Thread(target=self._load, name="expbuf-advantages-start", daemon=True)
        store.in_push = self.in_push

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the worker started (or failed to) within timeout."""
        return self._ready.wait(timeout)

    def _load(self) -> None:
        try:
            from .estimators import resolve_device
            from .worker import AdvantageWorker, use_threads

            use_threads(self._torch_threads)
            device = str(resolve_device("auto"))
            worker = AdvantageWorker(self._store, on_computed=self._on_computed, on_failed=self._on_failed)
        except Exception as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            log.exception("advantages cannot be computed: the advantage worker did not start")
        else:
            with self._lock:
                if not self._stopped:
                    self._worker = worker.start()
            # What the server has loaded by now (torch above all: about 180,000 objects) lives as
            # long as the process. Out of the collector's sight, a full collection, which the
            # records a take or a push makes and drops bring on every few batches, no longer
            # walks it: those walks took a fifth of a consume stream's writer. Garbage is collected
            # first, so that none is kept.
            gc.collect()
            gc.freeze()
            self._on_device(device)
            log.info("advantage worker started: advantages computed on %s", device)
        finally:
            self._ready.set()

    def in_push(self, config: TableConfig) -> Compute | None:
        """The store's `in_push`: None for a table without an estimator; otherwise, once the
        worker has started, its answer."""
        if config.advantages.estimator == "none":
            return None
        self._ready.wait()
        if self._worker is None:
            if self._failure:
                raise AdvantagesUnavailable(
                    f"table '{config.name}': advantages cannot be computed on this server ({self._failure})"
                )
            return None  # stopping: the groups stay computing, for the next start's worker
        return self._worker.in_push(config)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        if self._thread.ident is not None:
            self._thread.join()
        if self._worker is not None:
            self._worker.stop()
