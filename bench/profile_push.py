"""Where an expbuf server spends a push of 8 KB or 40 KB experiences, from a sampling profile.

    pip install py-spy   # into any environment; it attaches to the server from outside
    .venv/bin/python bench/profile_push.py [--shape 8k|40k] [--window W] [--pushers N] [--group-by G]
        [--py-spy PATH] [--seconds 8] [--ingest-processes N] [--raw OUT]

One writer (or N, each its own client and payloads) pushes pre-encoded payloads of
bench_reverb's shapes (256 x 8 KB or 64 x 40 KB experiences; the 40 KB ones in groups of 8 by
task) into a table with estimator none and group_by none (or G), as fast as the server acks
them (`push()`, or with --window W a `pusher(window=W)`), while py-spy samples every thread of
the `expbuf serve` process and its children (native frames included, idle ones left out). Each busy sample is
put down to the first stage found on its stack, from the list below, so the shares add up to
100 % of the server's busy time. The client's encode is not in it (bench_encode.py times
that). --raw keeps py-spy's output (one line per stack) there.
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

# (stage, the function names that put a sample in it: a compiled codec's frames are its C functions),
# most specific first.
STAGES = (
    ("durable commit (LMDB commit, fsync)", "_mdb_txn_commit"),
    ("parse (validate the payload)", ("parse ", "CPyPy_expbuf___client___trxp___parse___parse ")),
    ("pack each experience (Entry.of: repack, XXH3-128)", "Entry.of "),
    ("store the push (records, indexes, LMDB puts)", "put ("),  # pushes.put
    ("store: table and counters around the put", "Store.put_entries"),
    ("write loop and hand-offs", ("Writer._write_loop", "Environment._write_loop")),  # the latter: earlier trees
    ("ingest processes: hand-off and results", "Ingest."),
    ("gRPC: receive, unpack the request, reply", "_unary_response_in_pool"),
    ("gRPC: the server's polling thread", "_serve "),
)
IDLE = ("PyThread_acquire_lock_timed", "epoll_wait", "pthread_cond_timedwait", "pthread_cond_wait", "poll ")


def stage_of(frames: list[str], stages: tuple[tuple[str, str | tuple[str, ...]], ...]) -> str:
    for stage, marker in stages:
        if any(frame.startswith(marker) for frame in frames):
            return stage
    return "other"


def busy_samples(raw: Path, stages: tuple[tuple[str, str | tuple[str, ...]], ...] = STAGES) -> collections.Counter[str]:
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
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--ingest-processes", help="default: the server's own default")
    parser.add_argument("--shape", choices=("8k", "40k"), default="8k")
    parser.add_argument("--window", type=int, default=0, help="push through a pusher of this window (0: push())")
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw output here")
    parser.add_argument("--pushers", type=int, default=1, help="concurrent writers (bench_service's push: 8)")
    parser.add_argument("--group-by", default="none", help="the table's group_by (bench_service's push: task)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        ingest = ["--ingest-processes", args.ingest_processes] if args.ingest_processes else []
        serve = ("serve", "--data", data, "--port", "0", "--metrics-port", "-1", *ingest)
        server = Proc("-m", "expbuf.server.cli", *serve)
        with BufferClient(server.target) as client:
            client.create_table("small", estimator="none", group_by=args.group_by)
        server.wait_for("advantage worker")  # torch loaded: not a stage of a push
        serial, stop = itertools.count(), threading.Event()
        per_writer = max(16 // args.pushers, 2)
        pushed = [[0, 0.0] for _ in range(args.pushers)]  # each writer's experiences and seconds

        def load(done: list) -> None:
            pushes = make_pushes(args.shape, per_writer)
            with BufferClient(server.target, timeout=120) as client:
                while not stop.is_set():
                    restamp(pushes, serial)
                    payloads = [trxp.encode(p) for p in pushes]
                    start = time.perf_counter()
                    if args.window:
                        with client.pusher("small", window=args.window) as pusher:
                            for payload in payloads:
                                pusher.push(payload)
                    else:
                        for payload in payloads:
                            if stop.is_set():
                                return
                            client.push(payload, table="small")
                    done[0] += sum(map(len, pushes))
                    done[1] += time.perf_counter() - start

        threads = [threading.Thread(target=load, args=(done,)) for done in pushed]
        for thread in threads:
            thread.start()
        out = Path(data) / "profile.txt"
        try:
            time.sleep(2)  # warm up
            spy = subprocess.run(
                [args.py_spy, "record", "-p", str(server.proc.pid), "-d", str(args.seconds), "-r", "250",
                 "--native", "--threads", "--subprocesses", "-f", "raw", "-o", str(out)],
                capture_output=True, text=True,
            )  # fmt: skip
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            server.stop()
        if spy.returncode:
            sys.exit(f"py-spy failed: {spy.stderr.strip()}")
        counts = busy_samples(out)
        if args.raw:
            shutil.copy(out, args.raw)
    busy = sum(counts.values())
    how = f"pusher(window={args.window})" if args.window else "push()"
    rate = sum(count / seconds for count, seconds in pushed if seconds)
    per = 256 if args.shape == "8k" else 64
    print(f"push of {per} x {args.shape[:-1]} KB, {args.pushers} writer(s), {how}, ", end="")
    print(f"group_by {args.group_by}, ingest processes {args.ingest_processes or 'by default'}: ", end="")
    print(f"{rate:,.0f} exp/s ({1e6 / rate:.0f} µs per experience) at the clients, encode excluded")
    print("| stage | share of the server's busy samples |")
    print("| --- | --- |")
    for stage, count in counts.most_common():
        print(f"| {stage} | {count / busy:.0%} |")


if __name__ == "__main__":
    main()
