"""Large experiences end to end (issue 41): pushes and a consume stream of experiences of 1 MiB
to 512 MiB against raw durable LMDB puts and a raw gRPC stream of the same bytes, with the
machine's copy bandwidth (one `bytes` copy of a buffer) as the limit, and the server's memory.

    .venv/bin/python bench/bench_big.py [--out bench/RESULTS.md] [--sizes 1,8,64,256,512] [--total 1024]
        [--before DIR]

Each size pushes `--total` MiB (at least two experiences), one experience a push over the
client's defaults (chunks of 4 MiB), into an `expbuf serve` child, then consumes them as
columns (tokens, log-probs and mask: every byte) in batches of 16 MiB (one experience a batch
from 16 MiB on), window 2; replies larger than PART_BYTES come in parts. The raw baselines write
the same payloads to an LMDB environment of their own, one durable commit each, and read the
same bytes over a gRPC stream of messages of one batch's bytes, at most PART_BYTES
(bench/raw_grpc_server.py), with nothing decoded. Server memory:
the peak RSS (VmHWM, reset before each phase) and the peak of its anonymous memory (RssAnon,
sampled every 5 ms) over its RSS before, in MiB; the consume's RSS counts the stored pages it
maps, its anonymous memory does not. With --before DIR (an earlier tree of expbuf, `git archive`d,
its compiled codec built there), that tree's server runs each size too, the trees in turn, which
goes first alternating from size to size.
"""

from __future__ import annotations

import argparse
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

import grpc  # noqa: E402
import lmdb  # noqa: E402
import torch  # noqa: E402
from bench_consume import package  # noqa: E402
from bench_push_memory import status  # noqa: E402
from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402
from expbuf.server.rpc.sample.replies import PART_BYTES  # noqa: E402

MB = 1 << 20
BATCH = 16 * MB  # a consume batch's bytes, or one experience where that is more
HEADING = "## Large experiences end to end (issue 41)"
FIELDS = ["tokens", "logprobs", "action_mask"]


def payload(index: int, size: int) -> bytes:
    """One experience of about `size` bytes: int32 tokens, float32 log-probs and a bool mask."""
    tokens = size // 9
    experience = Experience(
        eid=EID(batch="big", task=index, run=0),
        tokens=torch.arange(tokens + 1, dtype=torch.int32),
        prompt_length=1,
        logprobs=torch.full((tokens,), -0.5),
        action_mask=torch.ones(tokens, dtype=torch.bool),
        reward=1.0,
    )
    return trxp.build([trxp.from_experience(experience)])


