"""The `expbuf` advantage function: Trinity-RFT's trainer takes the buffer's advantages as they are.

expbuf computes advantages when a group completes (the table's estimator), so nothing is left
to compute: in Trinity's experience pipeline (before the buffer) the function passes
experiences through untouched, and in the trainer it keeps the batch's `advantages` and
`returns`, which Trinity filled from the experiences it read.
"""

from __future__ import annotations

from typing import Any

import torch
from trinity.algorithm.advantage_fn import AdvantageFn
from trinity.buffer.operators import ExperienceOperator
from trinity.common.experience import Experience


class ExpbufAdvantageFn(AdvantageFn, ExperienceOperator):
    """Trinity-RFT's advantage_fn `expbuf`: the advantages the table computed, taken as they came
    with the batch (a batch that holds none is refused, naming the cause, and so is one whose
    rewards the trainer changed first: a KL penalty in them, which the advantages would lose)."""

    def __call__(self, exps: Any, **kwargs: Any) -> tuple[Any, dict]:
        if isinstance(exps, list):
            return self.process(exps)
        # verl's DataProto keeps a TensorDict, which answers `in` only through keys().
        keys = exps.batch.keys()
        if "advantages" not in keys:
            raise ValueError(
                "advantage_fn 'expbuf' found no advantages in the batch: read it from an expbuf:// experience "
                "buffer whose table has an estimator"
            )
        if {"token_level_rewards", "token_level_scores"} <= set(keys) and not torch.equal(
            exps.batch["token_level_rewards"], exps.batch["token_level_scores"]
        ):
            raise ValueError(
                "advantage_fn 'expbuf' takes the advantages the table computed from the experiences' rewards, but "
                "Trinity-RFT's trainer changed this batch's rewards first (algorithm.kl_penalty_fn puts a KL "
                "penalty in them), which those advantages would leave out: set kl_penalty_fn: none, and put the "
                "KL in the loss (kl_loss_fn) if you want one"
            )
        return exps, {}

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict]:
        """Before the buffer: pass through; the buffer computes the advantages when each group completes."""
        return exps, {}

    @classmethod
    def default_args(cls) -> dict:
        return {}

    @classmethod
    def compute_in_trainer(cls) -> bool:
        """False: Trinity may then place it in its experience pipeline, where it does nothing."""
        return False
