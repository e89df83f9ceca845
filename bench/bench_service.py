"""Service benchmark: expbuf over gRPC against raw LMDB and a raw gRPC server, side by side.

    .venv/bin/python bench/bench_service.py [--payloads-per-pusher 8] [--out bench/RESULTS.md]

Each server runs in its own process on a loopback port; clients run here.
- Push: 8 concurrent pushers, 40 KB experiences, 64 per payload, durable acks; against
  raw durable LMDB puts of the same bytes (one writer, fsync per 64) and a raw gRPC push
  of the same payloads to a server that stores nothing. Each pusher with `push()` (one push
  at a time), then (the thread-pool server) each with `pusher(window=4)`, a rollout worker's
  pipelined pushes, into a table of its own.
- Sample: whole groups of 8, batches of 256 experiences; consume (each batch confirmed in
  the stream, no Ack RPC) and lease with an Ack RPC per batch, in alternating rounds;
  against a raw gRPC server stream of messages of the same size. The client's defaults:
  each batch decoded before it is confirmed, one ahead of the caller (`prefetch=1`).
- Latency: p50/p99 of a one-experience push with a durable ack, and of the first batch of
  a sample when data is ready.
Both server flavours are measured: the thread-pool server (`expbuf serve`) and a
grpc.aio server over the same store (bench/aio_server.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
import lmdb

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
R = TypeVar("R")  # a benchmark's results
sys.path.insert(0, str(HERE))

from bench_store import experience  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402
from expbuf.client.client import SampleRequests  # noqa: E402
from expbuf.client.rpc.sample_reply import Parts, sample_method  # noqa: E402
from expbuf.client.rpc.sample_spec import SampleSpec  # noqa: E402

PUSHERS, PER_PAYLOAD, GROUP, BATCH = 8, 64, 8, 256
TABLE = "bench"  # estimator none: bench_advantages.py measures ingest with advantages
WINDOW = 4  # the pipelined pushers' window (the pusher's default)
MAX = 256 << 20


class Proc:
    """A server process; waits for its 'listening on' line, and keeps its log."""

    def __init__(self, *argv: str, env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        self.proc = subprocess.Popen([python, *argv], stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        for line in self.proc.stderr:
            self.log.append(line)
            match = re.search(r"listening on ([\d.]+:\d+)", line)
            if match:
                self.target = match.group(1)
                break
        else:
            raise RuntimeError(f"{argv} did not start")
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        """Until a line of the log holds `text` (an `expbuf serve` logs 'advantage worker' once torch
        has loaded, on a thread of its own: its steady state)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.log):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"no {text!r} in the server's log:\n" + "".join(self.log))
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@contextlib.contextmanager
def serving() -> Iterator[Proc]:
    """One `expbuf serve` child on a fresh data directory (no metrics), stopped after the block."""
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        server = Proc(
            "-m", "expbuf.server.cli", "serve", "--data", f"{tmp}/data", "--port", "0", "--metrics-port", "-1"
        )
        try:
            yield server
        finally:
            server.stop()


def main_on_a_server(
    script: str,
    heading: str,
    rounds: int,
    measure: Callable[[str, int, int], R],
    report: Callable[[str, str, R], str],
) -> None:
    """A benchmark's main against one `expbuf serve` child: `--rounds` (default `rounds`) and
    `--out`; `measure(target, server pid, rounds)` on a fresh server, and its `report(command,
    load average, results)` printed and written as the section `heading` of `--out`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = (f"python bench/{script} " + " ".join(sys.argv[1:])).strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    with serving() as server:
        results = measure(server.target, server.proc.pid, args.rounds)
    section = report(command, load, results)
    print(section)
    write_section(Path(args.out), heading, section)


def make_payloads(count: int, tokens: int = 5000) -> list[bytes]:
    payloads = []
    for p in range(count):
        exps = [experience(p, t, r, tokens) for t in range(PER_PAYLOAD // GROUP) for r in range(GROUP)]
        payloads.append(trxp.encode(exps))
    return payloads


def run_threads(work: list, target) -> float:
    threads = [threading.Thread(target=target, args=(w,)) for w in work]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def bench_push(target: str, payloads: list[bytes], table: str = TABLE) -> float:
    shares = [payloads[i::PUSHERS] for i in range(PUSHERS)]

    def push(share: list[bytes]) -> None:
        with BufferClient(target, timeout=120) as c:
            for payload in share:
                c.push(payload, table=table)

    return sum(map(len, payloads)) / run_threads(shares, push) / 1e6


def bench_pusher(target: str, payloads: list[bytes]) -> float:
    """The same pushes, each pusher through `pusher(window=WINDOW)`, into a table of its own:
    MB/s up to the last pusher's close (every push durable)."""
    shares = [payloads[i::PUSHERS] for i in range(PUSHERS)]
    table = f"{TABLE}-w{WINDOW}"
    with BufferClient(target) as c:
        c.create_table(table, estimator="none", exist_ok=True)

    def push(share: list[bytes]) -> None:
        with BufferClient(target, timeout=120) as c, c.pusher(table, window=WINDOW) as pusher:
            futures = [pusher.push(payload) for payload in share]
        for future in futures:
            future.result()

    return sum(map(len, payloads)) / run_threads(shares, push) / 1e6


