"""A data directory written by format 10 with rows tables whose groups' runs arrived over several pushes
(pending and computing groups, each with a fragment a push: tests/fixtures/datadir_v10, made by its
make.py at 4c65a9a) opens, upgraded to format 11 (whose heads keep their latest members' rows) also
where a start was killed during its open, with every table, group, payload and pending member where
that release left them; its groups complete with their last runs, those a format 10 fragment holds
and those a format 11 head does together, and a retried push of what it holds is a duplicate."""

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
from expbuf.server.store.disk import layout

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


# The counters added since format 10's release wrote the fixture: they read as zero.
ADDED_SINCE = {"dropped_claim_ended": 0, "groups_timed_out": 0}


def _wanted(table: str) -> dict[str, Any]:
    """What the fixture's release said of the table's stats, with the counters added since."""
    return ADDED_SINCE | {k: v for k, v in MANIFEST["stats"][table].items() if k != "staged_bytes"}


def test_format_10_opens_with_every_table_group_and_payload_in_place(v10: Path) -> None:
    with Store(v10, clock=lambda: NOW) as store:
        with store.environment.read() as txn:
            assert txn.get(b"format", db=store.db["meta"]) == str(layout.FORMAT).encode() == b"11"
        assert all(not head.inline and head.fragments for head in heads(store, "spread").values())
        for table in TABLES:
            assert _stats(store, table) == _wanted(table), table
            assert store.verify(table) == [], table
            listed = store.list_experiences(table, limit=10_000).items  # format 10's listed no computing group
            assert [[e.uid, e.group, e.state] for e in listed if e.state != "computing"] == MANIFEST["live"][table]
            assert sum(e.state == "computing" for e in listed) == _wanted(table)["computing"], table
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
        first, last = last[::2], last[1::2]
        put = store.put("spread", first)  # the runs before: in their heads, or completing a group
        assert len(put.stored) == len(first) and put.completed_groups
        joined = {gkey for gkey, head in heads(store, "spread").items() if head.inline}
        assert joined and all(heads(store, "spread")[gkey].fragments for gkey in joined)  # format 10's, and 11's
        assert store.verify("spread") == []
        assert store.put("spread", first).duplicates == [item.uid for item in first]
        completed = put.completed_groups + store.put("spread", last).completed_groups
        assert sorted(completed) == sorted(pending)
        assert set(heads(store, "spread")) == {"1/1", "1/7"}
        assert store.verify("spread") == []
        assert AdvantageWorker(store).run_once() > 0  # grpo's computing groups, their members from fragments
        assert store.stats("grpo")["computing"] == 0 < store.stats("grpo")["ready"]
        assert store.verify("grpo") == []
    with Store(v10, clock=lambda: NOW) as store:  # and after a restart
        assert all(store.verify(table) == [] for table in TABLES)


def test_a_start_killed_while_it_opens_format_10_leaves_it_whole(tmp_path: Path) -> None:
    """`expbuf serve` killed with SIGKILL at moments of its open of a format 10 directory (its upgrade
    is the format's record alone, in the open's transaction): `expbuf check` finds it whole, of format
    10 or 11, and it opens with every table as format 10 left it."""
    for trial, delay in enumerate((0.0, 0.05, 0.2, 0.6)):
        data = tmp_path / f"copy{trial}"
        data.mkdir()
        shutil.copy(V10 / "data.mdb", data / "data.mdb")
        lines = checked_after_a_kill(data, delay, 10)
        assert len(lines) == 1 or lines == [f"{table}: ok" for table in sorted((*TABLES, "default"))], (trial, lines)
        with Store(data, clock=lambda: NOW) as store:
            for table in TABLES:
                assert _stats(store, table) == _wanted(table), (trial, table)
                assert store.verify(table) == [], (trial, table)
