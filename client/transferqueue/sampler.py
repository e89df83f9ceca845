"""TransferQueue's sampler slot with expbuf's split of a step over data-parallel ranks.

TransferQueue's `SeqlenBalancedSampler` takes a step's whole GRPO groups and spreads them over
the ranks by Karmarkar-Karp over each group's tokens (`custom_meta["total_lengths"]`), as many
groups a rank. `ExpbufBalancedSampler` is that sampler with expbuf's split in its place
(schema/balance.split_groups with equal=True: Karmarkar-Karp over blocks of one group a rank, then
swaps between the heaviest and the lightest rank): on long-tailed groups the slowest of 8 ranks
carries 1.0006 of the mean tokens where TransferQueue's own carries 1.03-1.09
(bench/RESULTS.md, "Whole groups over data-parallel ranks"). The groups a step takes, the
caching of its parts for the ranks that ask after the first, and the checkpoint are
TransferQueue's; only the parts differ. It reads the sampler's own caches
(`_balanced_cache`, `_states`) of transferqueue 0.1.11, which tests/test_tq_sampler.py checks.

    tq.init(OmegaConf.create({"controller": {"sampler": ExpbufBalancedSampler(n_samples_per_prompt=8, dp_size=4)}}))
"""

from __future__ import annotations

from typing import Any

from transfer_queue.sampler.seqlen_balanced_sampler import SeqlenBalancedSampler

from ..schema.balance import split_groups


class ExpbufBalancedSampler(SeqlenBalancedSampler):
    """SeqlenBalancedSampler whose parts are expbuf's split, `balance` ("tokens" by default, or
    a cost registered with schema/balance.register_cost) over `total_lengths`."""

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1, balance: str = "tokens") -> None:
        super().__init__(n_samples_per_prompt=n_samples_per_prompt, dp_size=dp_size)
        self.balance = balance

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """The rank's part of the step (kwargs `dp_rank`, `batch_index`, `partition`, as
        TransferQueue's controller passes them): the first rank to ask splits the step."""
        key = (partition_id, task_name, kwargs.get("batch_index", 0))
        first = key not in self._balanced_cache
        sampled, consumed = super().sample(ready_indexes, batch_size, task_name, partition_id, *args, **kwargs)
        partition = kwargs.get("partition")
        parts = self._balanced_cache.get(key)
        size = self.n_samples_per_prompt
        if not first or partition is None or not parts or any(len(part) % size for part in parts):
            return sampled, consumed  # a step of no whole groups: TransferQueue's own split stands
        groups = [part[at : at + size] for part in parts for at in range(0, len(part), size)]
        meta = partition.get_custom_meta([index for group in groups for index in group])
        lengths = {group[0]: [meta.get(index, {}).get("total_lengths", 1) for index in group] for group in groups}
        members = {group[0]: group for group in groups}
        split = split_groups({str(head): lengths[head] for head in lengths}, self.dp_size, self.balance, None, True)
        parts = [[index for head in part for index in members[int(head)]] for part in split]
        self._balanced_cache[key] = parts
        states = self._states[partition_id][task_name]
        for rank in range(self.dp_size):
            states[rank][key[2]] = (parts[rank], parts[rank].copy())
        rank = kwargs.get("dp_rank", 0)
        return parts[rank], parts[rank].copy()
