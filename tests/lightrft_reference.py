"""LightRFT's reward shaping and advantage path, transcribed for the tests.

LightRFT's PyPI release holds no code, so its functions cannot be imported here. These are
its functions as its source has them, step for step, cited by file and function:

- seeds/003 (lightrft/trainer/fast_exp_maker.py): FastExperienceMaker.__init__ (the running
  moments, the calculator), FastExperienceMaker._process_experiences (overlong penalty,
  then the calculator's preprocess_rewards) and
  FastExperienceMaker._compute_advantages_and_returns (running normalisation, reward clip,
  compute_reward, the calculator's compute, then normalize_advantages_cross_batch).
- seeds/002 (lightrft/trainer/experience_maker.py): NaiveExperienceMaker.get_cumulative_returns;
  its process_experiences is the older form of the group steps below (grpo's epsilon 1e-8
  there, 1e-9 in the calculators seeds/003 uses, which this follows).
- lightrft/trainer/advantage_calculator.py, which seeds/003 imports: preprocess_rewards of
  RLOOCalculator, REINFORCEBaselineCalculator and GroupNormCalculator; compute of
  BaseREINFORCECalculator (advantages_norm, then advantage_clip), GroupNormCalculator (no
  advantages_norm) and REINFORCEBaselineCalculator._get_gamma (gamma 1); and
  normalize_advantages_cross_batch (gae, reinforce, reinforce_baseline).
- lightrft/trainer/utils.py: RunningMoments (float32 moments; std = sqrt(var * n / (n - 1)),
  infinite after a single value).
- lightrft/models/utils.py: compute_reward, here with a KL of 0 (the reward on the last
  action token).

One Experience holds `micro_batch` samples (LightRFT's micro_rollout_batch_size); a call of
`ExperienceMaker.make` is one rollout batch (make_experience_list), and the running moments
last across calls, as they last across a LightRFT run. Dynamic sampling and CPGD/GAE (which
need a critic) are left out.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Config:
    """The strategy.config / strategy.args settings the path reads."""

    advantage_estimator: str
    n_samples_per_prompt: int
    reward_running_norm: bool = False
    reward_running_norm_minus_mean: bool = False
    reward_clip: float = 0.0
    advantage_clip: float = 0.0
    advantages_norm: bool = False
    overlong_buffer: bool = False
    overlong_buffer_len: int = 0
    overlong_buffer_penalty_factor: float = 1.0
    no_advantage_std_norm: bool = False
    gamma: float = 1.0


class RunningMoments:
    """lightrft/trainer/utils.py RunningMoments."""

    def __init__(self) -> None:
        self.mean = 0
        self.std = 1
        self.var = 1
        self.count = 1e-24

    @torch.no_grad()
    def update(self, xs: Tensor) -> None:
        xs_count = xs.numel()
        xs_var, xs_mean = torch.var_mean(xs, unbiased=False)
        xs_mean, xs_var = xs_mean.float(), xs_var.float()
        delta = xs_mean - self.mean
        tot_count = self.count + xs_count
        old_sum_sq_diff = self.var * self.count
        new_sum_sq_diff = xs_var * xs_count
        correction_term = delta**2 * self.count * xs_count / tot_count
        tot_sum_sq_diff = old_sum_sq_diff + new_sum_sq_diff + correction_term
        self.mean += delta * xs_count / tot_count
        self.var = tot_sum_sq_diff / tot_count
        self.std = (self.var * tot_count / (tot_count - 1)).float().sqrt()
        self.count = tot_count


@dataclass
class Experience:
    """The parts of LightRFT's Experience the path reads and writes."""

    action_mask: Tensor  # [B, A] bool
    info: dict = field(default_factory=dict)  # "reward": [B]
    advantages: Tensor | None = None
    returns: Tensor | None = None


def compute_clip_fraction(values: Tensor, clip_max: float, clip_min: float) -> float:
    """lightrft/trainer/utils.py compute_clip_fraction (as a number)."""
    return ((values > clip_max).sum().item() + (values < clip_min).sum().item()) / max(values.numel(), 1)


def compute_reward(r: Tensor, action_mask: Tensor) -> Tensor:
    """lightrft/models/utils.py compute_reward with a KL of 0: the reward on the last action token."""
    kl = torch.zeros(action_mask.shape, dtype=r.dtype)
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    return torch.zeros_like(kl).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype))


def get_cumulative_returns(rewards: Tensor, action_mask: Tensor, gamma: float) -> Tensor:
    """AdvantageCalculator.get_cumulative_returns (seeds/002 NaiveExperienceMaker.get_cumulative_returns)."""
    response_length = rewards.size(1)
    returns = torch.zeros_like(rewards)
    cumulative_return = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        cumulative_return = rewards[:, t] + gamma * cumulative_return
        returns[:, t] = cumulative_return
    return returns


