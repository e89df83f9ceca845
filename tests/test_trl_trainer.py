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

from expbuf.client import EID, BufferClient
from expbuf.client.rpc.connection import DEFAULT_TIMEOUT

from conftest import Servers
from pages import code_blocks, page
from trl_cpu import EOS, MARKS, NoWeightSync, on_cpu, tiny_model, trained_marks, until


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global Dataset, TrainerCallback, AsyncGRPOConfig, AsyncGRPOTrainer, ExpbufRolloutWorker, group_experiences
    global RecordingTrainer, AckedOnlyWhenTrained, QueueFullAfterStepOne
    import trl_cpu

    trl_cpu.import_frameworks()
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from expbuf.client.trl import ExpbufRolloutWorker, group_experiences

    class RecordingTrainer(AsyncGRPOTrainer):
        """TRL's trainer, noting the marks of the samples each micro-batch trained."""

        trained: list[list[int]]

        def training_step(self, model: Any, inputs: dict[str, torch.Tensor], num_items_in_batch: Any) -> torch.Tensor:
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.trained.append(trained_marks(inputs))
            return loss

    class AckedOnlyWhenTrained(TrainerCallback):
        """After the worker's callback at each step's end: what the table consumed was trained (by
        this trainer, or `before` it)."""

        def __init__(
            self, trainer: RecordingTrainer, worker: ExpbufRolloutWorker, uids: dict[str, int], before: set[int]
        ) -> None:
            self.trainer, self.worker, self.uids, self.before = trainer, worker, uids, before
            self.violations: list[str] = []
            self.first_step: set[int] = set()

        def consumed(self) -> set[int]:
            live = {e.uid for e in self.worker.client.list_experiences(self.worker.table).experiences}
            return {mark for uid, mark in self.uids.items() if uid not in live}

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trained = {mark for marks in self.trainer.trained for mark in marks}
            if not self.first_step:  # the run's first step
                self.first_step = set(trained)
            if not until(lambda: self.worker.reporter.pending() == 0):
                self.violations.append(f"step {state.global_step}: acks not made")
            early = self.consumed() - trained - self.before
            if early:
                self.violations.append(f"step {state.global_step}: consumed before trained: {sorted(early)}")

    class QueueFullAfterStepOne(TrainerCallback):
        """At the end of step 1, before the weight sync that makes what is queued stale: wait until
        the worker has queued its two batches ahead."""

        def __init__(self, worker: ExpbufRolloutWorker) -> None:
            self.worker = worker

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                assert until(lambda: self.worker.rollout_buffer.qsize() == 2 * GROUP), (
                    "the worker queued no batches ahead"
                )


pytestmark = pytest.mark.client_timeout(DEFAULT_TIMEOUT)  # BufferClient's own

GROUP = 4


def recording_trainer(
    model: str, args: AsyncGRPOConfig, worker: ExpbufRolloutWorker, *callbacks: TrainerCallback
) -> RecordingTrainer:
    """TRL's trainer taking its rollouts from `worker` (made and trained under `on_cpu()`)."""
    trainer = RecordingTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"prompt": ["t3"] * 4}), rollout_worker=worker,
        weight_transfer=NoWeightSync(), callbacks=[worker.callback, *callbacks],
    )  # fmt: skip
    trainer.trained = []
    return trainer


def push_groups(client: BufferClient, table: str, groups: int, *, first: int = 0, version: int = 1) -> dict[str, int]:
    """Groups `first`, `first` + 1, ... of GROUP runs at policy `version`, each sample with its
    own mark (its group's number times GROUP, plus its run); uid -> mark."""
    uids = {}
    for task in range(first, first + groups):
        marks = [task * GROUP + run for run in range(GROUP)]
        completions = [[6, MARKS + mark, EOS] for mark in marks]
        exps = group_experiences(
            EID(batch="trl", task=task), [3, 4, 5], completions, [float(run % 2) for run in range(GROUP)],
            old_log_probs=[[-1.0, -2.0, -0.5]] * GROUP, model_version=version,
        )  # fmt: skip
        client.push(exps, table=table)
        uids.update(zip((e.eid.uid for e in exps), marks, strict=True))
    return uids


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory.mktemp("model"))


def train(
    client: BufferClient,
    model: str,
    output: Path,
    uids: dict[str, int],
    trained: set[int],
    *,
    steps: int,
    resume: bool = False,
    **settings: Any,
) -> tuple[RecordingTrainer, AckedOnlyWhenTrained]:
    """TRL's trainer for `steps` steps from table "grpo", a checkpoint saved at its end (a run
    with `resume` starts from the one in `output` and trains `steps` more; `trained`: the marks
    trained before)."""
    worker = ExpbufRolloutWorker(client, "grpo", num_groups=1, wait_seconds=0.5)
    args = AsyncGRPOConfig(
        output_dir=str(output), max_steps=steps * (2 if resume else 1), per_device_train_batch_size=GROUP,
        max_staleness=8, report_to="none", save_strategy="steps", save_steps=steps, logging_steps=1, use_cpu=True,
        disable_tqdm=True, **settings,
    )  # fmt: skip
    with on_cpu():
        trainer = recording_trainer(model, args, worker)
        check = AckedOnlyWhenTrained(trainer, worker, uids, trained)
        trainer.add_callback(check)
        trainer.train(resume_from_checkpoint=str(output / f"checkpoint-{steps}") if resume else None)
    assert trainer.state.global_step == steps * (2 if resume else 1)
    return trainer, check


