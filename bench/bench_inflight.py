"""Calls that arrive together under max_inflight_bytes: the server's peak RSS while eight large
pushes or PutValues from expbuf's client arrive at once, under a small cap, beside another tree's.

    .venv/bin/python bench/bench_inflight.py [--out bench/RESULTS.md] [--repeat 3] [--before DIR]

Each load against an `expbuf serve` child with `--max-inflight-bytes 32 MiB`: eight threads, let
go together, each sends one call with a BufferClient: a push of 24 MiB sent whole
(`push_chunk_bytes = 0`), a PutValues of 24 MiB, or a push of one 48 MiB experience in 16 MiB
chunks (its tensor data staged as it comes); and one push of 24 MiB alone, for what a call's
copies take. The figures are the server's growth while they run, in MiB: its anonymous memory's
peak (RssAnon, sampled every 5 ms), what calls in flight hold, and its VmHWM since a reset just
before the calls, which counts the stored data's pages of LMDB's map too; each the median of
`--repeat` runs, each with a server of its own. With `--before DIR` (another source tree, such as
an export of main), each load also goes to that tree's server, which takes no declaration
(`expbuf-message-bytes`) and reads each call as it comes while what is held is below the cap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_digest import package_of  # noqa: E402
from bench_push_memory import AnonPeak, status  # noqa: E402
from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402

MB = 1 << 20
CAP = 32 * MB
CALLS = 8
HEADING = "## Calls that arrive together under max_inflight_bytes (issue 63)"


@dataclass(frozen=True)
class Load:
    method: str  # push | put_values
    size: int  # bytes of each call's payload or value
    chunk: int = 0  # the client's push_chunk_bytes (0: sent whole)
    calls: int = CALLS  # let go together


LOADS = {
    "1 push of 24 MiB, whole, alone": Load("push", 24 * MB, calls=1),
    "8 pushes of 24 MiB, whole": Load("push", 24 * MB),
    "8 PutValues of 24 MiB": Load("put_values", 24 * MB),
    "8 pushes of 48 MiB in 16 MiB chunks": Load("push", 48 * MB, 16 * MB),
}


def payload(n: int, size: int) -> bytes:
    """One experience of about `size` bytes (its response tokens 9 bytes each)."""
    import torch

    response = size // 9
    return trxp.encode(
        [
            Experience(
                eid=EID(batch=n, task=0),
                tokens=torch.zeros(response + 3, dtype=torch.int32),
                prompt_length=3,
                logprobs=torch.zeros(response),
                action_mask=torch.ones(response, dtype=torch.bool),
                reward=1.0,
            )
        ]
    )


def measure(load: Load, tree: Path | None) -> tuple[int, int]:
    """The server's peak growth in bytes while the load's calls arrive together: its anonymous
    memory's (RssAnon, sampled every 5 ms) and its RSS's (VmHWM, which counts the stored data's
    pages of LMDB's map too)."""
    bodies = [payload(n, load.size) if load.method == "push" else os.urandom(load.size) for n in range(load.calls)]
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as data:
        argv = ("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1")
        server = Proc(*argv, "--max-inflight-bytes", str(CAP), env=env)
        try:
            pid = server.proc.pid
            clients = [BufferClient(server.target, timeout=300, push_chunk_bytes=load.chunk) for _ in range(load.calls)]
            try:
                clients[0].push(payload(99, 1 << 16))  # warm
                time.sleep(2)
                Path(f"/proc/{pid}/clear_refs").write_text("5")
                before = status(pid, "VmRSS")
                go = threading.Barrier(load.calls)

                def call(client: BufferClient, n: int) -> None:
                    go.wait()
                    if load.method == "push":
                        client.push(bodies[n])
                    else:
                        client.put_values([f"k{n}"], [bodies[n]])

                with AnonPeak(pid) as anon:
                    threads = [threading.Thread(target=call, args=(c, n)) for n, c in enumerate(clients)]
                    for thread in threads:
                        thread.start()
                    for thread in threads:
                        thread.join()
                return anon.most - anon.before, status(pid, "VmHWM") - before
            finally:
                for client in clients:
                    client.close()
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another source tree, whose server takes each load too")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        before = None if args.before is None else package_of(args.before.resolve(), Path(scratch))
        for name, load in LOADS.items():
            cells = []
            for tree in ([before] if before is not None else []) + [None]:
                runs = [measure(load, tree) for _ in range(args.repeat)]
                anon, rss = (statistics.median(run[n] for run in runs) for n in (0, 1))
                cells.append(f"+{anon / MB:.0f} ({anon / CAP:.1f}x the cap), RSS +{rss / MB:.0f}")
            rows.append(f"| {name} | {load.calls * load.size // MB} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    columns = (["before"] if before is not None else []) + ["this tree"]
    body = "\n".join(
        [
            HEADING,
            "",
            f"Command: `python bench/bench_inflight.py --repeat {args.repeat}"
            + (f" --before {args.before}" if args.before else "")
            + f"`, at a load average of {os.getloadavg()[0]:.1f}. The server's peak growth in MiB while",
            "calls from expbuf's client arrive together under `max_inflight_bytes` = 32 MiB: its anonymous",
            "memory's (RssAnon, sampled every 5 ms; in parentheses, over the cap) and its RSS's (VmHWM);",
            f"each figure the median of {args.repeat} runs.",
            "",
            "| calls | MiB sent | " + " | ".join(columns) + " |",
            "| --- | --- | " + " | ".join("---" for _ in columns) + " |",
            *rows,
        ]
    )
    write_section(Path(args.out), HEADING, body + "\n\n")
    print(body)


if __name__ == "__main__":
    main()
