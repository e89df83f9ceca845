"""Server-side cost of a push per experience: validating a TRXP payload (trxp.parse) and packing
each item as the store keeps it (Entry.of), in µs per experience, on one core.

    .venv/bin/python bench/bench_parse.py [--repeats 15]

Shapes: bench_reverb's 8 KB experiences (int32[1024] tokens, float32[1023] logprobs, 256 a
push) and 40 KB ones (64 a push), eight pushes each, encoded once with trxp.encode; and the
Trinity-RFT payloads of tests/fixtures/trxp (messages, info, metrics, multi-modal inputs).
Each figure is the median over the repeats of the time for all pushes of a shape, with the
fastest repeat in parentheses (on a busy machine the closer to the cost itself).
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

from expbuf.client import trxp  # noqa: E402
from expbuf.server.store import Entry  # noqa: E402

FIXTURES = HERE.parent / "tests" / "fixtures" / "trxp"


def timed(run: Callable[[], object], experiences: int, repeats: int) -> tuple[float, float]:
    """(median, fastest) µs per experience."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / experiences, min(times) * 1e6 / experiences


def measure(payloads: list[bytes], repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(parse, Entry.of), each (median, fastest) in µs per experience."""
    parsed = [trxp.parse(payload) for payload in payloads]
    count = sum(len(items) for items in parsed)
    parse_us = timed(lambda: [trxp.parse(payload) for payload in payloads], count, repeats)
    pack_us = timed(lambda: [Entry.of(item) for items in parsed for item in items], count, repeats)
    return parse_us, pack_us


def shown(median: float, fastest: float) -> str:
    return f"{median:.1f} ({fastest:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    shapes = {shape: [trxp.encode(push) for push in make_pushes(shape, 8)] for shape in ("8k", "40k")}
    shapes["trinity fixtures"] = [path.read_bytes() for path in sorted(FIXTURES.glob("*.trxp"))]
    print("| shape | parse µs/exp | Entry.of µs/exp | total µs/exp |")
    print("|---|---:|---:|---:|")
    for shape, payloads in shapes.items():
        (parse_med, parse_min), (pack_med, pack_min) = measure(payloads, args.repeats)
        total = shown(parse_med + pack_med, parse_min + pack_min)
        print(f"| {shape} | {shown(parse_med, parse_min)} | {shown(pack_med, pack_min)} | {total} |")


if __name__ == "__main__":
    main()
