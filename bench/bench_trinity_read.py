"""Time ExpbufReader.read() of 256 experiences from a table with a fixed group_size (8) and
from one with groups of varying size (group_size 0), in groups of 8 runs, over loopback.

    python bench/bench_trinity_read.py [--reads 8]

Needs trinity-rft (the reader is Trinity's BufferReader).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import torch


def measure(group_size: int, reads: int) -> float:
    """Milliseconds per read of 256 experiences."""
    from trinity.common.config import ExperienceBufferConfig
    from trinity.common.experience import EID, Experience

    from expbuf.client import BufferClient
    from expbuf.client.trinity import ExpbufReader, ExpbufWriter
    from expbuf.server.app import ExpbufServer
    from expbuf.server.config import ServerConfig

    server = ExpbufServer(ServerConfig(data=tempfile.mkdtemp(), port=0, metrics_port=-1)).start()
    try:
        with BufferClient(f"127.0.0.1:{server.port}") as admin:
            admin.create_table("bench", group_size=group_size, estimator="grpo")
            path = f"expbuf://127.0.0.1:{server.port}/bench"
            config = ExperienceBufferConfig(name="e", path=path, batch_size=256, max_read_timeout=60)
            exps = [
                Experience(eid=EID(batch=1, task=t, run=r), tokens=torch.arange(64), prompt_length=16,
                           logprobs=torch.zeros(48), reward=float(r))
                for t in range(32 * reads) for r in range(8)
            ]  # fmt: skip
            asyncio.run(ExpbufWriter(config.to_storage_config()).write(exps))
            while admin.stats("bench")["bench"].ready < len(exps):
                time.sleep(0.1)
        reader = ExpbufReader(config.to_storage_config())
        start = time.perf_counter()
        for _ in range(reads):
            assert len(asyncio.run(reader.read())) == 256
        return (time.perf_counter() - start) / reads * 1000
    finally:
        server.stop(grace=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=8)
    args = parser.parse_args()
    for group_size in (8, 0):
        print(f"group_size={group_size}: {measure(group_size, args.reads):.1f} ms per read of 256")


if __name__ == "__main__":
    main()
