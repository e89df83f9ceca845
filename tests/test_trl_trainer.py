"""TRL 1.16's AsyncGRPOTrainer trains from an expbuf table through ExpbufRolloutWorker: a tiny
model made from a config, on the CPU (tests/trl_cpu.py says exactly what stands in for CUDA).

Every sample carries a mark token, so the trainer's own packed inputs say which samples each
training step trained. At every step's end, once the worker's acks are made, nothing the
table has consumed is untrained: TRL fetches ahead of what it trains (a step's micro-batches,
one more, and with the token budget one sample more), and the acks wait for that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset
from transformers import TrainerCallback
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from expbuf.client import EID, BufferClient
from expbuf.client.connection import DEFAULT_TIMEOUT
from expbuf.client.trl import ExpbufRolloutWorker, group_experiences

from conftest import Servers
from pages import code_blocks, page
from trl_cpu import EOS, MARKS, NoWeightSync, on_cpu, tiny_model, trained_marks, until

pytestmark = pytest.mark.client_timeout(DEFAULT_TIMEOUT)  # BufferClient's own

GROUP = 4


class RecordingTrainer(AsyncGRPOTrainer):
    """TRL's trainer, noting the marks of the samples each micro-batch trained."""

    trained: list[list[int]]

    def training_step(self, model: Any, inputs: dict[str, torch.Tensor], num_items_in_batch: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.trained.append(trained_marks(inputs))
        return loss


class AckedOnlyWhenTrained(TrainerCallback):
    """After the worker's callback at each step's end: what the table consumed was trained."""

    def __init__(self, trainer: RecordingTrainer, worker: ExpbufRolloutWorker, uids: dict[str, int]) -> None:
        self.trainer, self.worker, self.uids = trainer, worker, uids
        self.violations: list[str] = []
        self.first_step: set[int] = set()

    def consumed(self) -> set[int]:
        live = {e.uid for e in self.worker.client.list_experiences(self.worker.table).experiences}
        return {mark for uid, mark in self.uids.items() if uid not in live}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trained = {mark for marks in self.trainer.trained for mark in marks}
        if state.global_step == 1:
            self.first_step = set(trained)
        if not until(lambda: self.worker.keeper.pending() == 0):
            self.violations.append(f"step {state.global_step}: acks not made")
        early = self.consumed() - trained
        if early:
            self.violations.append(f"step {state.global_step}: consumed before trained: {sorted(early)}")


def push_groups(client: BufferClient, table: str, groups: int) -> dict[str, int]:
    """Groups of GROUP runs at policy version 1, each sample with its own mark; uid -> mark."""
    uids = {}
    for task in range(groups):
        marks = [task * GROUP + run for run in range(GROUP)]
        completions = [[6, MARKS + mark, EOS] for mark in marks]
        exps = group_experiences(
            EID(batch="trl", task=task), [3, 4, 5], completions, [float(run % 2) for run in range(GROUP)],
            old_log_probs=[[-1.0, -2.0, -0.5]] * GROUP, model_version=1,
        )  # fmt: skip
        client.push(exps, table=table)
        uids.update(zip((e.eid.uid for e in exps), marks, strict=True))
    return uids


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize(
    ("accumulation", "token_budget", "steps"),
    [(1, 0, 4), (1, 18, 4), (2, 0, 3)],
    ids=["fixed_count", "token_budget", "accumulation_2"],
)
def test_async_grpo_trains_each_sample_once_and_acks_only_trained_ones(
    client: BufferClient, model: str, tmp_path: Path, accumulation: int, token_budget: int, steps: int
) -> None:
    client.create_table("grpo", group_size=GROUP)
    # enough for every step, TRL's look-ahead and the worker's batches ahead
    uids = push_groups(client, "grpo", steps * accumulation + 4)
    worker = ExpbufRolloutWorker(client, "grpo", num_groups=1, wait_seconds=0.5)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=GROUP,
        gradient_accumulation_steps=accumulation, token_budget=token_budget, max_staleness=8, report_to="none",
        save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    with on_cpu():
        trainer = RecordingTrainer(
            model=model, args=args, train_dataset=Dataset.from_dict({"prompt": ["t3"] * 4}),
            rollout_worker=worker, weight_transfer=NoWeightSync(), callbacks=[worker.callback],
        )  # fmt: skip
        trainer.trained = []
        check = AckedOnlyWhenTrained(trainer, worker, uids)
        trainer.add_callback(check)
        trainer.train()

    marks = [mark for step in trainer.trained for mark in step]
    assert len(trainer.trained) == steps * accumulation
    assert len(marks) == len(set(marks)), "a sample was trained twice"
    assert not check.violations, check.violations
    consumed = check.consumed()
    assert check.first_step and check.first_step <= consumed, "the first step's samples were never acked"
    assert consumed <= set(marks)
    stats = client.stats("grpo")["grpo"]
    assert stats.leased == 0, "the worker gave back what it held when training ended"
    assert stats.ready == len(uids) - len(consumed)
    assert stats.trainer_version == trainer.model_version == steps + 1  # a weight sync at start and each step


def test_the_docs_trl_section_runs_as_written(
    start_server: Servers, model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snippet as written, but for the server's address, the model (the tiny one), the CPU
    (AsyncGRPOConfig trains in bf16 on a GPU by default) and TRL's weight sync (no vLLM server
    here: tests/trl_cpu.py)."""
    code = code_blocks(page("frameworks/trl.md"), "python")[0]
    for old, new in {
        "10.0.0.5:50051": f"127.0.0.1:{start_server().port}",
        '"Qwen/Qwen3-0.6B"': repr(model),
        "AsyncGRPOConfig(": "AsyncGRPOConfig(use_cpu=True, ",
        "callbacks=[worker.callback],": "callbacks=[worker.callback], weight_transfer=NoWeightSync(),",
    }.items():
        assert old in code
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    names: dict[str, Any] = {"NoWeightSync": NoWeightSync}
    with on_cpu():
        exec(compile(code, "frameworks/trl.md", "exec"), names)
    assert names["trainer"].state.global_step == 4
    client: BufferClient = names["client"]
    ledger = client.ledger("trl_grpo", "prompts")
    assert ledger.total("trained") >= 4 and ledger.total("trained") + ledger.total("generated") == 12
    assert client.stats("trl_grpo")["trl_grpo"].leased == 0
