"""The `expbuf` sample strategy: Trinity-RFT's `staleness_control`, telling the buffer the
trainer's policy version as well.

Trinity's trainer asks its sample strategy for step `step` = finished train steps + 1, and
after k finished steps the policy it holds (and syncs to the explorer as `model_version`)
is version k. Trinity's own strategies pass the buffer only `min_model_version`
(step - max_staleness - 1, i.e. version - max_staleness); this one also passes
`model_version` = step - 1, which ExpbufReader stores as the table's trainer version, so
the server's admission, stale-push screen and staleness metrics follow the trainer.
"""

from __future__ import annotations

from trinity.algorithm.sample_strategy.sample_strategy import StalenessControlSampleStrategy
from trinity.algorithm.sample_strategy.utils import representative_sample
from trinity.common.experience import Experience
from trinity.utils.timer import Timer


class ExpbufSampleStrategy(StalenessControlSampleStrategy):
    """`staleness_control` (with `max_staleness`, default unbounded) plus the trainer's version."""

    async def sample(self, step: int, **kwargs: object) -> tuple[list[Experience], dict, list]:
        version = max(step - 1, 0)
        min_version = max(step - self.max_staleness - 1, 0)
        metrics: dict = {}
        with Timer(metrics, "time/read_experience"):
            exp_list = await self.exp_buffer.read(min_model_version=min_version, model_version=version)
            repr_samples = representative_sample(exp_list)
        self.set_model_version_metric(exp_list, metrics)
        return exp_list, metrics, repr_samples
