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
experiences, the fraction of values clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .tables import ConfigError


@dataclass(frozen=True)
class Shaping:
    """A table's shaping steps, under LightRFT's setting names; 0 (or false) turns a step off."""

    reward_clip: float = 0.0
    overlong_buffer: bool = False
    overlong_buffer_len: int = 0
    overlong_buffer_penalty_factor: float = 1.0
    max_new_tokens: int = 0
    reward_running_norm: bool = False
    reward_running_norm_minus_mean: bool = False
    advantage_clip: float = 0.0

    def __post_init__(self) -> None:
        for name in ("reward_clip", "advantage_clip", "overlong_buffer_penalty_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"shaping {name} is {value!r}; allowed: a finite number >= 0")
        for name in ("overlong_buffer_len", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"shaping {name} is {value!r}; allowed: an integer >= 0")
        if self.overlong_buffer and not 0 < self.overlong_buffer_len < self.max_new_tokens:
            raise ConfigError(
                f"shaping overlong_buffer needs 0 < overlong_buffer_len < max_new_tokens, "
                f"got {self.overlong_buffer_len} and {self.max_new_tokens}"
            )


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
    """What the steps did to one computation, for metrics and Stats."""

    overlong_penalised: int = 0
    reward_clip_fraction: float = 0.0
    advantage_clip_fraction: float = 0.0


def clip(values: Tensor, limit: float) -> tuple[Tensor, float]:
    """Values clipped to [-limit, limit], and the fraction that lay outside before."""
    if values.numel() == 0:
        return values, 0.0
    fraction = float((values.abs() > limit).double().mean())
    return values.clamp(-limit, limit), fraction


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
        rewards, report.reward_clip_fraction = clip(rewards, config.reward_clip)
    return rewards, moments, report


def clip_advantages(config: Shaping, advantages: Tensor, report: ShapingReport) -> Tensor:
    """Step 5 on the estimator's values (one per experience, or token-level)."""
    if config.advantage_clip <= 0:
        return advantages
    advantages, report.advantage_clip_fraction = clip(advantages, config.advantage_clip)
    return advantages
