"""The README's quick start and the examples' rollout worker and trainer run against a real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from expbuf.client import BufferClient

from pages import code_blocks, page

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("name", ["README", "getting-started.md"])
def test_the_first_push_and_sample_run_as_written(name: str, target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The newcomer's snippet: 32 experiences stored, then two batches of two whole groups each."""
    code = code_blocks(page(name), "python")[0]
    exec(compile(code.replace("127.0.0.1:50051", target), name, "exec"), {"__name__": "docs"})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "32 stored"
    assert [line.split("]")[0] for line in printed[1:]] == ["['0/0', '0/1'", "['0/2', '0/3'"]
    with BufferClient(target) as client:
        assert client.stats("grpo8")["grpo8"].consumed == 32


def test_rollout_worker_then_trainer(target: str) -> None:
    out = run("rollout_worker.py", "--target", target, "--size", "8", "--claim", "3", "--wait", "1")
    assert out.count("stored 8, duplicates 0") == 8 and "no prompt to claim within 1s" in out
    out = run("trainer.py", "--target", target, "--groups", "2", "--steps", "4", "--wait", "10", "--dataset", "prompts")
    assert out.count("16 experiences from 2 groups") == 4
    counts = "0 pending, 0 claimed, 0 generated, 8 trained, 0 dropped of 8 x 1 prompts"
    assert f"ledger of prompts: {counts}; done: True" in out
    with BufferClient(target) as client:
        stats = client.stats()["default"]
        info = client.ledger("default", "prompts")
    assert stats.consumed == 64 and stats.leased == 0 and stats.ready == 0
    assert info.done and [c.trained for c in info.counts] == [8] and (info.reissued, info.attempts_dropped) == (0, 0)
    out = run("rollout_worker.py", "--target", target, "--size", "8", "--wait", "1")  # the same dataset, read
    assert out.strip() == "dataset prompts is done: every prompt is trained"


def test_async_grpo_with_a_staleness_bound_of_two(target: str) -> None:
    out = run("async_grpo.py", "--target", target, "--workers", "2", "--steps", "5")
    lags = [int(line.split("at most ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]
    assert len(lags) == 5 and max(lags) <= 2
    assert out.count("4 groups") == 5
    with BufferClient(target) as client:
        stats = client.stats("grpo_async")["grpo_async"]
    assert stats.trainer_version == 5
    assert stats.submitted <= (2 + 5 + 1) * 4


def test_async_grpo_runs_again_on_the_same_table(target: str) -> None:
    """A job that starts over on a table an earlier run left (its version 5, its admission
    count) resets the table's off-policy state and finishes, instead of waiting for room."""
    for _ in range(2):
        out = run("async_grpo.py", "--target", target, "--workers", "2", "--steps", "5")
        assert out.count("4 groups") == 5
    with BufferClient(target) as client:
        stats = client.stats("grpo_async")["grpo_async"]
    assert stats.trainer_version == 5
    assert stats.submitted <= (2 + 5 + 1) * 4
