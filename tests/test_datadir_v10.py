"""A data directory written by format 10 (rows tables whose pending and computing groups kept a fragment
of their own a push: tests/fixtures/datadir_v10, made by its make.py) opens under format 11, which keeps
one fragment a push shared by the groups it reached (issue 64, Deliver 4): every table, group, payload
and pending member where that release left them, its groups completing with their last runs, a retried
push of what it holds a duplicate, and a start killed with SIGKILL at moments spread over the upgrade
leaving format 10 or 11, never a directory in between."""

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
from test_rows_upgrade import computed_all

from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store

from conftest import FIXTURES
from helpers import checked_after_a_kill

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
            assert _stats(store, table) == want | {"next_fragment": len(heads(store, table))}, table
            assert store.verify(table) == [], table
            listed = store.list_experiences(table, limit=10_000).items  # format 10's listed no computing group
            assert [[e.uid, e.group, e.state] for e in listed if e.state != "computing"] == MANIFEST["live"][table]
            assert sum(e.state == "computing" for e in listed) == want["computing"], table
            stored = store.get(table, MANIFEST["pushed"][table])
            assert {uid: hashlib.sha256(blob).hexdigest() for uid, blob in stored.items()} == MANIFEST["stored"][table]
            for gkey, head in heads(store, table).items():  # each group's fragments became one of its own
                assert [(ref.lo, ref.hi) for ref in head.refs] == [(0, head.size)], (table, gkey)
        assert len({ref.fragment for head in heads(store, "grpo").values() for ref in head.refs}) == 48


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


def test_a_kill_during_the_upgrade_to_format_11_leaves_format_10_or_11_and_check_finds_no_damage(
    tmp_path: Path,
) -> None:
    """`expbuf serve` SIGKILLed at moments spread over its start on a copy of the fixture: each time
    `expbuf check` exits 0 saying either that the next start upgrades the directory or that every table
    is ok, and the next start serves every table with the stats and members an upgrade never killed
    gives (grpo's computing groups computed, where the killed start served long enough to compute
    them), `verify` clean."""
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copy(V10 / "data.mdb", reference / "data.mdb")
    with Store(reference, clock=lambda: NOW) as store:
        want = {table: _stats(store, table) for table in TABLES}
        members = {table: store.list_experiences(table, limit=10_000).items for table in TABLES}
    # The upgrade takes about 10 ms from the moment LMDB opens: most delays land in it or just around it.
    for trial, delay in enumerate((0.0, 0.002, 0.004, 0.006, 0.008, 0.012, 0.02, 0.05, 0.2, 0.8)):
        data = tmp_path / f"copy{trial}"
        data.mkdir()
        shutil.copy(V10 / "data.mdb", data / "data.mdb")
        printed, upgrade = checked_after_a_kill(data, delay, 10)
        assert printed in (upgrade, [f"{table}: ok" for table in ("default", "grpo", "spread")]), (trial, printed)
        with Store(data, clock=lambda: NOW) as store:
            for table in TABLES:
                assert store.verify(table) == [], (trial, table)
                got = _stats(store, table)
                assert computed_all(got) == computed_all(want[table]), (trial, table)
                listed = store.list_experiences(table, limit=10_000).items
                assert [e.uid for e in listed] == [e.uid for e in members[table]], (trial, table)
