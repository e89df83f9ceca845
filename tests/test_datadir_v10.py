"""A data directory written by format 10 with rows tables whose groups' runs arrived over several pushes
(pending and computing groups, each with a fragment a push: tests/fixtures/datadir_v10, made by its
make.py at 4c65a9a) opens with every table, group, payload and pending member where that release left
them, its groups complete with their last runs, and a retried push of what it holds is a duplicate:
what the next format's upgrade of such a directory is tested against."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from test_rows_pending import heads

from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store

from conftest import FIXTURES

V10 = FIXTURES / "datadir_v10"
MANIFEST = json.loads((V10 / "manifest.json").read_text())
TABLES = ("spread", "grpo")
NOW = MANIFEST["now"]


def _make() -> ModuleType:
    """The fixture's make.py, whose `run` builds its experiences again the same way."""
    spec = importlib.util.spec_from_file_location("datadir_v10_make", V10 / "make.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _make()


@pytest.fixture
def v10(tmp_path: Path) -> Path:
    shutil.copy(V10 / "data.mdb", tmp_path / "data.mdb")
    return tmp_path


def _stats(store: Store, table: str) -> dict[str, Any]:
    return {k: v for k, v in store.stats(table).items() if k not in ("oldest_age_seconds", "staged_bytes")}


def test_format_10_opens_with_every_table_group_and_payload_in_place(v10: Path) -> None:
    with Store(v10, clock=lambda: NOW) as store:
        for table in TABLES:
            want = {k: v for k, v in MANIFEST["stats"][table].items() if k != "staged_bytes"}
            assert _stats(store, table) == want, table
            assert store.verify(table) == [], table
            listed = store.list_experiences(table, limit=10_000).items  # format 10's listed no computing group
            assert [[e.uid, e.group, e.state] for e in listed if e.state != "computing"] == MANIFEST["live"][table]
            assert sum(e.state == "computing" for e in listed) == want["computing"], table
            stored = store.get(table, MANIFEST["pushed"][table])
            assert {uid: hashlib.sha256(blob).hexdigest() for uid, blob in stored.items()} == MANIFEST["stored"][table]


def test_format_10_s_pending_groups_complete_with_their_last_runs_and_take_no_retried_run(v10: Path) -> None:
    with Store(v10, clock=lambda: NOW) as store:
        pending = {gkey for gkey, head in heads(store, "spread").items() if gkey not in ("1/1", "1/7")}
        retried = [MAKE.run(1, int(gkey.split("/")[1]), 0) for gkey in sorted(pending)]
        assert store.put("spread", retried).duplicates == [item.uid for item in retried]
        last = []
        for gkey in sorted(pending):
            task = int(gkey.split("/")[1])
            last += [MAKE.run(1, task, number) for number in range(1 + task % 5, 4)]
        assert sorted(store.put("spread", last).completed_groups) == sorted(pending)
        assert set(heads(store, "spread")) == {"1/1", "1/7"}
        assert store.verify("spread") == []
        assert AdvantageWorker(store).run_once() > 0  # grpo's computing groups, their members from fragments
        assert store.stats("grpo")["computing"] == 0 < store.stats("grpo")["ready"]
        assert store.verify("grpo") == []
    with Store(v10, clock=lambda: NOW) as store:  # and after a restart
        assert all(store.verify(table) == [] for table in TABLES)
