"""Builders of experiences for tests and benchmarks."""

from __future__ import annotations

import torch

from expbuf.client import EID, Experience, trxp


def make_experience(
    batch: int | str,
    task: int | str,
    run: int,
    *,
    step: int = 0,
    reward: float | None = 1.0,
    response: int = 4,
    prompt: int = 3,
    version: int | None = 1,
    priority: float | None = None,
) -> Experience:
    info: dict = {} if version is None else {"model_version": version}
    if priority is not None:
        info["priority"] = priority
    return Experience(
        eid=EID(batch=batch, task=task, run=run, step=step, suffix=f"r{run}s{step}"),
        tokens=torch.arange(prompt + response, dtype=torch.int32),
        prompt_length=prompt,
        logprobs=torch.full((response,), -0.5),
        action_mask=torch.ones(response, dtype=torch.bool),
        reward=reward,
        info=info,
    )


def group_items(batch: int | str, task: int | str, size: int, **kwargs: object) -> list[trxp.RawItem]:
    """A GRPO group: `size` runs of one task, as validated RawItems."""
    return [trxp.from_experience(make_experience(batch, task, run, **kwargs)) for run in range(size)]
