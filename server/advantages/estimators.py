"""Advantage estimators over a flat batch of experiences, in batched tensor code.

The estimators carry Trinity-RFT 0.6.0's registry names, parameter names and values
(`trinity/algorithm/advantage_fn`); expbuf's own variants have names of their own.

Every group statistic is a segment reduction over flat vectors (`index_add_`,
`scatter_reduce_`), and per-experience values reach the tokens with
`repeat_interleave`: there is no Python loop per group or per experience. Token-level
results follow Trinity-RFT's convention: `advantages` and `returns` have the response
length and are zero where `action_mask` is 0.

Two stages. The ingest stage (`estimate`) runs when groups complete and computes what
depends on a group alone; its result is stored per experience. Statistics over a batch
(whitening, the std over the batch) cannot be known then: the estimators that need them
store a pending value, and their batch stage (the `finish_*` functions) turns the pending
values of a sampled batch into its advantages, so that a batch gets the same advantages
however its groups arrived. Each estimator is registered, with its parameters and both
stages, in store/schema/estimator_registry.py. The ingest stage runs on the table's device:
every input is there (`FlatBatch.device`), and so is a tensor it makes without naming one; the
batch stage runs on the CPU.

Most estimators give one value per experience (every generated token of an experience
carries it): their result is `Advantages(scalar=...)`. `reinforceplusplus` and
`discounted_return` are token-level.

Rewards: the group estimators of Trinity (grpo, step_wise_grpo, reinforce, opmd, asymre,
rec) read the experience's reward; its verl-style ones (grpo_verl, rloo, opmd_verl,
asymre_verl, reinforceplusplus) read its token-level rewards, the pushed
`token_level_reward` or else the reward placed on the last response token, and their
sum (the `score`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..store.schema.estimator_registry import ESTIMATORS

WHITEN_EPSILON = 1e-8  # Trinity-RFT's masked_whiten


def _needed(tensor: Tensor | None, what: str, kind: str = "token-level") -> Tensor:
    """An optional input or result, there whenever the estimator that needs it runs."""
    if tensor is None:
        raise ValueError(f"the {kind} {what} are missing")
    return tensor


@dataclass
class FlatBatch:
    """The inputs of one computation: N experiences, T response tokens in all.

    `group` numbers the table's groups 0..G-1; `task`, `run` and `step` identify the
    experience inside its task (used by the multi-step estimators); `generated` counts
    the response tokens under each action mask. The token-level inputs are needed only by
    the token-level estimators: `mask` concatenates the action masks, and `token_rewards`
    (same layout) holds the pushed token-level rewards, or the scalar reward on the last
    response token where none were pushed (Trinity-RFT's layout).
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
    def device(self) -> torch.device:
        """Where every input is, and where the estimator computes (the table's device)."""
        return self.rewards.device

    @property
    def num_groups(self) -> int:
        return int(self.group.max()) + 1 if self.group.numel() else 0

    @property
    def scores(self) -> Tensor:
        """verl's sequence score: the sum of each experience's token-level rewards."""
        token_rewards = _needed(self.token_rewards, "rewards")
        if not self.lengths.numel():
            return torch.zeros(0, dtype=torch.float64, device=token_rewards.device)
        return torch.segment_reduce(token_rewards.double(), "sum", lengths=self.lengths, unsafe=True)

    def to(self, device: torch.device | str) -> FlatBatch:
        """Move every input with one host-to-device copy of one packed buffer."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        tokens = [t for t in (self.mask, self.token_rewards) if t is not None]
        ints = (self.group, self.lengths, self.task, self.run, self.step)
        flat = [self.rewards, self.generated, *(i.double() for i in ints), *(t.double() for t in tokens)]
        moved = torch.cat(flat).to(device, non_blocking=True)
        parts = list(torch.split(moved, [t.numel() for t in flat]))
        group, lengths, task, run, step = (p.long() for p in parts[2:7])
        mask = parts[7] if self.mask is not None else None
        token_rewards = parts[-1] if self.token_rewards is not None else None
        return FlatBatch(parts[0], group, lengths, parts[1], task, run, step, mask, token_rewards)


@dataclass
class Advantages:
    """One value per experience (`scalar`), or token-level `advantages` and `returns`.

    For an estimator with a batch stage these are the pending values it finishes over
    the sampled batch (its batch stage)."""

    scalar: Tensor | None = None  # [N]
    advantages: Tensor | None = None  # [T]
    returns: Tensor | None = None  # [T]
    drop_groups: Tensor | None = None  # [G] bool: groups the estimator removes (std threshold)

    def scalar_values(self) -> Tensor:
        """[N] the one value per experience of an estimator that gives one."""
        return _needed(self.scalar, "values", "one value per experience")

    def token_values(self) -> tuple[Tensor, Tensor]:
        """[T] the (advantages, returns) of a token-level estimator."""
        return _needed(self.advantages, "advantages"), _needed(self.returns, "returns")

    def tokens(self, batch: FlatBatch) -> tuple[Tensor, Tensor]:
        """Token-level float32 (advantages, returns), zero where the action mask is 0."""
        if self.scalar is not None:
            mask = _needed(batch.mask, "action masks")
            values = self.scalar.float().repeat_interleave(batch.lengths, output_size=mask.numel())
            values.mul_(mask)
            return values, values
        advantages, returns = self.token_values()
        return advantages.float(), returns.float()

    def finite(self, batch: FlatBatch) -> Tensor:
        """[N] bool: the experiences whose values are all finite as the float32 a batch
        carries them in (a float64 beyond float32's range would be infinite there)."""
        if self.scalar is not None:
            return torch.isfinite(self.scalar.float())
        advantages, returns = self.token_values()
        bad = (~torch.isfinite(advantages.float()) | ~torch.isfinite(returns.float())).double()
        index = torch.arange(batch.lengths.numel(), device=bad.device)
        index = index.repeat_interleave(batch.lengths.to(bad.device), output_size=bad.numel())
        return _segment_sum(bad, index, batch.lengths.numel()) == 0


def _segment_sum(values: Tensor, index: Tensor, size: int) -> Tensor:
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _group_mean_std(values: Tensor, index: Tensor, size: int, unbiased: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group count, mean and std (unbiased: torch.std's default), as flat segment sums. A
    group whose values are all equal has that value as its mean and a std of exactly 0, which
    their rounded sum would miss (0.1 three times): std_threshold 0 drops it, as documented."""
    count = _segment_sum(torch.ones_like(values), index, size)
    mean = _segment_sum(values, index, size) / count.clamp(min=1)
    low = mean.scatter_reduce(0, index, values, reduce="amin", include_self=False)
    high = mean.scatter_reduce(0, index, values, reduce="amax", include_self=False)
    mean = torch.where(low == high, high, mean)
    centred = values - mean[index]
    var = _segment_sum(centred * centred, index, size) / ((count - 1) if unbiased else count).clamp(min=1)
    return count, mean, var.sqrt()


def _baseline_free_singletons(count: Tensor, mean: Tensor, std: Tensor) -> tuple[Tensor, Tensor]:
    """Groups of one: baseline 0, scale 1 (verl's and Trinity-RFT's convention)."""
    single = count <= 1
    return torch.where(single, torch.zeros_like(mean), mean), torch.where(single, torch.ones_like(std), std)


def _below_threshold(count: Tensor, std: Tensor, std_threshold: float | None) -> Tensor | None:
    """Trinity's skip rule: with a threshold set, groups of one and groups with std <= it."""
    if std_threshold is None:
        return None
    return (count <= 1) | (std <= std_threshold)


def _batch_std(values: Tensor) -> Tensor:
    """Trinity's std over the batch: unbiased, and 1 for a batch of one."""
    return values.std() if values.numel() > 1 else torch.ones((), dtype=values.dtype, device=values.device)


# ---- Trinity-RFT's group estimators (they read the reward) ---------------------------


def grpo(b: FlatBatch, epsilon: float, std_threshold: float | None, std_cal_level: str) -> Advantages:
    """(r - mean_g) / (std_g + epsilon); groups at or below std_threshold (and groups of one
    when it is set) are dropped. With std_cal_level 'batch' the std is the batch's, taken
    at sample time; ingest stores r - mean_g."""
    count, mean, std = _group_mean_std(b.rewards, b.group, b.num_groups)
    drop = _below_threshold(count, std, std_threshold)
    mean, std = _baseline_free_singletons(count, mean, std)
    centred = b.rewards - mean[b.group]
    scalar = centred if std_cal_level == "batch" else centred / (std[b.group] + epsilon)
    return Advantages(scalar=scalar, drop_groups=drop)


def _last_of_each_run(run: Tensor, step: Tensor, runs: int) -> Tensor:
    """Which experience is each run's last (a mask): of its highest step, the one listed last.
    Trinity-RFT takes a run's last experience in its list, and its step-wise workflows list a
    run's experiences in step order, one per model call, several to a step where a step made
    several calls: one experience a run, never each of its last step's."""
    order = torch.arange(run.numel(), dtype=torch.int64, device=run.device)
    key = step.to(torch.int64) * max(run.numel(), 1) + order
    latest = torch.zeros(runs, dtype=torch.int64, device=run.device)
    latest = latest.scatter_reduce(0, run, key, reduce="amax", include_self=False)
    return key == latest[run]


def step_wise_grpo(
    b: FlatBatch, epsilon: float, enable_step_norm: str, std_cal_level: str, std_threshold: float | None
) -> Advantages:
    """GRPO over the last step of each run of a group; every step of the run carries its
    last step's advantage (divided by the run's number of steps with enable_step_norm).
    With std_cal_level 'batch' the std is over the last steps of the sampled batch."""
    runs = int(b.run.max()) + 1 if b.run.numel() else 0
    last = _last_of_each_run(b.run, b.step, runs).nonzero().squeeze(1)
    size = b.num_groups
    count, mean, std = _group_mean_std(b.rewards[last], b.group[last], size)
    drop = _below_threshold(count, std, std_threshold)
    mean, std = _baseline_free_singletons(count, mean, std)
    last_adv = b.rewards[last] - mean[b.group[last]]
    if std_cal_level != "batch":
        last_adv = last_adv / (std[b.group[last]] + epsilon)
    scalar = _segment_sum(last_adv, b.run[last], runs)[b.run]
    if enable_step_norm == "true":
        scalar = scalar / _segment_sum(torch.ones_like(b.rewards), b.run, runs)[b.run]
    return Advantages(scalar=scalar, drop_groups=drop)


def reinforce(b: FlatBatch) -> Advantages:
    """Trinity's REINFORCE: the reward itself on every generated token."""
    return Advantages(scalar=b.rewards.clone())


def _opmd(values: Tensor, b: FlatBatch, opmd_baseline: str, tau: float) -> Advantages:
    size = b.num_groups
    count, mean, _ = _group_mean_std(values, b.group, size)
    if opmd_baseline == "logavgexp":
        scaled = values / tau
        top = torch.full((size,), -math.inf, dtype=scaled.dtype, device=scaled.device)
        top = top.scatter_reduce(0, b.group, scaled, reduce="amax")
        lse = top + _segment_sum((scaled - top[b.group]).exp(), b.group, size).log()
        mean = tau * (lse - count.clamp(min=1).log())
    baseline = torch.where(count <= 1, torch.zeros_like(mean), mean)
    return Advantages(scalar=values - baseline[b.group])


def opmd(b: FlatBatch, opmd_baseline: str, tau: float) -> Advantages:
    """r - baseline_g: the group mean, or with opmd_baseline 'logavgexp' tau * log(mean(exp(r / tau)))."""
    return _opmd(b.rewards, b, opmd_baseline, tau)


def _asymre(values: Tensor, b: FlatBatch, baseline_shift: float) -> Advantages:
    count, mean, _ = _group_mean_std(values, b.group, b.num_groups)
    baseline = torch.where(count <= 1, torch.zeros_like(mean), mean + baseline_shift)
    return Advantages(scalar=values - baseline[b.group])


def asymre(b: FlatBatch, baseline_shift: float) -> Advantages:
    """AsymRE: r - (mean_g + baseline_shift); baseline 0 for a group of one."""
    return _asymre(b.rewards, b, baseline_shift)


def rec(b: FlatBatch, epsilon: float, std_normalize: str) -> Advantages:
    """REC: r - mean_g, divided by (population std_g + epsilon) with std_normalize.
    A group of one keeps its reward (Trinity-RFT raises on it)."""
    count, mean, std = _group_mean_std(b.rewards, b.group, b.num_groups, unbiased=False)
    mean, std = _baseline_free_singletons(count, mean, std)
    centred = b.rewards - mean[b.group]
    return Advantages(scalar=centred / (std[b.group] + epsilon) if std_normalize == "true" else centred)


# ---- Trinity-RFT's verl-style estimators (they read the token-level rewards) --------


def grpo_verl(b: FlatBatch, epsilon: float) -> Advantages:
    """verl's GRPO on the score: (s - mean_g) / (std_g + epsilon)."""
    scores = b.scores
    count, mean, std = _group_mean_std(scores, b.group, b.num_groups)
    mean, std = _baseline_free_singletons(count, mean, std)
    return Advantages(scalar=(scores - mean[b.group]) / (std[b.group] + epsilon))


def rloo(b: FlatBatch) -> Advantages:
    """REINFORCE leave-one-out on the score: s_i - mean of the other scores of the group."""
    scores = b.scores
    size = b.num_groups
    count = _segment_sum(torch.ones_like(scores), b.group, size)
    total = _segment_sum(scores, b.group, size)
    n = count[b.group]
    others = (total[b.group] - scores) / (n - 1).clamp(min=1)
    return Advantages(scalar=torch.where(n <= 1, scores, scores - others))


def opmd_verl(b: FlatBatch, opmd_baseline: str, tau: float) -> Advantages:
    """opmd on the score."""
    return _opmd(b.scores, b, opmd_baseline, tau)


def asymre_verl(b: FlatBatch, baseline_shift: float) -> Advantages:
    """asymre on the score."""
    return _asymre(b.scores, b, baseline_shift)


def _returns_to_go(b: FlatBatch, gamma: float) -> Tensor:
    """[T] G_t = r_t + gamma * G_{t+1} over each response's token-level rewards, through
    tokens outside the mask (a reward reaches every earlier turn). A scan over the flat tokens,
    log2 of the longest response's steps, each adding the sums 2^k tokens ahead in the same
    response: memory of the batch's tokens, where a matrix of experiences x the longest response
    took gigabytes for one long response among many short ones."""
    rewards = _needed(b.token_rewards, "rewards").double()
    total, device = rewards.numel(), rewards.device
    if not total:
        return rewards
    lengths = b.lengths.to(device)
    ends = torch.repeat_interleave(torch.cumsum(lengths, 0), lengths)  # each token's response's end
    ahead = ends - torch.arange(total, device=device)  # its response's tokens from it on, itself included
    returns, step, scale, longest = rewards, 1, gamma, int(lengths.max())  # one read of the device's, not a step's
    while step < longest:
        later = torch.zeros_like(returns)
        later[: total - step] = returns[step:]
        returns = returns + torch.where(ahead > step, scale * later, 0.0)
        step, scale = step * 2, scale * scale
    return returns


def reinforceplusplus(b: FlatBatch, gamma: float) -> Advantages:
    """REINFORCE++ (Trinity-RFT): the discounted returns-to-go, whitened over the generated
    tokens of the sampled batch. Ingest stores the mask (pending advantages) and the returns."""
    mask = _needed(b.mask, "action masks").double()
    return Advantages(advantages=mask, returns=_returns_to_go(b, gamma) * mask)


# ---- expbuf's own estimators ----------------------------------------------------------


def drgrpo(b: FlatBatch) -> Advantages:
    """Dr. GRPO: r - mean_g, no scaling by the std."""
    count, mean, _ = _group_mean_std(b.rewards, b.group, b.num_groups)
    mean = torch.where(count <= 1, torch.zeros_like(mean), mean)
    return Advantages(scalar=b.rewards - mean[b.group])


def reinforce_pp_baseline(b: FlatBatch, epsilon: float) -> Advantages:
    """verl's REINFORCE++ with a group baseline: r - mean_g, whitened at sample time over
    the generated tokens of the batch. Ingest stores r - mean_g."""
    count, mean, _ = _group_mean_std(b.rewards, b.group, b.num_groups)
    return Advantages(scalar=b.rewards - torch.where(count <= 1, torch.zeros_like(mean), mean)[b.group])


def discounted_return(b: FlatBatch, gamma: float) -> Advantages:
    """The discounted return-to-go of the token-level rewards, as advantages and returns."""
    returns = _returns_to_go(b, gamma) * _needed(b.mask, "action masks").double()
    return Advantages(advantages=returns, returns=returns)


def multi_turn_discount(b: FlatBatch, turn_level_discount: float) -> Advantages:
    """Per run, rewards of steps 0..T-1 accumulated backwards: G_t = r_t + gamma * G_{t+1}.

    Vectorised over runs, one step per turn of the longest run."""
    runs = int(b.run.max()) + 1 if b.run.numel() else 0
    order = torch.argsort(b.run * (int(b.step.max()) + 1) + b.step, stable=True)  # a step's experiences in push order
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


def estimate(name: str, batch: FlatBatch, args: dict[str, float | str | None]) -> Advantages:
    """The ingest stage of the named estimator, with its arguments (tables.estimator_args), on
    its batch's device: a tensor the stage makes without naming a device is made there too
    (`torch.zeros(n)` in an estimator of a user's, which would be on the CPU beside CUDA inputs)."""
    stage = ESTIMATORS[name].ingest_stage()
    if batch.device.type == "cpu":  # where torch makes tensors anyway: no device mode, which costs every op
        return stage(batch, **args)
    with batch.device:
        return stage(batch, **args)


# ---- batch stage: pure functions of the sampled batch's per-experience values -------


@dataclass
class SampledRows:
    """What the batch stage sees of a sampled batch of N experiences (T tokens for the
    token-level ones): the stored pending values and the inputs they are finished with."""

    pending: Tensor  # [N] float64: the stored scalar values (empty for token-level estimators)
    rewards: Tensor  # [N] float64
    generated: Tensor  # [N] float64
    run: Tensor  # [N] int64
    step: Tensor  # [N] int64
    mask: Tensor | None = None  # [T] float64, stored pending advantages of reinforceplusplus
    returns: Tensor | None = None  # [T] float64

    @property
    def device(self) -> torch.device:
        """Where every input is: the CPU (a batch stage runs where the reply is built)."""
        return self.pending.device


def finish_grpo(rows: SampledRows, epsilon: float, **_: object) -> Tensor:
    """(r - mean_g) / (std of the batch's rewards + epsilon)."""
    return rows.pending / (_batch_std(rows.rewards) + epsilon)


def finish_step_wise_grpo(rows: SampledRows, epsilon: float, **_: object) -> Tensor:
    """The pending value over (std of the batch's last-step rewards + epsilon)."""
    runs = int(rows.run.max()) + 1 if rows.run.numel() else 0
    last = _last_of_each_run(rows.run, rows.step, runs)
    return rows.pending / (_batch_std(rows.rewards[last]) + epsilon)


def finish_reinforce_pp_baseline(rows: SampledRows, epsilon: float) -> Tensor:
    """Whitened over the batch's generated tokens: (x - mean) / sqrt(var + epsilon), unbiased var."""
    weight = rows.generated
    tokens = weight.sum()
    mean = (rows.pending * weight).sum() / tokens.clamp(min=1)
    var = (weight * (rows.pending - mean) ** 2).sum() / tokens.clamp(min=1)
    var = var * tokens / (tokens - 1) if tokens > 1 else var
    return (rows.pending - mean) * torch.rsqrt(var + epsilon)


def finish_reinforceplusplus(rows: SampledRows, **_: object) -> Tensor:
    """[T] Trinity-RFT's masked_whiten of the returns over the batch's generated tokens,
    masked (its masked mean divides by count + 1e-8; unbiased variance; rsqrt(var + 1e-8)). Its
    count + 1e-8 is the count itself in float32, where it runs, for any count of one or more: so
    here, where float64 would keep the 1e-8 and put every return of a batch of equal ones r * 1e-8
    / count off their mean (whitened, r * 1e-4 / count: 0.025 a token for two tokens of 1000)."""
    mask, returns = _needed(rows.mask, "action masks"), _needed(rows.returns, "returns")
    count = mask.sum().clamp(min=WHITEN_EPSILON)
    mean = (returns * mask).sum() / count
    var = ((returns - mean) ** 2 * mask).sum() / count
    if count > 1:
        var = var * count / (count - 1)
    return (returns - mean) * torch.rsqrt(var + WHITEN_EPSILON) * mask


def resolve_device(device: str) -> torch.device:
    """auto: cuda when present, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
