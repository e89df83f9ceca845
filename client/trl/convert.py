"""TRL-style rollouts -> expbuf experiences of one group, and experiences -> TRL's RolloutSample.

TRL's AsyncGRPOTrainer trains on `RolloutSample`s: the whole sequence (`input_ids`), which of
its tokens are trained (`completion_mask`) and the sampler's log-prob of each (`old_log_probs`,
0 over the prompt), one `advantage` per sequence, the policy `model_version` that generated it
and a `group_id`. An expbuf experience keeps the tokens with a prompt length, and the
response's mask and log-probs (client/layout.py), so the two convert exactly:

    RolloutSample            expbuf Experience
    input_ids                tokens
    completion_mask          0 over the prompt, then action_mask (holes kept)
    old_log_probs            0 over the prompt, then logprobs
    advantage                the table's advantage (one value on every generated token)
    model_version            info["model_version"]
    group_id                 the table's group id, as a stable 63-bit integer (xxh3)
    metrics                  reward, the group's reward_std (population, as TRL's), metrics
    prompt, completion       prompt_text, response_text as one user and one assistant message
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ..schema.experience import EID, Experience
from ..schema.prompts import Prompt

Rows = Any  # a 2-D tensor or array, a sequence of 1-D ones or of lists; or one row


def _rows(values: Rows, name: str) -> list[torch.Tensor]:
    """The rows of a batch of token rows (padded 2-D, or ragged), or of a single row."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        tensor = torch.as_tensor(values)
        if tensor.ndim not in (1, 2):
            raise ValueError(f"{name} has {tensor.ndim} dimensions; expected rows of tokens (1 or 2)")
        return [tensor] if tensor.ndim == 1 else list(tensor)
    values = list(values)
    if values and isinstance(values[0], numbers.Number):
        return [torch.as_tensor(values)]
    return [torch.as_tensor(row) for row in values]


def group_id(group: str) -> int:
    """TRL's integer group id of an expbuf group: the same group always gets the same id."""
    return xxhash.xxh3_64_intdigest(group.encode()) >> 1


def _eid(group: EID | Prompt, run: int) -> EID:
    if isinstance(group, Prompt):
        return group.eid(run)
    return dataclasses.replace(group, run=run)


def group_experiences(
    group: EID | Prompt,
    prompt_ids: Rows,
    completion_ids: Rows,
    rewards: Sequence[float | None],
    *,
    completion_mask: Rows | None = None,
    old_log_probs: Rows | None = None,
    prompt_mask: Rows | None = None,
    model_version: int | None = None,
    prompt_text: str | None = None,
    completion_texts: Sequence[str] | None = None,
) -> list[Experience]:
    """One experience per completion, all of one group: run i has `group`'s batch and task
    (a ledger Prompt's `eid(i)`, or the EID given with run i), so they make one group in a
    table grouped by task, and a retried push of the same group is a duplicate, never a copy.

    `prompt_ids` is the group's prompt (one row) or one per completion; `prompt_mask` drops its
    padding (TRL's left padding). `completion_mask` marks the tokens trained (1) and those
    that are not (0): in padded rows (a 2-D tensor or array), the 0s after the last 1 are padding
    and dropped; ragged rows (a sequence of rows) are kept whole, their 0s after the last 1
    context the model did not generate, as TRL's own rows of multi-turn traces keep it (their
    `old_log_probs` may end at the last 1: 0 over the rest); 0s before the last 1 (a tool's reply)
    stay as holes of the action mask. Pass padded rows as a 2-D tensor or array: a list of padded
    rows is read as ragged, its padding kept as context. `old_log_probs` are the sampler's log-prob of each
    completion token (TRL needs them for its ratio); `model_version` is the policy version
    that generated the group (TRL's staleness is measured from it)."""
    completions = _rows(completion_ids, "completion_ids")
    padded = isinstance(completion_ids, (torch.Tensor, np.ndarray)) and np.ndim(completion_ids) == 2
    count = len(completions)
    prompts = _rows(prompt_ids, "prompt_ids")
    if len(prompts) == 1:
        prompts = prompts * count
    masks_in = _rows(completion_mask, "completion_mask") if completion_mask is not None else [None] * count
    logps_in = _rows(old_log_probs, "old_log_probs") if old_log_probs is not None else [None] * count
    prompt_masks = _rows(prompt_mask, "prompt_mask") if prompt_mask is not None else [None] * len(prompts)
    if len(prompt_masks) == 1:
        prompt_masks = prompt_masks * count
    texts = list(completion_texts) if completion_texts is not None else [None] * count
    for name, part in (
        ("prompt_ids", prompts), ("rewards", rewards), ("completion_mask", masks_in),
        ("old_log_probs", logps_in), ("prompt_mask", prompt_masks), ("completion_texts", texts),
    ):  # fmt: skip
        if len(part) != count:
            raise ValueError(f"{name} has {len(part)} rows for {count} completions")
    out = []
    for i in range(count):
        prompt, padding = prompts[i], prompt_masks[i]
        if padding is not None:
            prompt = prompt[padding.bool()]
        completion, mask, logps = completions[i], masks_in[i], logps_in[i]
        length = needed = completion.shape[0]
        if mask is not None:
            if mask.shape[0] != length:
                raise ValueError(f"completion {i}: completion_mask has {mask.shape[0]} values for {length} tokens")
            trained = mask.nonzero()
            needed = int(trained[-1]) + 1 if trained.numel() else 0  # log-probs up to the last trained token
            length = needed if padded else length
            mask = mask[:length].bool()
        if logps is not None:
            if logps.shape[0] < needed:
                raise ValueError(f"completion {i}: old_log_probs has {logps.shape[0]} values for {needed} tokens")
            logps = logps[:length].float()
            if logps.shape[0] < length:  # a ragged row's context after its last trained token: none sampled
                logps = torch.cat([logps, logps.new_zeros(length - logps.shape[0])])
        reward = rewards[i]
        info: dict[str, Any] = {} if model_version is None else {"model_version": int(model_version)}
        out.append(
            Experience(
                tokens=torch.cat([prompt, completion[:length]]).long(),
                eid=_eid(group, i),
                prompt_length=int(prompt.shape[0]),
                reward=None if reward is None else float(reward),
                logprobs=logps,
                action_mask=mask,
                info=info,
                prompt_text=prompt_text,
                response_text=texts[i],
            )
        )
    return out


