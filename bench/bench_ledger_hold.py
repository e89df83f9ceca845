"""How long the prompt ledger's largest calls hold the writer: what a concurrent push waits.

    .venv/bin/python bench/bench_ledger_hold.py [--count N] [--rounds 3] [--out bench/RESULTS.md]

One `expbuf serve` on loopback, a dataset of 2**20 prompts with a seed on table `t`, and a
second process that pushes a group of 2 small experiences into table `w` again and again,
timing each push. One client calls, `--rounds` times: Claim of `count` prompts (by default
the most one call may name), RenewClaims of them and ReleaseClaims of them. For each call:
its seconds end to end, and the slowest push that overlapped it; the slowest push of a quiet
spell before the calls is the baseline (a push's own commit and fsync). A push waits while
the single writer is held, so its wait is the call's hold of the writer, whatever tenant
pushes; the rest of the call's time is building, sending and reading its messages.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import Proc  # noqa: E402
from bench_store import experience  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient  # noqa: E402
from expbuf.client.schema.prompts import MAX_PROMPTS_PER_CALL  # noqa: E402

HEADING = "## The prompt ledger's largest calls and the writer (issue 39)"
CALLS = ("claim", "renew", "release")


def pusher(target: str, ready: Event, stop: Event, out: Connection) -> None:
    """Push groups into table `w` until `stop` (`ready` after the first ten); send back each
    push's (start, end), monotonic."""
    spans = []
    with BufferClient(target, timeout=120) as client:
        batch = 0
        while not stop.is_set():
            group = [experience(batch, 0, run, tokens=16) for run in (0, 1)]
            began = time.monotonic()
            client.push(group, table="w")
            spans.append((began, time.monotonic()))
            batch += 1
            if batch == 10:
                ready.set()
    out.send(spans)


def slowest(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """The longest push that overlapped [start, end]."""
    return max((b - a for a, b in spans if b > start and a < end), default=0.0)


def run(count: int, rounds: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as data:
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1")
        try:
            with BufferClient(server.target, timeout=600) as client:
                client.create_table("t", group_size=2)
                client.create_table("w", group_size=2, estimator="none")
                client.create_dataset("t", "math", 2**20, seed=1, max_attempts=1000)
                spawn = multiprocessing.get_context("spawn")  # a fork would copy the client's channel
                ready, stop, (receive, send) = spawn.Event(), spawn.Event(), spawn.Pipe(duplex=False)
                worker = spawn.Process(target=pusher, args=(server.target, ready, stop, send))
                worker.start()
                assert ready.wait(300), "the pusher did not start"
                quiet = (time.monotonic(), time.monotonic() + 2.0)
                time.sleep(2.0)
                windows: dict[str, list[tuple[float, float]]] = {call: [] for call in CALLS}
                for _ in range(rounds):
                    began = time.monotonic()
                    prompts = client.claim("t", "math", count, lease_seconds=3600).prompts
                    windows["claim"].append((began, time.monotonic()))
                    assert len(prompts) == count, len(prompts)
                    began = time.monotonic()
                    assert client.renew_claims(prompts, 3600) == []
                    windows["renew"].append((began, time.monotonic()))
                    began = time.monotonic()
                    assert client.release_claims(prompts) == count
                    windows["release"].append((began, time.monotonic()))
                    time.sleep(1.0)
                stop.set()
                spans = receive.recv()
                worker.join()
        finally:
            server.stop()
    out = {"quiet": [slowest(spans, *quiet)]}
    for call in CALLS:
        out[call] = [end - start for start, end in windows[call]]
        out[f"{call}_push"] = [slowest(spans, start, end) for start, end in windows[call]]
    print(out, file=sys.stderr)
    return out


def report(command: str, count: int, figures: dict[str, list[float]]) -> str:
    load = os.getloadavg()[0]
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores (load average {load:.1f} at the end), fsync on every commit. One"
        f" `expbuf serve`, a dataset of 2**20 prompts with a seed; a second process pushes a group of 2 small"
        f" experiences into another table again and again. Each call names {count:,} prompts; medians (and"
        f" the worst) of {len(figures['claim'])} rounds. The slowest push of a quiet spell:"
        f" {figures['quiet'][0] * 1000:.0f} ms.",
        "",
        "| call | seconds end to end | slowest concurrent push (the writer's hold) |",
        "| --- | --- | --- |",
    ]
    for call in CALLS:
        took, push = figures[call], figures[f"{call}_push"]
        lines.append(
            f"| {call} | {statistics.median(took):.2f} s (worst {max(took):.2f}) "
            f"| {statistics.median(push) * 1000:.0f} ms (worst {max(push) * 1000:.0f}) |"
        )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=MAX_PROMPTS_PER_CALL, help="prompts per call (default: the most)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the section into this RESULTS.md")
    args = parser.parse_args()
    figures = run(args.count, args.rounds)
    command = f"python bench/bench_ledger_hold.py --count {args.count} --rounds {args.rounds}"
    section = report(command, args.count, figures)
    print(section)
    if args.out:
        write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
