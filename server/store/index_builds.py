"""Building a lazy ready-group index in chunks (selection.ReadyIndex.build_step), each a write
transaction of its own, so that the writer's other requests (pushes, samples) wait at most one
chunk at a time, while the request that needs the index waits for the whole build. The build
reads every ready group's record, all over the file: the map's pages are given back
every RELEASE_CHUNKS chunks and at its end (residency.py), so RSS does not keep them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import lmdb

from . import layout, residency
from .catalog import TableCatalog
from .environment import Environment
from .selection import IndexBuilding

T = TypeVar("T")
RELEASE_CHUNKS = 64  # some 130,000 ready groups' records between two releases of the map's pages


def build(environment: Environment, catalog: TableCatalog, building: IndexBuilding) -> int:
    """Build the index a request found missing, chunk by chunk, until its table keeps it (or
    the table is gone); returns the transactions it took."""
    table_id = layout.table_of(building.prefix)
    chunks = 0

    def step(txn: lmdb.Transaction[bytes]) -> bool:
        tt = catalog.state_of(txn, table_id)
        return tt is None or tt.ready.build_step(building.index)

    while True:
        chunks += 1
        done = environment.submit(step)
        if done or chunks % RELEASE_CHUNKS == 0:
            residency.release(environment.path / "data.mdb")  # the records it read: page cache, not RSS
        if done:
            return chunks


def submit_building(environment: Environment, catalog: TableCatalog, fn: Callable[[lmdb.Transaction[bytes]], T]) -> T:
    """`fn` in the writer's next transaction; when it needs an index its table does not keep
    yet, the index is built first (`build`) and `fn` tried again."""
    while True:
        try:
            return environment.submit(fn)
        except IndexBuilding as building:
            build(environment, catalog, building)
