"""Where a trainer's decoded consume stream spends its time, client and server, from sampling profiles.

    pip install py-spy   # into the environment that runs this
    .venv/bin/python bench/profile_sample.py [--shape 8k|40k] [--prefetch 1] [--cycles 3] [--raw DIR]

A real `expbuf serve` is filled with bench_reverb's experiences (256 x 8 KB or 64 x 40 KB a
push, pre-encoded, each its own group), then drained by one consume stream of batches of 256
whose experiences are read (`Batch.experiences`, decoded into tensors, as bench_reverb's
decoded sample reads them), `--cycles` times. Over each drain py-spy samples this process (the
client: gRPC's receive, the reply's parts, the decode) and the server (its take, the commit,
the splice and send), every thread, native frames included, idle ones left out; each busy
sample goes to the first stage found on its stack. Beside it, each process's CPU per consumed
experience over the drains (py-spy's sampling slows both: the shares are what it is for).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_consume import STAGES as SERVER_STAGES  # noqa: E402
from bench_reverb import PER_PUSH, cpu_seconds, make_pushes, restamp  # noqa: E402
from bench_service import Proc  # noqa: E402
from profile_push import busy_samples  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402

BATCH = 256
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
# The client's stages: (stage, the function names that put a sample in it), most specific first.
LEFT_OUT = "the bench's own: its reader of the server's log, its sleep and its /proc reads (left out)"
CLIENT_STAGES = (
    (LEFT_OUT, ("Proc.__init__.<locals>.<lambda>", "time_sleep", "cpu_seconds ")),
    ("the garbage collector (a pass walks the process's tracked objects, torch's among them)", "gc_collect_main"),
    ("decode: gather the tensors' bytes, one buffer per dtype (`gather`)", "gather "),
    (
        "decode: parse and check the reply (`trxp.parse`)",
        ("parse ", "CPyPy_expbuf___client___trxp___codec___parse___parse "),
    ),
    ("decode: Experience objects (`to_experience`)", "to_experience "),
    ("decode: the rest (`decode_reply`)", "decode_reply "),
    ("receive: the reply's parts (`read_sample_reply`)", "read_sample_reply "),
    ("receive: gRPC's stream (messages in, credit out)", ("_next ", "__next__ ", "_MultiThreadedRendezvous")),
    ("hand-off: prefetch thread and caller", ("Prefetcher.", "sample (")),
    ("gRPC: the channel's polling thread", ("_poll_connectivity", "_spawn_delivery", "channel_spin")),
)


def drain(target: str, table: str, count: int, prefetch: int) -> None:
    with BufferClient(target, timeout=120) as client:
        got = 0
        for batch in client.sample(
            table, batch_size=BATCH, delivery="consume", max_batches=count // BATCH, prefetch=prefetch, timeout=60
        ):
            got += len(batch.experiences)
    assert got == count, (got, count)


def spy(pid: int, out: Path, *children: str) -> subprocess.Popen:
    command = [PY_SPY, "record", "-p", str(pid), "-r", "250", "--native", "--threads", *children]
    return subprocess.Popen([*command, "-f", "raw", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def shares(files: list[Path], stages: tuple) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    for path in files:
        counts += busy_samples(path, stages)
    counts.pop(LEFT_OUT, None)
    busy = sum(counts.values())
    return {stage: count / busy for stage, count in counts.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=("8k", "40k"), default="8k")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--cycles", type=int, default=3, help="fills and drains, each drain profiled")
    parser.add_argument("--experiences", type=int, help="per drain (default: 16384 of 8 KB, 4096 of 40 KB)")
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw output in this directory")
    args = parser.parse_args()
    count = args.experiences or (16384 if args.shape == "8k" else 4096)
    pushes, serial = make_pushes(args.shape, count // PER_PUSH[args.shape]), itertools.count()
    files: dict[str, list[Path]] = {"client": [], "server": []}
    cpu = {"client": 0.0, "server": 0.0, "seconds": 0.0}
    with tempfile.TemporaryDirectory() as data:
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1")
        try:
            with BufferClient(server.target, timeout=120) as client:
                client.create_table("t", estimator="none", group_by="none")
                server.wait_for("advantage worker")  # torch loaded: not a stage of a sample
                drain_pid = server.proc.pid
                for cycle in range(args.cycles):
                    restamp(pushes, serial)
                    for payload in [trxp.encode(p) for p in pushes]:
                        client.push(payload, table="t")
                    recorders = {}
                    sides = (("client", os.getpid(), ()), ("server", drain_pid, ("--subprocesses",)))
                    for side, pid, children in sides:
                        out = Path(data) / f"{side}.{cycle}.txt"
                        files[side].append(out)
                        recorders[side] = spy(pid, out, *children)  # the server is the client's child
                    time.sleep(1.0)  # attached
                    before = (time.process_time(), cpu_seconds(drain_pid), time.perf_counter())
                    drain(server.target, "t", count, args.prefetch)
                    after = (time.process_time(), cpu_seconds(drain_pid), time.perf_counter())
                    for key, now, then in zip(("client", "server", "seconds"), after, before, strict=True):
                        cpu[key] += now - then
                    for recorder in recorders.values():
                        recorder.send_signal(signal.SIGINT)
                        _, err = recorder.communicate(timeout=60)
                        if recorder.returncode not in (0, -signal.SIGINT):
                            sys.exit(f"py-spy failed: {err.decode().strip()}")
        finally:
            server.stop()
        if args.raw:
            args.raw.mkdir(parents=True, exist_ok=True)
            for path in files["client"] + files["server"]:
                shutil.copy(path, args.raw / path.name)
        client_shares = shares(files["client"], CLIENT_STAGES)
        server_shares = shares(files["server"], SERVER_STAGES)
    n = count * args.cycles
    print(
        f"consume of {args.shape[:-1]} KB experiences, batches of {BATCH}, decoded, prefetch {args.prefetch}, "
        f"{args.cycles} drains of {count}, under py-spy: {n / cpu['seconds']:,.0f} exp/s; CPU µs per experience: "
        f"client {cpu['client'] / n * 1e6:.1f}, server {cpu['server'] / n * 1e6:.1f}"
    )
    for side, found in (("client", client_shares), ("server", server_shares)):
        print(f"\n| stage ({side}) | share of its busy samples |\n| --- | ---: |")
        for stage, share in found.items():
            print(f"| {stage} | {share:.0%} |")


if __name__ == "__main__":
    main()
