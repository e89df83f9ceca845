"""A push's memory: the server's RSS before, at its peak and after large pushes, each sent
whole (one message) and in chunks (the clients' default), side by side.

    .venv/bin/python bench/bench_push_memory.py [--out bench/RESULTS.md] [--repeat 3] [--only NAME ...]
        [--before DIR]

Loads against an `expbuf serve` child with its defaults: 4 concurrent pushes of 63 MiB
(7 experiences of 1 Mi response tokens each), one push of 252 MiB (28 of them), and pushes
whose bytes sit in the metadata pickle: 64 MiB in one experience's `info` (a bytes value), and
64 MiB as 16 experiences of 4 MiB of `info` each, beside 64 MiB of tensors for comparison.
The peak is VmHWM since a reset just before the pushes; "after" is VmRSS 3 s after the last
reply. Anonymous memory (RssAnon) is sampled every 5 ms meanwhile: its peak and its value after.
A refused push counts as done when refused; its row says so. Each figure is the median of
`--repeat` runs, each with a server of its own (gRPC's copies make single runs vary by 0.5x).
With `--before DIR` (another source tree), each load is also sent whole to that tree's server.
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
from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, ExpbufError, Experience, trxp  # noqa: E402
from expbuf.client.rpc.connection import DEFAULT_PUSH_CHUNK_BYTES  # noqa: E402

MB = 1 << 20
HEADING = "## A push's memory (issue 16)"


@dataclass(frozen=True)
class Load:
    pushes: int
    experiences: int  # per push
    meta: int  # bytes of `info` per experience (0: none); its response is then 1 token
    response: int = 1 << 20  # response tokens per experience (9 bytes each)


LOADS = {
    "4 x 63 MiB": Load(4, 7, 0),
    "1 x 252 MiB": Load(1, 28, 0),
    "1 x 64 MiB, tensors": Load(1, 7, 0, 64 * MB // 7 // 9),
    "1 x 64 MiB in one info": Load(1, 1, 64 * MB, 1),
    "1 x 64 MiB in 16 infos": Load(1, 16, 4 * MB - 4096, 1),
}
SENT = {"whole": 0, f"in {DEFAULT_PUSH_CHUNK_BYTES // MB} MiB chunks": DEFAULT_PUSH_CHUNK_BYTES}


def payload(push: int, load: Load) -> bytes:
    import torch

    response = load.response
    return trxp.encode(
        Experience(
            eid=EID(batch=push, task=task),
            tokens=torch.zeros(response + 3, dtype=torch.int32),
            prompt_length=3,
            logprobs=torch.zeros(response),
            action_mask=torch.ones(response, dtype=torch.bool),
            reward=1.0,
            info={"blob": bytes(load.meta)} if load.meta else {},
        )
        for task in range(load.experiences)
    )


def status(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(name)


class AnonPeak:
    """The most anonymous memory (RssAnon) process `pid` held while the block ran, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = self.most = status(pid, "RssAnon")
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample)

    def __enter__(self) -> AnonPeak:
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._sampler.join()

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.most = max(self.most, status(self.pid, "RssAnon"))


@dataclass
class Figures:
    in_flight: int
    before: int
    peak: int
    after: int
    anon_before: int
    anon_peak: int
    anon_after: int
    refused: str


def measure(load: Load, client_options: dict[str, int], tree: Path | None = None) -> Figures:
    """The server's memory around `load`'s pushes, made with a BufferClient of `client_options`,
    the server that of this tree or of the package directory `tree`."""
    payloads = [payload(p, load) for p in range(load.pushes)]
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as data:
        argv = ("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1")
        server = Proc(*argv, env=env)
        try:
            pid = server.proc.pid
            with BufferClient(server.target, timeout=300, **client_options) as client:
                client.push(payload(99, Load(1, 1, 0, 1 << 16)))  # warm, in one message either way
                time.sleep(2)
                Path(f"/proc/{pid}/clear_refs").write_text("5")
                before = status(pid, "VmRSS")
                refusals: list[str] = []

                def push(body: bytes) -> None:
                    try:
                        client.push(body)
                    except ExpbufError as exc:
                        refusals.append(exc.code.name)

                with AnonPeak(pid) as anon:
                    threads = [threading.Thread(target=push, args=(p,)) for p in payloads]
                    for thread in threads:
                        thread.start()
                    for thread in threads:
                        thread.join()
                    time.sleep(3)
                return Figures(
                    sum(map(len, payloads)),
                    before,
                    status(pid, "VmHWM"),
                    status(pid, "VmRSS"),
                    anon.before,
                    anon.most,
                    status(pid, "RssAnon"),
                    ", ".join(sorted(set(refusals))),
                )
        finally:
            server.stop()


def median(runs: list[Figures]) -> Figures:
    """Each figure the median of the runs'."""
    middle = {
        name: int(statistics.median(getattr(run, name) for run in runs))
        for name in ("in_flight", "before", "peak", "after", "anon_before", "anon_peak", "anon_after")
    }
    return Figures(**middle, refused=runs[0].refused)


def row(name: str, sent: str, f: Figures) -> str:
    refused = f" (refused: {f.refused})" if f.refused else ""
    return (
        f"| {name}{refused} | {sent} | {f.before // MB} | {f.peak // MB} (+{(f.peak - f.before) / f.in_flight:.2f}x) "
        f"| {f.after // MB} (+{(f.after - f.before) // MB}) "
        f"| +{(f.anon_peak - f.anon_before) / f.in_flight:.2f}x | +{(f.anon_after - f.anon_before) // MB} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--repeat", type=int, default=3, help="runs of each load and way of sending; medians shown")
    parser.add_argument("--only", nargs="*", choices=list(LOADS), help="these loads only (and RESULTS.md untouched)")
    parser.add_argument("--before", type=Path, help="another source tree, whose server is sent each load whole")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        before = None if args.before is None else package_of(args.before.resolve(), Path(scratch))
        for name, load in LOADS.items():
            if args.only and name not in args.only:
                continue
            ways = [(f"whole, to {args.before}", 0, before)] if before is not None else []
            for sent, chunk, tree in [*ways, *((sent, chunk, None) for sent, chunk in SENT.items())]:
                runs = [measure(load, {"push_chunk_bytes": chunk}, tree) for _ in range(args.repeat)]
                rows.append(row(name, sent, median(runs)))
                print(rows[-1], flush=True)
    body = "\n".join(
        [
            HEADING,
            "",
            f"Command: `python bench/bench_push_memory.py --repeat {args.repeat}"
            + (f" --before {args.before}" if args.before else "")
            + "`; server RSS in MiB (peak: + multiple",
            "of the bytes in flight; after: + MiB over before), and its anonymous memory (RssAnon, sampled every",
            f"5 ms) over before; each figure the median of {args.repeat} runs. Each load sent whole (one message) and",
            "in chunks (the clients' default), side by side in one run.",
            "",
            "| pushes | sent | before | peak | after | anon peak | anon after |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    if not args.only:
        write_section(Path(args.out), HEADING, body + "\n\n")
    print(body)


if __name__ == "__main__":
    main()
