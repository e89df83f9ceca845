"""Reward shaping steps against per-experience references written from LightRFT's
FastExperienceMaker (its overlong penalty, running normalisation and clipping)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from expbuf.server.advantages.shaping import (
    RunningMoments,
    Shaping,
    ShapingReport,
    clip_advantages,
    penalise_overlong,
    shape,
)
from expbuf.server.store.schema.table_config import ConfigError


def ref_overlong(reward: float, length: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """expected_len = max_new_tokens - buffer_len; penalty = clamp(-exceed / buffer_len * factor, max=0)."""
    exceed = length - (max_new_tokens - buffer_len)
    return reward + min(-exceed / buffer_len * factor, 0.0)


def batches(seed: int) -> list[tuple[list[float], list[int], list[int]]]:
    """Computations of 1-4 groups: rewards, generated-token counts, group sizes."""
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        sizes = [rng.randint(1, 6) for _ in range(rng.randint(1, 4))]
        n = sum(sizes)
        out.append(([rng.uniform(-3, 3) for _ in range(n)], [rng.randint(0, 100) for _ in range(n)], sizes))
    return out


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
    for rewards, lengths, sizes in batches(seed):
        report = ShapingReport()
        penalised = penalise_overlong(config, torch.tensor(rewards, dtype=torch.float64), torch.tensor(lengths), report)
        got, moments, bad = shape(config, penalised, sizes, [True] * len(sizes), moments, report)
        want_penalised = [ref_overlong(r, n, 90, 20, 0.5) for r, n in zip(rewards, lengths, strict=True)]
        assert penalised.tolist() == pytest.approx(want_penalised, abs=1e-12)
        want, normed_all, start = [], [], 0
        for size in sizes:  # the moments take in each group before it is normalised
            group = want_penalised[start : start + size]
            seen += group
            mean = statistics.fmean(seen)
            std = statistics.stdev(seen) if len(seen) > 1 else math.inf
            normed = [0.0 if math.isinf(std) else ((r - mean) if minus_mean else r) / std for r in group]
            normed_all += normed
            want += [max(-1.5, min(1.5, r)) for r in normed]
            start += size
        assert got.tolist() == pytest.approx(want, abs=1e-9) and not bad
        assert report.overlong_penalised == sum(n > 70 for n in lengths)
        assert report.reward_clip_fraction == pytest.approx(sum(abs(r) > 1.5 for r in normed_all) / len(normed_all))
        assert moments.mean == pytest.approx(statistics.fmean(seen))


def test_groups_not_kept_take_nothing_in() -> None:
    config = Shaping(reward_running_norm=True)
    values = torch.tensor([1.0, 2.0, 100.0, 200.0, 3.0, 5.0], dtype=torch.float64)
    got, moments, bad = shape(config, values, [2, 2, 2], [True, False, True], RunningMoments(), ShapingReport())
    kept = [1.0, 2.0, 3.0, 5.0]
    assert moments.mean == pytest.approx(statistics.fmean(kept)) and not bad
    assert got.tolist()[2:4] == [100.0, 200.0]
    assert got.tolist()[4:] == pytest.approx([3.0 / statistics.stdev(kept), 5.0 / statistics.stdev(kept)])


def test_first_value_alone_is_zero_then_lightrfts_moments() -> None:
    """LightRFT's std after one value is infinite (count - 1 = 0): the value becomes 0. The
    moments after it are LightRFT's to the last residue of its initial variance (an equal
    second value is divided by a std of about 3e-12, as in LightRFT)."""
    from lightrft_reference import RunningMoments as LightRFTMoments

    config = Shaping(reward_running_norm=True)
    got, moments, _ = shape(config, torch.tensor([3.0]), [1], [True], RunningMoments(), ShapingReport())
    assert got.tolist() == [0.0] and math.isinf(moments.std) and RunningMoments().std == 1.0
    got, moments, _ = shape(config, torch.tensor([3.0]), [1], [True], moments, ShapingReport())
    reference = LightRFTMoments()
    reference.update(torch.tensor([3.0]))
    assert math.isinf(float(reference.std))
    reference.update(torch.tensor([3.0]))
    assert got.tolist() == [pytest.approx(3.0 / float(reference.std), rel=1e-5)]


def test_steps_off_leave_rewards_alone() -> None:
    rewards = torch.tensor([5.0, -7.0, 0.25], dtype=torch.float64)
    report = ShapingReport()
    penalised = penalise_overlong(Shaping(), rewards, torch.tensor([1000, 0, 5]), report)
    got, moments, bad = shape(Shaping(), penalised, [3], [True], RunningMoments(), report)
    assert got.tolist() == rewards.tolist() and moments == RunningMoments() and not bad
    assert (report.overlong_penalised, report.reward_clip_fraction) == (0, 0.0)


def test_advantage_clip() -> None:
    config = Shaping(advantage_clip=0.5)
    report = ShapingReport()
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
    assert math.isinf(RunningMoments().update(torch.tensor([2.0])).std)  # one value: LightRFT's infinite std


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