def preprocess_rewards(config: Config, rewards: Tensor, experiences: list[Experience]) -> list[Tensor]:
    """The calculators' preprocess_rewards: the group step of rloo, reinforce_baseline and
    group_norm/grpo; the others chunk the rewards back unchanged."""
    n_samples = config.n_samples_per_prompt
    estimator = config.advantage_estimator
    if estimator == "rloo":
        rewards = rewards.reshape(-1, n_samples)
        baseline = (rewards.sum(-1, keepdim=True) - rewards) / (n_samples - 1)
        rewards = rewards - baseline
    elif estimator == "reinforce_baseline":
        rewards = rewards.reshape(-1, n_samples)
        rewards = rewards - rewards.mean(-1, keepdim=True)
    elif estimator in ("group_norm", "grpo"):
        rewards = rewards.reshape(-1, n_samples)
        rewards = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)
    return list(rewards.flatten().chunk(len(experiences)))


def compute(config: Config, experience: Experience, final_reward: Tensor) -> tuple[Tensor, Tensor]:
    """BaseREINFORCECalculator.compute (GroupNormCalculator.compute without advantages_norm;
    REINFORCEBaselineCalculator with gamma 1)."""
    gamma = 1.0 if config.advantage_estimator == "reinforce_baseline" else config.gamma
    returns = get_cumulative_returns(final_reward, experience.action_mask, gamma)
    advantages = deepcopy(returns)
    if config.advantages_norm and config.advantage_estimator not in ("group_norm", "grpo"):
        masked_adv = torch.masked_select(advantages, experience.action_mask)
        advantages = (advantages - masked_adv.mean()) / (masked_adv.std() + 1e-8)
    if config.advantage_clip > 0:
        advantages = torch.clamp(advantages, -config.advantage_clip, config.advantage_clip)
    return advantages, returns


@torch.no_grad()
def normalize_advantages_cross_batch(experiences: list[Experience], config: Config) -> list[Experience]:
    """advantage_calculator.py normalize_advantages_cross_batch."""
    if config.advantage_estimator not in ("gae", "reinforce", "reinforce_baseline"):
        return experiences
    advantages_vector = torch.cat([exp.advantages.flatten() for exp in experiences], dim=0).float()
    action_masks_vector = torch.cat([exp.action_mask.flatten() for exp in experiences], dim=0)
    num_actions = action_masks_vector.sum()
    mean = (advantages_vector * action_masks_vector).sum() / num_actions
    if not config.no_advantage_std_norm:
        var = ((advantages_vector - mean).pow(2) * action_masks_vector).sum() / num_actions
        rstd = var.clamp(min=1e-8).rsqrt()
    else:
        rstd = 1
    for exp in experiences:
        exp.advantages = (exp.advantages - mean) * rstd
    return experiences


class ExperienceMaker:
    """FastExperienceMaker's reward and advantage stages, its running moments kept across
    rollout batches."""

    def __init__(self, config: Config, max_new_tokens: int = 0) -> None:
        self.config = config
        self.max_new_tokens = max_new_tokens
        self.reward_running_moments = RunningMoments() if config.reward_running_norm else None

    def make(self, rewards: list[float], masks: list[list[int]], micro_batch: int) -> list[Tensor]:
        """The advantages ([response length] each, float32) of one rollout batch: samples in
        order, `micro_batch` to an Experience, the action masks right-padded."""
        experiences = []
        for start in range(0, len(rewards), micro_batch):
            part = masks[start : start + micro_batch]
            width = max(len(m) for m in part)
            mask = torch.tensor([m + [0] * (width - len(m)) for m in part], dtype=torch.bool)
            reward = torch.tensor(rewards[start : start + micro_batch], dtype=torch.float32)
            experiences.append(Experience(mask, {"reward": reward}))
        shaped = self._process_experiences(experiences)
        experiences = self._compute_advantages_and_returns(experiences, shaped)
        out = []
        for exp in experiences:
            for row, m in zip(exp.advantages, exp.action_mask, strict=True):
                out.append((row * m)[: len(masks[len(out)])].float())
        return out

    def _process_experiences(self, experiences: list[Experience]) -> list[Tensor]:
        config = self.config
        rewards = torch.cat([exp.info["reward"] for exp in experiences])
        if config.overlong_buffer:
            expected_len = self.max_new_tokens - config.overlong_buffer_len
            actual_lens = torch.cat([exp.action_mask.sum(dim=1) for exp in experiences])
            exceed_len = actual_lens - expected_len
            penalty = torch.clamp(
                -exceed_len / config.overlong_buffer_len * config.overlong_buffer_penalty_factor, max=0.0
            )
            rewards += penalty
        return preprocess_rewards(config, rewards, experiences)

    def _compute_advantages_and_returns(self, experiences: list[Experience], rewards: list[Tensor]) -> list[Experience]:
        config = self.config
        for experience, reward in zip(experiences, rewards, strict=True):
            processed_reward = reward.clone()
            if self.reward_running_moments:
                self.reward_running_moments.update(processed_reward)
                if config.reward_running_norm_minus_mean:
                    processed_reward = (
                        processed_reward - self.reward_running_moments.mean
                    ) / self.reward_running_moments.std
                else:
                    processed_reward /= self.reward_running_moments.std
            if config.reward_clip > 0:
                processed_reward = torch.clamp(processed_reward, -config.reward_clip, config.reward_clip)
            final_reward = compute_reward(processed_reward, experience.action_mask)
            experience.advantages, experience.returns = compute(config, experience, final_reward)
        return normalize_advantages_cross_batch(experiences, config)
