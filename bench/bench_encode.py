"""The client's TRXP encoder, in µs per experience: trxp.encode and its two parts,
from_experience (reading and checking one experience) and build (the payload).

    .venv/bin/python bench/bench_encode.py [--rounds 15]
    .venv/bin/python bench/bench_encode.py --before DIR [--runs 8] [--rounds 15] [--out bench/RESULTS.md]

Shapes as bench/bench_reverb.py pushes them: 8 pushes of 256 8 KB experiences (int32[1024]
tokens, float32[1023] logprobs, a reward) and 8 pushes of 64 40 KB experiences. Each round
times every push once; the figures are medians over rounds, of wall time and of the thread's
CPU time (which a busy machine's other work changes less). Single-threaded, no server.

With `--before DIR` (another source tree with its own `.venv`, e.g. the main branch's), this
script runs in a process of DIR's venv (its expbuf is DIR's) and in one of this tree's, the two
alternating (which goes first swaps each run), `--runs` times; the section written to `--out`
gives the median over the runs of each tree's figures, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import Experience, trxp  # noqa: E402

PUSHES = 8
SHAPES = ("8k", "40k")
HEADING = "## The client's encode (issue 32)"
# What a run measures, each as (wall, CPU) µs per experience.
PARTS = ("encode", "from_experience", "build")


def per_experience(
    pushes: list[list[Experience]], run: Callable[[list[Experience]], object], rounds: int
) -> tuple[float, float]:
    """Medians over rounds of the wall and CPU µs per experience that `run` takes over all pushes."""
    count = sum(len(push) for push in pushes)
    wall, cpu = [], []
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for push in pushes:
            run(push)
        wall.append((time.perf_counter() - start) / count * 1e6)
        cpu.append((time.thread_time() - start_cpu) / count * 1e6)
    return statistics.median(wall), statistics.median(cpu)


def measure(rounds: int) -> dict[str, dict[str, tuple[float, float]]]:
    """shape -> part -> (wall, CPU) µs per experience."""
    out = {}
    for shape in SHAPES:
        pushes = make_pushes(shape, PUSHES)
        items = [[trxp.from_experience(exp) for exp in push] for push in pushes]
        per_experience(pushes, trxp.encode, 2)  # warm-up
        out[shape] = {
            "encode": per_experience(pushes, trxp.encode, rounds),
            "from_experience": per_experience(pushes, lambda push: [trxp.from_experience(exp) for exp in push], rounds),
            "build": per_experience(items, trxp.build, rounds),
        }
    return out


def run(python: Path, rounds: int) -> dict[str, dict[str, tuple[float, float]]]:
    """One run of this script in a process of `python`, whose expbuf is the tree measured."""
    out = subprocess.run(
        [str(python), __file__, "--rounds", str(rounds), "--json"], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


def load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def compare(before: Path, runs: int, rounds: int, out: Path) -> None:
    """This script under both trees' venvs, alternating; their medians side by side into `out`."""
    pythons = {"before": before.resolve() / ".venv" / "bin" / "python", "after": Path(sys.executable)}
    figures: dict[str, list[dict[str, dict[str, tuple[float, float]]]]] = {label: [] for label in pythons}
    start = load()
    for index in range(runs):
        for label in list(pythons)[:: 1 if index % 2 == 0 else -1]:
            figures[label].append(run(pythons[label], rounds))
            print(label, json.dumps(figures[label][-1]), flush=True)
    end = load()

    def median(label: str, shape: str, part: str, clock: int) -> float:
        return statistics.median(one[shape][part][clock] for one in figures[label])

    lines = [
        HEADING,
        "",
        f"Command: `.venv/bin/python bench/bench_encode.py --before DIR --runs {runs} --rounds {rounds}` "
        "(DIR: the tree before this change, with its own venv)  ",
        f"{os.cpu_count()} cores shared with other work, load average {start} at the start and {end} at the end "
        "(`uptime`). The same script in a process of each tree's venv, alternating, which goes first swapped each "
        f"run; medians over the {runs} runs of each, each run's figure the median of its {rounds} rounds. µs per "
        "experience, the thread's CPU time (wall time in parentheses, which the machine's other work moves more); "
        "`from_experience` reads and checks one experience alone, `build` composes the payload of items already read.",
        "",
        "| shape | tree | encode | from_experience | build |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for shape in SHAPES:
        for label in pythons:
            cells = " | ".join(
                f"{median(label, shape, part, 1):.1f} ({median(label, shape, part, 0):.1f})" for part in PARTS
            )
            lines.append(f"| {shape} | {label} | {cells} |")
    ratios = ", ".join(
        f"{shape} **{median('after', shape, 'encode', 1) / median('before', shape, 'encode', 1):.2f}** "
        f"({median('after', shape, 'encode', 0) / median('before', shape, 'encode', 0):.2f})"
        for shape in SHAPES
    )
    lines += ["", f"encode, after / before, CPU (wall): {ratios}.", ""]
    write_section(out, HEADING, "\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--before", type=Path, help="another source tree (with its .venv) measured beside this one")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.before is not None:
        compare(args.before, args.runs, args.rounds, args.out)
        return
    figures = measure(args.rounds)
    if args.json:
        print(json.dumps(figures))
        return
    print("| shape | encode | from_experience | build |")
    print("|---|---|---|---|")
    for shape, parts in figures.items():
        print(
            f"| {shape} | "
            + " | ".join(f"{parts[part][1]:.1f} µs CPU ({parts[part][0]:.1f} wall)" for part in PARTS)
            + " |"
        )


if __name__ == "__main__":
    main()
