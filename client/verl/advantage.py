"""`algorithm.adv_estimator: expbuf`: the advantages and returns expbuf computed when each group
completed, taken as they are instead of being recomputed by verl.

verl's advantage step hands an estimator the rewards, the response mask and the prompt uids,
not the rows' stored advantages; the `expbuf_external` trainer reads them from TransferQueue
and holds them here for the one call it makes (`holding`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_adv_est

NAME = "expbuf"
_HELD: ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = ContextVar("expbuf_advantages", default=None)


@contextmanager
def holding(advantages: torch.Tensor, returns: torch.Tensor) -> Iterator[None]:
    """Make the batch's stored advantages and returns ([batch, response]) what `expbuf` returns."""
    token = _HELD.set((advantages, returns))
    try:
        yield
    finally:
        _HELD.reset(token)


@register_adv_est(NAME)
def compute_expbuf_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The held advantages and returns, zero outside the response mask."""
    held = _HELD.get()
    if held is None:
        raise RuntimeError(
            "algorithm.adv_estimator=expbuf takes the advantages expbuf computed: use it with "
            "trainer.v1.trainer_mode=expbuf_external and the expbuf sampler in source mode"
        )
    advantages, returns = held
    if advantages.shape != response_mask.shape or returns.shape != response_mask.shape:
        raise ValueError(
            f"expbuf advantages {tuple(advantages.shape)} and returns {tuple(returns.shape)} do not match the "
            f"response mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.to(advantages.dtype)
    return advantages * mask, returns * mask
