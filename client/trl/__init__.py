"""expbuf as the rollout buffer of TRL's AsyncGRPOTrainer (needs trl 1.16; `import expbuf.client`
never loads this).

    worker = ExpbufRolloutWorker("HOST:PORT", "grpo")
    AsyncGRPOTrainer(..., rollout_worker=worker, callbacks=[worker.callback])

Rollout producers push with any expbuf client; `group_experiences` turns TRL-style prompt and
completion ids, masks, old log-probs and rewards into the experiences of one group, and
`rollout_samples` turns experiences into TRL's RolloutSample.
"""

from __future__ import annotations

from .convert import group_experiences, group_id, rollout_samples
from .worker import AckAfterStep, ExpbufRolloutWorker

__all__ = ["AckAfterStep", "ExpbufRolloutWorker", "group_experiences", "group_id", "rollout_samples"]
