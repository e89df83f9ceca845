"""What a start of `expbuf serve` costs: CPU (the server and every process it started, reaped) and
the time until it is ready, on an empty data directory, side by side with another tree's server.

    .venv/bin/python bench/bench_start.py [--rounds 8] [--before PYTHON] [--out bench/RESULTS.md]

Each round starts this tree's server (and, with `--before`, the one that PYTHON runs: another
tree's virtualenv), in turn, reads its log up to the line on its advantage worker (the last of a
start; torch is not loaded), stops it with SIGTERM and reaps it. The environment is this one's:
where PYTHONDONTWRITEBYTECODE is set, a tree whose bytecode was not written beforehand compiles
its modules at every start. Medians of the rounds.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results  # noqa: E402

HEADING = "## A server's start"


def start(python: str) -> tuple[float, float]:
    """CPU seconds of one start and stop, and seconds until the server was ready."""
    with tempfile.TemporaryDirectory(prefix="expbuf-start-") as data:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.monotonic()
        command = [python, "-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "0"]
        child = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        assert child.stderr is not None
        for line in child.stderr:
            if "advantage worker" in line:
                break
        else:
            raise RuntimeError(f"{python}: the server did not start")
        ready = time.monotonic() - began
        child.send_signal(signal.SIGTERM)
        child.communicate(timeout=60)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, ready


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--before", help="the Python of another tree's virtualenv, started beside this one")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"now": sys.executable, **({"before": args.before} if args.before else {})}
    load = os.getloadavg()
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        names = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
        for name in names:
            found[name].append(start(trees[name]))
    rows = []
    for name, runs in found.items():
        cpu = statistics.median(run[0] for run in runs)
        ready = statistics.median(run[1] for run in runs)
        rows.append(f"| {name} | {cpu:.2f} | {ready:.2f} |")
    bytecode = "set" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "not set"
    section = results.section(
        HEADING,
        "python bench/bench_start.py " + " ".join(sys.argv[1:]),
        f"{os.cpu_count()} CPUs, shared; load average {', '.join(f'{x:.2f}' for x in load)} at the start; "
        f"PYTHONDONTWRITEBYTECODE {bytecode}. `expbuf serve` on an empty directory, to its advantage "
        f"worker's line, then SIGTERM; medians of {args.rounds} rounds, the trees in turn.",
        ["tree", "CPU s (the server and its children)", "s to ready"],
        rows,
    )
    results.publish(section, HEADING, args.out)


if __name__ == "__main__":
    main()