def bench_raw_push(target: str, payloads: list[bytes]) -> float:
    shares = [payloads[i::PUSHERS] for i in range(PUSHERS)]
    options = [("grpc.max_send_message_length", MAX), ("grpc.max_receive_message_length", MAX)]

    def push(share: list[bytes]) -> None:
        with grpc.insecure_channel(target, options=options) as channel:
            call = channel.unary_unary("/bench.Raw/Push")
            for payload in share:
                call(payload, timeout=120)

    return sum(map(len, payloads)) / run_threads(shares, push) / 1e6


def bench_raw_lmdb(path: Path, payloads: list[bytes]) -> float:
    env = lmdb.open(str(path), map_size=8 << 30, sync=True, metasync=True, readahead=False)
    blobs = [[(item.uid.encode(), trxp.pack_item(item)) for item in trxp.parse(p)] for p in payloads]
    start = time.perf_counter()
    for batch in blobs:
        with env.begin(write=True) as txn:
            for key, value in batch:
                txn.put(key, value)
    elapsed = time.perf_counter() - start
    env.close()
    return sum(map(len, payloads)) / elapsed / 1e6


def consume_batches(target: str, batches: int) -> tuple[int, float]:
    """Consume delivery: each batch leaves the buffer once the stream confirms it, no Ack RPC.
    Returns (payload bytes, seconds)."""
    with BufferClient(target, timeout=120) as c:
        total = 0
        start = time.perf_counter()
        for batch in c.sample(TABLE, num_groups=BATCH // GROUP, delivery="consume", max_batches=batches, timeout=60):
            total += len(batch.payload)
        return total, time.perf_counter() - start


def lease_batches(target: str, batches: int) -> tuple[int, float]:
    """Lease delivery with an Ack RPC per batch. Returns (payload bytes, seconds)."""
    with BufferClient(target, timeout=120) as c:
        total = 0
        start = time.perf_counter()
        for batch in c.sample(TABLE, num_groups=BATCH // GROUP, delivery="lease", max_batches=batches, timeout=60):
            total += len(batch.payload)
            batch.ack()
        return total, time.perf_counter() - start


def raw_consume_batches(target: str, batches: int) -> tuple[int, float]:
    """Consume as a raw gRPC client reads it, from the pipelined pushers' table: each reply's
    payload bytes (a batch larger than a part put together from its parts), each batch confirmed
    on the stream as it arrives, nothing decoded (the server's part alone). Returns (payload
    bytes, seconds)."""
    spec = SampleSpec(f"{TABLE}-w{WINDOW}", num_groups=BATCH // GROUP, delivery="consume", max_batches=batches)
    start = time.perf_counter()
    _, total = raw_consume(target, spec)
    return total, time.perf_counter() - start


def raw_consume(target: str, spec: SampleSpec) -> tuple[int, int]:
    """The batches of a Sample stream of `spec` read as a raw gRPC client reads them (each reply's
    payload bytes, confirmed as it arrives, nothing decoded): how many, and their payload bytes."""
    requests = SampleRequests(spec.request(MAX))
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", MAX)]) as channel:
        total, received, parts = 0, 0, Parts()
        for reply in sample_method(channel)(requests, timeout=120):
            whole = parts.add(reply)
            if whole is None:  # more parts of this batch to come
                continue
            received += 1
            total += len(whole.payload)
            requests.confirm(received)
        requests.close()
    return received, total


def drain(client: BufferClient, table: str, batches: int, *, fields: Sequence[str] = (), prefetch: int = 1) -> int:
    """How many experiences `batches` consume batches of BATCH from `table` held, each batch read as
    a trainer reads it: decoded into experiences, or with `fields` as those columns."""
    got = 0
    for batch in client.sample(
        table, batch_size=BATCH, delivery="consume", max_batches=batches, timeout=60, prefetch=prefetch,
        fields=list(fields) or None,
    ):  # fmt: skip
        got += int(batch.columns[fields[0]].offsets.numel()) - 1 if fields else len(batch.experiences)
    return got


def bench_sample(target: str, batches: int, raw: bool) -> dict[str, float]:
    """MB/s of consume and of lease + ack, in alternating rounds (consume, lease, lease, consume)
    so that neither gets the fresher or the fuller buffer; with `raw`, consume read as bytes
    over a raw stream too, first and last."""
    runs = {"consume": consume_batches, "lease": lease_batches, "raw consume": raw_consume_batches}
    order = ("consume", "lease", "lease", "consume")
    if raw:
        order = ("raw consume", *order, "raw consume")
    spent = {name: [0, 0.0] for name in order}
    for name in order:
        size, seconds = runs[name](target, batches // 4)
        spent[name][0] += size
        spent[name][1] += seconds
    return {name: size / seconds / 1e6 for name, (size, seconds) in spent.items()}


def bench_raw_stream(target: str, size: int, batches: int) -> float:
    options = [("grpc.max_receive_message_length", MAX)]
    with grpc.insecure_channel(target, options=options) as channel:
        call = channel.unary_stream("/bench.Raw/Stream")
        start = time.perf_counter()
        total = sum(len(m) for m in call(f"{batches},{size}".encode(), timeout=120))
        return total / (time.perf_counter() - start) / 1e6


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_latency(target: str, reps: int) -> dict[str, float]:
    one = [trxp.encode([experience(900_000 + i, 0, 0)]) for i in range(reps)]
    groups = [trxp.encode([experience(800_000 + i, 0, r, 256) for r in range(GROUP)]) for i in range(reps)]
    with BufferClient(target, timeout=60) as c:
        push_t = []
        for payload in one:
            start = time.perf_counter()
            c.push(payload, table=TABLE)
            push_t.append(time.perf_counter() - start)
        next(
            c.sample(TABLE, batch_size=reps, max_batches=1, timeout=10, delivery="consume")
        )  # drain the single experiences
        for payload in groups:
            c.push(payload, table=TABLE)
        first_t = []
        for _ in range(reps):
            start = time.perf_counter()
            next(c.sample(TABLE, num_groups=1, delivery="lease", max_batches=1)).ack()
            first_t.append(time.perf_counter() - start)
    ms = 1e3
    return {
        "push_p50": percentile(push_t, 0.5) * ms,
        "push_p99": percentile(push_t, 0.99) * ms,
        "first_p50": percentile(first_t, 0.5) * ms,
        "first_p99": percentile(first_t, 0.99) * ms,
    }


def measure_server(kind: str, data: Path, payloads: list[bytes], reps: int) -> dict[str, float]:
    argv = (
        ["-m", "expbuf.server.cli", "serve", "--data", str(data), "--port", "0", "--metrics-port", "0"]
        if kind == "sync"
        else [str(HERE / "aio_server.py"), str(data)]
    )
    server = Proc(*argv)
    try:
        if kind == "sync":
            with BufferClient(server.target) as c:
                c.create_table(TABLE, estimator="none", exist_ok=True)
            server.wait_for("advantage worker")  # torch loads after the server listens: its steady state
        push = bench_push(server.target, payloads)
        pipelined = bench_pusher(server.target, payloads) if kind == "sync" else float("nan")  # no PushStream in aio
        sample = bench_sample(server.target, len(payloads) * PER_PAYLOAD // BATCH, raw=kind == "sync")
        latency = bench_latency(server.target, reps)
    finally:
        server.stop()
    result = {"push": push, "pusher": pipelined, **sample, **latency}
    print(kind, result, file=sys.stderr)
    return result


def report(command: str, runs: dict[str, dict], raw: dict[str, float], load: tuple[str, str]) -> str:
    s, a = runs["sync"], runs["aio"]
    mb = raw["batch_bytes"] / 1e6
    lines = [
        "## Service over gRPC (issue 3)",
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores (load average {load[0]} at the start, {load[1]} at the end, `uptime`); "
        "servers in their own processes, clients in the benchmark's; "
        "MB/s of TRXP payload bytes. Ratios are expbuf / baseline, measured in the same run. "
        f"Pushes of pre-encoded payloads, each pusher's durable before its next (`push()`), or up to {WINDOW} "
        f"in flight (`pusher(window={WINDOW})`, timed to its close). Samples with the client's defaults: each "
        "batch decoded into tensors before it is confirmed, one batch ahead of the caller (`prefetch=1`); "
        "and, from the pipelined pushers' table, read as a raw gRPC client reads the Sample stream (each "
        "reply's payload bytes, confirmed as it arrives, not decoded). Measured once the server's torch has "
        "loaded (it loads after the server listens).",
        "",
        "| measure | thread-pool server (`expbuf serve`) | grpc.aio server | baseline | ratio (thread pool) | goal |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| push, 8 pushers, 64 x 40 KB per payload, durable | {s['push']:.0f} MB/s | {a['push']:.0f} MB/s | "
        f"raw durable LMDB puts {raw['lmdb']:.0f} MB/s | **{s['push'] / raw['lmdb']:.2f}** | ≥ 0.6 |",
        f"| the same | | | raw gRPC push, no storage {raw['grpc_push']:.0f} MB/s | "
        f"{s['push'] / raw['grpc_push']:.2f} | |",
        f"| the same, each pusher `pusher(window={WINDOW})` | {s['pusher']:.0f} MB/s | | "
        f"raw durable LMDB puts {raw['lmdb']:.0f} MB/s | **{s['pusher'] / raw['lmdb']:.2f}** | ≥ 0.6 |",
        f"| sample, groups of 8, {BATCH} per batch ({mb:.1f} MB), consume (no Ack RPC) | "
        f"{s['consume']:.0f} MB/s | "
        f"{a['consume']:.0f} MB/s | raw gRPC stream {raw['grpc_stream']:.0f} MB/s | "
        f"**{s['consume'] / raw['grpc_stream']:.2f}** | ≥ 0.6 |",
        f"| the same, lease + an Ack RPC per batch | {s['lease']:.0f} MB/s | {a['lease']:.0f} MB/s | "
        f"raw gRPC stream {raw['grpc_stream']:.0f} MB/s | **{s['lease'] / raw['grpc_stream']:.2f}** | ≥ 0.6 |",
        f"| the same, consume read as bytes by a raw gRPC client (confirmed, not decoded) | "
        f"{s['raw consume']:.0f} MB/s | | raw gRPC stream {raw['grpc_stream']:.0f} MB/s | "
        f"{s['raw consume'] / raw['grpc_stream']:.2f} | |",
        f"| one-experience push (40 KB), durable ack: p50 / p99 | {s['push_p50']:.2f} / {s['push_p99']:.2f} ms | "
        f"{a['push_p50']:.2f} / {a['push_p99']:.2f} ms | | | p99 < 10 ms |",
        f"| first batch of a sample, data ready (one group): p50 / p99 | {s['first_p50']:.2f} / "
        f"{s['first_p99']:.2f} ms | {a['first_p50']:.2f} / {a['first_p99']:.2f} ms | | | |",
        "",
    ]
    return "\n".join(lines)


def uptime() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--payloads-per-pusher", type=int, default=8)
    parser.add_argument("--latency-reps", type=int, default=200)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = ("python bench/bench_service.py " + " ".join(sys.argv[1:])).strip()
    start = uptime()
    payloads = make_payloads(PUSHERS * args.payloads_per_pusher)
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        raw_server = Proc(str(HERE / "raw_grpc_server.py"))
        try:
            raw = {"grpc_push": bench_raw_push(raw_server.target, payloads)}
            size = len(trxp.join([trxp.pack_item(i) for p in payloads[:4] for i in trxp.parse(p)]))
            raw["batch_bytes"] = size
            raw["grpc_stream"] = bench_raw_stream(raw_server.target, size, len(payloads) * PER_PAYLOAD // BATCH // 2)
        finally:
            raw_server.stop()
        raw["lmdb"] = bench_raw_lmdb(Path(tmp) / "raw", payloads)
        print("raw", raw, file=sys.stderr)
        runs = {kind: measure_server(kind, Path(tmp) / kind, payloads, args.latency_reps) for kind in ("sync", "aio")}
    section = report(command, runs, raw, (start, uptime()))
    print(section)
    write_section(Path(args.out), "## Service over gRPC (issue 3)", section)


if __name__ == "__main__":
    main()
