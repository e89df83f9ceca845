"""Pipelined pushes (issue 32): one pusher with window 1, 2, 4 and 8, side by side in one run.

    .venv/bin/python bench/bench_push_window.py [--rounds 3] [--before ../main/.venv/bin/python] [--out FILE]

One `expbuf serve` child on loopback, the client here; bench_reverb.py's shapes and tables: 8 KB
experiences, 256 per push, and 40 KB experiences, 64 per push, into tables with estimator none,
group_by none, durable acks (fsync). Each push is of Experience objects, so its encode is timed.
- `push()`: one call after another, each waiting for its ack (what bench_reverb.py measures).
- `pusher(window=K)`: the same pushes through one pusher, K in flight over one PushStream.
With `--before PYTHON`, a second server runs the tree that Python imports expbuf from (an earlier
checkout with its own virtualenv), and every way runs against both servers in each round, the
client being this tree's: the figures of the two servers are side by side, from the same run.
Each round runs every way once, in rotating order, after the same warm-up; fresh ids each time.
Medians of the rounds; ratios are to `pusher(window=1)` of the same server, and to the same way
against the earlier server.
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


def ways_of(side: ExpbufSide) -> dict[str, Callable[[str, list[list[Experience]]], float]]:
    ways: dict[str, Callable[[str, list[list[Experience]]], float]] = {"push()": side.push}
    return ways | {f"pusher(window={k})": by_pusher(side, k) for k in WINDOWS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pushes-8k", type=int, default=48)
    parser.add_argument("--pushes-40k", type=int, default=48)
    parser.add_argument("--before", metavar="PYTHON", help="also run the server of the tree this Python imports")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    load = os.getloadavg()[0]
    serial = itertools.count()
    servers = {"this tree": sys.executable} | ({"before": args.before} if args.before else {})
    with tempfile.TemporaryDirectory() as tmp:
        sides = {
            name: ExpbufSide(str(Path(tmp) / f"data-{n}"), python) for n, (name, python) in enumerate(servers.items())
        }
        ways = {(server, name): run for server, side in sides.items() for name, run in ways_of(side).items()}
        figures: dict[tuple[str, str, str], list[float]] = {}
        try:
            for shape, count in (("8k", args.pushes_8k), ("40k", args.pushes_40k)):
                pushes = make_pushes(shape, count)
                for run in ways.values():  # warm-up: every way once
                    restamp(pushes, serial)
                    run(shape, pushes[:4])
                keys = list(ways)
                for r in range(args.rounds):
                    for server, name in keys[r % len(keys) :] + keys[: r % len(keys)]:
                        restamp(pushes, serial)
                        figures.setdefault((shape, server, name), []).append(ways[server, name](shape, pushes))
                        print(shape, server, name, f"{figures[shape, server, name][-1]:.0f} exp/s", flush=True)
        finally:
            for side in sides.values():
                side.stop()
    medians = {key: statistics.median(values) for key, values in figures.items()}
    rows = []
    for shape in ("8k", "40k"):
        for server, name in ways:
            value = medians[shape, server, name]
            base = medians[shape, server, "pusher(window=1)"]
            against = f" | {value / medians[shape, 'before', name]:.2f}" if args.before else ""
            rows.append(f"| {shape} | {server} | `{name}` | {value:,.0f} | {value / base:.2f}{against} |")
    command = f"bench/bench_push_window.py --rounds {args.rounds}" + (f" --before {args.before}" if args.before else "")
    ratios = "ratio to `pusher(window=1)` of the same server"
    header = "| size | server | how | exp/s | ratio |"
    if args.before:
        ratios += ", and to the same way against the server of the earlier tree, in the same run"
        header += " to before |"
    section = (
        f"{HEADING}\n\n"
        f"Command: `.venv/bin/python {command}` (load average {load:.1f} at the start, 2 cores, shared).\n"
        f"One pusher, experiences per second, median of the rounds; {ratios}.\n\n"
        f"{header}\n{'| --- ' * header.count(' |')}|\n" + "\n".join(rows) + "\n\n"
    )
    write_section(Path(args.out), HEADING, section)
    print(section)


if __name__ == "__main__":
    main()
