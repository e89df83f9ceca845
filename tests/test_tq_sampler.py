"""expbuf's split in TransferQueue's sampler slot (client/transferqueue/sampler.py), driven as
TransferQueue's controller drives a sampler: each data-parallel rank asks for its part of a step
with its dp_rank, the step's groups chosen by TransferQueue's own GRPO logic and each sample's
tokens read from the partition's custom_meta; side by side with TransferQueue's
SeqlenBalancedSampler on the same steps (transferqueue from PyPI)."""

from __future__ import annotations

import random
from typing import Any

import pytest


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global SeqlenBalancedSampler, ExpbufBalancedSampler
    pytest.importorskip("transfer_queue")
    from transfer_queue.sampler.seqlen_balanced_sampler import SeqlenBalancedSampler

    from expbuf.client.transferqueue import ExpbufBalancedSampler


class Partition:
    """What TransferQueue's samplers read of a partition: each sample's custom_meta."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def get_custom_meta(self, indexes: list[int]) -> dict[int, dict[str, Any]]:
        return {index: {"total_lengths": self.lengths[index]} for index in indexes}


def step(rng: random.Random, groups: int, size: int) -> list[int]:
    """Each run's tokens, group after group: prompts of 256-2,048, responses of 200 to 32k, long-tailed."""
    return [
        rng.randint(256, 2048) + min(32_768, int(200 * rng.paretovariate(1.2)))
        for _ in range(groups)
        for _ in range(size)
    ]


def parts(sampler: Any, lengths: list[int], ranks: int, per_rank: int, batch: int = 0) -> list[list[int]]:
    partition = Partition(lengths)
    return [
        sampler.sample(list(range(len(lengths))), per_rank, "train", "p", dp_rank=rank, batch_index=batch,
                       partition=partition)[0]
        for rank in range(ranks)
    ]  # fmt: skip


def test_each_rank_gets_whole_groups_as_many_and_the_slowest_rank_carries_less() -> None:
    rng = random.Random(42)
    size, ranks, groups_per_rank = 8, 8, 8
    worse = 0
    for trial in range(10):
        lengths = step(rng, ranks * groups_per_rank, size)
        per_rank = groups_per_rank * size
        ours = parts(ExpbufBalancedSampler(n_samples_per_prompt=size, dp_size=ranks), lengths, ranks, per_rank)
        theirs = parts(SeqlenBalancedSampler(n_samples_per_prompt=size, dp_size=ranks), lengths, ranks, per_rank)
        assert sorted(i for part in ours for i in part) == list(range(len(lengths)))  # every sample once
        for part in ours:
            assert len(part) == per_rank  # as many a rank
            heads = {i // size for i in part}
            assert sorted(part) == [head * size + run for head in sorted(heads) for run in range(size)]  # whole groups
        load = [sum(lengths[i] for i in part) for part in ours]
        their_load = [sum(lengths[i] for i in part) for part in theirs]
        mean = sum(lengths) / ranks
        assert max(load) <= 1.02 * mean, trial
        worse += max(load) > max(their_load)
    assert worse == 0  # never a slower slowest rank than TransferQueue's own split


def test_the_ranks_after_the_first_get_the_cached_part_and_the_controllers_check_sees_it() -> None:
    lengths = step(random.Random(1), 16, 4)
    sampler = ExpbufBalancedSampler(n_samples_per_prompt=4, dp_size=4)
    first = parts(sampler, lengths, 4, 16)
    again = parts(sampler, lengths, 4, 16)  # the same step asked again: its parts, not a new split
    assert again == first
    states = sampler._states["p"]["train"]
    assert [states[rank][0][0] for rank in range(4)] == first  # what the controller's polling reads
    state = sampler.save_checkpoint()
    restored = ExpbufBalancedSampler(n_samples_per_prompt=4, dp_size=4)
    restored.load_checkpoint(state)
    assert parts(restored, lengths, 4, 16) == first
