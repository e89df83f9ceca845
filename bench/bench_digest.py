"""What packing an experience costs the server, and its ingest before and after a change to it.

    .venv/bin/python bench/bench_digest.py [--repeats 15] [--rounds 5] [--before DIR] [--out bench/RESULTS.md]

1. Per experience, in µs on one core, at bench_reverb's 8 KB shape (256 a push) and its 40 KB one
   (64 a push): the scan of the pushed metadata pickle, the canonical repack (`trxp.pack_item`),
   the metadata pickle it writes (`fragment`) and a bare walk of that pickle's opcodes (the least a
   proof that a pushed pickle is already canonical would cost), the digests a store could take of the
   packed payload (SHA-256, XXH3-128, BLAKE3 where the `blake3` package is installed) and all of
   `Entry.of` as this tree takes it. Median over the repeats, the fastest in parentheses.
2. The server's ingest of 8 pushes of each shape into a fresh store (estimator none): CPU time per
   experience to decode them (parse and Entry.of, as ingest.entries_of) and to store them (a
   durable put of each push), in a child process of this tree, and with `--before DIR` of another
   source tree in alternating rounds, so that both see the same machine. CPU time, not wall time:
   on a shared machine the wall time of a push varies by more than the digest costs. DIR holds
   the repository's files at another commit, e.g. `git archive e13e62d | tar -x -C DIR` for the
   tree before format 4.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import xxhash

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import PER_PUSH, make_pushes  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import trxp  # noqa: E402
from expbuf.client.trxp.codec.build import fragment  # noqa: E402
from expbuf.client.trxp.codec.common import HEADER  # noqa: E402
from expbuf.client.trxp.codec.pickles import scan_pickle  # noqa: E402
from expbuf.server.store import Entry  # noqa: E402

SHAPES = ("8k", "40k")
PUSHES = 8


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
    metas = [memoryview(payload)[trxp.HEADER_SIZE : trxp.HEADER_SIZE + meta_length(payload)] for payload in payloads]
    row = {
        "metadata scan of the push (scan_pickle)": timed(
            lambda: [scan_pickle(meta, trxp.Work(1 << 40)) for meta in metas], len(items), repeats
        ),
        "canonical repack (pack_item)": timed(lambda: [trxp.pack_item(i) for i in items], len(items), repeats),
        "of which the metadata pickle (fragment)": timed(
            lambda: [fragment(i.meta) for i in items], len(items), repeats
        ),
    }
    fragments = [b"".join(fragment(item.meta)) for item in items]
    row["a bare walk of that pickle's opcodes"] = timed(lambda: [walk(f) for f in fragments], len(items), repeats)
    for name, digest in digests().items():
        row[name] = timed(lambda digest=digest: [digest(b) for b in blobs], len(items), repeats)
    row["Entry.of (repack + digest + fields)"] = timed(lambda: [Entry.of(i) for i in items], len(items), repeats)
    return row


def ingest_cost(tree: Path | None, shape: str) -> dict[str, float]:
    """CPU µs per experience of a server's ingest (decode: parse and Entry.of; store: a durable
    put of each push), in a child process of this tree or of `tree`."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    command = [sys.executable, __file__, "--child", shape]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def child(shape: str) -> None:
    """ingest_cost's child: PUSHES pushes of `shape` into a fresh store, timed in CPU seconds."""
    from expbuf.server.rpc.push.ingest import entries_of
    from expbuf.server.store import Store
    from expbuf.server.store.schema.table_config import TableConfig

    payloads = [trxp.encode(push) for push in make_pushes(shape, PUSHES)]
    decode = store = 0.0
    with tempfile.TemporaryDirectory() as data, Store(Path(data)) as buffer:
        buffer.create_table(TableConfig.of(name="bench", estimator="none", group_by="none"))
        for payload in payloads:
            start = time.process_time()
            entries = entries_of(payload)
            middle = time.process_time()
            buffer.put_entries("bench", entries)
            decode, store = decode + middle - start, store + time.process_time() - middle
    count = PUSHES * PER_PUSH[shape]
    print(json.dumps({"decode": decode * 1e6 / count, "store": store * 1e6 / count}))


# The argument size of each opcode of a canonical metadata pickle that has one of a fixed size.
_FIXED = {**dict.fromkeys(b"}])N\x88\x89(usaet\x85\x86\x87", 0), ord("K"): 1, ord("M"): 2, ord("J"): 4, ord("G"): 8}


def walk(raw: bytes) -> int:
    """Step over the opcodes of a canonical metadata pickle and count them, checking nothing: the
    least a proof that a pushed pickle is canonical (sorted keys, minimal ints, no memo) costs."""
    pos, ops = 0, 0
    while pos < len(raw):
        code = raw[pos]
        ops += 1
        size = _FIXED.get(code)
        if size is not None:
            pos += 1 + size
        elif code == ord("X"):  # BINUNICODE
            pos += 5 + int.from_bytes(raw[pos + 1 : pos + 5], "little")
        elif code == ord("C"):  # SHORT_BINBYTES
            pos += 2 + raw[pos + 1]
        else:
            raise ValueError(f"opcode {code} is not in the metadata of these shapes")
    return ops


def meta_length(payload: bytes) -> int:
    _, _, length, _ = HEADER.unpack_from(payload)
    return int(length)


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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another source tree whose ingest is measured beside this one's")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--child", choices=SHAPES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    steps = costs({shape: [trxp.encode(push) for push in make_pushes(shape, 2)] for shape in SHAPES}, args.repeats)
    for shape, row in steps.items():
        for name, (median, fastest) in row.items():
            print(f"{shape} {name}: {median:.1f} ({fastest:.1f}) µs")
    rounds: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        trees: dict[str, Path | None] = {"after": None}
        if args.before is not None:
            trees = {"before": package_of(args.before.resolve(), Path(scratch)), **trees}
        for _ in range(args.rounds):
            for label, tree in trees.items():
                for shape in SHAPES:
                    cost = ingest_cost(tree, shape)
                    rounds.setdefault((label, shape), []).append(cost)
                    print(f"{label} {shape}: decode {cost['decode']:.1f} µs, store {cost['store']:.1f} µs")
    ingest = {
        key: {part: statistics.median(cost[part] for cost in costs_) for part in ("decode", "store")}
        for key, costs_ in rounds.items()
    }
    write_section(Path(args.out), "## Packing and digest", section(steps, ingest, args))


def section(
    steps: dict[str, dict[str, tuple[float, float]]],
    ingest: dict[tuple[str, str], dict[str, float]],
    args: argparse.Namespace,
) -> str:
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    lines = [
        "## Packing and digest: XXH3-128 instead of SHA-256 (issue 22)",
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
        f"| server ingest, CPU µs per experience (median of {args.rounds} rounds): decode + store | 8 KB | 40 KB |",
        "| --- | --- | --- |",
    ]
    for label in ("before", "after"):
        if (label, "8k") in ingest:
            cells = [f"{ingest[(label, s)]['decode']:.1f} + {ingest[(label, s)]['store']:.1f}" for s in SHAPES]
            lines.append(f"| {label} | {' | '.join(cells)} |")
    if ("before", "8k") in ingest:
        ratios = [sum(ingest[("before", s)].values()) / sum(ingest[("after", s)].values()) for s in SHAPES]
        lines.append(f"| experiences a CPU second ingests, after / before | {' | '.join(f'{r:.2f}' for r in ratios)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