@pytest.mark.parametrize(
    ("accumulation", "token_budget", "steps", "whole_batches"),
    [(1, 0, 4, True), (1, 18, 4, True), (2, 0, 3, True), (2, 18, 3, False)],
    ids=["fixed_count", "token_budget", "accumulation_2", "token_budget_accumulation_2"],
)
def test_async_grpo_trains_each_sample_once_and_acks_only_trained_ones(
    client: BufferClient,
    model: str,
    tmp_path: Path,
    accumulation: int,
    token_budget: int,
    steps: int,
    whole_batches: bool,
) -> None:
    """Two runs, the second resumed from the first one's last checkpoint: each acks at its end
    every batch its steps trained and gives back what TRL fetched ahead of them, so the second
    trains nothing again; only a batch whose samples the last step trained in part goes back
    whole, to be trained again (a token budget of 5 samples a micro-batch, batches of 4, 3 steps
    of 2 micro-batches: 30 samples trained; with 4 steps of 1, 20: whole batches again)."""
    client.create_table("grpo", group_size=GROUP)
    # enough for both runs, TRL's look-ahead and the worker's batches ahead
    uids = push_groups(client, "grpo", 2 * steps * accumulation + 6)
    settings = {"gradient_accumulation_steps": accumulation, "token_budget": token_budget}
    trained: set[int] = set()
    whole: set[int] = set()  # the marks of groups trained whole
    for resume in (False, True):
        trainer, check = train(client, model, tmp_path / "out", uids, trained, steps=steps, resume=resume, **settings)
        marks = [mark for step in trainer.trained for mark in step]
        assert len(trainer.trained) == steps * accumulation
        assert len(marks) == len(set(marks)), "a sample was trained twice"
        assert set(marks) & trained <= trained - whole, "the resumed run trained again what the first acked"
        consumed = check.consumed()
        assert not check.violations, check.violations
        assert check.first_step and check.first_step <= consumed, "the first step's samples were never acked"
        trained |= set(marks)
        whole = {mark for mark in trained if {mark // GROUP * GROUP + run for run in range(GROUP)} <= trained}
        assert consumed == whole, "the table consumed what the runs trained, in whole batches (a group each)"
        assert (whole == trained) is whole_batches, "micro-batches of whole batches leave none half trained"
        stats = client.stats("grpo")["grpo"]
        assert stats.leased == 0, "the worker gave back what it held when training ended"
        assert (stats.consumed, stats.ready) == (len(whole), len(uids) - len(whole))
        assert stats.trainer_version == trainer.model_version == steps + 1  # a weight sync at start and each step


def test_what_trls_queue_drops_as_stale_in_the_last_fetch_is_acked_at_the_end(
    client: BufferClient, model: str, tmp_path: Path
) -> None:
    """Two steps of two micro-batches (a group each), max_staleness 0: step 1's fetch takes groups
    0-2 (TRL's loader one micro-batch ahead), then the weight sync to version 2 makes groups 3
    and 4, queued at version 1, stale; step 2's fetch takes them, TRL's queue drops them, and the
    worker leases groups at version 2 (5, 6). Step 2 trains groups 2 and 5: at the end groups 0-5
    are acked (3 and 4 with their batches, as every stale sample is), and group 6 goes back."""
    client.create_table("grpo", group_size=GROUP)
    uids = push_groups(client, "grpo", 5) | push_groups(client, "grpo", 4, first=5, version=2)
    worker = ExpbufRolloutWorker(client, "grpo", num_groups=1, wait_seconds=0.5)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=GROUP, gradient_accumulation_steps=2,
        token_budget=0, max_staleness=0, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    with on_cpu():
        trainer = recording_trainer(model, args, worker, QueueFullAfterStepOne(worker))
        trainer.train()
    trained = {mark for marks in trainer.trained for mark in marks}
    assert trained == {*range(0, 3 * GROUP), *range(5 * GROUP, 6 * GROUP)}
    live = {e.uid for e in client.list_experiences("grpo").experiences}
    assert {mark for uid, mark in uids.items() if uid not in live} == set(range(6 * GROUP))
    stats = client.stats("grpo")["grpo"]
    assert (stats.consumed, stats.leased, stats.ready) == (6 * GROUP, 0, 3 * GROUP)


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
