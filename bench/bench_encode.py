"""The client's TRXP encoder, in µs per experience: trxp.encode and its two parts,
from_experience (reading and checking each experience) and build (the payload).

    .venv/bin/python bench/bench_encode.py [--rounds 15]

Shapes as bench/bench_reverb.py pushes them: 8 pushes of 256 8 KB experiences (int32[1024]
tokens, float32[1023] logprobs, a reward) and 8 pushes of 64 40 KB experiences. Each round
times every push once; the figures are medians over rounds. Single-threaded, no server.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes  # noqa: E402

from expbuf.client import Experience, trxp  # noqa: E402

PUSHES = 8


def per_experience(pushes: list[list[Experience]], run: Callable[[list[Experience]], object], rounds: int) -> float:
    """Median over rounds of the µs per experience that `run` takes over all pushes."""
    count = sum(len(push) for push in pushes)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for push in pushes:
            run(push)
        times.append((time.perf_counter() - start) / count * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print("| shape | encode | from_experience | build |")
    print("|---|---|---|---|")
    for shape in ("8k", "40k"):
        pushes = make_pushes(shape, PUSHES)
        items = [[trxp.from_experience(exp) for exp in push] for push in pushes]
        per_experience(pushes, trxp.encode, 2)  # warm-up
        encode = per_experience(pushes, trxp.encode, args.rounds)
        convert = per_experience(pushes, lambda push: [trxp.from_experience(exp) for exp in push], args.rounds)
        build = per_experience(items, trxp.build, args.rounds)
        print(f"| {shape} | {encode:.1f} µs | {convert:.1f} µs | {build:.1f} µs |")


if __name__ == "__main__":
    main()
