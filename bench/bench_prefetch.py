"""Decode that overlaps training (issue 32): a trainer's loop with `prefetch` 0 (off), 1 (the
default) and 2, side by side in one run.

    .venv/bin/python bench/bench_prefetch.py [--rounds 3] [--batches 10] [--out bench/RESULTS.md]

One `expbuf serve` child on loopback (bench_reverb.py's ExpbufSide), the trainer here. Batches of
256 experiences of bench_reverb.py's shapes (8 KB and 40 KB), consume delivery, window 2 (the
default). Each batch's tensors are read (`batch.experiences`), then a step runs:
- `sleep`: time.sleep, standing for a GPU step (the GIL is free meanwhile);
- `torch`: CPU work in torch matmuls on one thread, which release the GIL as a kernel launch does.
Both steps last about as long as a batch takes to arrive, decoded, with prefetch off (the median
wait, measured in the warm-up, per shape), where overlapping the two can gain the most. Each
round runs every prefetch once per step, in rotating order, after the same warm-up; fresh ids
for every stream, pushed before it, untimed. A trainer's loop runs on, so each is timed from
`sample()` to the end of its last step, the stream's end not included. Batches per second,
median of the rounds; each ratio is to prefetch 0 in the same round, the median of the rounds'
ratios (paired, so that the machine's drift between rounds cancels); and the median time the caller
waited for a batch (`next()` and `.experiences`), what prefetch takes off its path.
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

import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import BATCH, PER_PUSH, TABLE, ExpbufSide, make_pushes, restamp  # noqa: E402
from results import write_section  # noqa: E402

HEADING = "## Decode that overlaps training: prefetch (issue 32)"
PREFETCH = (0, 1, 2)
MATRIX = 256  # the torch step's matmul size


def torch_step(seconds: float) -> Callable[[], None]:
    """Matmuls on one thread, as many as take about `seconds` here."""
    a = torch.randn(MATRIX, MATRIX)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    each = (time.perf_counter() - start) / 20
    count = max(1, round(seconds / each))

    def step() -> None:
        for _ in range(count):
            a @ a

    return step


def sleep_step(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)


def trainer(
    side: ExpbufSide, shape: str, pushes: list, serial: itertools.count, prefetch: int, step: Callable[[], None] | None
) -> tuple[float, float]:
    """One trainer's loop over a consume stream of the batches in `pushes` (pushed before it
    under fresh ids, untimed): batches per second up to the end of its last step (a trainer's
    loop runs on; the stream's end is not timed), and the median time the caller waited for a
    batch and its tensors."""
    restamp(pushes, serial)
    for exps in pushes:
        side.client.push(exps, table=TABLE[shape])
    batches = sum(map(len, pushes)) // BATCH
    waits = []
    stream = side.client.sample(TABLE[shape], batch_size=BATCH, delivery="consume", timeout=60, prefetch=prefetch)
    start = time.perf_counter()
    for _ in range(batches):
        asked = time.perf_counter()
        assert len(next(stream).experiences) >= BATCH
        waits.append(time.perf_counter() - asked)
        if step is not None:
            step()
    seconds = time.perf_counter() - start
    stream.close()  # the batches sent ahead go back: the next stream takes them first
    return batches / seconds, statistics.median(waits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    serial = itertools.count()
    rates: dict[tuple[str, str, int], list[float]] = {}
    waits: dict[tuple[str, str, int], list[float]] = {}
    fetch: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        side = ExpbufSide(str(Path(tmp) / "data"))
        try:
            for shape in ("8k", "40k"):
                pushes = make_pushes(shape, args.batches * BATCH // PER_PUSH[shape])
                # the warm-up, and the steps' length: how long a batch takes to arrive, decoded, with prefetch off
                fetch[shape] = statistics.median(trainer(side, shape, pushes, serial, 0, None)[1] for _ in range(3))
                steps = {"sleep": sleep_step(fetch[shape]), "torch": torch_step(fetch[shape])}
                for step in steps.values():  # the same warm-up for every prefetch
                    for prefetch in PREFETCH:
                        trainer(side, shape, pushes, serial, prefetch, step)
                for r in range(args.rounds):
                    for name, step in steps.items():
                        for prefetch in PREFETCH[r % 3 :] + PREFETCH[: r % 3]:
                            rate, wait = trainer(side, shape, pushes, serial, prefetch, step)
                            rates.setdefault((shape, name, prefetch), []).append(rate)
                            waits.setdefault((shape, name, prefetch), []).append(wait)
                            print(
                                shape,
                                name,
                                f"prefetch={prefetch}",
                                f"{rate:.2f} batches/s",
                                f"wait {wait * 1e3:.1f} ms",
                            )
        finally:
            side.stop()
    rows = []
    for shape in ("8k", "40k"):
        for name in ("sleep", "torch"):
            base = rates[shape, name, 0]
            cells = []
            for prefetch in PREFETCH:
                value = statistics.median(rates[shape, name, prefetch])
                wait = statistics.median(waits[shape, name, prefetch]) * 1e3
                paired = statistics.median(a / b for a, b in zip(rates[shape, name, prefetch], base, strict=True))
                ratio = "" if prefetch == 0 else f" (**{paired:.2f}**)"
                cells.append(f"{value:.2f}{ratio}, waits {wait:.1f} ms")
            rows.append(f"| {shape} | {name}, {fetch[shape] * 1e3:.0f} ms | " + " | ".join(cells) + " |")
    command = f"bench/bench_prefetch.py --rounds {args.rounds} --batches {args.batches}"
    section = (
        f"{HEADING}\n\n"
        f"Command: `.venv/bin/python {command}` (load average {load:.1f} at the start, 2 cores, shared).\n"
        f"A trainer's loop over a consume stream: {args.batches} batches of {BATCH}, the tensors of each read, then "
        "a step as long as a batch takes to arrive, decoded, with prefetch off (median, measured in the warm-up). "
        "Batches per second up to the end of the last step, median of the rounds; in brackets the median of "
        "the rounds' ratios to prefetch 0 in the same round; then the median time the caller waited for a batch "
        "and its tensors.\n\n"
        "| size | step | prefetch 0 | prefetch 1 (default) | prefetch 2 |\n| --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        + "\n\n"
    )
    write_section(Path(args.out), HEADING, section)
    print(section)


if __name__ == "__main__":
    main()
