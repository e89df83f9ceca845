"""Ingest with grpo against none, with the advantages computed in the push and left to the worker.

    .venv/bin/python bench/bench_estimator_ab.py [--payloads-per-pusher 4] [--pairs 4]

bench_advantages.py's ingest comparison (8 pushers, payloads of 64 x 40 KB experiences of 4,000
response tokens in groups of 8, a grpo table and a none table in turns on one server, medians of
6 rounds) run on `expbuf serve` as it is, and on a server whose pushes compute no advantages (every
group left to the advantage worker, as before issue 22), in turns, so that both see the same load
on a shared machine. Prints each run's ratios with the load average at its start.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_advantages  # noqa: E402
from bench_service import PUSHERS, Proc, make_payloads  # noqa: E402

# `expbuf serve` with no table's advantages computed by the push.
WORKER_ONLY = (
    "import sys\n"
    "from expbuf.server import advantages, cli\n"
    "advantages.AdvantageWorker.in_push = lambda self, config: None\n"
    "sys.exit(cli.main())\n"
)


class WorkerOnly(Proc):
    def __init__(self, *argv: str) -> None:
        args = list(argv)
        if args[:2] == ["-m", "expbuf.server.cli"]:
            args = ["-c", WORKER_ONLY, *args[2:]]
        super().__init__(*args)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--payloads-per-pusher", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    payloads = make_payloads(PUSHERS * args.payloads_per_pusher)
    servers = {"in the push": Proc, "by the worker": WorkerOnly}
    print("| advantages | ingest MB/s, none | grpo | ratio grpo / none | CPU s per GB, none | grpo | ratio | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for pair in range(args.pairs):
        for name in list(servers) if pair % 2 == 0 else list(servers)[::-1]:
            bench_advantages.Proc = servers[name]
            load = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
                got = bench_advantages.bench_ingest(Path(tmp), payloads, 6)
            ratio, cpu = got["grpo"] / got["none"], got["none_cpu"] / got["grpo_cpu"]
            print(
                f"| {name} | {got['none']:.0f} | {got['grpo']:.0f} | {ratio:.2f} | {got['none_cpu']:.2f} "
                f"| {got['grpo_cpu']:.2f} | {cpu:.2f} | {load:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
