"""The threads that do a table's zstd work (chunked.py): a push's chunks compressed before the
writer takes them, a reply's decompressed where it is built, each side by side on a few threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import zstandard

from expbuf.client.trxp.stored.pieces import Bytes

T = TypeVar("T")


class Workers:
    """A few threads, made at first use, for one kind of zstd work: zstd lets go of the
    interpreter while it compresses or decompresses a chunk, so a large experience's chunks go
    at the speed of the server's cores, not of one. Pushes' compression and replies'
    decompression each have their own, so that neither waits behind the other; the writer,
    and every other read, decompresses on its own thread."""

    def __init__(self, name: str) -> None:
        self._name, self._lock = name, threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._threads = min(8, _cores())

    def each(self, work: Callable[..., T], *over: Sequence[Any]) -> list[T]:
        """`work` over the items of `over` (zipped), side by side where there are several; every
        one done before this returns (or raises the first failure). A call has at most as many
        in the pool at once as it has threads, the next going in as one ends: the calls of
        several tables share the threads in turn, where a table compressing at level 19 would
        have held a level-1 table's push behind all of its chunks."""
        items = list(zip(*over, strict=True))
        if len(items) < 2:
            return [work(*item) for item in items]
        pool = self._threads_made()
        futures: list[Future[T]] = []
        running: set[Future[T]] = set()
        try:
            for item in items:
                if len(running) >= self._threads:
                    _, running = wait(running, return_when=FIRST_COMPLETED)
                future = pool.submit(work, *item)
                futures.append(future)
                running.add(future)
        finally:
            wait(futures)  # none still reads the caller's views once it has left
        return [future.result() for future in futures]

    def submit(self, work: Callable[..., T], *args: Any) -> Future[T]:
        """`work(*args)` on one of the threads, as it comes (a reply's next chunk, ahead of its read)."""
        return self._threads_made().submit(work, *args)

    def _threads_made(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix=self._name)
            return self._pool


def _cores() -> int:
    """The cores this process may run on (all of the machine's where the platform cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


COMPRESSING = Workers("expbuf-zstd-push")  # a push's chunks, compressed before the writer
DECOMPRESSING = Workers("expbuf-zstd-reply")  # a reply's chunks, decompressed where it is built


def compress(chunk: Bytes, level: int) -> bytes:
    """A chunk as a table that compresses keeps it: one zstd frame, which says its length."""
    frame: bytes = zstandard.ZstdCompressor(level=level).compress(chunk)
    return frame
