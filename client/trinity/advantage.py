"""The `expbuf` advantage function: Trinity-RFT's trainer takes the buffer's advantages as they are.

expbuf computes advantages when a group completes (the table's estimator), so nothing is left
to compute: in Trinity's experience pipeline (before the buffer) the function passes
experiences through untouched, and in the trainer it keeps the batch's `advantages` and
`returns`, which Trinity filled from the experiences it read.
"""

from __future__ import annotations

from typing import Any

from trinity.algorithm.advantage_fn import AdvantageFn
from trinity.buffer.operators import ExperienceOperator
from trinity.common.experience import Experience


class ExpbufAdvantageFn(AdvantageFn, ExperienceOperator):
    """Trinity-RFT's advantage_fn `expbuf`: the advantages the table computed, taken as they came
    with the batch (a batch that holds none is refused, naming the cause)."""

    def __call__(self, exps: Any, **kwargs: Any) -> tuple[Any, dict]:
        if isinstance(exps, list):
            return self.process(exps)
        # verl's DataProto keeps a TensorDict, which answers `in` only through keys().
        if "advantages" not in exps.batch.keys():  # noqa: SIM118
            raise ValueError(
                "advantage_fn 'expbuf' found no advantages in the batch: read it from an expbuf:// experience "
                "buffer whose table has an estimator"
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