def _advantage(exp: Any, mask: torch.Tensor) -> float:
    """The one advantage of an experience: the value on its generated tokens."""
    if exp.advantages is None:
        raise ValueError(f"experience {exp.eid}: no advantages (the table's estimator computed none)")
    values = exp.advantages[mask]
    if not values.numel():
        return 0.0
    if not bool((values == values[0]).all()):
        raise ValueError(
            f"experience {exp.eid}: its advantages differ from token to token (a token-level estimator), and "
            "TRL's RolloutSample takes one advantage per sequence"
        )
    return float(values[0])


def _messages(role: str, text: str | None) -> list[dict[str, str]]:
    return [] if text is None else [{"role": role, "content": text}]


def _reward_std(experiences: Sequence[Any]) -> float:
    rewards = [exp.reward for exp in experiences]
    if any(r is None for r in rewards):
        return math.nan
    return float(np.std(np.asarray(rewards, dtype=np.float64)))


def rollout_samples(experiences: Sequence[Any], group_ids: Sequence[str]) -> list[RolloutSample]:
    """TRL's RolloutSample of each experience (expbuf's or Trinity-RFT's), a group's together.
    Every experience needs its sampler's `logprobs`, its `info["model_version"]` and the
    table's advantages; a group's `reward_std` is taken over the experiences given."""
    if len(group_ids) != len(experiences):
        raise ValueError(f"{len(group_ids)} group ids for {len(experiences)} experiences")
    groups: dict[str, list[Any]] = {}
    for exp, group in zip(experiences, group_ids, strict=True):
        groups.setdefault(group, []).append(exp)
    samples = []
    for group, members in groups.items():
        reward_std = _reward_std(members)
        for exp in members:
            samples.append(_sample(exp, group_id(group), reward_std))
    return samples


def _sample(exp: Any, group: int, reward_std: float) -> RolloutSample:
    tokens = exp.tokens.reshape(-1)
    start = int(exp.prompt_length)
    mask = exp.action_mask
    if mask is None:
        mask = torch.ones(tokens.numel() - start, dtype=torch.bool)
    mask = mask.bool()
    if exp.logprobs is None:
        raise ValueError(f"experience {exp.eid}: no logprobs, and TRL's loss needs the sampler's log-probs")
    version = exp.info.get("model_version")
    if not isinstance(version, int):
        raise ValueError(f"experience {exp.eid}: info['model_version'] is {version!r}; TRL needs the policy version")
    zeros = np.zeros(start)
    metrics = {k: float(v) for k, v in (exp.metrics or {}).items() if isinstance(v, numbers.Real)}
    metrics.update(reward=math.nan if exp.reward is None else float(exp.reward), reward_std=reward_std)
    return RolloutSample(
        prompt=_messages("user", exp.prompt_text),
        completion=_messages("assistant", exp.response_text),
        input_ids=tokens.numpy().astype(np.int64),
        completion_mask=np.concatenate([zeros, mask.numpy()]).astype(np.int64),
        old_log_probs=np.concatenate([zeros, exp.logprobs.float().numpy()]).astype(np.float32),
        advantage=_advantage(exp, mask),
        model_version=version,
        group_id=group,
        metrics=metrics,
        enqueued_at=time.time(),
    )
