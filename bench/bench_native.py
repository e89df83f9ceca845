"""What the modules compiled with mypyc (client/native_build.py) save: each hot operation timed on the
compiled module and on the same source run as Python, side by side in one process, alternating
round by round; and `expbuf check` of one data directory run both ways (EXPBUF_PURE_PYTHON).

    .venv/bin/python bench/bench_native.py [--rounds 15] [--groups 250]

Operations: trxp.parse of bench_reverb's 8 KB and 40 KB pushes and of the Trinity-RFT payloads of
tests/fixtures/trxp (the server's parse of a push, and the open check's reading of each stored
payload); pack_item of each of their experiences (the server's canonical packing of a pushed
experience, the payload it stores); build of the 8 KB and 40 KB pushes' items (a client's encode of a push, less
reading its experiences). Figures are µs of this process's CPU per experience: the fastest round, then the
median, and the ratio of pure Python to compiled on the fastest rounds; `expbuf check` in
seconds of wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_open import fill  # noqa: E402
from bench_reverb import make_pushes  # noqa: E402

from expbuf.client import native, trxp  # noqa: E402
from expbuf.client.trxp.codec import build  # noqa: E402

FIXTURES = HERE.parent / "tests" / "fixtures" / "trxp"


def side_by_side(runs: dict[str, Callable[[], object]], count: int, rounds: int) -> dict[str, tuple[float, float]]:
    """(fastest, median) µs of CPU per unit of each run, the runs alternating round by round (CPU
    time: on a shared machine, the time the process waits for a core is not the operation's)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.process_time()
            run()
            times[name].append((time.process_time() - start) * 1e6 / count)
    return {name: (min(values), statistics.median(values)) for name, values in times.items()}


def row(operation: str, figures: dict[str, tuple[float, float]]) -> str:
    compiled, pure = figures["compiled"], figures["pure"]
    return (
        f"| {operation} | {compiled[0]:.2f} ({compiled[1]:.2f}) | {pure[0]:.2f} ({pure[1]:.2f}) "
        f"| {pure[0] / compiled[0]:.2f} |"
    )


def check_both_ways(groups: int, rounds: int) -> list[str]:
    """`expbuf check` of one directory, compiled and pure Python alternating: seconds."""
    expbuf = Path(sys.executable).parent / "expbuf"
    times: dict[str, list[float]] = {"compiled": [], "pure": []}
    with tempfile.TemporaryDirectory(prefix="expbuf-native-") as tmp:
        fill(Path(tmp), groups)
        for _ in range(rounds):
            for name, pure in (("compiled", "0"), ("pure", "1")):
                env = {**os.environ, native.PURE_PYTHON: pure}
                start = time.perf_counter()
                subprocess.run([str(expbuf), "check", "--data", tmp], env=env, check=True, capture_output=True)
                times[name].append(time.perf_counter() - start)
    compiled, pure = min(times["compiled"]), min(times["pure"])
    return [
        f"| expbuf check, {groups * 8} experiences (s) | {compiled:.2f} ({statistics.median(times['compiled']):.2f}) "
        f"| {pure:.2f} ({statistics.median(times['pure']):.2f}) | {pure / compiled:.2f} |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--groups", type=int, default=250, help="groups of 8 in the checked directory; 0 skips it")
    args = parser.parse_args()
    if not native.compiled("expbuf.client.trxp.codec.parse"):
        raise SystemExit("the compiled modules are not in use: run `make setup` (and unset EXPBUF_PURE_PYTHON)")
    parsers = {"compiled": trxp.parse, "pure": native.source_module("expbuf.client.trxp.codec.parse").parse}
    pure_build = native.source_module("expbuf.client.trxp.codec.build")
    shapes = {shape: [trxp.encode(push) for push in make_pushes(shape, 8)] for shape in ("8k", "40k")}
    shapes["trinity fixtures"] = [path.read_bytes() for path in sorted(FIXTURES.glob("*.trxp"))]
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    print("| operation | compiled µs: fastest (median) | pure Python µs | pure / compiled |")
    print("|---|---:|---:|---:|")
    for shape, payloads in shapes.items():
        count = sum(len(trxp.parse(payload)) for payload in payloads)
        runs = {
            name: (lambda parse=parse, payloads=payloads: [parse(payload) for payload in payloads])
            for name, parse in parsers.items()
        }
        print(row(f"parse, {shape}", side_by_side(runs, count, args.rounds)))
    for shape, payloads in shapes.items():
        items = [item for payload in payloads for item in trxp.parse(payload)]
        runs = {
            name: (lambda pack=pack, items=items: [pack(item) for item in items])
            for name, pack in (("compiled", build.pack_item), ("pure", pure_build.pack_item))
        }
        print(row(f"pack each experience, {shape}", side_by_side(runs, len(items), args.rounds)))
    for shape in ("8k", "40k"):
        pushes = [trxp.parse(payload) for payload in shapes[shape]]
        runs = {
            name: (lambda make=make, pushes=pushes: [make(push) for push in pushes])
            for name, make in (("compiled", build.build), ("pure", pure_build.build))
        }
        print(row(f"build a push's payload, {shape}", side_by_side(runs, sum(map(len, pushes)), args.rounds)))
    if args.groups:
        print("\n".join(check_both_ways(args.groups, max(3, args.rounds // 5))))
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")


if __name__ == "__main__":
    main()
