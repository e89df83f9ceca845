"""Reward shaping steps against per-experience references written from LightRFT's
FastExperienceMaker (its overlong penalty, running normalisation and clipping)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from expbuf.server.shaping import RunningMoments, Shaping, clip_advantages, shape_rewards
from expbuf.server.tables import ConfigError


def ref_overlong(reward: float, length: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """expected_len = max_new_tokens - buffer_len; penalty = clamp(-exceed / buffer_len * factor, max=0)."""
    exceed = length - (max_new_tokens - buffer_len)
    return reward + min(-exceed / buffer_len * factor, 0.0)


def batches(seed: int) -> list[tuple[list[float], list[int]]]:
    rng = random.Random(seed)
    return [
        ([rng.uniform(-3, 3) for _ in range(n)], [rng.randint(0, 100) for _ in range(n)])
        for n in (rng.randint(1, 20) for _ in range(4))
    ]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("minus_mean", [False, True])
def test_all_reward_steps_in_order(seed: int, minus_mean: bool) -> None:
    config = Shaping(
        reward_clip=1.5,
        overlong_buffer=True,
        overlong_buffer_len=20,
        overlong_buffer_penalty_factor=0.5,
        max_new_tokens=90,
        reward_running_norm=True,
        reward_running_norm_minus_mean=minus_mean,
    )
    moments, seen = RunningMoments(), []
    for rewards, lengths in batches(seed):
        got, moments, report = shape_rewards(
            config, torch.tensor(rewards, dtype=torch.float64), torch.tensor(lengths), moments
        )
        penalised = [ref_overlong(r, n, 90, 20, 0.5) for r, n in zip(rewards, lengths, strict=True)]
        seen += penalised  # the moments take in this batch before it is normalised
        mean = statistics.fmean(seen)
        std = statistics.stdev(seen) if len(seen) > 1 else 1.0
        normed = [(r - mean) / std if minus_mean else r / std for r in penalised]
        want = [max(-1.5, min(1.5, r)) for r in normed]
        assert got.tolist() == pytest.approx(want, abs=1e-9)
        assert report.overlong_penalised == sum(n > 70 for n in lengths)
        assert report.reward_clip_fraction == pytest.approx(sum(abs(r) > 1.5 for r in normed) / len(normed))
        assert moments.mean == pytest.approx(mean) and moments.std == pytest.approx(std)


def test_steps_off_leave_rewards_alone() -> None:
    rewards = torch.tensor([5.0, -7.0, 0.25], dtype=torch.float64)
    got, moments, report = shape_rewards(Shaping(), rewards, torch.tensor([1000, 0, 5]), RunningMoments())
    assert got.tolist() == rewards.tolist() and moments == RunningMoments()
    assert (report.overlong_penalised, report.reward_clip_fraction) == (0, 0.0)


def test_advantage_clip() -> None:
    config = Shaping(advantage_clip=0.5)
    _, _, report = shape_rewards(config, torch.zeros(1), torch.zeros(1), RunningMoments())
    got = clip_advantages(config, torch.tensor([-2.0, 0.1, 0.7, 0.5]), report)
    assert got.tolist() == [-0.5, pytest.approx(0.1), 0.5, 0.5]
    assert report.advantage_clip_fraction == 0.5


def test_running_moments_merge_equals_the_whole() -> None:
    rng = random.Random(4)
    values = [rng.gauss(3, 2) for _ in range(57)]
    moments = RunningMoments()
    for start in range(0, 57, 10):
        moments = moments.update(torch.tensor(values[start : start + 10]))
    assert moments.count == pytest.approx(57)
    assert moments.mean == pytest.approx(statistics.fmean(values))
    assert moments.std == pytest.approx(statistics.stdev(values))
    assert math.isfinite(RunningMoments().update(torch.tensor([2.0])).std)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"reward_clip": -1.0}, "reward_clip is -1.0; allowed: a finite number >= 0"),
        ({"advantage_clip": math.inf}, "advantage_clip is inf"),
        ({"overlong_buffer_penalty_factor": -0.1}, "overlong_buffer_penalty_factor"),
        ({"overlong_buffer_len": -4}, "overlong_buffer_len is -4; allowed: an integer >= 0"),
        ({"overlong_buffer": True, "overlong_buffer_len": 100, "max_new_tokens": 100}, "0 < overlong_buffer_len"),
    ],
)
def test_bad_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Shaping(**settings)
