"""A data directory written by format 3 (expbuf 0.2.0: SHA-256 digests, full tombstones)
opens under today's release with every table, group, lease, payload and tombstone where
that release left them (tests/fixtures/datadir_v3, made by make.py), and a retried push of
anything it holds, tombstones included, is still a duplicate."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from expbuf.client import EID, Experience, decode, trxp
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import Conflict

from conftest import FIXTURES
from helpers import take

V3 = FIXTURES / "datadir_v3"
MANIFEST = json.loads((V3 / "manifest.json").read_text())
COUNTS = ("pending", "computing", "ready", "leased", "consumed", "evicted", "bytes", "pushed", "sampled")


@pytest.fixture
def v3(tmp_path: Path) -> Path:
    shutil.copy(V3 / "data.mdb", tmp_path / "data.mdb")
    return tmp_path


def group(batch: int, task: int, size: int, *, response: int = 4, reward_offset: float = 0.0) -> list[trxp.RawItem]:
    """make.py's groups, built again the same way."""
    return [
        trxp.from_experience(
            Experience(
                eid=EID(batch=batch, task=task, run=run, step=0, suffix=f"r{run}"),
                tokens=torch.arange(3 + response, dtype=torch.int32),
                prompt_length=3,
                logprobs=torch.full((response,), -0.5),
                action_mask=torch.tensor([True, False] + [True] * (response - 2)),
                reward=float(run) + reward_offset,
                info={"model_version": batch, "priority": float(task)},
            )
        )
        for run in range(size)
    ]


def test_format_3_opens_with_every_table_payload_and_lease_in_place(v3: Path) -> None:
    now = MANIFEST["now"]
    with Store(v3, clock=lambda: now) as store:
        assert {t.name for t in store.list_tables()} == set(MANIFEST["stats"])
        for table, want in MANIFEST["stats"].items():
            stats = store.stats(table)
            assert {k: stats[k] for k in COUNTS} == {k: want[k] for k in COUNTS}, table
            assert store.verify(table) == [], table
        for table, digests in MANIFEST["stored"].items():
            stored = store.get(table, MANIFEST["pushed"][table])
            assert {uid: hashlib.sha256(blob).hexdigest() for uid, blob in stored.items()} == digests, table
        lease = MANIFEST["lease"]
        assert store.ack(lease["id"], lease["table"]) == 4
        ready = take(store, "grpo4", num_groups=1)
        assert ready is not None and ready.group_ids == ["1/0"] * 4
        assert all(e.advantages is not None for e in decode(ready.payload))
        turns = take(store, "turns", num_groups=3)
        assert turns is not None and all(e.advantages is not None for e in decode(turns.payload))
        for table in MANIFEST["stats"]:
            assert store.verify(table) == [], table


def test_format_3_takes_new_pushes_and_completes_its_pending_group(v3: Path) -> None:
    with Store(v3) as store:
        rest = [item for item in group(1, 3, 4) if item.eid.run >= 2]
        assert store.put("grpo4", rest).completed_groups == ["1/3"]
        assert AdvantageWorker(store).run_once() == 1
        batch = take(store, "grpo4", num_groups=1, order="lifo")
        assert batch is not None and batch.group_ids == ["1/3"] * 4
        assert store.verify("grpo4") == []


def test_a_retried_push_of_anything_format_3_holds_is_a_duplicate_tombstones_included(v3: Path) -> None:
    with Store(v3, clock=lambda: MANIFEST["now"]) as store:
        for batch, task in ((1, 0), (1, 1), (1, 2)):  # ready, leased, consumed (tombstones)
            items = group(batch, task, 4)
            assert store.put("grpo4", items).duplicates == [item.uid for item in items], (batch, task)
        evicted = group(4, 0, 1)  # the small table's first, evicted: a tombstone
        assert store.put("small", evicted).duplicates == [evicted[0].uid]
        assert store.put("plain", group(3, 0, 2)).duplicates == [f"3/0/{run}/0/r{run}" for run in range(2)]


def test_a_retried_push_with_other_content_is_a_conflict_for_a_format_3_tombstone(v3: Path) -> None:
    with Store(v3, clock=lambda: MANIFEST["now"]) as store:
        with pytest.raises(Conflict):
            store.put("grpo4", group(1, 2, 4, reward_offset=0.5))  # consumed: known only by its tombstone
        with pytest.raises(Conflict):
            store.put("grpo4", group(1, 0, 4, reward_offset=0.5))  # ready
        assert store.verify("grpo4") == []
