"""A data-parallel rank killed (SIGKILL) mid-step, after it read its part of a leased step and
before it trained it, and the server killed (SIGKILL) and restarted after it: a replacement with
the same rank number reads the same part again (the split is made anew from the durable lease and
stored runs, the same), the driver acks the step once every rank has trained, and every group of
the step is trained exactly once. Ranks are processes of their own, each with its own client,
against a real server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from expbuf.client import BufferClient, trxp
from expbuf.client.schema.experience import EID, Experience

from helpers import servers, wait_ready

pytestmark = pytest.mark.faults

RANKS = 3
RANK = """
import json, sys, time
from expbuf.client import BufferClient
target, lease, rank, out, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
with BufferClient(target, timeout=30) as client:
    part = client.read_part(lease, rank, {ranks}, ["tokens"], table="t")
print(json.dumps(part.uids), flush=True)  # read: the step is on this rank now
time.sleep(pause)  # training
with open(out, "w") as done:
    json.dump(part.uids, done)
""".replace("{ranks}", str(RANKS))


def rank(target: str, lease: str, number: int, out: Path, pause: float) -> subprocess.Popen:
    argv = [sys.executable, "-c", RANK, target, lease, str(number), str(out), str(pause)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_uids(proc: subprocess.Popen) -> list[str]:
    """The uids a rank printed once it had read its part; it fails the test, with its log, if it died first."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"a rank died before it read its part:\n{proc.stderr.read() if proc.stderr else ''}")
    return list(json.loads(line))


def test_a_rank_killed_mid_step_reads_its_part_again_and_no_group_is_trained_twice(tmp_path: Path) -> None:
    made = [
        Experience(
            eid=EID(batch=0, task=task, run=run),
            tokens=torch.arange(8 + 50 * task + run, dtype=torch.int32),
            prompt_length=8,
            reward=float(run),
        )
        for task in range(9)
        for run in range(2)
    ]
    with servers() as start:
        server = start(str(tmp_path / "data"))
        with BufferClient(server.target, timeout=30) as client:
            client.create_table("t", group_size=2, estimator="grpo")
            client.push(trxp.encode(made), table="t")
            wait_ready(client, "t", len(made))  # computed once the child's torch, which the push asked for, loads
            (batch,) = client.sample("t", num_groups=9, delivery="lease", lease_seconds=120, max_batches=1, timeout=10)
            outs = [tmp_path / f"rank{number}.json" for number in range(RANKS)]
            procs = [
                rank(server.target, batch.lease_id, number, outs[number], 0.0 if number else 60.0)
                for number in range(RANKS)
            ]
            first = [read_uids(proc) for proc in procs]
            procs[0].send_signal(signal.SIGKILL)  # mid-step: it read its part and did not train it
            assert procs[0].wait(30) == -signal.SIGKILL and not outs[0].exists()
            for proc in procs[1:]:
                assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL  # the server too: its cached splits go
        server = start(str(tmp_path / "data"))
        with BufferClient(server.target, timeout=30) as client:
            replacement = rank(server.target, batch.lease_id, 0, outs[0], 0.0)
            assert read_uids(replacement) == first[0]  # the same part, for the same rank
            assert replacement.wait(60) == 0, replacement.stderr.read() if replacement.stderr else ""
            trained = [uid for out in outs for uid in json.loads(out.read_text())]
            assert sorted(trained) == sorted(batch.uids) and len(set(trained)) == len(trained)
            assert client.ack(batch.lease_id, "t") == len(made)  # the driver acks once every rank has trained
            deadline = time.monotonic() + 10
            while client.stats("t")["t"].consumed != len(made):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert list(client.sample("t", num_groups=1, max_batches=1, timeout=0.5, allow_partial=True)) == []
