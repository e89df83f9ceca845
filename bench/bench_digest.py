"""What packing an experience costs the server, and push throughput before and after a change to it.

    .venv/bin/python bench/bench_digest.py [--repeats 15] [--rounds 3] [--before DIR] [--out bench/RESULTS.md]

1. Per experience, in µs on one core, at bench_reverb's 8 KB shape (256 a push) and its 40 KB one
   (64 a push): the canonical repack (`trxp.pack_item`), the digests a store could take of the
   packed payload (SHA-256, XXH3-128, BLAKE3 where the `blake3` package is installed) and all of
   `Entry.of` as this tree takes it. Median over the repeats, the fastest in parentheses.
2. Push throughput through `expbuf serve` (estimator none, durable acks, 4 pushers, 8 pushes each
   of both shapes): this tree's server, and with `--before DIR` the server of another source tree
   in alternating rounds, so that both see the same machine. DIR holds the repository's files at
   another commit, e.g. `git archive e13e62d | tar -x -C DIR` for the tree before format 4.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import xxhash

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import PER_PUSH, make_pushes  # noqa: E402
from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402
from expbuf.server.store import Entry  # noqa: E402

SHAPES = ("8k", "40k")
PUSHERS, PUSHES = 4, 8


def timed(run: Callable[[], object], count: int, repeats: int) -> tuple[float, float]:
    """(median, fastest) µs per experience."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / count, min(times) * 1e6 / count


def digests() -> dict[str, Callable[[bytes], bytes]]:
    found: dict[str, Callable[[bytes], bytes]] = {
        "SHA-256 (hashlib)": lambda blob: hashlib.sha256(blob).digest()[:16],
        "XXH3-128 (xxhash)": xxhash.xxh3_128_digest,
    }
    try:
        import blake3
    except ImportError:
        return found
    found["BLAKE3 (blake3)"] = lambda blob: blake3.blake3(blob).digest(16)
    return found


def costs(payloads: dict[str, list[bytes]], repeats: int) -> dict[str, dict[str, tuple[float, float]]]:
    """µs per experience of each step, by shape."""
    return {shape: shape_costs(shape_payloads, repeats) for shape, shape_payloads in payloads.items()}


def shape_costs(payloads: list[bytes], repeats: int) -> dict[str, tuple[float, float]]:
    items = [item for payload in payloads for item in trxp.parse(payload)]
    blobs = [trxp.pack_item(item) for item in items]
    row = {"canonical repack (pack_item)": timed(lambda: [trxp.pack_item(i) for i in items], len(items), repeats)}
    for name, digest in digests().items():
        row[name] = timed(lambda digest=digest: [digest(b) for b in blobs], len(items), repeats)
    row["Entry.of (repack + digest + fields)"] = timed(lambda: [Entry.of(i) for i in items], len(items), repeats)
    return row


def push_rate(tree: Path | None, payloads: list[bytes], per_push: int) -> float:
    """Experiences a second pushed by PUSHERS clients into a fresh server of this tree (or `tree`)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    with tempfile.TemporaryDirectory() as data:
        argv = ["-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "0"]
        server = Proc(*argv, env=env)
        try:
            with BufferClient(server.target) as client:
                client.create_table("bench", estimator="none", group_by="none")
            shares = [payloads[i::PUSHERS] for i in range(PUSHERS)]

            def push(share: list[bytes]) -> None:
                with BufferClient(server.target, timeout=120) as client:
                    for payload in share:
                        client.push(payload, table="bench")

            threads = [threading.Thread(target=push, args=(share,)) for share in shares]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return len(payloads) * per_push / (time.perf_counter() - start)
        finally:
            server.stop()


def package_of(tree: Path, into: Path) -> Path:
    """A directory whose `expbuf` package is the source tree `tree`, laid out as pyproject maps it."""
    package = into / "expbuf"
    package.mkdir()
    for name, source in (("server", "server"), ("client", "client"), ("proto", "proto/expbuf"), ("ray", "server/ray")):
        (package / name).symlink_to(tree / source)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another source tree whose server is measured beside this one")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    payloads = {shape: [trxp.encode(push) for push in make_pushes(shape, PUSHES * PUSHERS)] for shape in SHAPES}
    steps = costs({shape: shape_payloads[:2] for shape, shape_payloads in payloads.items()}, args.repeats)
    for shape, row in steps.items():
        for name, (median, fastest) in row.items():
            print(f"{shape} {name}: {median:.1f} ({fastest:.1f}) µs")
    rates: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        trees: dict[str, Path | None] = {"after": None}
        if args.before is not None:
            trees = {"before": package_of(args.before.resolve(), Path(scratch)), **trees}
        for _ in range(args.rounds):
            for label, tree in trees.items():
                for shape in SHAPES:
                    rate = push_rate(tree, payloads[shape], PER_PUSH[shape])
                    rates.setdefault((label, shape), []).append(rate)
                    print(f"{label} {shape}: {rate:,.0f} experiences/s")
    pushed = {key: statistics.median(values) for key, values in rates.items()}
    write_section(Path(args.out), "## Packing and digest", section(steps, pushed, args))


def section(
    steps: dict[str, dict[str, tuple[float, float]]], pushed: dict[tuple[str, str], float], args: argparse.Namespace
) -> str:
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    lines = [
        "## Packing and digest: no SHA-256 on the push path (issue 22)",
        "",
        f"`bench/bench_digest.py --repeats {args.repeats} --rounds {args.rounds}"
        + (" --before DIR` (DIR: the tree before format 4)" if args.before else "`")
        + f"; {os.cpu_count()} cores, load average {load} at the end (a shared, busy machine: read the ratios).",
        "",
        "| µs per experience, median (fastest) | 8 KB | 40 KB |",
        "| --- | --- | --- |",
    ]
    for name in steps["8k"]:
        cells = [f"{steps[shape][name][0]:.1f} ({steps[shape][name][1]:.1f})" for shape in SHAPES]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines += [
        "",
        f"| push through `expbuf serve`, {PUSHERS} pushers, experiences/s (median of {args.rounds} rounds) "
        "| 8 KB | 40 KB |",
        "| --- | --- | --- |",
    ]
    for label in ("before", "after"):
        if (label, "8k") in pushed:
            lines.append(f"| {label} | {' | '.join(f'{pushed[(label, shape)]:,.0f}' for shape in SHAPES)} |")
    if ("before", "8k") in pushed:
        ratios = [pushed[("after", shape)] / pushed[("before", shape)] for shape in SHAPES]
        lines.append(f"| after / before | {' | '.join(f'{ratio:.2f}' for ratio in ratios)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
