"""Reward shaping and advantage clipping in LightRFT's order (its FastExperienceMaker and
advantage calculators), as pure functions over flat per-experience vectors.

The steps, in order, each off unless configured:

1. DAPO's overlong penalty, on the rewards: with E = max_new_tokens - overlong_buffer_len
   and L the generated-token count, r += min(0, -(L - E) / overlong_buffer_len * factor).
2. The group step, for the estimators that have one (tables.group_step_first): the
   estimator runs here, and steps 3-4 take its values, as LightRFT's group calculators
   (grpo, rloo, reinforce_baseline) hand their values on as the rewards.
3. Running normalisation, group by group in the order the groups completed: the moments
   take in a group's values, then x = (x - mean) / std with reward_running_norm_minus_mean,
   else x / std. LightRFT's std after a single value is infinite (its count - 1 is 0), so
   that value becomes 0; a std of 0 gives 0 too, not NaN.
4. Reward clipping to [-reward_clip, reward_clip].
5. The estimator, for those without a group step.
6. advantages_norm, over each sampled batch's generated tokens (advantages/batch_stage.py).
7. Advantage clipping to [-advantage_clip, advantage_clip], then an estimator's whitening
   over the batch (reinforceplusplus, reinforce++_baseline), as LightRFT clips and then
   whitens across the batch.

The moments advance once per group, in completion order, which the store keeps durable:
the same groups completing in the same order give the same values whether they were
pushed at once, in parts or concurrently, and computed together or apart. They are a
value passed in and returned (`RunningMoments`), so whoever calls these keeps them
durable. Each step reports what it did: the count of penalised experiences, the counts of
values seen and clipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..store.schema.table_parts import Shaping
from .moments import RunningMoments

ADVANTAGES_NORM_EPSILON = 1e-8  # LightRFT's BaseREINFORCECalculator


@dataclass
class ShapingReport:
    """What the steps did to one computation, as counts that add up in the table's counters."""

    overlong_penalised: int = 0
    rewards_seen: int = 0
    rewards_clipped: int = 0
    advantages_seen: int = 0
    advantages_clipped: int = 0

    @property
    def reward_clip_fraction(self) -> float:
        return self.rewards_clipped / self.rewards_seen if self.rewards_seen else 0.0

    @property
    def advantage_clip_fraction(self) -> float:
        return self.advantages_clipped / self.advantages_seen if self.advantages_seen else 0.0


def clip(values: Tensor, limit: float) -> tuple[Tensor, int]:
    """Values clipped to [-limit, limit], and how many lay outside before."""
    return values.clamp(-limit, limit), int((values.abs() > limit).sum())


def overlong_penalty(
    rewards: Tensor, generated: Tensor, max_new_tokens: int, buffer_len: int, factor: float
) -> tuple[Tensor, int]:
    """DAPO's soft overlong punishment; and how many experiences it penalised."""
    exceed = generated.double() - (max_new_tokens - buffer_len)
    penalty = (-exceed / buffer_len * factor).clamp(max=0.0)
    return rewards + penalty, int((penalty < 0).sum())


def penalise_overlong(config: Shaping, rewards: Tensor, generated: Tensor, report: ShapingReport) -> Tensor:
    """Step 1 on the rewards of one computation (float64 [N]; generated-token counts [N])."""
    rewards = rewards.double()
    if not config.overlong_buffer:
        return rewards
    rewards, report.overlong_penalised = overlong_penalty(
        rewards, generated, config.max_new_tokens, config.overlong_buffer_len, config.overlong_buffer_penalty_factor
    )
    return rewards


def shape(
    config: Shaping,
    values: Tensor,
    sizes: Sequence[int],
    keep: Sequence[bool],
    moments: RunningMoments,
    report: ShapingReport,
) -> tuple[Tensor, RunningMoments, set[int]]:
    """Steps 3-4 on one computation's values ([N], the groups' members one group after
    another, `sizes` of them each, in completion order). Groups not kept (failed or
    dropped already) are left as they are and take nothing in. Returns the values, the
    moments after them, and the groups whose values came out non-finite: those take
    nothing in either, and fail."""
    if not config.shapes_values:
        return values, moments, set()
    out = values.double().cpu().tolist()
    bad: set[int] = set()
    start = 0
    for index, (size, kept) in enumerate(zip(sizes, keep, strict=True)):
        end = start + size
        if kept and config.reward_running_norm:
            after = moments.update(out[start:end])
            normed = after.normalise(out[start:end], config.reward_running_norm_minus_mean)
            if all(math.isfinite(v) for v in normed) and math.isfinite(after.var):
                out[start:end], moments = normed, after
            else:
                bad.add(index)
        if kept and index not in bad and config.reward_clip > 0:
            limit = config.reward_clip
            report.rewards_seen += size
            report.rewards_clipped += sum(abs(v) > limit for v in out[start:end])
            out[start:end] = [min(limit, max(-limit, v)) for v in out[start:end]]
        start = end
    return torch.tensor(out, dtype=torch.float64, device=values.device), moments, bad


def advantages_norm(values: Tensor, tokens: Tensor) -> Tensor:
    """LightRFT's advantages_norm over one value per experience, each on its `tokens`
    generated tokens: (x - mean) / (std + 1e-8), the token-weighted mean and unbiased std."""
    total = tokens.sum()
    mean = (values * tokens).sum() / total.clamp(min=1)
    var = (tokens * (values - mean) ** 2).sum() / (total - 1).clamp(min=1)
    return (values - mean) / (var.sqrt() + ADVANTAGES_NORM_EPSILON)


def clip_advantages(config: Shaping, advantages: Tensor, report: ShapingReport) -> Tensor:
    """Step 7's clip on the estimator's values (one per experience, or token-level)."""
    if config.advantage_clip <= 0:
        return advantages
    report.advantages_seen += advantages.numel()
    advantages, clipped = clip(advantages, config.advantage_clip)
    report.advantages_clipped += clipped
    return advantages
