"""What data-parallel ranks reading their parts of a step cost the pushes of rollout workers on
the same server: a push's latency while 0, 4, 16 and 32 ranks read their parts (read_part) of a
leased step of 64 groups of 4 runs of 50,000 tokens, as fast as they can.

    .venv/bin/python bench/bench_reads_pushes.py [--seconds 8] [--readers 0 4 16 32]

The ranks run in 4 processes of their own at the lowest CPU priority (nice 19), standing for
trainers on other machines: what is measured is the server's share of the cost, not the
readers' own decoding. One pusher in this process pushes groups of 2 small runs, one a call.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402
from expbuf.client.schema.experience import EID, Experience  # noqa: E402

HEADING = "## Pushes while ranks read their parts"
RANKS = 32  # the step is split over this many ranks; a reader count reads that many of the parts


def rollout(batch: str, task: int, run: int, tokens: int) -> Experience:
    return Experience(
        eid=EID(batch=batch, task=task, run=run),
        tokens=torch.arange(tokens, dtype=torch.int32),
        prompt_length=4,
        logprobs=torch.zeros(tokens - 4),
        reward=float(run),
    )


def readers(target: str, lease: str, ranks: list[int], stop: Any, count: Any) -> None:
    """Read these ranks' parts, over and over, until `stop`."""
    os.nice(19)

    def one(rank: int) -> None:
        with BufferClient(target, timeout=120) as client:
            while not stop.is_set():
                client.read_part(lease, rank, RANKS, ["tokens", "logprobs"], table="big")
                with count.get_lock():
                    count.value += 1

    threads = [threading.Thread(target=one, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def one(target: str, lease: str, pusher: BufferClient, count: int, seconds: float) -> dict[str, float]:
    stop, reads = mp.Event(), mp.Value("i", 0)
    procs = [
        mp.Process(target=readers, args=(target, lease, list(range(p, count, 4)), stop, reads))
        for p in range(min(4, count))
    ]
    for proc in procs:
        proc.start()
    time.sleep(3 if count else 0)  # the readers connected and reading
    latencies: list[float] = []
    first = reads.value
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        pusher.push(trxp.encode([rollout(f"p{count}", len(latencies), run, 64) for run in range(2)]), table="small")
        latencies.append(time.perf_counter() - start)
    done = reads.value - first
    stop.set()
    for proc in procs:
        proc.join()
    latencies.sort()
    return {
        "pushes": len(latencies) / seconds,
        "p50": latencies[len(latencies) // 2] * 1e3,
        "p99": latencies[int(len(latencies) * 0.99)] * 1e3,
        "reads": done / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--readers", type=int, nargs="+", default=[0, 4, 16, 32])
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    mp.set_start_method("spawn")
    command = ("python bench/bench_reads_pushes.py " + " ".join(sys.argv[1:])).strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["-m", "expbuf.server.cli", "serve", "--data", f"{tmp}/data", "--port", "0", "--metrics-port", "-1"]
        server = Proc(*argv)
        try:
            server.wait_for("advantage worker")
            with BufferClient(server.target, timeout=120) as client:
                client.create_table("big", group_size=4, estimator="none")
                client.create_table("small", group_size=2, estimator="none")
                for task in range(64):
                    client.push(trxp.encode([rollout("b", task, run, 50_000) for run in range(4)]), table="big")
                (batch,) = client.sample("big", num_groups=64, delivery="lease", lease_seconds=3600, max_batches=1,
                                         fields=["reward"])  # fmt: skip
                for count in args.readers:
                    got = one(server.target, batch.lease_id, client, count, args.seconds)
                    print(count, {k: round(v, 1) for k, v in got.items()}, flush=True)
                    part = 2 * 4 * 50_000 * 8 / (1 << 20)  # a rank's 2 groups of 4 runs: tokens and log-probs
                    rows.append(
                        f"| {count} | {got['pushes']:.0f} | {got['p50']:.1f} | {got['p99']:.1f} | {got['reads']:.0f} | "
                        f"{got['reads'] * part:.0f} |"
                    )
        finally:
            server.stop()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `{command}`  ",
            f"{os.cpu_count()} CPUs, shared; load average {load} at the end. One server; the readers in 4 processes "
            "at nice 19; one pusher of groups of 2 small runs, one push a call.",
            "",
            "| ranks reading | pushes a second | push p50 (ms) | push p99 (ms) | parts read a second | MiB read a "
            "second |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            "The ranks read as much as the server serves (about the same MiB a second however many read), and each "
            "reader more lengthens a push. A ReadFields no longer takes a turn of the writer to open its snapshot "
            "(it did until this measurement: with 32 ranks reading, p50 13.1 ms and p99 52 ms; 4: 3.9 and 12; 16: "
            "7.4 and 24). Profiled with 16 ranks reading, the writer is now idle most of the time and a push's "
            "handler spends 96% of its time waiting for its commit to be handed back: the two cores are busy "
            "serving the reads (the replies' copies and gRPC's sends), and each thread that wakes waits for one. "
            "Bounding how many replies are built at once (a semaphore of 1 or 2 around each message) and a shorter "
            "switch interval (1 ms) did not shorten the pushes in trials (issue 41).",
            "",
        ]
    )
    print(section)
    write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
