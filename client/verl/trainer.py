"""`trainer.v1.trainer_mode: expbuf_external`: a verl V1 trainer whose groups all come from expbuf
(the sampler in source mode), so it dispatches no prompts to verl's own generation."""

from __future__ import annotations

import logging

import transfer_queue as tq
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer

from expbuf.client.verl import advantage
from expbuf.client.verl.replay_buffer import ExpbufReplayBuffer
from expbuf.client.verl.settings import filter_disagreement

logger = logging.getLogger(__name__)

NAME = "expbuf_external"


@register_trainer(NAME)
class ExpbufExternalTrainer(PPOTrainer):
    """Trains on whole groups leased from expbuf; rollouts happen elsewhere (Trinity explorers,
    other workers), which take the new weights through their own synchronisation."""

    def __init__(self, config) -> None:
        super().__init__(config)
        try:
            self._check()
        except ValueError:
            if isinstance(self.replay_buffer, ExpbufReplayBuffer):
                self.replay_buffer.close()
            raise

    def _check(self) -> None:
        """Refuse a sampler that is not expbuf's in source mode, and KL in the reward with kept advantages."""
        buffer = self.replay_buffer
        if not (isinstance(buffer, ExpbufReplayBuffer) and buffer.mode == "source"):
            raise ValueError(
                f"trainer_mode {NAME} needs trainer.v1.sampler.custom_sampler = ExpbufReplayBuffer with "
                "sampler_kwargs.expbuf.mode = source: it generates nothing itself"
            )
        filter_groups = self.config.algorithm.get("filter_groups", None)
        enabled = bool(filter_groups is not None and filter_groups.get("enable", False))
        why = filter_disagreement(enabled, buffer.table_config.drop_zero_variance)
        if why:
            logger.warning(why)
        if self.config.algorithm.adv_estimator == advantage.NAME and self.config.algorithm.use_kl_in_reward:
            raise ValueError(
                "algorithm.use_kl_in_reward changes the rewards after expbuf computed the advantages: "
                "turn it off with adv_estimator=expbuf (use the actor's KL loss instead)"
            )

    def prepare_step(self) -> dict:
        """No prompts to dispatch: the sampler leases finished groups from expbuf."""
        return {}

    def on_step_end(self) -> None:
        return

    def on_sample_end(self) -> None:
        return

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        if self.config.algorithm.adv_estimator != advantage.NAME:
            return super()._compute_advantage(batch, metrics)
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["advantages", "returns"]
        )
        padded = data.to_padded_tensor()
        with advantage.holding(padded["advantages"], padded["returns"]):
            return super()._compute_advantage(batch, metrics)
