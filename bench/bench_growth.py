"""How one table grows: push and sample latency, selection by order, restart, RSS and bytes per
experience at 10 k, 1 M and 10 M experiences.

    .venv/bin/python bench/bench_growth.py [--sizes 10000,1000000,10000000] [--out bench/RESULTS.md]

One `expbuf serve` child with a `grpo` table of groups of 4 small experiences (7 tokens,
4 response tokens, a random priority, model version = group // 1000). Pushers fill it to each
size in pushes of 256 groups; at each size the bench measures, with the fill stopped:
- push: p50/p90 of 200 pushes of one group;
- sample, per order (fifo, lifo, uniform, priority) and for `min_model_version` = the newest
  version: p50/p90 of 50 one-group Sample streams (window 1, consume), which is the selection
  plus one round trip; a stream of its own per sample, so nothing is read ahead;
- restart: SIGTERM, then a new server until it listens, with the full open check and with
  `check_at_open = "quick"`;
- the server's RSS after the restart and after the measurements;
- the data file's allocated bytes per stored experience.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402

from helpers import ServerProcess, make_experience  # noqa: E402

HEADING = "## Growth of one table to 10 M experiences (issue 22)"
TABLE = "growth"
GROUP = 4
PER_PUSH = 256
ORDERS = ("fifo", "lifo", "uniform", "priority")
TEMPLATE = trxp.from_experience(make_experience(0, 0, 0))


def groups(first: int, count: int) -> bytes:
    """TRXP bytes of groups first..first+count-1, each GROUP runs of its own task."""
    rng = random.Random(first)
    items = []
    for g in range(first, first + count):
        priority = rng.random()
        for run in range(GROUP):
            meta = copy.deepcopy(TEMPLATE.meta)
            meta["eid"].update(batch=g, task=g, run=run, suffix=f"r{run}")
            meta["info"] = {"model_version": g // 1000, "priority": priority}
            meta["reward"] = float(run)
            items.append(trxp.RawItem(meta, TEMPLATE.tensors))
    return trxp.build(items)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def quantiles(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return f"{statistics.median(ms):.1f} / {ms[int(len(ms) * 0.9)]:.1f}"


class Growth:
    """The server, its data directory and the next group number to push."""

    def __init__(self, data: str, config: Path) -> None:
        self.data = data
        self.config = config
        self.next_group = 0
        self.server = self.start("full")

    def start(self, check: str) -> ServerProcess:
        text = self.config.read_text().replace("CHECK", check)
        self.config.with_name(f"{check}.toml").write_text(text)
        return ServerProcess(self.data, "--config", str(self.config.with_name(f"{check}.toml")))

    def fill(self, groups_total: int, pushers: int = 2) -> float:
        """Push groups until the table holds groups_total; returns experiences per second."""
        lock = threading.Lock()
        start_group, started = self.next_group, time.perf_counter()

        def pusher() -> None:
            with BufferClient(self.server.target, timeout=600) as client:
                while True:
                    with lock:
                        first = self.next_group
                        count = min(PER_PUSH, groups_total - first)
                        self.next_group += max(count, 0)
                    if count <= 0:
                        return
                    client.push(groups(first, count), TABLE)

        threads = [threading.Thread(target=pusher) for _ in range(pushers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return (self.next_group - start_group) * GROUP / max(time.perf_counter() - started, 1e-9)

    def measure(self, client: BufferClient) -> dict[str, str]:
        row: dict[str, str] = {}
        pushes = []
        for _ in range(200):
            payload = groups(self.next_group, 1)
            self.next_group += 1
            begin = time.perf_counter()
            client.push(payload, TABLE)
            pushes.append(time.perf_counter() - begin)
        row["push"] = quantiles(pushes)
        newest = (self.next_group - 1) // 1000
        for name, spec in [(order, {"order": order}) for order in ORDERS] + [
            ("min_version", {"order": "fifo", "min_model_version": newest})
        ]:
            times = []
            for _ in range(50):
                begin = time.perf_counter()
                batches = list(
                    client.sample(TABLE, num_groups=1, delivery="consume", max_batches=1, window=1, timeout=30, **spec)
                )
                times.append(time.perf_counter() - begin)
                assert len(batches) == 1 and len(batches[0].experiences) == GROUP
            row[name] = quantiles(times)
        row["rss_after"] = f"{rss_mib(self.server.proc.pid):.0f}"
        return row

    def restart(self, check: str) -> float:
        self.server.proc.terminate()
        self.server.proc.wait(600)
        begin = time.perf_counter()
        self.server = self.start(check)
        return time.perf_counter() - begin

    def data_bytes(self) -> int:
        return sum(p.stat().st_blocks * 512 for p in Path(self.data).rglob("*") if p.is_file())


def run(sizes: list[int]) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("EXPBUF_BENCH_DIR")) as tmp:
        config = Path(tmp) / "growth.toml"
        config.write_text(
            f'check_at_open = "CHECK"\n[[tables]]\nname = "{TABLE}"\ngroup_size = {GROUP}\nestimator = "grpo"\n'
            "tombstone_seconds = 0\n"
        )
        growth = Growth(f"{tmp}/data", config)
        try:
            for size in sizes:
                rate = growth.fill(size // GROUP)
                stored = growth.next_group * GROUP
                per_exp = growth.data_bytes() / stored
                full = growth.restart("full")
                rss_open = rss_mib(growth.server.proc.pid)
                quick = growth.restart("quick")
                with BufferClient(growth.server.target, timeout=120) as client:
                    row = growth.measure(client)
                rows.append(
                    f"| {stored:,} | {rate:,.0f} | {row['push']} | {row['fifo']} | {row['lifo']} | {row['uniform']} "
                    f"| {row['priority']} | {row['min_version']} | {full:.1f} / {quick:.1f} | {rss_open:.0f} / "
                    f"{row['rss_after']} | {per_exp:,.0f} |"
                )
                print(rows[-1], flush=True)
        finally:
            growth.server.proc.terminate()
            growth.server.proc.wait(600)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000,10000000", help="table sizes to measure at, in experiences")
    parser.add_argument("--out", type=Path, help="write the table into this RESULTS.md")
    args = parser.parse_args()
    rows = run([int(s) for s in args.sizes.split(",")])
    body = "\n".join(
        [
            HEADING,
            "",
            f"`.venv/bin/python bench/bench_growth.py --sizes {args.sizes}`, {time.strftime('%Y-%m-%d')}, "
            f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end. Latencies are p50 / p90 in ms; "
            "a sample is a one-group Sample stream of its own (selection plus a round trip).",
            "",
            "| stored | fill exp/s | push | fifo | lifo | uniform | priority | min version | restart s full / quick "
            "| RSS MiB open / after | data bytes / exp |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(body)
    if args.out:
        write_section(args.out, HEADING, body)


if __name__ == "__main__":
    main()
