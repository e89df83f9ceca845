"""A trainer's batches as columns against the same batches decoded as experiences, side by side
in one run (issue 41).

    .venv/bin/python bench/bench_columns.py [--rounds 5] [--out bench/RESULTS.md]

One `expbuf serve` child on loopback; the shapes of bench/bench_decode.py: 8 KB experiences
(int32[1024] tokens, float32[1023] log-probs) and 40 KB ones, 8,192 a stream, batches of 256,
consume delivery, estimator none. After one stream of each to warm up, each round runs, in
alternating order, one consume stream of:
- experiences: `Batch.experiences`, a trainer's read today (the client decodes each batch before
  it confirms it);
- columns: `sample(..., fields=["tokens", "logprobs"])`, the batch as one tensor per field
  (`Batch.columns`), also decoded before it is confirmed.
Experiences per second, and the client's and the server's CPU µs per experience (the server's
from /proc, in clock ticks: about 1.2 µs an experience); medians of the rounds, ratios of
medians from the same run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_decode import BATCH, SERIAL, SHAPES, server_cpu  # noqa: E402
from bench_reverb import make_pushes, restamp  # noqa: E402
from bench_service import drain, main_on_a_server  # noqa: E402

from expbuf.client import BufferClient  # noqa: E402

HEADING = "## Columnar batches against decoded experiences (issue 41)"
FIELDS = ["tokens", "logprobs"]
STREAMS: dict[str, dict[str, Any]] = {"experiences": {}, "columns": {"fields": FIELDS}}
PUSHES = {"8 KB": 32, "40 KB": 128}  # 8,192 experiences a stream


def stream(client: BufferClient, server: int, table: str, batches: int, name: str) -> tuple[float, float, float]:
    """Experiences per second of one consume stream read as `name` says, and the client's and
    the server's CPU µs per experience."""
    start, cpu, served = time.perf_counter(), time.process_time(), server_cpu(server)
    got = drain(client, table, batches, **STREAMS[name])
    assert got == batches * BATCH, got
    wall, cpu, served = time.perf_counter() - start, time.process_time() - cpu, server_cpu(server) - served
    return got / wall, cpu / got * 1e6, served / got * 1e6


def measure(target: str, server: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {}
    with BufferClient(target, timeout=120) as client:
        for shape, (kind, _) in SHAPES.items():
            table = f"columns{kind}"
            client.create_table(table, estimator="none", group_by="none")
            pushes = make_pushes(kind, PUSHES[shape])
            batches = sum(map(len, pushes)) // BATCH
            rates = results.setdefault(shape, {})
            names = list(STREAMS)
            for r in range(-1, rounds):  # round -1 warms up
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    restamp(pushes, SERIAL)
                    for exps in pushes:
                        client.push(exps, table=table)
                    rate, cpu, served = stream(client, server, table, batches, name)
                    if r >= 0:
                        rates.setdefault(f"stream {name}", []).append(rate)
                        rates.setdefault(f"client {name}", []).append(cpu)
                        rates.setdefault(f"server {name}", []).append(served)
            print(shape, {k: round(statistics.median(v), 1) for k, v in rates.items()}, file=sys.stderr)
    return results


def report(command: str, load: str, results: dict[str, dict[str, list[float]]]) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores shared with other work: load average {load} at the start "
        "(uptime). Batches of 256, consume delivery; columns of tokens and log-probs; medians of the "
        "rounds, ratios from the same run.",
        "",
        "| experiences | stream, experiences | stream, columns | columns / experiences |",
        "| --- | --- | --- | --- |",
    ]
    for shape, rates in results.items():
        med = {k: statistics.median(v) for k, v in rates.items()}
        exps, cols = med["stream experiences"], med["stream columns"]
        lines.append(f"| {shape} | {exps:,.0f} exp/s | {cols:,.0f} exp/s | **{cols / exps:.2f}** |")
    lines += [
        "",
        "CPU µs per experience in those streams (medians), the client's and the server's:",
        "",
        "| experiences | client: experiences / columns | server: experiences / columns |",
        "| --- | --- | --- |",
    ]
    for shape, rates in results.items():
        med = {k: statistics.median(v) for k, v in rates.items()}
        client = " / ".join(f"{med[f'client {name}']:.1f}" for name in STREAMS)
        server = " / ".join(f"{med[f'server {name}']:.1f}" for name in STREAMS)
        lines.append(f"| {shape} | {client} | {server} |")
    lines += [
        "",
        "The server's CPU per experience is about the same either way: its take and its confirm cost it,",
        "not the reply; where it bounds the stream (8 KB) columns gain little in experiences a second.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    main_on_a_server("bench_columns.py", HEADING, 5, measure, report)


if __name__ == "__main__":
    main()
