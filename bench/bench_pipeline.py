"""Pipelined sampling and zero-copy decode (issue 22), side by side in one run.

    .venv/bin/python bench/bench_pipeline.py [--rounds 3] [--out bench/RESULTS.md]

One `expbuf serve` child on loopback, the client here. Batches of 256 experiences in whole
groups of 8, consume delivery (each batch confirmed in the stream), 8 KB and 40 KB
experiences. Before each timed stream the table is refilled with exactly the batches it takes
(the push is not timed).
- Window: the same stream with `window=1` (one batch ahead, a round trip per batch, the
  behaviour before issue 22), 2 (the default) and 4, in rotating order within each round;
  payload bytes only, and decoded into tensors (`batch.experiences`) as a trainer reads them.
- Decode: the same sampled payloads decoded by the copying decode (a tensor copied out of
  the payload on its own, as before issue 22) and by `trxp.decode` (views over one gathered
  buffer), alternating, in CPU time.
Medians of the rounds; ratios are to window 1 / to the copying decode, from the same run.
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

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import Proc  # noqa: E402
from bench_store import experience  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402

GROUP, BATCH = 8, 256
WINDOWS = (1, 2, 4)
SHAPES = {"8 KB": (1024, 16), "40 KB": (5000, 6)}  # tokens per experience, batches per stream
HEADING = "## Pipelined sampling and zero-copy decode (issue 22)"


def fill(client: BufferClient, table: str, tokens: int, batches: int, serial: list[int]) -> None:
    """Push `batches` batches' worth of new groups (new batch numbers, so never duplicates)."""
    for _ in range(batches * BATCH // 64):
        serial[0] += 1
        exps = [experience(serial[0], t, r, tokens) for t in range(64 // GROUP) for r in range(GROUP)]
        client.push(trxp.encode(exps), table=table)


def stream(client: BufferClient, table: str, batches: int, window: int, decode: bool) -> float:
    """MB/s of payload bytes over one stream of `batches` batches."""
    total = 0
    start = time.perf_counter()
    for batch in client.sample(
        table, num_groups=BATCH // GROUP, max_batches=batches, window=window, timeout=60, delivery="consume"
    ):
        total += len(batch.payload)
        if decode:
            assert len(batch.experiences) == BATCH
    return total / (time.perf_counter() - start) / 1e6


def copying_decode(payload: bytes) -> list:
    """The decode before issue 22: every tensor copied out of the immutable payload on its own."""
    return [trxp.to_experience(item) for item in trxp.parse(payload)]


def decode_rate(payloads: list[bytes], decode) -> float:
    """MB/s of payload per second of this process's CPU time (steadier than wall time on a
    loaded machine; the decode runs on one thread)."""
    start = time.process_time()
    for payload in payloads:
        decode(payload)
    return sum(map(len, payloads)) / (time.process_time() - start) / 1e6


def measure(target: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {}
    serial = [0]
    with BufferClient(target, timeout=120) as client:
        for shape, (tokens, batches) in SHAPES.items():
            table = f"bench{tokens}"
            client.create_table(table, estimator="none", group_size=GROUP, exist_ok=True)
            rates = results.setdefault(shape, {})
            for r in range(rounds):
                order = WINDOWS[r % len(WINDOWS) :] + WINDOWS[: r % len(WINDOWS)]
                for decode in (False, True):
                    for window in order:
                        fill(client, table, tokens, batches, serial)
                        key = f"{'tensors' if decode else 'bytes'} w{window}"
                        rates.setdefault(key, []).append(stream(client, table, batches, window, decode))
            fill(client, table, tokens, batches, serial)
            payloads = [
                b.payload
                for b in client.sample(table, num_groups=BATCH // GROUP, max_batches=batches, delivery="consume")
            ]
            for _ in range(rounds):
                for name, fn in (("copying", copying_decode), ("views", trxp.decode)):
                    rates.setdefault(f"decode {name}", []).append(decode_rate(payloads, fn))
            print(shape, {k: round(statistics.median(v), 1) for k, v in rates.items()}, file=sys.stderr)
    return results


def report(command: str, load: str, results: dict[str, dict[str, list[float]]]) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores shared with other work: load average {load} at the start "
        "(uptime). Consume delivery, batches of 256 in groups of 8; MB/s of TRXP payload bytes, "
        "medians of the rounds; ratios from the same run.",
        "",
        "| experiences | read as | window 1 | window 2 | window 4 | 2 / 1 | 4 / 1 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for shape, rates in results.items():
        med = {k: statistics.median(v) for k, v in rates.items()}
        for kind in ("bytes", "tensors"):
            one, two, four = (med[f"{kind} w{w}"] for w in WINDOWS)
            lines.append(
                f"| {shape} | {kind} | {one:.0f} | {two:.0f} | {four:.0f} | **{two / one:.2f}** | {four / one:.2f} |"
            )
    lines += [
        "",
        "Decode of the same sampled batches, MB/s of payload per CPU second:",
        "",
        "| experiences | copying decode (before) | views over one gathered buffer (now) | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for shape, rates in results.items():
        before, after = statistics.median(rates["decode copying"]), statistics.median(rates["decode views"])
        lines.append(f"| {shape} | {before:.0f} MB/s | {after:.0f} MB/s | **{after / before:.2f}** |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = ("python bench/bench_pipeline.py " + " ".join(sys.argv[1:])).strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", tmp, "--port", "0", "--metrics-port", "0")
        try:
            results = measure(server.target, args.rounds)
        finally:
            server.stop()
    section = report(command, load, results)
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
