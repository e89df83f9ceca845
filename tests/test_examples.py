"""The README's quick start and the examples' rollout worker and trainer run against a real server."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from expbuf.client import BufferClient

from helpers import make_experience
from pages import code_blocks, page, section
from test_column_push import docs_scope
from test_column_push import rollout as column_rollout

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
        assert client.stats("quickstart")["quickstart"].consumed == 32


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
    """A job that starts over where an earlier run left its table (its version 5, its admission
    count, its groups of versions up to 6) finishes, instead of waiting for room, and trains none
    of that run's groups: its first step trained them, 5 versions ahead of it."""
    for _ in range(2):
        out = run("async_grpo.py", "--target", target, "--workers", "2", "--steps", "5")
        assert out.count("4 groups") == 5
        lags = [int(line.split("at most ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]
        assert len(lags) == 5 and all(0 <= lag <= 2 for lag in lags), out
    with BufferClient(target) as client:
        stats = client.stats("grpo_async")["grpo_async"]
    assert stats.trainer_version == 5
    assert stats.submitted <= (2 + 5 + 1) * 4


class Stop(Exception):
    """Ends a trainer loop of the docs after its first batch, as a reader stops a running loop."""


def first_batch_only(got: list[object]) -> Callable[[object], None]:
    def train_step(step: object) -> None:
        got.append(step)
        raise Stop

    return train_step


def run_block(code: str, name: str, target: str, scope: dict[str, Any] | None = None) -> dict[str, Any]:
    """One block of a page as a reader runs it, against `target`; a trainer loop ended by Stop."""
    scope = {"__name__": "docs", **(scope or {})}
    with contextlib.suppress(Stop):
        exec(compile(code.replace("127.0.0.1:50051", target), name, "exec"), scope)
    return scope


def test_the_docs_blocks_run_one_after_another_on_one_server(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A reader runs the quick start, then the pages' blocks, against the one server they started:
    no block may take a table another made with other settings, nor wait for groups another
    consumed (the curriculum failed after the quick start, and the columnar trainer waited out
    its 30 s for the quick start's groups). Each block that trains stops after its first batch."""
    readme = code_blocks(page("README"), "python")[0]
    assert code_blocks(page("getting-started.md"), "python")[0] == readme  # the same block: run once
    rollout = run_block(readme, "README", target)["rollout"]
    assert capsys.readouterr().out.splitlines()[0] == "32 stored"

    ledger, curriculum = code_blocks(page("concepts/prompt-ledger.md"), "python")
    generate = lambda index, n: [make_experience("x", index, run, reward=float(run)) for run in range(n)]  # noqa: E731
    run_block(ledger, "prompt-ledger.md", target, {"generate": generate, "train_step": lambda step: None})
    run_block(curriculum, "prompt-ledger.md", target)
    assert capsys.readouterr().out.splitlines() == ["32", "{'target': 0.5, 'tau': 0.1}"]

    sampling = "concepts/pushing-and-sampling.md"
    blocks = code_blocks(page(sampling), "python")
    columnar = next(block for block in blocks if "fields = [" in block)
    (pushing_columns,) = code_blocks(section(sampling, "### Pushing columns"), "python")
    with BufferClient(target) as client:
        tables = [block for block in code_blocks(page("concepts/tables.md"), "python") if "create_table" in block]
        for block in tables:
            run_block(block, "tables.md", target, {"client": client})
        experiences = [rollout(task, run) for task in range(64) for run in range(8)]  # as the quick start made them
        trained: list[object] = []
        run_block(blocks[0], sampling, target, {"experiences": experiences, "train_step": first_batch_only(trained)})
        run_block(columnar, sampling, target, {"client": client, "train_step": first_batch_only(trained)})
        assert [len(step) for step in trained] == [256, 256]  # each block's first batch: 32 groups of 8
        made = [column_rollout(task, run) for task in range(2) for run in range(3)]
        scope = run_block(pushing_columns, sampling, target, {"client": client, **docs_scope(made, 2, 3)})
        assert len(scope["result"].stored) == 6 and len(scope["result"].completed_groups) == 2
