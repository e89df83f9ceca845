"""Where an `expbuf serve` process spends its CPU on a unary push of ONE 8 KB experience (a rollout
worker pushing each run as it ends), against a raw gRPC server that stores nothing receiving the
same bytes: the floor of a Python gRPC unary call (issue 64).

    .venv/bin/python bench/bench_one_push_instructions.py [--pushes 64] [--before /tmp/before]
        [--cases none,grpo,raw,raw-read] [--cpu 2000] [--out bench/RESULTS.md]

Each case starts a server under valgrind's callgrind on a fresh directory (every thread, the
writer's apart: the thread whose counts name mdb_txn_commit); one client pushes 16 pushes not
counted (imports, the first commits), then `--pushes` pushes one after the other, each of one
experience (bench_small_pushers.payload: runs of a task in groups of 8), counted. `none` and
`grpo`: a table of groups of 8 by task with that estimator (grpo: the advantage worker computes
a group's advantages as its last run is stored; counted once it has started), no ingest processes
(a small push is decoded in the process anyway); `raw`: bench/raw_grpc_server.py, the same
payloads as unary calls of bytes; `raw-read`: the same, its handler reading its message as a
stream of one, as expbuf's Push does (read once admitted: server/rpc/push/push_memory.py).
With `--before`, the expbuf cases of another checkout are counted beside. With `--cpu N`: the same
pushes without valgrind, N of them, and the server's user and system CPU (/proc/PID/stat fields
14 and 15, its ingest processes' too) a push: how much of it is the kernel's (the commit's fsync).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grpc  # noqa: E402
import results  # noqa: E402
from bench_push_before import package  # noqa: E402
from bench_server_instructions import totals  # noqa: E402
from bench_service import Proc  # noqa: E402
from bench_small_pushers import GROUP, payload  # noqa: E402

from expbuf.client import BufferClient  # noqa: E402
from expbuf.client.errors import UnavailableError  # noqa: E402

HEADING = "## Instructions of a push of one experience in the server's process (issue 64)"
WARM = 16  # pushes not counted
CASES = ("none", "grpo", "raw", "raw-read")
TABLE = "one"
RAW = {"raw": "raw gRPC, nothing stored", "raw-read": "raw gRPC, nothing stored, its message read as a stream of one"}


def start(case: str, data: str, env: dict[str, str], valgrind: list[str]) -> Proc:
    """The case's server (under `valgrind`'s argv where given)."""
    if case.startswith("raw"):
        argv = [str(HERE / "raw_grpc_server.py")]
    else:
        argv = ["-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1"]
        argv += ["--ingest-processes", "0"]
    if valgrind:
        return Proc(*valgrind, sys.executable, *argv, python="valgrind", env=env)
    return Proc(*argv, env=env)


def pusher(case: str, target: str) -> tuple[object, callable]:
    """A client and its push of one payload, durable before it returns."""
    if case.startswith("raw"):
        channel = grpc.insecure_channel(target)
        call = channel.unary_unary("/bench.Raw/Read" if case == "raw-read" else "/bench.Raw/Push")
        return channel, lambda data: call(data, timeout=600)
    client = BufferClient(target, timeout=600)
    grouping = {"group_by": "task", "group_size": GROUP}
    client.create_table(TABLE, estimator=case, exist_ok=True, **grouping)
    return client, lambda data: client.push(data, table=TABLE)


def pushed(case: str, pushes: int, tree: Path | None, out: Path | None) -> tuple[int, int] | tuple[float, float]:
    """One server: under callgrind (`out`), its `pushes` counted (every thread, the writer's);
    without (`out` None), its user and system CPU seconds over them."""
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        if tree is not None:
            env["PYTHONPATH"] = str(package(tree.resolve(), Path(tmp) / "pkg"))
        valgrind = []
        if out is not None:
            valgrind = ["--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes"]
            valgrind += [f"--callgrind-out-file={out}/cg.%p"]
        server = start(case, f"{tmp}/data", env, valgrind)
        try:
            client, push = pusher(case, server.target)
            for index in range(WARM):
                push(payload(1, index))
            if case == "grpo":  # the advantage worker loaded (torch) and computing
                server.wait_for("advantage worker started", timeout=900)
            made = [payload(1, WARM + index) for index in range(pushes)]
            if out is not None:
                subprocess.run(["callgrind_control", "-i", "on", str(server.proc.pid)], check=True, capture_output=True)
            else:
                before = cpu(server.proc.pid)
            for data in made:
                push(data)
            if out is None:
                after = cpu(server.proc.pid)
                return after[0] - before[0], after[1] - before[1]
            time.sleep(1)  # the last group's advantages
            for what in ("-d", "-i off"):
                subprocess.run(
                    ["callgrind_control", *what.split(), str(server.proc.pid)], check=True, capture_output=True
                )
            client.close()  # type: ignore[attr-defined]
        finally:
            server.stop()
    return totals(out, 1)


def cpu(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process and its live descendants (/proc/PID/stat 14, 15)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats[int(path.parent.name)] = path.read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
    tree, user, system = [pid], 0.0, 0.0
    while tree:
        current = tree.pop()
        fields = stats.get(current)
        if fields is not None:
            user, system = user + int(fields[11]) / tick, system + int(fields[12]) / tick
        tree.extend(child for child, f in stats.items() if int(f[1]) == current)
    return user, system


# Where the rest's instructions run, by the file or library of each function (callgrind_annotate's
# exclusive counts): the interpreter (every line of Python, expbuf's and gRPC's own Python layer),
# gRPC's C core and Cython layer, and the compiled code the rest calls.
PLACES = (
    ("Python-3.", "interpreter"),
    ("libpython", "interpreter"),
    ("cygrpc", "gRPC core"),
    ("_native", "TRXP codec"),
    ("native_", "TRXP codec"),
    ("mypyc", "TRXP codec"),
    ("_message", "protobuf"),
)


def places(out: Path) -> dict[str, int]:
    """Of dump 1, the threads but the writer: instructions by where they run (PLACES, else "C")."""
    found: dict[str, int] = {}
    for path in out.glob("cg.*.1-*"):
        if b"mdb_txn_commit" in path.read_bytes():
            continue
        listing = subprocess.run(
            ["callgrind_annotate", "--threshold=100", "--auto=no", str(path)], capture_output=True, text=True
        )
        for line in listing.stdout.split("file:function", 1)[-1].splitlines():
            row = re.match(r"\s*([\d,]+) \(.*?\)\s+(.*)$", line)
            if row is None:
                continue
            place = next((name for key, name in PLACES if key in row.group(2)), "C")
            found[place] = found.get(place, 0) + int(row.group(1).replace(",", ""))
    return found


def counted(case: str, pushes: int, tree: Path | None) -> tuple[float, float, dict[str, float]]:
    """Instructions a push in the server's process, and in its writer thread, `case` on `tree`; the
    rest's by where they run."""
    for _ in range(3):  # a connection under callgrind may time out before the server's first answer
        with tempfile.TemporaryDirectory() as out:
            try:
                total, writer = pushed(case, pushes, tree, Path(out))
            except UnavailableError as exc:
                print(f"{case}: {exc}; on a fresh server again", file=sys.stderr)
                continue
            split = {place: count / pushes for place, count in places(Path(out)).items()}
            return total / pushes, writer / pushes, split
    raise SystemExit(f"{case}: the server under callgrind did not answer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=64)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--before", type=Path)
    parser.add_argument("--cpu", type=int, default=0, help="pushes timed by /proc without valgrind (0: none)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for case in args.cases.split(","):
        trees = [("now", None)]
        if args.before is not None and not case.startswith("raw"):
            trees.insert(0, (f"before ({args.before.name})", args.before))
        for side, tree in trees:
            total, writer, split = counted(case, args.pushes, tree)
            where = " / ".join(f"{split.get(place, 0):,.0f}" for place in ("interpreter", "gRPC core", "C"))
            kernel = ""
            if args.cpu:
                user, system = pushed(case, args.cpu, tree, None)
                kernel = f"{user / args.cpu * 1e6:,.0f} / {system / args.cpu * 1e6:,.0f}"
            name = RAW.get(case, f"expbuf, estimator {case}, {side}")
            codec = split.get("TRXP codec", 0) + split.get("protobuf", 0)
            rows.append(
                f"| {name} | {total:,.0f} | {writer:,.0f} | {total - writer:,.0f} | {where} | {codec:,.0f} | {kernel} |"
            )
            print(rows[-1], flush=True)
    about = (
        f"callgrind in the server, every thread; {WARM} pushes not counted, then {args.pushes} unary pushes one "
        f"after the other, each of one 8 KB experience (groups of {GROUP} by task). Instructions a push; "
        f"user / system CPU µs a push from /proc over {args.cpu} pushes without valgrind (2 shared cores: "
        "a time, which moves with the load). The rest split by where its instructions run (callgrind_annotate's "
        "exclusive counts by file and library): the interpreter runs every line of Python, expbuf's and gRPC's "
        "own Python layer (grpc/_server.py) alike."
    )
    columns = [
        "server",
        "the server's process",
        "its writer thread",
        "the rest (RPC threads, gRPC)",
        "the rest: interpreter / gRPC core / other C",
        "the rest: TRXP codec and protobuf (compiled)",
        "user / system µs",
    ]
    command = " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    results.publish(results.section(HEADING, command, about, columns, rows), HEADING, args.out)


if __name__ == "__main__":
    main()
