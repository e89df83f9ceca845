"""A table dropped while other calls wait for the writer: the calls that share the drop's batch and
come after it are refused NotFound, nothing of them stored under the dropped table; and a drop and a
create of one name in one batch leave the catalog's memory as the batch left the disk, whichever of
their callers wakes first."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.errors import NotFound
from expbuf.server.store.schema.table_config import TableConfig

CONFIG = TableConfig.of(name="t", group_size=2, estimator="none")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "data", seed=1) as opened:
        opened.create_table(CONFIG)
        yield opened


def one_batch(store: Store, calls: list[tuple[str, Callable[[], object]]]) -> dict[str, object]:
    """Each call made from a thread of its own (named as given) while the writer is held, queued in
    this order, so that they share its next batch; what each returned or raised."""
    running, gate = threading.Event(), threading.Event()

    def hold(txn: object) -> None:
        running.set()
        gate.wait(30)

    held = store.environment.queue(hold)
    assert running.wait(30)  # its batch taken: the calls queue for the next
    out: dict[str, object] = {}

    def call(name: str, fn: Callable[[], object]) -> None:
        try:
            out[name] = fn()
        except Exception as exc:
            out[name] = exc

    threads = []
    for count, (name, fn) in enumerate(calls, start=1):
        threads.append(threading.Thread(target=call, args=(name, fn), name=name))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while store.environment.writer._queue.qsize() < count:  # queued: the next one after it
            assert time.monotonic() < deadline, f"{name} never reached the writer"
            time.sleep(0.001)
    gate.set()
    held.result()
    for thread in threads:
        thread.join(30)
    return out


def rows_under(store: Store, table_id: int) -> dict[str, int]:
    """The rows each per-table database holds under a table's prefix."""
    prefix = layout.table_prefix(table_id)
    with store.environment.read() as txn:
        return {
            name: sum(1 for key, _ in txn.cursor(db=store.db[name]) if bytes(key).startswith(prefix))
            for name in layout.per_table(store.db)
        }


def test_calls_behind_a_drop_in_its_batch_are_refused_and_store_nothing(store: Store) -> None:
    """They looked the table up before the drop and reached the writer after it: each was answered
    as stored (a value, a trainer version, a grant) and left rows under the dropped table's prefix
    that no table owns (`expbuf check` lists them)."""
    table_id, _ = store.catalog.lookup("t")
    out = one_batch(
        store,
        [
            ("drop", lambda: store.drop_table("t")),
            ("values", lambda: store.put_values("t", ["k"], [b"v" * 100])),
            ("version", lambda: store.set_trainer_version("t", 3)),
            ("admit", lambda: store.admit("t", 2)),
        ],
    )
    assert out["drop"] == 0
    for name in ("values", "version", "admit"):
        assert isinstance(out[name], NotFound) and "'t' does not exist" in str(out[name]), (name, out[name])
    assert not any(rows_under(store, table_id).values())
    assert "t" not in [config.name for config in store.list_tables()]


def slow(store: Store, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller on thread `name` wakes 0.2 s after its batch is committed, as a busy machine may
    wake it after the other callers of the batch."""
    submit = store.environment.submit

    def late(*args: object, **kwargs: object) -> object:
        out = submit(*args, **kwargs)  # type: ignore[arg-type]
        if threading.current_thread().name == name:
            time.sleep(0.2)
        return out

    monkeypatch.setattr(store.environment, "submit", late)


def stored(store: Store, name: str) -> int | None:
    with store.environment.read() as txn:
        return store.catalog.stored_id(txn, name)


def test_a_table_made_again_in_the_batch_of_its_drop_stays_whichever_caller_wakes_first(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop's caller, waking last, took the new table out of the catalog's memory: created, on
    disk, and NotFound to every call until a restart."""
    slow(store, "drop", monkeypatch)
    out = one_batch(store, [("drop", lambda: store.drop_table("t")), ("create", lambda: store.create_table(CONFIG))])
    assert out == {"drop": 0, "create": True}
    new = stored(store, "t")
    assert new is not None and store.catalog.lookup("t")[0] == new
    store.set_trainer_version("t", 2)  # a call naming it finds it


def test_a_table_dropped_in_the_batch_of_a_create_that_found_it_is_gone_whichever_caller_wakes_first(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create (exist_ok) that found the table, then its drop, in one batch: the create's caller,
    waking last, put the dropped table back in the catalog's memory, with nothing of it on disk."""
    slow(store, "create", monkeypatch)
    out = one_batch(
        store, [("create", lambda: store.create_table(CONFIG, exist_ok=True)), ("drop", lambda: store.drop_table("t"))]
    )
    assert out == {"create": False, "drop": 0}
    assert stored(store, "t") is None and not store.has_table("t")
    assert "t" not in [config.name for config in store.list_tables()]


def test_an_upkeep_pass_in_the_batch_of_a_drop_counts_no_failure(tmp_path: Path) -> None:
    """The pass still listed the table (the catalog's memory follows a drop once it commits) and
    found it gone on disk: an ERROR `maintenance skipped table t: NotFound` and a maintenance
    failure for an ordinary drop (a helper's audit)."""
    stale = TableConfig.of(name="t", group_size=1, estimator="none", max_staleness=2, evict_stale=True)
    with Store(tmp_path / "data", seed=1) as store:
        store.create_table(stale)
        store.set_trainer_version("t", 1)
        out = one_batch(store, [("drop", lambda: store.drop_table("t")), ("tick", store.tick)])
        assert out["drop"] == 0 and isinstance(out["tick"], dict) and out["tick"]["failed"] == 0
        assert store.maintenance_failures == 0


@pytest.mark.parametrize("made_again", [True, False])
def test_a_claim_whose_table_is_dropped_and_made_again_while_it_waits_is_refused(
    store: Store, made_again: bool
) -> None:
    """A claim's steps looked the table up by name each: one waiting for a prompt, or going on over
    several transactions, went on in a table made again under the name meanwhile, one reply mixing
    the old table's prompts (gone with it) with the new one's, a prompt twice (a helper's audit).
    One that wakes while the table is gone, not made again yet, says the same."""
    store.create_dataset("t", DatasetRecord("d", size=1))
    assert len(store.claim("t", "d", 1, seconds=60)[0]) == 1  # every prompt out: the next claim waits

    def again() -> None:
        time.sleep(0.5)
        store.drop_table("t")
        if made_again:
            store.create_table(CONFIG)
            store.create_dataset("t", DatasetRecord("d", size=1))

    made = threading.Thread(target=again)
    made.start()
    try:
        with pytest.raises(NotFound, match="table 't' was dropped while the claim went on"):
            store.claim("t", "d", 1, seconds=60, wait=10)
    finally:
        made.join()
    if made_again:
        assert len(store.claim("t", "d", 1, seconds=60)[0]) == 1  # a claim of the table made again


def test_a_dropped_tables_grants_go_with_it(store: Store) -> None:
    """Kept, an admit made again under a grant's id after the table was made again was refused
    ("names an open grant of another table") until the old grant expired, up to a day."""
    limited = TableConfig.of(name="a", group_size=2, estimator="none", max_staleness=0, batch_size=4)
    store.create_table(limited)
    assert store.admit("a", 2, grant_id="g").count == 2
    store.drop_table("a")
    store.create_table(limited)
    assert store.admit("a", 2, grant_id="g").count == 2
    with store.environment.read() as txn:
        assert len(list(txn.cursor(db=store.db["grants"]))) == 1
