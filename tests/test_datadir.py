"""A data directory written by an earlier release opens, with every table, group, lease
and counter where that release left them (tests/fixtures/datadir_v1, made by make.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from expbuf.client import decode
from expbuf.server.advantages import AdvantageWorker
from expbuf.server.store import Store

from conftest import FIXTURES
from helpers import group_items, take

V1 = FIXTURES / "datadir_v1"
MANIFEST = json.loads((V1 / "manifest.json").read_text())
COUNTS = ("pending", "computing", "ready", "leased", "consumed", "failed", "bytes", "pushed", "sampled")


@pytest.fixture
def v1(tmp_path: Path) -> Path:
    shutil.copy(V1 / "data.mdb", tmp_path / "data.mdb")
    return tmp_path


def test_first_format_opens_with_everything_in_place(v1: Path) -> None:
    now = MANIFEST["now"]
    with Store(v1, clock=lambda: now) as store:
        assert {t.name for t in store.list_tables()} == set(MANIFEST["stats"])
        assert store.table("turns").estimator == "discounted_return"  # version 1's "reinforce"
        for table, want in MANIFEST["stats"].items():
            stats = store.stats(table)
            assert {k: stats[k] for k in COUNTS} == {k: want[k] for k in COUNTS}, table
            assert store.verify(table) == [], table
        for table, uids in MANIFEST["stored"].items():
            assert sorted(store.get(table, MANIFEST["pushed"][table])) == uids
        lease = MANIFEST["lease"]
        assert store.ack(lease["id"], lease["table"]) == 4
        ready = take(store, "grpo4", num_groups=1)
        assert ready.group_ids == ["1/0"] * 4
        assert all(e.advantages is not None for e in decode(ready.payload))
        replayed = take(store, "plain", num_groups=2, delivery="replay")
        assert sorted(set(replayed.group_ids)) == ["3/0", "3/1"]
        for table in MANIFEST["stats"]:
            assert store.verify(table) == [], table


def test_first_format_takes_new_pushes_and_completes_its_pending_group(v1: Path) -> None:
    with Store(v1) as store:
        pending = [item for item in group_items(1, 3, 4) if item.eid.run >= 2]
        for item in pending:
            item.meta["eid"]["suffix"] = f"r{item.eid.run}"
        assert store.put("grpo4", pending).completed_groups == ["1/3"]
        assert AdvantageWorker(store).run_once() == 1
        assert take(store, "grpo4", num_groups=1, order="lifo").group_ids == ["1/3"] * 4
        store.put("turns", group_items(5, 0, 2))
        assert AdvantageWorker(store).run_once() == 2
        assert store.verify("grpo4") == [] and store.verify("turns") == []
