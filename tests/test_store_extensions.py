"""Table extensions (server/store/extensions.py): a new hook is one class and one registration,
and runs at a real Store's events inside the request's transaction; the compute queue and
stale-group eviction are such extensions."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from expbuf.server.store import Store, TableExtension
from expbuf.server.store.compute_queue import ComputeQueue
from expbuf.server.store.errors import InvalidRequest
from expbuf.server.store.extensions import Extensions
from expbuf.server.store.ledger import Ledger
from expbuf.server.store.records import GroupRecord
from expbuf.server.store.sample_spec import SampleSpec
from expbuf.server.store.staleness import StaleEviction
from expbuf.server.store.table_config import TableConfig
from expbuf.server.store.table_state import Groups, TableState

from helpers import group_items


class Journal(TableExtension):
    """Writes down what it hears."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        self.events.append(("push", list(gkeys)))

    def on_insert(self, tt: TableState, uids: Sequence[str]) -> None:
        self.events.append(("insert", tt.config.name, len(uids)))

    def on_update(self, tt: TableState, gkey: str, grp: GroupRecord, was: str) -> None:
        self.events.append(("update", gkey, was, grp.state))

    def on_sample(self, tt: TableState, groups: Groups) -> None:
        self.events.append(("sample", [gkey for gkey, _ in groups]))

    def on_retire(self, tt: TableState, groups: Groups, state: str) -> None:
        self.events.append(("retire", [(gkey, grp.state) for gkey, grp in groups], state))


def test_a_registered_extension_hears_a_real_stores_events(tmp_path: Path) -> None:
    with Store(tmp_path / "data") as store:
        journal = store.extensions.register(Journal())
        store.create_table(TableConfig.of(name="t", estimator="none", group_size=2))
        pushed = store.put("t", group_items(0, 0, 2))
        (gkey,) = pushed.completed_groups
        leased = store.sample(SampleSpec("t", num_groups=1, delivery="lease"))
        assert store.nack(leased.lease_id) == 2
        assert store.sample(SampleSpec("t", num_groups=1)) is not None  # consumed
    assert journal.events == [
        ("push", [gkey]),
        ("update", gkey, "pending", "ready"),
        ("insert", "t", 2),
        ("update", gkey, "ready", "leased"),
        ("sample", [gkey]),
        ("update", gkey, "leased", "ready"),
        ("retire", [(gkey, "ready")], "consumed"),
        ("sample", [gkey]),
    ]


class Refuser(TableExtension):
    """Refuses every push of a table named `closed`, and into a group named `0/1`."""

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        if "0/1" in gkeys:
            raise InvalidRequest("group 0/1 takes no pushes")

    def on_insert(self, tt: TableState, uids: Sequence[str]) -> None:
        if tt.config.name == "closed":
            raise InvalidRequest("table 'closed' takes no pushes")


def test_an_extension_runs_inside_the_requests_transaction(tmp_path: Path) -> None:
    """What an extension refuses is undone with the request: nothing of the push is stored."""
    with Store(tmp_path / "data") as store:
        store.extensions.register(Refuser())
        for name in ("closed", "open"):
            store.create_table(TableConfig.of(name=name, estimator="none", group_size=2))
        with pytest.raises(InvalidRequest, match="takes no pushes"):
            store.put("closed", group_items(0, 0, 2))
        with pytest.raises(InvalidRequest, match="group 0/1 takes no pushes"):
            store.put("open", group_items(0, 0, 2) + group_items(0, 1, 2))
        store.put("open", group_items(0, 0, 2))
        assert store.stats("closed")["pushed"] == 0 and store.stats("closed")["ready"] == 0
        assert store.stats("open")["ready"] == 2
        assert store.verify("closed") == [] and store.verify("open") == []


def test_only_extensions_are_registered() -> None:
    with pytest.raises(TypeError, match="not a TableExtension"):
        Extensions().register(object())  # type: ignore[arg-type]


def test_the_compute_queue_stale_eviction_and_ledger_are_the_stores_own_extensions(tmp_path: Path) -> None:
    with Store(tmp_path / "data") as store:
        assert [type(ext) for ext in store.extensions] == [ComputeQueue, StaleEviction, Ledger]
        store.create_table(TableConfig.of(name="g", estimator="grpo", group_size=2))
        store.put("g", group_items(0, 0, 2))
        (job,) = store.compute_backlog()  # queued by the compute queue's on_update
        assert job.table == "g" and len(job.groups) == 1
        store.delete("g", group_ids=job.groups)  # leaves the queue by its on_retire
        assert store.compute_backlog() == []
        assert store.verify("g") == []
