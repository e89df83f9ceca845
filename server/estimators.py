"""Advantage estimators over a flat batch of experiences, in batched tensor code.

Every group statistic is a segment reduction over flat vectors (`index_add_`,
`scatter_reduce_`), and per-experience values reach the tokens with
`repeat_interleave`: there is no Python loop per group or per experience. Token-level
results follow Trinity-RFT's convention: `advantages` and `returns` have the response
length and are zero where `action_mask` is 0.

Most estimators give one value per experience (every generated token of an
experience carries it): their result is `Advantages(scalar=...)`, and the token-level
tensors are `scalar * action_mask`. `reinforce` is token-level by nature.

Groups of one experience have no baseline to compare with: their baseline is 0 and
their scale 1 (verl's and Trinity-RFT's convention), so their advantage is the reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .tables import ESTIMATOR_PARAMS


@dataclass
class FlatBatch:
    """The inputs of one computation: N experiences, T response tokens in all.

    `group` numbers the table's groups 0..G-1; `task`, `run` and `step` identify the
    experience inside its task (used by the multi-step estimators); `generated` counts
    the response tokens under each action mask. The token-level inputs are needed only by
    `reinforce` and by `Advantages.tokens`: `mask` concatenates the action masks, and
    `token_rewards` (same layout) holds the pushed token-level rewards, or the scalar
    reward on the last generated token where none were pushed.
    """

    rewards: Tensor  # [N] float64
    group: Tensor  # [N] int64
    lengths: Tensor  # [N] int64, response lengths
    generated: Tensor  # [N] float64
    task: Tensor  # [N] int64
    run: Tensor  # [N] int64
    step: Tensor  # [N] int64
    mask: Tensor | None = None  # [T] float64 (or bool)
    token_rewards: Tensor | None = None  # [T] float64

    @property
    def num_groups(self) -> int:
        return int(self.group.max()) + 1 if self.group.numel() else 0

    def to(self, device: torch.device | str) -> FlatBatch:
        """Move every input with one host-to-device copy of one packed buffer."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        tokens = [t for t in (self.mask, self.token_rewards) if t is not None]
        ints = (self.group, self.lengths, self.task, self.run, self.step)
        flat = [self.rewards, self.generated, *(i.double() for i in ints), *tokens]
        moved = torch.cat(flat).to(device, non_blocking=True)
        parts = list(torch.split(moved, [t.numel() for t in flat]))
        group, lengths, task, run, step = (p.long() for p in parts[2:7])
        mask = parts[7] if self.mask is not None else None
        token_rewards = parts[-1] if self.token_rewards is not None else None
        return FlatBatch(parts[0], group, lengths, parts[1], task, run, step, mask, token_rewards)


@dataclass
class Advantages:
    """One value per experience (`scalar`), or token-level `advantages` and `returns`."""

    scalar: Tensor | None = None  # [N]
    advantages: Tensor | None = None  # [T]
    returns: Tensor | None = None  # [T]
    drop_groups: Tensor | None = None  # [G] bool: groups the estimator removes (std threshold)

    def tokens(self, batch: FlatBatch) -> tuple[Tensor, Tensor]:
        """Token-level float32 (advantages, returns), zero where the action mask is 0."""
        if self.scalar is not None:
            values = self.scalar.float().repeat_interleave(batch.lengths, output_size=batch.mask.numel())
            values.mul_(batch.mask)
            return values, values
        return self.advantages.float(), self.returns.float()


