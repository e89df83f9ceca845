"""Reward shaping before the estimator, and advantage clipping after it (LightRFT's
FastExperienceMaker), as pure functions over flat per-experience vectors.

The steps, in order, each off unless configured:

1. DAPO's overlong penalty: with E = max_new_tokens - overlong_buffer_len and L the
   generated-token count, r += min(0, -(L - E) / overlong_buffer_len * overlong_buffer_penalty_factor).
2. Running reward normalisation: the running moments take in the rewards first, then
   r = (r - mean) / std with reward_running_norm_minus_mean, else r / std.
3. Reward clipping to [-reward_clip, reward_clip].
4. The estimator.
5. Advantage clipping to [-advantage_clip, advantage_clip].

The running moments are a value passed in and returned (`RunningMoments`), so whoever
calls these keeps them durable. Each step reports what it did: the count of penalised
experiences, the counts of values seen and clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .tables import Shaping


@dataclass(frozen=True)
class RunningMoments:
    """Running mean and variance of every reward seen (Chan et al.'s parallel merge).

    `count` starts at a tiny value and `var` at 1, so that the first update gives the
    moments of its own batch."""

    mean: float = 0.0
    var: float = 1.0  # population variance
    count: float = 1e-24

    @property
    def std(self) -> float:
        """The unbiased standard deviation of everything seen."""
        return math.sqrt(self.var * self.count / (self.count - 1)) if self.count > 1 else 1.0

    @classmethod
    def of(cls, stored: list[float] | None) -> RunningMoments:
        """The moments as a table's counters keep them (None before any reward)."""
        return cls(*stored) if stored else cls()

    def stored(self) -> list[float]:
        """The form the table's counters keep."""
        return [self.mean, self.var, self.count]

    def update(self, values: Tensor) -> RunningMoments:
        """These moments with the values taken in."""
        n = values.numel()
        if n == 0:
            return self
        batch_var, batch_mean = torch.var_mean(values.double(), unbiased=False)
        delta = float(batch_mean) - self.mean
        total = self.count + n
        merged = self.var * self.count + float(batch_var) * n + delta * delta * self.count * n / total
        return RunningMoments(self.mean + delta * n / total, merged / total, total)


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


def shape_rewards(
    config: Shaping, rewards: Tensor, generated: Tensor, moments: RunningMoments
) -> tuple[Tensor, RunningMoments, ShapingReport]:
    """Steps 1-3 on the rewards of one computation (float64 [N]; generated-token counts [N])."""
    report = ShapingReport()
    rewards = rewards.double()
    if config.overlong_buffer:
        rewards, report.overlong_penalised = overlong_penalty(
            rewards, generated, config.max_new_tokens, config.overlong_buffer_len, config.overlong_buffer_penalty_factor
        )
    if config.reward_running_norm:
        moments = moments.update(rewards)
        rewards = (
            (rewards - moments.mean) / moments.std if config.reward_running_norm_minus_mean else rewards / moments.std
        )
    if config.reward_clip > 0:
        report.rewards_seen = rewards.numel()
        rewards, report.rewards_clipped = clip(rewards, config.reward_clip)
    return rewards, moments, report


def clip_advantages(config: Shaping, advantages: Tensor, report: ShapingReport) -> Tensor:
    """Step 5 on the estimator's values (one per experience, or token-level)."""
    if config.advantage_clip <= 0:
        return advantages
    report.advantages_seen += advantages.numel()
    advantages, clipped = clip(advantages, config.advantage_clip)
    report.advantages_clipped += clipped
    return advantages