class Memory:
    """A process's peak RSS and peak anonymous memory over one phase, above its RSS before."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> Memory:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        self.before = status(self.pid, "VmRSS")
        self.anon_before = status(self.pid, "RssAnon")
        self.anon_peak = self.anon_before
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.anon_peak = max(self.anon_peak, status(self.pid, "RssAnon"))

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = status(self.pid, "VmHWM") - self.before
        self.anon = self.anon_peak - self.anon_before


def batch_groups(size: int) -> int:
    """Experiences a consume batch: BATCH bytes of them, or one."""
    return max(1, BATCH // size)


def expbuf_side(sizes: list[int], total: int, tree: Path | None = None) -> dict[int, dict[str, float]]:
    """Each size pushed and consumed through a server of `tree` (None: this one)."""
    out: dict[int, dict[str, float]] = {}
    for size in sizes:
        count = max(2, total // size)
        with tempfile.TemporaryDirectory() as data:
            env = {**os.environ, "EXPBUF_MAX_INFLIGHT_BYTES": str(2 * size + 64 * MB)}
            if tree is not None:
                env["PYTHONPATH"] = str(package(tree, Path(data) / "before"))
            argv = ["-m", "expbuf.server.cli", "serve", "--data", f"{data}/d", "--port", "0", "--metrics-port", "-1"]
            server = Proc(*argv, env=env)
            try:
                time.sleep(5)  # torch loads after the server listens
                pid = server.proc.pid
                with BufferClient(server.target, timeout=600, max_message_bytes=256 * MB) as client:
                    client.create_table("big", group_size=1, estimator="none")
                    pushed, seconds = 0, 0.0
                    with Memory(pid) as push_memory:
                        for index in range(count):
                            body = payload(index, size)
                            start = time.perf_counter()
                            client.push(body, table="big")
                            seconds += time.perf_counter() - start
                            pushed += len(body)
                            del body
                    push_rate = pushed / seconds
                    received = 0
                    groups = batch_groups(size)
                    with Memory(pid) as consume_memory:
                        start = time.perf_counter()
                        for batch in client.sample(
                            "big",
                            num_groups=groups,
                            max_batches=count // groups,
                            timeout=30,
                            delivery="consume",
                            fields=FIELDS,
                        ):
                            received += sum(column.values.nbytes for column in batch.columns.values())
                            del batch
                        consume_seconds = time.perf_counter() - start
                out[size] = {
                    "count": count,
                    "push": push_rate,
                    "consume": received / consume_seconds,
                    "push_peak": push_memory.peak / MB,
                    "push_anon": push_memory.anon / MB,
                    "consume_peak": consume_memory.peak / MB,
                    "consume_anon": consume_memory.anon / MB,
                }
            finally:
                server.proc.kill()
                server.proc.wait()
    return out


def raw_lmdb(sizes: list[int], total: int) -> dict[int, float]:
    """Bytes a second of one durable LMDB commit per payload, the same payloads."""
    out = {}
    for size in sizes:
        count = max(2, total // size)
        with tempfile.TemporaryDirectory() as data:
            env = lmdb.open(data, map_size=4 * count * size + (1 << 30), max_dbs=2)
            written, seconds = 0, 0.0
            for index in range(count):
                body = payload(index, size)
                start = time.perf_counter()
                with env.begin(write=True) as txn:
                    txn.put(f"big/{index}".encode(), body)
                seconds += time.perf_counter() - start
                written += len(body)
            env.close()
        out[size] = written / seconds
    return out


def raw_stream(sizes: list[int], total: int) -> dict[int, float]:
    """Bytes a second of a gRPC stream of the same bytes, in messages of at most PART."""
    server = Proc(str(HERE / "raw_grpc_server.py"))
    out = {}
    try:
        options = [("grpc.max_receive_message_length", 256 * MB)]
        with grpc.insecure_channel(server.target, options=options) as channel:
            stream = channel.unary_stream("/bench.Raw/Stream")
            for size in sizes:
                count = max(2, total // size)
                message = min(size * batch_groups(size), PART_BYTES)
                messages = count * size // message
                received = 0
                start = time.perf_counter()
                for reply in stream(f"{messages},{message}".encode(), timeout=600):
                    received += len(reply)
                out[size] = received / (time.perf_counter() - start)
    finally:
        server.proc.kill()
    return out


def memcpy() -> float:
    """Bytes a second of one copy of a 256 MiB buffer (the best of five)."""
    buffer = bytearray(os.urandom(MB) * 256)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        copy = bytes(buffer)
        best = max(best, len(copy) / (time.perf_counter() - start))
        del copy
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sizes", default="1,8,64,256,512", help="experience sizes in MiB (0.25: 256 KiB)")
    parser.add_argument("--total", type=int, default=1024, help="MiB pushed and consumed per size")
    parser.add_argument("--before", type=Path, help="an earlier tree of expbuf, its servers run beside this one's")
    args = parser.parse_args()
    sizes = [int(float(s) * MB) for s in args.sizes.split(",")]
    total = args.total * MB
    load = os.getloadavg()
    copy = memcpy()
    trees: dict[str, Path | None] = {"now": None} if args.before is None else {"before": args.before, "now": None}
    ours: dict[str, dict[int, dict[str, float]]] = {name: {} for name in trees}
    for turn, size in enumerate(sizes):
        for name in list(trees)[:: 1 if turn % 2 == 0 else -1]:
            ours[name].update(expbuf_side([size], total, trees[name]))
    lmdb_rates = raw_lmdb(sizes, total)
    stream_rates = raw_stream(sizes, total)
    rows = []
    for size in sizes:
        for name in trees:
            f = ours[name][size]
            rows.append(
                f"| {size / MB:g} MiB |{f' {name} |' if args.before else ''} {int(f['count'])} | "
                f"{f['push'] / MB:,.0f} / {lmdb_rates[size] / MB:,.0f} | **{f['push'] / lmdb_rates[size]:.2f}** | "
                f"{f['consume'] / MB:,.0f} / {stream_rates[size] / MB:,.0f} | "
                f"**{f['consume'] / stream_rates[size]:.2f}** | {f['push'] / copy:.1%} / {f['consume'] / copy:.1%} | "
                f"{f['push_peak']:,.0f} / {f['push_anon']:,.0f} | {f['consume_peak']:,.0f} / {f['consume_anon']:,.0f} |"
            )
    before = f" --before {args.before}" if args.before else ""
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `python bench/bench_big.py --sizes {args.sizes} --total {args.total}{before}`  ",
            f"Loopback, 2 cores shared with other work: load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} "
            f"at the start. One copy of a 256 MiB buffer: {copy / MB:,.0f} MiB/s.",
            "",
            f"| experience |{' tree |' if args.before else ''} experiences | push MiB/s, expbuf / raw LMDB | push "
            "ratio | consume MiB/s, expbuf columns / raw stream | consume ratio | push / consume of copy bandwidth | "
            "server peak in a push, RSS / anonymous (MiB) | server peak in the consume, RSS / anonymous (MiB) |",
            "| --- |" + " --- |" * (9 if args.before else 8),
            *rows,
            "",
        ]
    )
    print(section)
    if args.out:
        write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
