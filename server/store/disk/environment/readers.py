"""The read transactions of an environment and the snapshots it hands out, and the gate a map's
resize passes through: no reader holds a transaction while the map grows (LMDB's rule), so a
resize waits for the readers under way, lets none begin, and detaches every snapshot first."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Literal, TypeVar, overload

import lmdb

from ..snapshot import Snapshot

V = TypeVar("V", bytes, memoryview)
# Snapshots open at once (see Readers.snapshot); each holds one of LMDB's reader slots.
MAX_SNAPSHOTS = 16


class Readers:
    """The readers of an LMDB environment: how many hold a transaction, the snapshots open, and
    whether the map is being resized."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env
        self._readers = 0
        self._resizing = False
        self._snapshots: list[weakref.ref[Snapshot]] = []  # those open, under _snapshots_lock
        self._snapshots_lock = threading.Lock()
        self._gate = threading.Condition()

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
        self._enter()
        try:
            with begin() as txn:
                yield txn
        finally:
            self._leave()

    def snapshot(self) -> Snapshot:
        """A read transaction of the last committed state whose values are views into the
        map, open until released (snapshot.py): the writer's, while it takes a batch (the state
        its take saw), or any thread's (a ReadFields, which needs no writer's turn). It is pinned
        until its opener unpins it. At most MAX_SNAPSHOTS stay open: opening another detaches the
        oldest not pinned, or, for one whose reply is being built, has its reader detach it as it
        ends, so that no one waits for a reply (one more per reply being built, or pinned, may
        stay open until then)."""
        while True:
            self._enter()  # a resize, which detaches every snapshot, lets none begin
            try:
                with self._snapshots_lock:
                    if self._resizing:  # began after this counted itself a reader: its detach may be past
                        opened = None
                    else:
                        live = [ref for ref in self._snapshots if (snap := ref()) is not None and snap.open]
                        loose = [snap for ref in live if (snap := ref()) is not None and not snap.pinned]
                        extra = loose[: max(0, len(live) + 1 - MAX_SNAPSHOTS)]
                        opened = Snapshot(self.env.begin(buffers=True), self._leave)
                        self._snapshots = [*live, weakref.ref(opened)]
            except BaseException:
                self._leave()
                raise
            if opened is None:
                self._leave()
                continue
            for oldest in extra:  # copied, if so, outside the lock: it holds up no other opening
                oldest.detach(wait=False)
            return opened

    def detach_snapshots(self) -> None:
        """Copy what open snapshots hold and end them, before the map is resized or closed."""
        with self._snapshots_lock:
            opened, self._snapshots = self._snapshots, []
        for ref in opened:
            snap = ref()
            if snap is not None:
                snap.detach()

    def resize(self, size: int) -> None:
        """Set the map's size once no reader holds a transaction: none begins from the call on,
        and every snapshot is detached first."""
        with self._gate:
            self._resizing = True  # no reader begins from here on: none opens a snapshot after the detach
        try:
            self.detach_snapshots()
            with self._gate:
                self._gate.wait_for(lambda: self._readers == 0)
                self.env.set_mapsize(size)
        finally:
            with self._gate:
                self._resizing = False
                self._gate.notify_all()

    def _enter(self) -> None:
        with self._gate:
            self._gate.wait_for(lambda: not self._resizing)
            self._readers += 1

    def _leave(self) -> None:
        with self._gate:
            self._readers -= 1
            self._gate.notify_all()
