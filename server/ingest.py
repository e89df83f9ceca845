"""Decoding and packing pushed payloads, in this process or in a pool of processes.

Validation and packing are Python work per experience, so under the GIL they use one
core however many pushers there are. With `ingest_processes` > 0 (2 by default: 1.16x to
1.60x the push throughput of 0 on 2 cores, bench/RESULTS.md) they run in that many worker
processes (spawned, so no thread of the server is forked): the server process keeps only
the storage and the RPCs. Every check is the same code either way. A worker
that dies is replaced, and the push it was decoding is decoded here instead.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from expbuf.client import trxp

from .store import Entry

log = logging.getLogger("expbuf.ingest")


def entries_of(payload: bytes) -> list[Entry]:
    """A pushed payload's experiences, validated and packed as the store keeps them."""
    return [Entry.of(item) for item in trxp.parse(payload)]


class Ingest:
    """Turns pushed payloads into entries, in `processes` worker processes (0: here)."""

    def __init__(self, processes: int = 0) -> None:
        self.processes = processes
        self._lock = threading.Lock()
        self._pool = self._start() if processes else None

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        for future in [pool.submit(entries_of, b"") for _ in range(self.processes)]:
            future.exception()  # spawn and import now, not on the first push
        return pool

    def entries(self, payload: bytes) -> list[Entry]:
        pool = self._pool
        if pool is None:
            return entries_of(payload)
        try:
            return pool.submit(entries_of, payload).result()
        except BrokenProcessPool:
            log.warning("an ingest process died; starting new ones, and decoding this push here")
            with self._lock:
                if self._pool is pool:
                    self._pool = self._start()
            return entries_of(payload)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
