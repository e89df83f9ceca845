"""A push's memory: the server's RSS before, at its peak and after concurrent large pushes.

    .venv/bin/python bench/bench_push_memory.py [--out bench/RESULTS.md]

Two loads against an `expbuf serve` child with its defaults: 4 concurrent pushes of 63 MiB
(7 experiences of 1 Mi response tokens each) and one push of 252 MiB (28 of them). The peak
is VmHWM since a reset just before the pushes; "after" is VmRSS 3 s after the last ack.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402

MB = 1 << 20
LOADS = {"4 x 63 MiB": (4, 7), "1 x 252 MiB": (1, 28)}  # pushes, experiences of 9 MiB each
HEADING = "## A push's memory (issue 16)"


def payload(push: int, experiences: int) -> bytes:
    import torch

    response = 1 << 20
    return trxp.encode(
        Experience(
            eid=EID(batch=push, task=task),
            tokens=torch.zeros(response + 3, dtype=torch.int32),
            prompt_length=3,
            logprobs=torch.zeros(response),
            action_mask=torch.ones(response, dtype=torch.bool),
            reward=1.0,
        )
        for task in range(experiences)
    )


def status(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(name)


def measure(pushes: int, experiences: int) -> tuple[int, int, int, int]:
    """In flight, and the server's RSS before, at its peak and after."""
    payloads = [payload(p, experiences) for p in range(pushes)]
    with tempfile.TemporaryDirectory() as data:
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1")
        try:
            pid = server.proc.pid
            with BufferClient(server.target, timeout=300) as client:
                client.push(payload(99, 1))  # warm
                time.sleep(2)
                Path(f"/proc/{pid}/clear_refs").write_text("5")
                before = status(pid, "VmRSS")
                threads = [threading.Thread(target=client.push, args=(p,)) for p in payloads]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                time.sleep(3)
                return sum(map(len, payloads)), before, status(pid, "VmHWM"), status(pid, "VmRSS")
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    rows = []
    for name, (pushes, experiences) in LOADS.items():
        in_flight, before, peak, after = measure(pushes, experiences)
        rows.append(
            f"| {name} | {before // MB} | {peak // MB} (+{(peak - before) / in_flight:.2f}x) "
            f"| {after // MB} (+{(after - before) // MB}) |"
        )
        print(rows[-1], flush=True)
    body = "\n".join(
        [
            HEADING,
            "",
            "Command: `python bench/bench_push_memory.py`; server RSS in MiB (peak: + multiple of the bytes in flight;",
            "after: + MiB over before).",
            "",
            "| pushes | before | peak | after |",
            "| --- | --- | --- | --- |",
            *rows,
        ]
    )
    write_section(Path(args.out), HEADING, body + "\n\n")
    print(body)


if __name__ == "__main__":
    main()
