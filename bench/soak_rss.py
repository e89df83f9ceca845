"""RSS soak: a steady push + consume load against an `expbuf serve` child, its memory sampled.

    .venv/bin/python bench/soak_rss.py [--minutes 9] [--interval 10] [--tombstone-seconds S] [--out soak.jsonl]

Pushers push groups of 8 (about 8 KB an experience) into a table while a
consumer drains it at the same pace, so the live data stays small and constant. Every
`interval` seconds the server's memory is read from /proc: VmRSS split into RssAnon
(the Python heap, gRPC buffers) and RssFile (pages of the LMDB map the process has
touched), VmHWM, and the LMDB file's size, with the counts pushed and consumed. A
leak shows as RssAnon rising at a constant load; a growing file shows in RssFile.
The table keeps the records of consumed experiences for `--tombstone-seconds` (the
server's default, a day, when not given).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import Proc  # noqa: E402
from bench_store import experience  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402

GROUP = 8
TABLE = "soak"


def memory(pid: int) -> dict[str, int]:
    """The kB figures of /proc/PID/status that tell heap from mapped file."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=9.0)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--pushers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--tombstone-seconds", type=float, default=None)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    stop = threading.Event()
    counts = {"pushed": 0, "consumed": 0}
    with tempfile.TemporaryDirectory(prefix="expbuf-soak-") as tmp:
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", tmp, "--port", "0", "--metrics-port", "0")
        settings = {} if args.tombstone_seconds is None else {"tombstone_seconds": args.tombstone_seconds}
        with BufferClient(server.target) as client:
            client.create_table(TABLE, **settings)

        def push(worker: int) -> None:
            with BufferClient(server.target, timeout=60) as client:
                task = 0
                while not stop.is_set():
                    exps = [experience(worker * 10**9 + task, task, run, args.tokens) for run in range(GROUP)]
                    client.push(trxp.encode(exps), table=TABLE)
                    counts["pushed"] += GROUP
                    task += 1
                    time.sleep(0.02)

        def consume() -> None:
            with BufferClient(server.target, timeout=60) as client:
                while not stop.is_set():
                    try:
                        for batch in client.sample(
                            TABLE, num_groups=4, timeout=1.0, max_batches=50, delivery="consume"
                        ):
                            counts["consumed"] += len(batch.uids)
                    except Exception as exc:  # a wait without data ends the stream; keep draining
                        if "DEADLINE_EXCEEDED" not in str(exc):
                            raise

        threads = [threading.Thread(target=push, args=(w,), daemon=True) for w in range(args.pushers)]
        threads.append(threading.Thread(target=consume, daemon=True))
        for thread in threads:
            thread.start()
        out = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed below
        start = time.monotonic()
        try:
            while time.monotonic() - start < args.minutes * 60:
                time.sleep(args.interval)
                row = {
                    "t": round(time.monotonic() - start),
                    **memory(server.proc.pid),
                    "lmdb_kb": os.path.getsize(Path(tmp) / "data.mdb") // 1024,
                    **counts,
                }
                print(json.dumps(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
            server.stop()
            if out:
                out.close()


if __name__ == "__main__":
    main()
