"""Instructions an `expbuf serve` process spends an experience on a push and on a consume stream,
counted by valgrind's callgrind in the server itself (every thread, the writer's apart), where a
busy machine moves CPU time 1.5x from run to run and a count not at all (issue 64).

    .venv/bin/python bench/bench_server_instructions.py [--pushes 8] [--ways bytes,decoded,columns]
        [--shape 8k] [--out bench/RESULTS.md]

Each way starts a server under callgrind on a fresh directory (a table of groups of one, no
estimator; no ingest processes, so that the parse of each push is counted in the process), pushes
`--pushes` pushes of 256 experiences of 8 KB (bench_reverb's shape) one after the other (the first
not counted: imports, the first commits; `--shape 40k`: pushes of 64 of bench_reverb's 40 KB ones,
in groups of 8, issue 64's row of them), then drains them as a consume stream: as bytes (a raw
gRPC client of the Sample stream, each batch confirmed as it arrives, nothing decoded), decoded into
experiences, or as columns of tokens and log-probs. The pushes and the drain are counted apart
(callgrind_control's dumps). The writer is the thread that commits (its counts name
mdb_txn_commit); the rest is the RPC threads' and gRPC's. Needs valgrind.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results  # noqa: E402
from bench_reverb import PER_PUSH, make_pushes, restamp  # noqa: E402
from bench_service import BATCH, Proc, raw_consume  # noqa: E402
from bench_stream_8k import TABLE, columns, decoded  # noqa: E402

from expbuf.client import EID, BufferClient, trxp  # noqa: E402
from expbuf.client.errors import UnavailableError  # noqa: E402
from expbuf.client.rpc.sample_spec import SampleSpec  # noqa: E402

HEADING = "## Instructions of a push and a consume in the server's process (issue 64)"
GROUPS = {"8k": 1, "40k": 8}  # each shape's group size: issue 64's rows of them
WAYS = ("bytes", "decoded", "columns")


def counted(way: str, pushes: int, out: Path, shape: str = "8k") -> tuple[int, int]:
    """One server under callgrind: its pushes of `shape` and then its `way` of drain counted, a
    dump after each (part 1, part 2); how many experiences each counted."""
    group = GROUPS[shape]
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        server = Proc(
            "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes", f"--callgrind-out-file={out}/cg.%p",
            sys.executable, "-m", "expbuf.server.cli", "serve", "--data", f"{tmp}/data", "--port", "0",
            "--metrics-port", "-1", "--ingest-processes", "0",
            python="valgrind", env={**os.environ, "PYTHONHASHSEED": "0"},
        )  # fmt: skip

        def control(*what: str) -> None:
            subprocess.run(["callgrind_control", *what, str(server.proc.pid)], check=True, capture_output=True)

        try:
            with BufferClient(server.target, timeout=600) as client:
                grouping = {"group_by": "task", "group_size": group} if group > 1 else {"group_by": "none"}
                client.create_table(TABLE, estimator="none", **grouping)
            server.wait_for("advantage worker", timeout=900)
            made = make_pushes(shape, pushes)
            restamp(made, itertools.count())
            for exps in made:  # runs of one task, as bench_consume groups them
                for i, exp in enumerate(exps):
                    exp.eid = EID(batch=exps[i - i % group].eid.batch, task=0, run=i % group)
            encoded = [trxp.encode(push) for push in made]
            with BufferClient(server.target, timeout=600) as client:
                client.push(encoded[0], table=TABLE)
                control("-i", "on")
                for payload in encoded[1:]:
                    client.push(payload, table=TABLE)
            control("-d")
            drained = _drain(way, server.target, pushes * PER_PUSH[shape] // BATCH)
            time.sleep(1)  # the last confirm's commit
            control("-d")
            control("-i", "off")
        finally:
            server.stop()
    return (pushes - 1) * PER_PUSH[shape], drained


def _counted(way: str, pushes: int, out: Path, shape: str) -> tuple[int, int]:
    """`counted`, on a fresh server again where a connection under callgrind timed out before the
    server's first answer (its handshake waits on threads that valgrind runs one at a time)."""
    for _ in range(3):
        try:
            return counted(way, pushes, out, shape)
        except UnavailableError as exc:
            print(f"{way}: {exc}; on a fresh server again", file=sys.stderr)
            for path in out.glob("cg.*"):
                path.unlink()
    raise SystemExit(f"{way}: the server under callgrind did not answer")


def _drain(way: str, target: str, batches: int) -> int:
    """The experiences of `batches` consume batches drained `way`. A connection under callgrind
    may time out before the server's first answer (nothing taken then): drained again so."""
    drained = 0
    for _ in range(5):
        left = batches - drained // BATCH
        try:
            if way == "bytes":
                spec = SampleSpec(TABLE, batch_size=BATCH, delivery="consume", max_batches=left)
                drained += raw_consume(target, spec)[0] * BATCH
            else:
                drained += (decoded if way == "decoded" else columns)(target, left)
            return drained
        except UnavailableError as exc:
            print(f"{way}: {exc}; again", file=sys.stderr)
    raise SystemExit(f"{way}: the server under callgrind did not answer")


def totals(out: Path, part: int) -> tuple[int, int]:
    """Of dump `part`: every thread's instructions, and the writer's (the thread that commits)."""
    total = writer = 0
    for path in out.glob(f"cg.*.{part}-*"):
        text = path.read_bytes()
        found = re.search(rb"^totals: (\d+)", text, re.MULTILINE)
        count = int(found.group(1)) if found else 0
        total += count
        if b"mdb_txn_commit" in text:
            writer = max(writer, count)
    return total, writer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=8)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--shape", default="8k", choices=GROUPS, help="bench_reverb's experiences: 8k, or 40k")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows, pushed = [], []
    for way in args.ways.split(","):
        with tempfile.TemporaryDirectory() as out:
            counts = _counted(way, args.pushes, Path(out), args.shape)
            for phase, part, experiences in (("push", 1, counts[0]), (f"consume, {way}", 2, counts[1])):
                total, writer = totals(Path(out), part)
                row = (phase, total / experiences, writer / experiences)
                if phase == "push":
                    pushed.append(row)
                    continue
                rows.append(f"| {row[0]} | {row[1]:,.0f} | {row[2]:,.0f} | {row[1] - row[2]:,.0f} |")
                print(rows[-1], flush=True)
    if pushed:
        phase, total, writer = min(pushed, key=lambda row: row[1])
        rows.insert(0, f"| {phase} | {total:,.0f} | {writer:,.0f} | {total - writer:,.0f} |")
    about = (
        f"callgrind in the server, every thread; {args.pushes} pushes of {PER_PUSH[args.shape]} experiences of "
        f"{args.shape.upper()}B (groups of {GROUPS[args.shape]}, no estimator), the first not counted, then drained. "
        "Instructions an experience (the push: the least of the ways' runs, which repeat to about 1 %)."
    )
    columns_ = ["what", "the server's process", "its writer thread", "the rest (RPC threads, gRPC)"]
    command = " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    results.publish(results.section(HEADING, command, about, columns_, rows), HEADING, args.out)


if __name__ == "__main__":
    main()
