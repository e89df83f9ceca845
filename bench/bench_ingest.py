"""Ingest off the GIL: push throughput with validation and packing in the server process
and in 1 or 2 worker processes (`--ingest-processes`), side by side in one run.

    .venv/bin/python bench/bench_ingest.py [--rounds 3] [--out bench/RESULTS.md]

8 pushers, durable acks, three shapes: 64 x 40 KB experiences per push (bytes-bound),
256 x 8 KB (int32[1024] tokens + float32[1024] logprobs; per-experience work), and 8 x 8 KB
(a rollout worker's group per push; 32 times as many pushes). Each round starts one server per
setting, in alternating order, on fresh data directories. `--shape` runs one shape only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import PUSHERS, TABLE, Proc, bench_push, make_payloads  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402

SETTINGS = (0, 1, 2)


def small_payloads(count: int, per: int = 256) -> list[bytes]:
    """8 KB experiences: int32[1024] tokens and float32[1024] logprobs."""
    return [
        trxp.encode(
            Experience(
                eid=EID(batch=p, task=i // 8, run=i % 8),
                tokens=torch.zeros(1024, dtype=torch.int32),
                prompt_length=1,
                logprobs=torch.zeros(1023),
                reward=1.0,
            )
            for i in range(per)
        )
        for p in range(count)
    ]


WARM_UP = "warm-up"
WARM_UP_SECONDS = 3.0  # for the ingest processes the warm-up's pushes started to be ready


def measure(processes: int, payloads: list[bytes]) -> float:
    with tempfile.TemporaryDirectory() as data:
        server = Proc(
            "-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1",
            "--ingest-processes", str(processes),
        )  # fmt: skip
        try:
            with BufferClient(server.target) as client:
                client.create_table(TABLE, estimator="none", group_by="none")
                client.create_table(WARM_UP, estimator="none", group_by="none")
            if processes:  # the pushes that overlap first start the processes: not timed
                bench_push(server.target, payloads[:PUSHERS], table=WARM_UP)
                time.sleep(WARM_UP_SECONDS)
            return bench_push(server.target, payloads)
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--payloads", type=int, default=32)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--shape", help="run only this shape (its figures are printed, not written)")
    args = parser.parse_args()
    shapes = {
        "64 x 40 KB": lambda: make_payloads(args.payloads),
        "256 x 8 KB": lambda: small_payloads(args.payloads),
        "8 x 8 KB": lambda: small_payloads(32 * args.payloads, per=8),
    }
    shapes = {name: make() for name, make in shapes.items() if args.shape in (None, name)}
    results: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        order = SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]
        for shape, payloads in shapes.items():
            for processes in order:
                results.setdefault((shape, processes), []).append(measure(processes, payloads))
                print(shape, processes, f"{results[(shape, processes)][-1]:.1f} MB/s", flush=True)
    rows = []
    for shape, payloads in shapes.items():
        base = statistics.median(results[(shape, 0)])
        per_push = len(trxp.parse(payloads[0]))
        for processes in SETTINGS:
            mbps = statistics.median(results[(shape, processes)])
            size = sum(map(len, payloads)) / len(payloads) / per_push
            rows.append(
                f"| {shape} | {processes} | {mbps:.1f} MB/s ({mbps * 1e6 / size:,.0f} exp/s) | {mbps / base:.2f} |"
            )
    body = (
        "\n".join(
            [
                "## Ingest off the GIL (issue 10)",
                "",
                f"Command: `python bench/bench_ingest.py --rounds {args.rounds} --payloads {args.payloads}`  ",
                f"Machine: {os.cpu_count()} CPU threads; 8 pushers; medians of {args.rounds} alternating rounds.",
                "",
                "| push of | ingest processes | throughput | ratio to 0 |",
                "| --- | --- | --- | --- |",
                *rows,
            ]
        )
        + "\n"
    )
    if args.shape is None:
        write_section(Path(args.out), "## Ingest off the GIL (issue 10)", body)
    print(body)


if __name__ == "__main__":
    main()
