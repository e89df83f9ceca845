"""Per-prompt statistics on the prompt ledger (issue 45, first part): each prompt of a dataset keeps
how it fared over its epochs (claims, groups generated and their runs, runs that passed the
dataset's pass_threshold, the last group's reward mean and variance, when it was last trained),
updated in the transaction of each event, so a kill -9 of the server loses none of them. The
reference is the test's own log of what it acknowledged."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from expbuf.client import BufferClient, InvalidArgumentError, Prompt, PromptStats

from helpers import make_experience, scrape, servers

PROMPTS, RUNS, EPOCHS = 12, 4, 2


def passes(index: int) -> int:
    """How many of a prompt's runs pass: its difficulty, 0 to 4 of 4."""
    return index % (RUNS + 1)


def push_group(client: BufferClient, prompt: Prompt) -> None:
    """A prompt's group: its passing runs rewarded 1.0, the others -0.5 (pass_threshold 0.25)."""
    runs = []
    for run in range(RUNS):
        exp = make_experience(prompt.batch, prompt.task, run, reward=1.0 if run < passes(prompt.index) else -0.5)
        exp.eid = prompt.eid(run)
        runs.append(exp)
    client.push(runs, table="t")


def expected(index: int, last_step: int) -> PromptStats:
    rewards = [1.0] * passes(index) + [-0.5] * (RUNS - passes(index))
    mean = sum(rewards) / RUNS
    return PromptStats(
        attempts=EPOCHS, generated=EPOCHS, runs=EPOCHS * RUNS, passes=EPOCHS * passes(index), last_runs=RUNS,
        last_mean=mean, last_var=sum((r - mean) ** 2 for r in rewards) / RUNS, trained=EPOCHS,
        last_epoch=EPOCHS - 1, last_step=last_step,
    )  # fmt: skip


def stats_of(client: BufferClient) -> dict[int, PromptStats]:
    page = client.list_prompts("t", "d", limit=1000)
    return {p.index: p.stats for p in page.prompts if p.epoch == EPOCHS - 1 and p.stats is not None}


def test_the_statistics_survive_two_kills_and_equal_what_was_acknowledged(tmp_path: Path) -> None:
    """A worker claims and pushes, a trainer trains each epoch at a trainer version of its own; the
    server is killed with SIGKILL once with groups pushed and not trained, once with prompts
    claimed and not pushed. Every prompt's statistics equal those of the acknowledged events."""
    data = str(tmp_path / "data")
    with servers() as start:
        server = start(data)
        with BufferClient(server.target, timeout=60) as client:
            client.create_table("t", group_size=RUNS, estimator="none")
            info = client.create_dataset("t", "d", PROMPTS, epochs=EPOCHS, seed=3, pass_threshold=0.25)
            assert info.pass_threshold == 0.25
            claimed = client.claim("t", "d", PROMPTS, lease_seconds=600).prompts
            for prompt in claimed:
                push_group(client, prompt)
        server.proc.kill()  # epoch 0 generated, not trained
        server.proc.wait(30)
        server = start(data)
        with BufferClient(server.target, timeout=60) as client:
            client.set_trainer_version(1, "t")
            (batch,) = client.sample("t", num_groups=PROMPTS, max_batches=1, timeout=30, delivery="lease")
            assert batch.ack() == PROMPTS * RUNS
            claimed = client.claim("t", "d", PROMPTS, lease_seconds=600).prompts
            assert {p.epoch for p in claimed} == {1} and len(claimed) == PROMPTS
        server.proc.kill()  # epoch 1 claimed, not pushed
        server.proc.wait(30)
        server = start(data)
        with BufferClient(server.target, timeout=60) as client:
            for prompt in claimed:
                push_group(client, prompt)
            client.set_trainer_version(2, "t")
            (batch,) = client.sample("t", num_groups=PROMPTS, max_batches=1, timeout=30, delivery="lease")
            assert batch.ack() == PROMPTS * RUNS
            got = stats_of(client)
            assert client.ledger("t", "d").done
    assert sorted(got) == list(range(PROMPTS))
    for index, stats in got.items():
        want = expected(index, last_step=2)
        assert stats.pass_rate == passes(index) / RUNS
        for name in ("attempts", "generated", "runs", "passes", "last_runs", "trained", "last_epoch", "last_step"):
            assert getattr(stats, name) == getattr(want, name), (index, name)
        assert math.isclose(stats.last_mean, want.last_mean) and math.isclose(stats.last_var, want.last_var)


