"""What the garbage collector costs a trainer's decode, and what `gc.freeze()` gives back (issue 32).

    .venv/bin/python bench/bench_gc_decode.py [--rounds 5] [--batches 60] [--out bench/RESULTS.md]

One sampled reply of 256 x 8 KB experiences (bench_reverb's shape, built in this process: no
server, the decode alone) is decoded `--batches` times with every experience's tensors read, as
`Batch.experiences` does for a trainer, in this process's CPU time per experience:
- with the collector as it runs by default, in a process holding torch and the bench's pushes
  (about 280 k tracked objects, fewer than a trainer with its model and framework loaded);
- the same after `gc.freeze()` (what the process holds is left out of every collection);
- the same with the collector off (the floor).
The time each generation's collections took is read from `gc.callbacks` in the default run.
Medians of the rounds, the three in alternating order within each round.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes, uptime  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import trxp  # noqa: E402
from expbuf.client.trxp.codec.convert import decode_reply  # noqa: E402

HEADING = "## A trainer's garbage collector and the decode (issue 32)"


class Collections:
    """Seconds spent in collections, by generation, while installed in gc.callbacks."""

    def __init__(self) -> None:
        self.spent = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.spent[info["generation"]] += time.perf_counter() - self._start


def decode_us(payload: bytes, batches: int) -> float:
    """CPU µs per experience of decoding `payload` `batches` times, each experience's tensors read."""
    start = time.process_time()
    count = 0
    for _ in range(batches):
        for exp in decode_reply(payload):
            count += exp.tokens.numel() > 0
    return (time.process_time() - start) / count * 1e6


def frozen(run: Callable[[], float]) -> float:
    gc.freeze()
    try:
        return run()
    finally:
        gc.unfreeze()


def collector_off(run: Callable[[], float]) -> float:
    gc.disable()
    try:
        return run()
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = ("python bench/bench_gc_decode.py " + " ".join(sys.argv[1:])).strip()
    load = uptime()
    held = make_pushes("8k", 64) + make_pushes("40k", 64)  # what bench_reverb's client holds
    payload = trxp.join([trxp.pack_item(item) for item in trxp.parse(trxp.encode(held[0]))])
    tracked = len(gc.get_objects())

    def run() -> float:
        return decode_us(payload, args.batches)

    kinds: dict[str, Callable[[], float]] = {
        "default": run,
        "frozen": lambda: frozen(run),
        "off": lambda: collector_off(run),
    }
    results: dict[str, list[float]] = {name: [] for name in kinds}
    watch = Collections()
    for r in range(args.rounds):
        for name in list(kinds)[r % 3 :] + list(kinds)[: r % 3]:
            if name == "default":
                gc.callbacks.append(watch)
            try:
                results[name].append(kinds[name]())
            finally:
                if name == "default":
                    gc.callbacks.remove(watch)
    med = {name: statistics.median(values) for name, values in results.items()}
    per_exp = [s / (args.rounds * args.batches * 256) * 1e6 for s in watch.spent]
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `{command}`  ",
            f"One process, {tracked:,} tracked objects before the decode (torch and the bench's pushes; "
            f"load average {load} at the start). A reply of 256 x 8 KB experiences decoded {args.batches} "
            f"times a round, each experience's tensors read; CPU µs per experience, medians of {args.rounds} "
            "rounds in alternating order.",
            "",
            "| collector | decode, µs per experience | against the default |",
            "| --- | ---: | ---: |",
            f"| on, as by default | {med['default']:.1f} | 1.00 |",
            f"| on, after `gc.freeze()` | {med['frozen']:.1f} | {med['frozen'] / med['default']:.2f} |",
            f"| off (the floor) | {med['off']:.1f} | {med['off'] / med['default']:.2f} |",
            "",
            "Collections during the default runs, µs per experience decoded, by generation: "
            f"young {per_exp[0]:.1f}, middle {per_exp[1]:.1f}, full {per_exp[2]:.1f}. A decoded batch's "
            "objects live through the young collections its own decode brings on, so they reach the oldest "
            "generation, and every few batches that triggers a full collection, which walks everything the "
            "process holds.",
            "",
        ]
    )
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
