"""A consume stream of 8 KB experiences against a raw gRPC stream of the same bytes (issue 41).

    .venv/bin/python bench/bench_stream_8k.py [--rounds 3] [--pushes 32] [--out bench/RESULTS.md]

An `expbuf serve` child and a gRPC server that stores nothing (raw_grpc_server.py), each in its
own process. Each round fills a table with `--pushes` pushes of 256 x 8 KB experiences
(bench_reverb's shape, each its own group) before each of three drains, consume delivery in
batches of 256: read as a trainer reads it, decoded into experiences (`Batch.experiences`, the
client's defaults); as columns of tokens and log-probs (`fields=`); and as bytes by a raw gRPC
client of the Sample stream (each batch confirmed as it arrives, nothing decoded: the server's
part alone). Beside them, the raw server streams messages of a batch's bytes, RAW_READS times as
many (a longer, steadier measure: a channel's start is a good part of a short stream). The order
of the four alternates from round to round; MB/s of payload bytes, medians of the rounds, and
each process's CPU per experience. The fills are measured too (issue 64's "push of 8 KB experiences
against raw durable LMDB puts, one synced commit a push"): each push of pre-encoded payloads made
one after the other by one client, its durable ack awaited, against raw LMDB (py-lmdb, fsync on
every commit) putting the same experiences as the server stores them, one commit a push, in the
same round.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import cpu_seconds, make_pushes, restamp  # noqa: E402
from bench_service import BATCH, Proc, bench_raw_lmdb, bench_raw_stream, drain, raw_consume, serving  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402
from expbuf.client.rpc.sample_spec import SampleSpec  # noqa: E402

HEADING = "## A consume stream of 8 KB experiences against a raw gRPC stream (issue 41)"
TABLE = "stream"
WAYS = ("decoded", "columns", "bytes", "raw stream")
PUSHES = ("push", "raw lmdb")  # the fills, and raw durable LMDB puts of the same experiences
# The raw stream sends this many times a drain's batches, so that it too runs for a good part of
# a second, past its channel's connection and first messages.
RAW_READS = 8


def decoded(target: str, batches: int) -> int:
    """Experiences consumed and decoded, as a trainer reads them."""
    with BufferClient(target, timeout=120) as client:
        return drain(client, TABLE, batches)


def columns(target: str, batches: int) -> int:
    """Experiences consumed as columns of their tokens and log-probs."""
    with BufferClient(target, timeout=120) as client:
        return drain(client, TABLE, batches, fields=["tokens", "logprobs"])


def as_bytes(target: str, batches: int) -> int:
    """Experiences consumed by a raw client of the Sample stream: each reply's bytes, confirmed."""
    received, _ = raw_consume(target, SampleSpec(TABLE, batch_size=BATCH, delivery="consume", max_batches=batches))
    return received * BATCH