def test_a_prompt_never_generated_has_no_rates_and_a_bad_threshold_is_refused(client: BufferClient) -> None:
    fresh = PromptStats()
    assert math.isnan(fresh.pass_rate) and math.isnan(fresh.last_mean) and fresh.last_epoch == -1
    client.create_table("t", group_size=RUNS)
    with pytest.raises(ValueError, match="pass_threshold is 'high'; it must be a number"):
        client.create_dataset("t", "d", 4, pass_threshold="high")
    with pytest.raises(InvalidArgumentError, match="pass_threshold is nan; it must be a finite number"):
        client.create_dataset("t", "d", 4, pass_threshold=math.nan)
    client.create_dataset("t", "d", 4)
    (prompt,) = client.claim("t", "d", 1).prompts
    (listed,) = client.list_prompts("t", "d").prompts
    stats = listed.stats
    assert stats is not None and prompt.stats is None  # a claim's prompts carry none
    assert (stats.attempts, stats.generated, stats.runs, stats.trained) == (1, 0, 0, 0)
    assert math.isnan(stats.last_mean) and math.isnan(stats.pass_rate)


def test_a_group_the_table_drops_as_it_completes_still_counts_its_runs(client: BufferClient, server) -> None:
    """Zero variance (every run passed, or none): the group is dropped as it completes, and its
    prompt's statistics hold its runs: the prompts a curriculum most wants to know about."""
    client.create_table("t", group_size=RUNS, estimator="none", drop_zero_variance=True)
    client.create_dataset("t", "d", 5, pass_threshold=0.25)
    for prompt in client.claim("t", "d", 5).prompts:
        push_group(client, prompt)
    listed = {p.index: p for p in client.list_prompts("t", "d").prompts}
    for index, prompt in listed.items():
        stats = prompt.stats
        assert stats is not None and (stats.generated, stats.runs, stats.passes) == (1, RUNS, passes(index))
        assert prompt.state == ("dropped" if passes(index) in (0, RUNS) else "generated")
    metrics = scrape(server.metrics_port)
    bands = {band: metrics[("expbuf_prompts_by_pass_rate", (("band", band), ("dataset", "d"), ("table", "t")))]
             for band in ("zero", "low", "high", "all")}  # fmt: skip
    assert bands == {"zero": 1, "low": 1, "high": 2, "all": 1}  # 0, 1, 2 and 3, 4 of 4 runs passed


@pytest.mark.parametrize("order", ["permutation", "pools", "pass_rate"])
def test_a_report_of_large_finite_rewards_trains_its_prompt(client: BufferClient, order: str) -> None:
    """A report takes any finite rewards: a spread past 1e154 squared out of float's range, and the
    report failed INTERNAL (OverflowError), its prompt left claimed, to be handed out and trained
    again once its claim ended. Its variance is now inf, and the prompt is trained."""
    client.create_table("t", group_size=2)
    client.create_dataset("t", "math", 2, order=order)
    (prompt,) = client.claim("t", "math", lease_seconds=600).prompts
    assert client.report_prompts({prompt: [1e200, -1e200]}) == 1
    (listed,) = client.list_prompts("t", "math").prompts
    assert listed.state == "trained" and listed.stats is not None and listed.stats.runs == 2
    assert listed.stats.last_var == math.inf