def _segment_sum(values: Tensor, index: Tensor, size: int) -> Tensor:
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _group_mean_std(values: Tensor, index: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group count, mean and unbiased std (torch.std's default), as flat segment sums."""
    count = _segment_sum(torch.ones_like(values), index, size)
    mean = _segment_sum(values, index, size) / count.clamp(min=1)
    centred = values - mean[index]
    var = _segment_sum(centred * centred, index, size) / (count - 1).clamp(min=1)
    return count, mean, var.sqrt()


def _baseline_free_singletons(count: Tensor, mean: Tensor, std: Tensor) -> tuple[Tensor, Tensor]:
    """Groups of one: baseline 0, scale 1."""
    single = count <= 1
    return torch.where(single, torch.zeros_like(mean), mean), torch.where(single, torch.ones_like(std), std)


def grpo(
    b: FlatBatch,
    epsilon: float = 1e-6,
    std_over_batch: float = 0.0,
    std_threshold: float = 0.0,
    drop_below_threshold: float = 0.0,
) -> Advantages:
    """(r - mean_group) / (std + epsilon). Options: the std of the whole batch instead of
    the group's; groups whose std is below std_threshold get zero advantages (skipped) or,
    with drop_below_threshold, are dropped."""
    size = b.num_groups
    count, mean, std = _group_mean_std(b.rewards, b.group, size)
    mean, std = _baseline_free_singletons(count, mean, std)
    group_std = std
    if std_over_batch:
        batch_std = b.rewards.std() if b.rewards.numel() > 1 else torch.ones((), dtype=b.rewards.dtype)
        std = torch.where(count <= 1, std, batch_std.to(std.device).expand_as(std))
    scalar = (b.rewards - mean[b.group]) / (std[b.group] + epsilon)
    below = (group_std < std_threshold) & (count > 1)  # std_threshold 0: never
    scalar = torch.where(below[b.group], torch.zeros_like(scalar), scalar)
    return Advantages(scalar=scalar, drop_groups=below if drop_below_threshold else None)


def drgrpo(b: FlatBatch) -> Advantages:
    """Dr. GRPO: r - mean_group, no scaling by the std."""
    count, mean, _ = _group_mean_std(b.rewards, b.group, b.num_groups)
    mean = torch.where(count <= 1, torch.zeros_like(mean), mean)
    return Advantages(scalar=b.rewards - mean[b.group])


def rloo(b: FlatBatch) -> Advantages:
    """REINFORCE leave-one-out: r_i - mean of the other rewards of the group."""
    size = b.num_groups
    count = _segment_sum(torch.ones_like(b.rewards), b.group, size)
    total = _segment_sum(b.rewards, b.group, size)
    n = count[b.group]
    others = (total[b.group] - b.rewards) / (n - 1).clamp(min=1)
    return Advantages(scalar=torch.where(n <= 1, b.rewards, b.rewards - others))


def reinforce_pp(b: FlatBatch, epsilon: float = 1e-8) -> Advantages:
    """REINFORCE++ baseline: r - mean_group, then whitened over the batch's generated
    tokens: (x - mean) / sqrt(var + epsilon), with the unbiased variance under the mask."""
    count, mean, _ = _group_mean_std(b.rewards, b.group, b.num_groups)
    centred = b.rewards - torch.where(count <= 1, torch.zeros_like(mean), mean)[b.group]
    weight = b.generated
    tokens = weight.sum()
    batch_mean = (centred * weight).sum() / tokens.clamp(min=1)
    var = (weight * (centred - batch_mean) ** 2).sum() / tokens.clamp(min=1)
    var = var * tokens / (tokens - 1) if tokens > 1 else var
    return Advantages(scalar=(centred - batch_mean) * torch.rsqrt(var + epsilon))


def reinforce(b: FlatBatch, gamma: float = 1.0) -> Advantages:
    """Discounted return-to-go of the token-level rewards: G_t = r_t + gamma * G_{t+1},
    restarting after tokens outside the action mask; advantages = returns, masked.

    Vectorised over experiences, one step per token position of the longest response."""
    n, t_max = b.lengths.numel(), int(b.lengths.max()) if b.lengths.numel() else 0
    padded_mask = torch.zeros(n, t_max, dtype=b.mask.dtype, device=b.mask.device)
    keep = torch.arange(t_max, device=b.mask.device).expand(n, t_max) < b.lengths.unsqueeze(1)
    padded_mask[keep] = b.mask
    padded_rewards = torch.zeros_like(padded_mask)
    padded_rewards[keep] = b.token_rewards
    returns = torch.zeros_like(padded_mask)
    running = torch.zeros(n, dtype=b.mask.dtype, device=b.mask.device)
    for t in range(t_max - 1, -1, -1):
        running = padded_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * padded_mask[:, t]
    returns = returns[keep] * b.mask
    return Advantages(advantages=returns, returns=returns)


def opmd(b: FlatBatch, tau: float = 1.0, logavgexp_baseline: float = 0.0) -> Advantages:
    """r - baseline_group; the baseline is the group mean, or with logavgexp_baseline
    tau * log(mean(exp(r / tau)))."""
    size = b.num_groups
    count, mean, _ = _group_mean_std(b.rewards, b.group, size)
    if logavgexp_baseline:
        scaled = b.rewards / tau
        top = torch.full((size,), -math.inf, dtype=scaled.dtype, device=scaled.device)
        top = top.scatter_reduce(0, b.group, scaled, reduce="amax")
        lse = top + _segment_sum((scaled - top[b.group]).exp(), b.group, size).log()
        mean = tau * (lse - count.clamp(min=1).log())
    baseline = torch.where(count <= 1, torch.zeros_like(mean), mean)
    return Advantages(scalar=b.rewards - baseline[b.group])


def step_wise_grpo(b: FlatBatch, epsilon: float = 1e-6) -> Advantages:
    """GRPO over the last step of each run of a task; every step of a run carries its
    last step's advantage."""
    runs = int(b.run.max()) + 1 if b.run.numel() else 0
    last_step = torch.full((runs,), -1, dtype=b.step.dtype, device=b.step.device)
    last_step = last_step.scatter_reduce(0, b.run, b.step, reduce="amax")
    is_last = b.step == last_step[b.run]
    last = is_last.nonzero().squeeze(1)
    tasks = int(b.task.max()) + 1 if b.task.numel() else 0
    count, mean, std = _group_mean_std(b.rewards[last], b.task[last], tasks)
    mean, std = _baseline_free_singletons(count, mean, std)
    last_adv = (b.rewards[last] - mean[b.task[last]]) / (std[b.task[last]] + epsilon)
    run_adv = _segment_sum(last_adv, b.run[last], runs)
    return Advantages(scalar=run_adv[b.run])


def multi_turn_discount(b: FlatBatch, turn_level_discount: float = 1.0) -> Advantages:
    """Per run, rewards of steps 0..T-1 accumulated backwards: G_t = r_t + gamma * G_{t+1}.

    Vectorised over runs, one step per turn of the longest run."""
    runs = int(b.run.max()) + 1 if b.run.numel() else 0
    order = torch.argsort(b.run * (int(b.step.max()) + 1) + b.step)
    sorted_run = b.run[order]
    first = torch.searchsorted(sorted_run, torch.arange(runs, device=b.run.device))
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=b.run.device) - first[sorted_run]
    turns = int(position.max()) + 1 if position.numel() else 0
    table = torch.zeros(runs, turns, dtype=b.rewards.dtype, device=b.rewards.device)
    table[b.run, position] = b.rewards
    running = torch.zeros(runs, dtype=b.rewards.dtype, device=b.rewards.device)
    for t in range(turns - 1, -1, -1):
        running = table[:, t] + turn_level_discount * running
        table[:, t] = running
    return Advantages(scalar=table[b.run, position])


ESTIMATORS: dict[str, Callable[..., Advantages]] = {
    "grpo": grpo,
    "drgrpo": drgrpo,
    "rloo": rloo,
    "reinforce++": reinforce_pp,
    "reinforce": reinforce,
    "opmd": opmd,
    "step_wise_grpo": step_wise_grpo,
    "multi_turn_discount": multi_turn_discount,
}


def estimate(name: str, batch: FlatBatch, params: dict[str, float] | None = None) -> Advantages:
    """Run the named estimator with the table's parameters over the defaults."""
    unknown = set(params or {}) - set(ESTIMATOR_PARAMS[name])
    if unknown:
        raise ValueError(f"estimator {name} has no parameter(s) {', '.join(sorted(unknown))}")
    return ESTIMATORS[name](batch, **{**ESTIMATOR_PARAMS[name], **(params or {})})


def resolve_device(device: str) -> torch.device:
    """auto: cuda when present, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
