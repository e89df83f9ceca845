"""Where an expbuf server spends a push of 8 KB experiences, from a sampling profile.

    pip install py-spy   # into any environment; it attaches to the server from outside
    .venv/bin/python bench/profile_push.py [--py-spy PATH] [--seconds 8] [--ingest-processes N]

One writer pushes pre-encoded payloads of 256 x 8 KB experiences (bench_reverb's shape) into
a table with estimator none and group_by none, as fast as the server acks them, while py-spy
samples every thread of the `expbuf serve` process (native frames included, idle ones left
out). Each busy sample is put down to the first stage found on its stack, from the list
below, so the shares add up to 100 % of the server's busy time. The client's encode is not
in it (bench_encode.py times that).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes, restamp  # noqa: E402
from bench_service import Proc  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402

# (stage, a function name that puts a sample in it), most specific first.
STAGES = (
    ("durable commit (LMDB commit, fsync)", "_mdb_txn_commit"),
    ("parse (validate the payload)", "parse "),
    ("pack each experience (Entry.of: repack, SHA-256)", "Entry.of "),
    ("store the push (records, indexes, LMDB puts)", "put ("),  # groups.put
    ("store: table and counters around the put", "Store.put_entries"),
    ("write loop and hand-offs", "Environment._write_loop"),
    ("ingest processes: hand-off and results", "Ingest."),
    ("gRPC: receive, unpack the request, reply", "_unary_response_in_pool"),
    ("gRPC: the server's polling thread", "_serve "),
)
IDLE = ("PyThread_acquire_lock_timed", "epoll_wait", "pthread_cond_timedwait", "pthread_cond_wait", "poll ")


def stage_of(frames: list[str], stages: tuple[tuple[str, str], ...]) -> str:
    for stage, marker in stages:
        if any(frame.startswith(marker) for frame in frames):
            return stage
    return "other"


def busy_samples(raw: Path, stages: tuple[tuple[str, str], ...] = STAGES) -> collections.Counter[str]:
    """py-spy's raw output as busy samples by stage (stacks that end waiting left out)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if any(idle in frame for frame in frames[-3:] for idle in IDLE):
            continue
        counts[stage_of(frames, stages)] += int(count)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--ingest-processes", help="default: the server's own default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        ingest = ["--ingest-processes", args.ingest_processes] if args.ingest_processes else []
        serve = ("serve", "--data", data, "--port", "0", "--metrics-port", "-1", *ingest)
        server = Proc("-m", "expbuf.server.cli", *serve)
        client = BufferClient(server.target, timeout=120)
        client.create_table("small", estimator="none", group_by="none")
        pushes, serial, stop = make_pushes("8k", 16), itertools.count(), threading.Event()
        pushed = [0, 0.0]

        def load() -> None:
            while not stop.is_set():
                restamp(pushes, serial)
                payloads = [trxp.encode(p) for p in pushes]
                start = time.perf_counter()
                for payload in payloads:
                    if stop.is_set():
                        return
                    client.push(payload, table="small")
                pushed[0] += 16 * 256
                pushed[1] += time.perf_counter() - start

        thread = threading.Thread(target=load)
        thread.start()
        out = Path(data) / "profile.txt"
        try:
            time.sleep(2)  # warm up
            spy = subprocess.run(
                [args.py_spy, "record", "-p", str(server.proc.pid), "-d", str(args.seconds), "-r", "250",
                 "--native", "--threads", "-f", "raw", "-o", str(out)],
                capture_output=True, text=True,
            )  # fmt: skip
        finally:
            stop.set()
            thread.join()
            client.close()
            server.stop()
        if spy.returncode:
            sys.exit(f"py-spy failed: {spy.stderr.strip()}")
        counts = busy_samples(out)
    busy = sum(counts.values())
    print(f"push of 256 x 8 KB, one writer, ingest processes {args.ingest_processes or 'by default'}: ", end="")
    print(f"{pushed[1] / pushed[0] * 1e6:.0f} µs per experience at the client, encode excluded")
    print("| stage | share of the server's busy samples |")
    print("| --- | --- |")
    for stage, count in counts.most_common():
        print(f"| {stage} | {count / busy:.0%} |")


if __name__ == "__main__":
    main()
