"""Pipelined pushes (issue 32): one pusher with window 1, 2, 4 and 8, side by side in one run.

    .venv/bin/python bench/bench_push_window.py [--rounds 3] [--out bench/RESULTS.md]

One `expbuf serve` child on loopback, the client here; bench_reverb.py's shapes and tables: 8 KB
experiences, 256 per push, and 40 KB experiences, 64 per push, into tables with estimator none,
group_by none, durable acks (fsync). Each push is of Experience objects, so its encode is timed.
- `push()`: one call after another, each waiting for its ack (what bench_reverb.py measures).
- `pusher(window=K)`: the same pushes through one pusher, K in flight over one PushStream.
Each round runs every way once, in rotating order, after the same warm-up; fresh ids each time.
Medians of the rounds; ratios are to `pusher(window=1)`, from the same run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import TABLE, ExpbufSide, make_pushes, restamp  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import Experience  # noqa: E402

HEADING = "## Pipelined pushes: a pusher's window (issue 32)"
WINDOWS = (1, 2, 4, 8)


def by_pusher(side: ExpbufSide, window: int) -> Callable[[str, list[list[Experience]]], float]:
    def run(shape: str, pushes: list[list[Experience]]) -> float:
        start = time.perf_counter()
        with side.client.pusher(TABLE[shape], window=window) as pusher:
            futures = [pusher.push(exps) for exps in pushes]
        assert all(len(f.result().stored) == len(exps) for f, exps in zip(futures, pushes, strict=True))
        return sum(map(len, pushes)) / (time.perf_counter() - start)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pushes-8k", type=int, default=48)
    parser.add_argument("--pushes-40k", type=int, default=48)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    load = os.getloadavg()[0]
    serial = itertools.count()
    with tempfile.TemporaryDirectory() as tmp:
        side = ExpbufSide(str(Path(tmp) / "data"))
        ways: dict[str, Callable[[str, list[list[Experience]]], float]] = {"push()": side.push}
        ways |= {f"pusher(window={k})": by_pusher(side, k) for k in WINDOWS}
        figures: dict[tuple[str, str], list[float]] = {}
        try:
            for shape, count in (("8k", args.pushes_8k), ("40k", args.pushes_40k)):
                pushes = make_pushes(shape, count)
                for run in ways.values():  # warm-up: every way once
                    restamp(pushes, serial)
                    run(shape, pushes[:4])
                names = list(ways)
                for r in range(args.rounds):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        restamp(pushes, serial)
                        figures.setdefault((shape, name), []).append(ways[name](shape, pushes))
                        print(shape, name, f"{figures[shape, name][-1]:.0f} exp/s", flush=True)
        finally:
            side.stop()
    rows = []
    for shape in ("8k", "40k"):
        base = statistics.median(figures[shape, "pusher(window=1)"])
        for name in ways:
            value = statistics.median(figures[shape, name])
            rows.append(f"| {shape} | `{name}` | {value:,.0f} | {value / base:.2f} |")
    command = f"bench/bench_push_window.py --rounds {args.rounds}"
    section = (
        f"{HEADING}\n\n"
        f"Command: `.venv/bin/python {command}` (load average {load:.1f} at the start, 2 cores, shared).\n"
        "One pusher, experiences per second, median of the rounds; ratio to `pusher(window=1)` of the same run.\n\n"
        "| size | how | exp/s | ratio |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n\n"
    )
    write_section(Path(args.out), HEADING, section)
    print(section)


if __name__ == "__main__":
    main()
