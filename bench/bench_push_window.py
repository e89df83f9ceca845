"""Pipelined pushes (issue 32): one pusher with window 1, 2, 4 and 8, side by side in one run.

    .venv/bin/python bench/bench_push_window.py [--rounds 3] [--before ../main/.venv/bin/python] [--shards 2]

One `expbuf serve` child on loopback, the client here; bench_reverb.py's shapes and tables: 8 KB
experiences, 256 per push, and 40 KB experiences, 64 per push, into tables with estimator none,
group_by none, durable acks (fsync). Each push is of Experience objects, so its encode is timed.
- `push()`: one call after another, each waiting for its ack (what bench_reverb.py measures).
- `pusher(window=K)`: the same pushes through one pusher, K in flight over one PushStream.
With `--before PYTHON`, a second server runs the tree that Python imports expbuf from (an earlier
checkout with its own virtualenv), the client being this tree's: in each round every way runs
against both servers back to back (which goes first alternates), so "to before" is the median of
the rounds' ratios of the two. With `--shards N`, N more servers of this tree take the same pushes
through `ShardedBufferClient.pusher` (group_by none: each push's experiences spread over the shards).
`--before-args` gives the earlier server flags of its own: `--before .venv/bin/python --before-args
"--push-stream-window 1"` compares this tree's server with itself storing each push of a stream
before it reads the next (its section is FLAGS_HEADING's).
Each round runs every way once, in rotating order, after the same warm-up; fresh ids each time.
Medians of the rounds; "ratio" is to `pusher(window=1)` of the same server(s).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
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

from expbuf.client import BufferClient, Experience  # noqa: E402
from expbuf.client.shards.blocking import ShardedBufferClient  # noqa: E402

HEADING = "## Pipelined pushes: a pusher's window (issue 32)"
FLAGS_HEADING = "## Pipelined pushes: this tree's server beside itself with other flags (issue 32)"
WINDOWS = (1, 2, 4, 8)


Way = Callable[[str, list[list[Experience]]], float]


def by_pusher(client: BufferClient | ShardedBufferClient, window: int) -> Way:
    def run(shape: str, pushes: list[list[Experience]]) -> float:
        start = time.perf_counter()
        with client.pusher(TABLE[shape], window=window) as pusher:
            futures = [pusher.push(exps) for exps in pushes]
        assert all(len(f.result().stored) == len(exps) for f, exps in zip(futures, pushes, strict=True))
        return sum(map(len, pushes)) / (time.perf_counter() - start)

    return run


def ways_of(side: ExpbufSide) -> dict[str, Way]:
    ways: dict[str, Way] = {"push()": side.push}
    return ways | {f"pusher(window={k})": by_pusher(side.client, k) for k in WINDOWS}


def rounds(ways: dict[tuple[str, str], Way], count: int) -> list[list[tuple[str, str]]]:
    """Each round's order: the ways rotated, each way's servers back to back, which first alternating."""
    names = list(dict.fromkeys(name for _, name in ways))
    order = []
    for r in range(count):
        turn = []
        for name in names[r % len(names) :] + names[: r % len(names)]:
            servers = [server for server, way in ways if way == name]
            turn += [(server, name) for server in (servers if r % 2 == 0 else servers[::-1])]
        order.append(turn)
    return order


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pushes-8k", type=int, default=48)
    parser.add_argument("--pushes-40k", type=int, default=48)
    parser.add_argument("--before", metavar="PYTHON", help="also run the server of the tree this Python imports")
    parser.add_argument("--before-args", default="", help="more flags of the earlier server, in one string")
    parser.add_argument("--shards", type=int, default=0, help="also push through a sharded pusher over N servers")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    load = os.getloadavg()[0]
    serial = itertools.count()
    servers = {"this tree": sys.executable} | ({"before": args.before} if args.before else {})
    sharded_name = f"{args.shards} shards"
    with tempfile.TemporaryDirectory() as tmp:
        flags = {"before": tuple(shlex.split(args.before_args))}
        sides = {name: ExpbufSide(str(Path(tmp) / name), py, flags.get(name, ())) for name, py in servers.items()}
        shards = [ExpbufSide(str(Path(tmp) / f"shard{n}")) for n in range(args.shards)]
        sharded = ShardedBufferClient([shard.server.target for shard in shards], timeout=120) if shards else None
        ways = {(server, name): run for server, side in sides.items() for name, run in ways_of(side).items()}
        if sharded is not None:
            ways |= {(sharded_name, f"pusher(window={k})"): by_pusher(sharded, k) for k in WINDOWS}
        figures: dict[tuple[str, str, str], list[float]] = {}
        try:
            for shape, count in (("8k", args.pushes_8k), ("40k", args.pushes_40k)):
                pushes = make_pushes(shape, count)
                for run in ways.values():  # warm-up: every way once
                    restamp(pushes, serial)
                    run(shape, pushes[:4])
                for turn in rounds(ways, args.rounds):
                    for server, name in turn:
                        restamp(pushes, serial)
                        figures.setdefault((shape, server, name), []).append(ways[server, name](shape, pushes))
                        print(shape, server, name, f"{figures[shape, server, name][-1]:.0f} exp/s", flush=True)
        finally:
            if sharded is not None:
                sharded.close()
            for side in (*sides.values(), *shards):
                side.stop()
    end_load = os.getloadavg()[0]
    medians = {key: statistics.median(values) for key, values in figures.items()}
    rows = []
    for shape in ("8k", "40k"):
        for server, name in ways:
            value, base = medians[shape, server, name], medians[shape, server, "pusher(window=1)"]
            row = f"| {shape} | {server} | `{name}` | {value:,.0f} | {value / base:.2f}"
            if args.before:
                paired = zip(figures[shape, server, name], figures[shape, "before", name], strict=True)
                row += f" | {statistics.median(a / b for a, b in paired):.2f}" if server == "this tree" else " |"
            rows.append(row + " |")
    options = (f" --before {args.before}" if args.before else "") + (f" --shards {args.shards}" if args.shards else "")
    options += f' --before-args "{args.before_args}"' if args.before_args else ""
    command = f"bench/bench_push_window.py --rounds {args.rounds}{options}"
    ratios = "ratio to `pusher(window=1)` of the same server(s)"
    header = "| size | server | how | exp/s | ratio |"
    if args.before:
        ratios += "; to before: the median of the rounds' ratios to the same way against the earlier tree's server"
        header += " to before |"
    heading = FLAGS_HEADING if args.before_args else HEADING
    section = (
        f"{heading}\n\n"
        f"Command: `.venv/bin/python {command}` (load average {load:.1f} at the start and {end_load:.1f} at the end, "
        "2 cores, shared).\n"
        f"One pusher, experiences per second, median of the rounds; {ratios}.\n\n"
        f"{header}\n{'| --- ' * header.count(' |')}|\n" + "\n".join(rows) + "\n\n"
    )
    write_section(Path(args.out), heading, section)
    print(section)


if __name__ == "__main__":
    main()
