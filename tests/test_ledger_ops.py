"""The prompt ledger's operations side against a real server: the ledger's series on a real
/metrics scrape, read back from LMDB after a restart."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from expbuf.client import BufferClient, Experience, Prompt
from expbuf.server.app import ExpbufServer
from expbuf.server.metrics import StoreCollector
from expbuf.server.store import Store
from expbuf.server.store.ledger_records import DatasetRecord
from expbuf.server.tables import TableConfig

from conftest import Servers
from helpers import make_experience, scrape

STATES = ("pending", "claimed", "generated", "trained", "dropped")


def cli(*args: str) -> subprocess.CompletedProcess:
    """`expbuf ARGS` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "expbuf.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=dict(os.environ),
    )


def one_line_error(done: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The command failed with `code` and one line on stderr holding every word."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def group(prompt: Prompt, runs: range) -> list[Experience]:
    """The experiences of one attempt at a prompt (rewards 0, 1, ...: never all equal)."""
    out = []
    for run in runs:
        exp = make_experience(0, 0, run, reward=float(run))
        exp.eid = prompt.eid(run)
        out.append(exp)
    return out


def wait_for(check, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    return start_server()


@pytest.fixture
def client(server: ExpbufServer) -> Iterator[BufferClient]:
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
        c.create_table("t", group_size=2, estimator="none")
        yield c


def every_state(client: BufferClient) -> dict[str, Prompt]:
    """Dataset math (4 prompts) with 0 trained, 1 sent back (its incomplete attempt dropped),
    2 claimed by worker-2, 3 pending; returns the prompts by what happened to them."""
    client.create_dataset("t", "math", 4)
    trained, released, claimed = client.claim("t", "math", 3, lease_seconds=600, owner="worker-2").prompts
    client.push(group(trained, range(2)), table="t")
    wait_for(lambda: client.ledger("t", "math").total("generated") == 1)
    batch = next(client.sample("t", num_groups=1, delivery="consume", timeout=10, max_batches=1))
    assert batch.groups == [trained.group]
    client.push(group(released, range(1)), table="t")
    assert client.release_claims([released]) == 1
    return {"trained": trained, "released": released, "claimed": claimed}


def series(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


# ---- metrics ----------------------------------------------------------------------------


def test_metrics_count_prompts_by_state_and_survive_a_restart(
    start_server: Servers, server: ExpbufServer, client: BufferClient
) -> None:
    every_state(client)
    client.create_table("plain", estimator="none")
    m = scrape(server.metrics_port)
    by_state = {state: series(m, "expbuf_prompts", table="t", dataset="math", state=state) for state in STATES}
    assert by_state == {"pending": 2, "claimed": 1, "generated": 0, "trained": 1, "dropped": 0}
    assert series(m, "expbuf_prompt_claims_reissued_total", table="t", dataset="math") == 1
    assert series(m, "expbuf_prompt_attempts_dropped_total", table="t", dataset="math") == 1
    ledger = {name for name, _ in m if name.startswith("expbuf_prompt")}
    assert {dict(labels)["table"] for name, labels in m if name in ledger} == {"t"}  # no dataset, no series
    server.stop(grace=1)
    again = scrape(start_server().metrics_port)  # read from LMDB, not counted in memory
    assert {k: v for k, v in again.items() if k[0] in ledger} == {k: v for k, v in m.items() if k[0] in ledger}


def test_a_scrape_reads_each_tables_datasets_once(tmp_path: Path) -> None:
    reads: list[str] = []

    class Counting(Store):
        def datasets(self, table: str, name: str = "") -> list[DatasetRecord]:
            reads.append(table)
            return super().datasets(table, name)

    with Counting(tmp_path / "data") as store:
        for table in ("a", "b", "c"):
            store.create_table(TableConfig(name=table, estimator="none"))
            store.create_dataset(table, DatasetRecord("one", size=2))
            store.create_dataset(table, DatasetRecord("two", size=3))
        families = {family.name: family for family in StoreCollector(store).collect()}
        assert sorted(reads) == ["a", "b", "c", "default"]
        pending = {(s.labels["table"], s.labels["dataset"]): s.value for s in families["expbuf_prompts"].samples
                   if s.labels["state"] == "pending"}  # fmt: skip
        assert pending == {(t, d): n for t in "abc" for d, n in (("one", 2), ("two", 3))}
