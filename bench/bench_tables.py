"""What many idle tables cost a server: idle CPU, push and CreateTable latency, /metrics.

    .venv/bin/python bench/bench_tables.py [--tables 10000] [--out bench/RESULTS.md]

Against an `expbuf serve` child with 1 table and with `--tables` empty ones (created by 16
concurrent clients): the server's CPU seconds over 10 s idle, the p50/p90/max of 200 pushes
of one 8-experience group and of 50 CreateTable calls, one /metrics scrape's time and size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402

from helpers import ServerProcess, group_items  # noqa: E402

HEADING = "## Many idle tables (issue 16)"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantiles(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return f"{statistics.median(ms):.1f} / {ms[int(len(ms) * 0.9)]:.1f} / {ms[-1]:.0f}"


def measure(tables: int) -> str:
    with tempfile.TemporaryDirectory() as data:
        server = ServerProcess(f"{data}/data")
        try:
            with BufferClient(server.target, timeout=120) as client:
                with ThreadPoolExecutor(16) as pool:
                    list(pool.map(lambda i: client.create_table(f"idle{i}"), range(tables)))
                time.sleep(5)  # the sweep after creation
                before = cpu_seconds(server.proc.pid)
                time.sleep(10)
                idle = cpu_seconds(server.proc.pid) - before
                pushes = []
                for i in range(200):
                    payload = trxp.build(group_items(i, 0, 8))
                    start = time.perf_counter()
                    client.push(payload)
                    pushes.append(time.perf_counter() - start)
                creates = []
                for i in range(50):
                    start = time.perf_counter()
                    client.create_table(f"late{i}")
                    creates.append(time.perf_counter() - start)
            start = time.perf_counter()
            text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=300).read()
            scrape = time.perf_counter() - start
        finally:
            server.proc.terminate()
            server.proc.wait(30)
    return (
        f"| {tables + 1} | {idle:.2f} | {quantiles(pushes)} | {quantiles(creates)} "
        f"| {scrape * 1000:.0f} ms, {len(text) / 1e3:.0f} KB |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tables", type=int, default=10_000)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    rows = []
    for tables in (0, args.tables):
        rows.append(measure(tables))
        print(rows[-1], flush=True)
    body = "\n".join(
        [
            HEADING,
            "",
            f"Command: `python bench/bench_tables.py --tables {args.tables}`; {os.cpu_count()} CPU threads.",
            "",
            "| tables | idle CPU-s per 10 s | push ms p50 / p90 / max | CreateTable ms p50 / p90 / max | /metrics |",
            "| --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    write_section(Path(args.out), HEADING, body + "\n\n")
    print(body)


if __name__ == "__main__":
    main()
