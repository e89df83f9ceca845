"""The writer's batches run without the garbage collector's passes (disk/environment/writer.py): a push of
hundreds of experiences makes thousands of tracked objects (its members' rows, its groups, their
segments' columns) that its own reference counts free, so a pass that walks them finds nothing to
collect. None starts on the writer's thread while a push is stored (but the one due as it ends); the
collector runs again once the batch is done, after a refused push too, and a collector a caller
disabled stays disabled."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest

from expbuf.server.store import Store
from expbuf.server.store.schema.errors import GroupOverfilled
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items, passes_started

ONES = {"estimator": "none", "group_by": "none"}  # each experience its own group: a row a group


def _writer_ident(store: Store) -> int:
    """The writer thread's id, as an op run there sees it."""
    ident: int = store.environment.submit(lambda txn: threading.get_ident())
    return ident


@pytest.mark.parametrize("layout", ["rows", "records"])
def test_no_pass_runs_on_the_writer_while_a_push_is_stored(tmp_path: Path, layout: str) -> None:
    """Four pushes of 256 experiences, hundreds of tracked objects each, many times the low first
    threshold passes_started sets: no pass starts on the writer's thread while it runs a request
    (Writer._run), where without the pause 55 did with rows, 79 with records; the pass due runs
    once the batch's requests are done, and the collector runs as it ran before once they are stored."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", layout=layout, **ONES))
        writer = _writer_ident(store)
        with passes_started(inside="_run", thread=writer) as started:
            for n in range(4):
                store.put("t", group_items(n, 0, 256))
            assert gc.isenabled()
        assert started, "no pass at all on the writer: the test's threshold did not take"
        assert not any(started), f"{sum(started)} of the writer's {len(started)} passes ran inside a request"
        assert store.stats("t")["ready"] == 1024


def test_a_refused_push_leaves_the_collector_running(tmp_path: Path) -> None:
    """A push the writer refuses (a group it would overfill) leaves the collector as it was."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", estimator="none", group_by="task", group_size=2))
        with pytest.raises(GroupOverfilled):
            store.put("t", group_items(0, 0, 3))
        assert gc.isenabled()
        assert store.stats("t")["pending"] + store.stats("t")["ready"] == 0


def test_a_collector_the_caller_disabled_stays_disabled(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", **ONES))
        gc.disable()
        try:
            store.put("t", group_items(0, 0, 8))
            assert not gc.isenabled()
        finally:
            gc.enable()
