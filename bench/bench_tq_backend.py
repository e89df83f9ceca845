"""TransferQueue on its in-memory SimpleStorage and on expbuf (the "Expbuf" backend with its
controller journalled), side by side in one run: the work of TransferQueue's own performance
test, Small case (scripts/performance_test/perftest.py in its repository): a writer puts a batch
of `--batch` samples of `--fields` float32 fields of `--seq` values with `tq.kv_batch_put`, a
reader in another process gets them all with `tq.kv_batch_get`, then they are cleared. Throughput
as TransferQueue reports it, in Gb/s: put, get, and 2 x bytes / (put + get).

    python bench/bench_tq_backend.py                    # Small: 1024 x 9 x 8192 (288 MiB a batch)
    python bench/bench_tq_backend.py --rounds 5 --batch 256

Each round runs both backends in turn (the order alternating), each in a fresh TransferQueue with
the same warm-up iteration and the same repeats; one expbuf server for the run. Needs the
`transferqueue` extra.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf

from expbuf.client.transferqueue import setup


@ray.remote(num_cpus=0)
class Side:
    """A writer or a reader in a process of its own, as TransferQueue's test places them."""

    def __init__(self) -> None:
        setup()  # expbuf registered in this process (Ray imports its module to unpickle this call)
        tq.init()

    def make(self, batch: int, fields: int, seq: int) -> float:
        from tensordict import TensorDict

        self.keys = [f"k{i}" for i in range(batch)]
        self.data = TensorDict({f"f{n}": torch.randn(batch, seq) for n in range(fields)}, batch_size=batch)
        return batch * fields * seq * 4 / 1e9

    def put(self, partition: str) -> float:
        start = time.perf_counter()
        tq.kv_batch_put(keys=self.keys, partition_id=partition, fields=self.data)
        return time.perf_counter() - start

    def get(self, partition: str, keys: list[str]) -> float:
        start = time.perf_counter()
        tq.kv_batch_get(keys=keys, partition_id=partition)
        return time.perf_counter() - start

    def clear(self, partition: str, keys: list[str]) -> None:
        tq.kv_clear(keys=keys, partition_id=partition)


def conf(backend: str, target: str, table: str) -> Any:
    if backend == "SimpleStorage":
        return OmegaConf.create({"backend": {"storage_backend": "SimpleStorage"}})
    return OmegaConf.create({"backend": {"storage_backend": "Expbuf", "Expbuf": {"target": target, "table": table}}})


def run(backend: str, target: str, table: str, args: argparse.Namespace) -> list[tuple[float, float, float]]:
    """(put s, get s, GB) of each measured iteration, after one warm-up."""
    tq.init(conf(backend, target, table))
    try:
        writer, reader = Side.remote(), Side.remote()
        size = ray.get(writer.make.remote(args.batch, args.fields, args.seq))
        keys = [f"k{i}" for i in range(args.batch)]
        out = []
        for iteration in range(args.iterations + 1):
            partition = f"p{iteration}"
            put = ray.get(writer.put.remote(partition))
            get = ray.get(reader.get.remote(partition, keys))
            ray.get(reader.clear.remote(partition, keys))
            if iteration:
                out.append((put, get, size))
        for side in (writer, reader):
            ray.kill(side)
        return out
    finally:
        tq.close()


def serve(data: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "listening on" in line:
            port = line.split("listening on ")[1].split(" ")[0].rsplit(":", 1)[1]
            return proc, f"127.0.0.1:{port}"
    raise SystemExit(f"expbuf serve exited with {proc.wait()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--fields", type=int, default=9)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations a backend a round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="bench-tq-") as folder:
        proc, target = serve(os.path.join(folder, "data"))
        results: dict[str, list[tuple[float, float, float]]] = {"SimpleStorage": [], "Expbuf": []}
        try:
            for round_ in range(args.rounds):
                order = ["SimpleStorage", "Expbuf"][:: 1 if round_ % 2 == 0 else -1]
                for backend in order:
                    results[backend] += run(backend, target, f"tq_{round_}", args)
        finally:
            proc.terminate()
            proc.wait(30)
            ray.shutdown()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds x {args.iterations} iterations")
    total = {}
    for backend, rows in results.items():
        put = statistics.median(gb * 8 / p for p, _, gb in rows)
        get = statistics.median(gb * 8 / g for _, g, gb in rows)
        total[backend] = statistics.median(2 * gb * 8 / (p + g) for p, g, gb in rows)
        print(f"{backend:14s} put {put:6.2f} Gb/s  get {get:6.2f} Gb/s  total {total[backend]:6.2f} Gb/s")
    print(f"Expbuf / SimpleStorage, total: {total['Expbuf'] / total['SimpleStorage']:.2f}")


if __name__ == "__main__":
    main()
