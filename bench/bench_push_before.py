"""Pushes to this tree's server beside another tree's, side by side in one run: what a change to
the server's push path buys (issue 41).

    git worktree add /tmp/before REV
    .venv/bin/python bench/bench_push_before.py --before /tmp/before [--shapes "8 KB,40 KB"] [--rounds 6]

Two `expbuf serve` children on loopback, the same client (this tree's) and the same pushes
(bench_column_push's shapes, experiences and columns), rounds alternating which server goes
first. The other tree's server runs this venv's Python on that tree's sources, through a package
of links named as installed (expbuf/server -> DIR/server, ...) put first on PYTHONPATH; its
compiled codec is this tree's where it has none built and its sources are the same (else its
pure-Python one). Experiences a second and the server's CPU µs an experience, medians of the
rounds, and the median of the rounds' paired ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_column_push import SHAPES, Push  # noqa: E402
from bench_decode import server_cpu  # noqa: E402
from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient  # noqa: E402

HEADING = "## A push's cost: this tree's server beside another's (issue 41)"
ARMS = ("experiences", "columns")
LINKS = {"server": "server", "client": "client", "proto": "proto/expbuf", "ray": "server/ray"}


def codec_folder(tree: Path) -> Path:
    """Where `tree` keeps the compiled codec's sources: client/trxp/codec/, or client/trxp/ in a
    tree from before the codec's room."""
    room = tree / "client/trxp/codec"
    return room if room.is_dir() else tree / "client/trxp"


def package(tree: Path, into: Path) -> Path:
    """A directory holding `expbuf` as links to `tree`'s folders, to put first on PYTHONPATH; the
    compiled codec of this tree copied in where `tree` has none and compiled the same sources."""
    theirs, here = codec_folder(tree), codec_folder(ROOT)
    native, ours = theirs / "_native", here / "_native"
    if not native.exists() and (ours / "manifest.json").exists():
        sources = json.loads((ours / "manifest.json").read_text())["sources"]
        if all((theirs / f"{name}.py").read_bytes() == (here / f"{name}.py").read_bytes()
               for name in sources):  # fmt: skip
            shutil.copytree(ours, native)
    root = into / "expbuf"
    root.mkdir(parents=True)
    for name, folder in LINKS.items():
        (root / name).symlink_to(tree / folder)
    return into


@contextlib.contextmanager
def side_by_side(before: Path) -> Iterator[dict[str, tuple[str, int]]]:
    """Two `expbuf serve` children on fresh directories, `before`'s and this tree's: their targets and
    pids by side, stopped after the block."""
    serve = ("-m", "expbuf.server.cli", "serve", "--port", "0", "--metrics-port", "-1", "--data")
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(package(before.resolve(), Path(tmp) / "before"))}
        servers = {"before": Proc(*serve, f"{tmp}/b", env=env), "after": Proc(*serve, f"{tmp}/a")}
        try:
            yield {side: (proc.target, proc.proc.pid) for side, proc in servers.items()}
        finally:
            for proc in servers.values():
                proc.stop()


def measure(targets: dict[str, tuple[str, int]], rounds: int, shapes: list[str]) -> dict[str, dict]:
    results: dict[str, dict] = {}
    serial = 0
    clients = {side: BufferClient(target, timeout=300) for side, (target, _) in targets.items()}
    for shape in shapes:
        per, count, make = SHAPES[shape]
        gen = torch.Generator().manual_seed(0)
        pushes = [Push([make(gen) for _ in range(per)]) for _ in range(count)]
        figures = results.setdefault(shape, {})
        for r in range(-1, rounds):  # round -1 warms up
            for side in ("before", "after") if r % 2 else ("after", "before"):
                client, pid = clients[side], targets[side][1]
                for arm in ARMS:
                    client.create_table("push", estimator="none", group_by="none")
                    start, cpu = time.perf_counter(), server_cpu(pid)
                    for push in pushes:
                        serial += 1
                        client.push(push.payload(arm, serial), table="push")
                    wall, cpu = time.perf_counter() - start, server_cpu(pid) - cpu
                    client.drop_table("push")
                    if r >= 0:
                        figures.setdefault((side, arm), []).append((per * count / wall, cpu / (per * count) * 1e6))
        print(shape, {k: statistics.median(x[0] for x in v) for k, v in figures.items()}, file=sys.stderr)
    for client in clients.values():
        client.close()
    return results


def report(command: str, load: str, results: dict[str, dict]) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores shared with other work: load average {load} at the start "
        "(uptime). One push at a time, each durable before the next; the same client and pushes for "
        "both servers, rounds alternating which goes first; medians of the rounds.",
        "",
        "| experience | pushed as | before exp/s | after exp/s | after / before (paired) | server µs, before / after |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for shape, figures in results.items():
        for arm in ARMS:
            before, after = figures[("before", arm)], figures[("after", arm)]
            paired = statistics.median(a[0] / b[0] for a, b in zip(after, before, strict=True))
            rb, ra = (statistics.median(x[0] for x in side) for side in (before, after))
            cb, ca = (statistics.median(x[1] for x in side) for side in (before, after))
            lines.append(f"| {shape} | {arm} | {rb:,.0f} | {ra:,.0f} | **{paired:.2f}** | {cb:.1f} / {ca:.1f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="another source tree (a git worktree) of expbuf")
    parser.add_argument("--shapes", default="8 KB,40 KB")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--note", default="", help="a line on what the before tree lacks, for the section")
    args = parser.parse_args()
    command = f'python bench/bench_push_before.py --before BEFORE --shapes "{args.shapes}" --rounds {args.rounds}'
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    with side_by_side(Path(args.before)) as targets:
        results = measure(targets, args.rounds, args.shapes.split(","))
    section = report(command, load, results)
    if args.note:
        section += args.note + "\n"
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
