"""Scale-out benchmark: durable push throughput with 1, 2 and 3 shards, as ratios to one shard.

    .venv/bin/python bench/bench_shards.py [--rounds 3] [--payloads-per-pusher 4] [--out bench/RESULTS.md]

Three `expbuf serve` processes run on loopback, each with its own data directory; the
pushers run here through one ShardedBufferClient over the first 1, 2 or 3 of them. Each
payload carries 8 groups of 8 experiences of about 40 KB, so a sharded push splits it by
group. Rounds alternate the shard counts after a warm-up round, and the medians are reported. The client's own
cost per push (parsing the payload and building one part per shard) is timed apart, on one
thread, for the projection to many nodes.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_store import experience  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402
from expbuf.client.shards.blocking import ShardedBufferClient  # noqa: E402

PUSHERS, PER_PAYLOAD, GROUP = 8, 64, 8
SHARDS = (1, 2, 3)


def start(data: Path, name: str) -> tuple[subprocess.Popen, str]:
    argv = ["-m", "expbuf.server.cli", "serve", "--data", str(data), "--port", "0", "--metrics-port", "-1"]
    proc = subprocess.Popen([sys.executable, *argv, "--shard", name], stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        match = re.search(r"listening on ([\d.]+:\d+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, match.group(1)
    raise RuntimeError(f"shard {name} did not start")


def make_payloads(count: int, round_: int) -> list[bytes]:
    """`count` payloads of 8 groups of 8; batch ids differ per round so that nothing is a duplicate."""
    payloads = []
    for p in range(count):
        batch = round_ * 100_000 + p
        exps = [experience(batch, t, r) for t in range(PER_PAYLOAD // GROUP) for r in range(GROUP)]
        payloads.append(trxp.encode(exps))
    return payloads


def push_all(client: ShardedBufferClient | BufferClient, payloads: list[bytes], table: str) -> float:
    """MB/s of payload bytes pushed durably by PUSHERS threads sharing one client."""
    shares = [payloads[i::PUSHERS] for i in range(PUSHERS)]

    def push(share: list[bytes]) -> None:
        for payload in share:
            client.push(payload, table=table)

    threads = [threading.Thread(target=push, args=(share,)) for share in shares]
    begin = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(map(len, payloads)) / (time.perf_counter() - begin) / 1e6


def client_cost(client: ShardedBufferClient, payloads: list[bytes], reps: int = 3) -> float:
    """Seconds of one thread to split a payload into its shards' parts (median)."""
    times = []
    for _ in range(reps):
        for payload in payloads:
            begin = time.perf_counter()
            client.split(payload, "task")
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure(targets: dict[str, str], rounds: int, per_pusher: int) -> tuple[dict[str, list[float]], float, int]:
    results: dict[str, list[float]] = {"plain": [], **{str(n): [] for n in SHARDS}}
    names = list(targets)
    cost, size = 0.0, 0
    for round_ in range(rounds + 1):  # round 0 warms the servers up and is not counted
        for n in SHARDS:
            payloads = make_payloads(PUSHERS * per_pusher, round_ * 10 + n)
            size = len(payloads[0])
            table = f"r{round_}n{n}"
            with ShardedBufferClient({name: targets[name] for name in names[:n]}) as client:
                client.create_table(table, estimator="none", group_size=GROUP)
                mbps = push_all(client, payloads, table)
                results[str(n)] += [mbps] if round_ else []
                client.drop_table(table)
                if n == max(SHARDS) and round_ == 0:
                    cost = client_cost(client, payloads[:8])
        payloads = make_payloads(PUSHERS * per_pusher, round_ * 10)
        with BufferClient(targets[names[0]]) as plain:
            plain.create_table("plain", estimator="none", group_size=GROUP)
            mbps = push_all(plain, payloads, "plain")
            results["plain"] += [mbps] if round_ else []
            plain.drop_table("plain")
    return results, cost, size


def report(command: str, results: dict[str, list[float]], cost: float, size: int) -> str:
    median = {key: statistics.median(values) for key, values in results.items()}
    one = median["1"]
    mb = size / 1e6
    client_mbps = mb / cost
    lines = [
        "## Scale-out: push over 1, 2 and 3 shards (issue 12)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {os.cpu_count()} CPU threads, shared by the 3 shard processes and the 8 pushing threads"
        " (one ShardedBufferClient); loopback. Medians of rounds that alternate the shard counts;"
        f" payloads of {PER_PAYLOAD} x 40 KB ({mb:.2f} MB) in 8 groups of 8, durable acks, no estimator.",
        "",
        "| shards | push MB/s | ratio to one shard (same run) | each round |",
        "| --- | --- | --- | --- |",
    ]
    for n in SHARDS:
        rounds = ", ".join(f"{v:.0f}" for v in results[str(n)])
        lines.append(f"| {n} | {median[str(n)]:.0f} | **{median[str(n)] / one:.2f}** | {rounds} |")
    plain = ", ".join(f"{v:.0f}" for v in results["plain"])
    lines.append(f"| 1, plain BufferClient | {median['plain']:.0f} | {median['plain'] / one:.2f} | {plain} |")
    lines += [
        "",
        f"Client cost per push of {mb:.2f} MB split over 3 shards (parse + one TRXP part per shard,"
        f" one thread): {cost * 1e3:.1f} ms, i.e. {client_mbps:.0f} MB/s per client core.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--payloads-per-pusher", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    command = "python bench/bench_shards.py" + (f" --rounds {args.rounds}" if args.rounds != 3 else "")
    with tempfile.TemporaryDirectory() as tmp:
        servers = {f"s{i}": start(Path(tmp) / f"s{i}", f"s{i}") for i in range(max(SHARDS))}
        try:
            results, cost, size = measure(
                {name: t for name, (_, t) in servers.items()}, args.rounds, args.payloads_per_pusher
            )
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    section = report(command, results, cost, size)
    print(section)
    if args.out:
        write_section(args.out, "## Scale-out: push over 1, 2 and 3 shards", section)


if __name__ == "__main__":
    main()
