"""How evenly a step's groups are spread over data-parallel ranks (issue 42): the slowest rank's
tokens over the mean, for expbuf's split (client/schema/balance.py, what ReadFields by lease
serves each rank; also with `equal=True`, as many groups a rank), TransferQueue's
`SeqlenBalancedSampler` (transferqueue from PyPI, driven by its own class on the same groups:
Karmarkar-Karp with as many groups on every rank), a random split of as many groups a rank, and
the ideal (the total over the ranks, or the largest group where that is more).

    .venv/bin/python bench/bench_rank_balance.py [--trials 20] [--groups-per-rank 8]

Each trial draws a step of `groups-per-rank` x ranks groups of 8 or 16 runs; a run is a prompt
of 256 to 2,048 tokens and a response of 200 to 32,768 (Pareto-tailed, alpha 1.2, clipped): most
runs are short, a few fill the context. A group's load is its runs' tokens. Medians over the
trials, side by side on the same groups, and the milliseconds each split took.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import write_section  # noqa: E402
from transfer_queue.sampler.seqlen_balanced_sampler import SeqlenBalancedSampler  # noqa: E402

from expbuf.client.schema.balance import parts  # noqa: E402

HEADING = "## Whole groups over data-parallel ranks (issue 42)"
RANKS = (2, 8, 64)
GROUP_SIZES = (8, 16)


class Lengths:
    """What TransferQueue's sampler reads of a partition: each sample's custom_meta."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def get_custom_meta(self, indexes: list[int]) -> dict[int, dict[str, Any]]:
        return {index: {"total_lengths": self.lengths[index]} for index in indexes}


def step(rng: random.Random, groups: int, size: int) -> list[int]:
    """Each run's tokens, group after group."""
    return [
        rng.randint(256, 2048) + min(32_768, int(200 * rng.paretovariate(1.2)))
        for _ in range(groups)
        for _ in range(size)
    ]


def ratio(loads: list[int], ranks: int) -> float:
    return max(loads) / (sum(loads) / ranks)


def one(rng: random.Random, ranks: int, size: int, per_rank: int) -> dict[str, tuple[float, float]]:
    """The slowest rank over the mean and the split's milliseconds, each way, for one step."""
    groups = ranks * per_rank
    runs = step(rng, groups, size)
    costs = [sum(runs[g * size : (g + 1) * size]) for g in range(groups)]
    out: dict[str, tuple[float, float]] = {}
    start = time.perf_counter()
    split = parts(costs, ranks)
    out["expbuf"] = (ratio([sum(costs[g] for g in part) for part in split], ranks), time.perf_counter() - start)
    start = time.perf_counter()
    split = parts(costs, ranks, equal=True)
    assert len({len(part) for part in split}) == 1
    out["equal"] = (ratio([sum(costs[g] for g in part) for part in split], ranks), time.perf_counter() - start)
    sampler = SeqlenBalancedSampler(n_samples_per_prompt=size, dp_size=ranks)
    partition = Lengths(runs)
    start = time.perf_counter()
    chosen = [
        sampler.sample(
            list(range(len(runs))), per_rank * size, "t", "p", dp_rank=rank, batch_index=0, partition=partition
        )[0]
        for rank in range(ranks)
    ]
    seconds = time.perf_counter() - start
    assert sorted(i for part in chosen for i in part) == list(range(len(runs)))
    out["transferqueue"] = (ratio([sum(runs[i] for i in part) for part in chosen], ranks), seconds)
    order = list(range(groups))
    rng.shuffle(order)
    out["random"] = (ratio([sum(costs[g] for g in order[r::ranks]) for r in range(ranks)], ranks), 0.0)
    out["ideal"] = (max(sum(costs) / ranks, max(costs)) / (sum(costs) / ranks), 0.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--groups-per-rank", type=int, default=8)
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    command = ("python bench/bench_rank_balance.py " + " ".join(sys.argv[1:])).strip()
    rng = random.Random(42)
    rows = []
    for size in GROUP_SIZES:
        for ranks in RANKS:
            found: dict[str, list[tuple[float, float]]] = {}
            for _ in range(args.trials):
                for way, value in one(rng, ranks, size, args.groups_per_rank).items():
                    found.setdefault(way, []).append(value)
            med = {way: statistics.median(r for r, _ in values) for way, values in found.items()}
            ms = {way: statistics.median(s for _, s in values) * 1e3 for way, values in found.items()}
            rows.append(
                f"| {size} | {ranks} | {ranks * args.groups_per_rank} | **{med['expbuf']:.4f}** | "
                f"**{med['equal']:.4f}** | {med['transferqueue']:.4f} | {med['random']:.3f} | {med['ideal']:.4f} | "
                f"{ms['expbuf']:.1f} / {ms['equal']:.1f} / {ms['transferqueue']:.1f} |"
            )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `{command}`  ",
            f"One process, load average {load} at the end; medians of {args.trials} steps a row, every way on the "
            "same groups. The slowest rank's tokens over the mean (1 is perfect); the ideal is the most even any "
            "split of whole groups could be.",
            "",
            "| runs a group | ranks | groups | expbuf | expbuf, equal | TransferQueue | random | ideal | ms a split, "
            "expbuf / equal / TransferQueue |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            "TransferQueue's sampler gives every rank as many groups (`equal_size=True`), as expbuf's `equal=True` "
            'does ("expbuf, equal": like with like); expbuf\'s default split does not, so a rank of a few long '
            "groups carries as many tokens as one of many short ones: a trainer that packs micro-batches by tokens "
            "wants that, one that steps through a fixed number of sequences a rank wants `equal`.",
            "",
        ]
    )
    print(section)
    write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