def measure(rounds: int, pushes: int) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    """MB/s of each way by round, and its CPU µs per experience (client, server) by round; and a
    batch's bytes."""
    batch = make_pushes("8k", 1)[0]
    batch_bytes = len(trxp.join([trxp.pack_item(item) for item in trxp.parse(trxp.encode(batch))]))
    rates: dict[str, list[float]] = {way: [] for way in (*WAYS, *PUSHES)}
    cpu: dict[str, list[float]] = {f"{way} {side}": [] for way in (*WAYS, "push") for side in ("client", "server")}
    serial = itertools.count()
    with serving() as server:
        raw = Proc(str(HERE / "raw_grpc_server.py"))
        try:
            with BufferClient(server.target, timeout=120) as client:
                client.create_table(TABLE, estimator="none", group_by="none")
            server.wait_for("advantage worker")  # torch loaded: the server's steady state
            drains: dict[str, Callable[[str, int], int]] = {"decoded": decoded, "columns": columns, "bytes": as_bytes}
            for round_ in range(rounds):
                for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
                    pid = raw.proc.pid if way == "raw stream" else server.proc.pid
                    if way != "raw stream":
                        made = make_pushes("8k", pushes)
                        restamp(made, serial)
                        encoded = [trxp.encode(p) for p in made]
                        filled = (time.process_time(), cpu_seconds(server.proc.pid), time.perf_counter())
                        with BufferClient(server.target, timeout=120) as client:
                            for payload in encoded:
                                client.push(payload, table=TABLE)
                        pushed = (time.process_time(), cpu_seconds(server.proc.pid), time.perf_counter())
                        count = pushes * BATCH
                        rates["push"].append(sum(map(len, encoded)) / (pushed[2] - filled[2]) / 1e6)
                        cpu["push client"].append((pushed[0] - filled[0]) / count * 1e6)
                        cpu["push server"].append((pushed[1] - filled[1]) / count * 1e6)
                        with tempfile.TemporaryDirectory() as lmdb_dir:
                            rates["raw lmdb"].append(bench_raw_lmdb(Path(lmdb_dir), encoded))
                    before = (time.process_time(), cpu_seconds(pid), time.perf_counter())
                    if way == "raw stream":
                        bench_raw_stream(raw.target, batch_bytes, pushes * RAW_READS)
                        count = pushes * RAW_READS * BATCH
                    else:
                        count = drains[way](server.target, pushes)
                        assert count == pushes * BATCH, (way, count)
                    after = (time.process_time(), cpu_seconds(pid), time.perf_counter())
                    rates[way].append(count / BATCH * batch_bytes / (after[2] - before[2]) / 1e6)
                    cpu[f"{way} client"].append((after[0] - before[0]) / count * 1e6)
                    cpu[f"{way} server"].append((after[1] - before[1]) / count * 1e6)
        finally:
            raw.stop()
    return rates, cpu, batch_bytes


def report(command: str, load: tuple[str, str], rates: dict, cpu: dict, batch_bytes: int) -> str:
    raw = statistics.median(rates["raw stream"])
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores (load average {load[0]} at the start, {load[1]} at the end, `uptime`); "
        f"batches of {BATCH} experiences of 8 KB ({batch_bytes / 1e6:.1f} MB a batch), consume delivery; medians of "
        f"{len(rates['raw stream'])} rounds; CPU µs per experience of the client (this process, gRPC's threads "
        "included) and of the server (the expbuf server, or the raw one).",
        "",
        "| stream | MB/s | / raw stream | goal | client CPU µs | server CPU µs |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
    ]
    labels = {
        "decoded": ("consume, decoded into experiences (the client's defaults)", "≥ 0.7"),
        "columns": ("consume, columns of tokens and log-probs (`fields=`)", "≥ 0.7"),
        "bytes": ("consume, each reply's bytes read by a raw gRPC client, confirmed", ""),
        "raw stream": ("raw gRPC stream of the same bytes, no storage", ""),
    }
    for way in WAYS:
        label, goal = labels[way]
        rate = statistics.median(rates[way])
        lines.append(
            f"| {label} | {rate:,.0f} | **{rate / raw:.2f}** | {goal} | "
            f"{statistics.median(cpu[f'{way} client']):.1f} | {statistics.median(cpu[f'{way} server']):.1f} |"
        )
    push, lmdb = statistics.median(rates["push"]), statistics.median(rates["raw lmdb"])
    lines += [
        "",
        f"The fills before the drains: {BATCH} experiences of 8 KB a push, pre-encoded, one client pushing one "
        "after the other (each durable ack awaited), against raw LMDB putting the same experiences as the "
        "server stores them (py-lmdb, one synced commit a push) in the same round; MB/s of payload bytes.",
        "",
        "| push | MB/s | / raw durable LMDB puts | goal | client CPU µs | server CPU µs |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
        f"| `push()`, one pusher | {push:,.0f} | **{push / lmdb:.2f}** | ≥ 1.5 | "
        f"{statistics.median(cpu['push client']):.1f} | {statistics.median(cpu['push server']):.1f} |",
        f"| raw durable LMDB puts of the same experiences | {lmdb:,.0f} | | | | |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pushes", type=int, default=32, help="pushes of 256 x 8 KB before each drain")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = ("python bench/bench_stream_8k.py " + " ".join(sys.argv[1:])).strip()
    start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    rates, cpu, batch_bytes = measure(args.rounds, args.pushes)
    end = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    section = report(command, (start, end), rates, cpu, batch_bytes)
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
