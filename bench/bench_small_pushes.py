"""What pushes of a few experiences each cost a rows table, and its drain after them (issue 64): rollout
workers that push each trajectory as it ends (an asynchronous or multi-turn agent's), side by side
with pushes of a whole batch.

    .venv/bin/python bench/bench_small_pushes.py [--experiences 4096] [--sizes 1,4,16,256] [--rounds 3]
        [--group 1] [--without-growth | --before TREE] [--out bench/RESULTS.md]

Each round fills a fresh rows table (groups of one, or of --group runs of a task; no estimator) with
the same 8 KB experiences (bench_reverb's shape) in pushes of each size, one durable commit a push
(`Store.put_entries`, one after the other), then drains it as a Sample stream's server does: takes
of 256 held, each confirmed (consumed) by the next take, one durable commit each. CPU µs an
experience of the fill and of the drain (this process: the store's writer thread included), and
bytes the fill wrote an experience (LMDB's pages handed to write calls: storage_writes.py), medians
of the rounds, and the segments the table kept. With --without-growth, "before" is this tree with every push's groups in
segments of their own (core/verbs/rows/segments.GROW_BELOW = 0), as before the newest segment grew. With
--before TREE (an earlier checkout of expbuf, its compiled codec beside it), each round runs that
tree's store in a process of its own beside this tree's, which goes first alternating.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_consume import package  # noqa: E402
from bench_take_floor import entries  # noqa: E402
from results import publish, section  # noqa: E402
from storage_writes import written  # noqa: E402

from expbuf.server.store import Store  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

try:
    from expbuf.server.store.core.verbs.rows import segments
except ImportError:  # a tree before a rows table's verbs had a room of their own (--before)
    from expbuf.server.store.core.verbs import segments  # type: ignore[no-redef]

HEADING = "## Pushes of a few experiences each, and the drain after them (issue 64)"
BATCH = 256


def one(size: int, count: int, group: int) -> dict[str, float]:
    """A fresh rows table of groups of `group` filled in pushes of `size`, then drained: CPU µs an
    experience of each, and the segments it kept."""
    pushes = [entry for push in entries(count, group, itertools.count()) for entry in push]
    config = (
        TableConfig.of(name="t", estimator="none", group_by="none")
        if group == 1
        else TableConfig.of(name="t", estimator="none", group_by="task", group_size=group)
    )
    config = dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout="rows"))
    with tempfile.TemporaryDirectory() as data, Store(Path(data), map_size=8 << 30) as store:
        store.create_table(config)
        start, wrote = time.process_time(), written()
        for at in range(0, count, size):
            store.put_entries("t", pushes[at : at + size])
        fill, wrote = time.process_time() - start, written() - wrote
        with store.environment.read() as txn, txn.cursor(db=store.db["segs"]) as cur:
            segments = sum(1 for _ in cur)
        spec = TakeSpec("t", batch_size=BATCH, delivery="consume", wait_seconds=0)
        start, held, taken = time.process_time(), "", 0
        while taken < count:
            batch = store.sample(spec, hold=True, confirm=held)
            assert batch is not None
            taken, held = taken + len(batch.uids), batch.lease_id
            batch.release()
        store.confirm(held, spec)
        drain = time.process_time() - start
    return {"fill": fill / count * 1e6, "written": wrote / count, "drain": drain / count * 1e6, "segments": segments}


def child(
    tree: Path | None, sizes: list[int], count: int, group: int, grow: bool = True
) -> dict[int, dict[str, float]]:
    """`one` of each size in a process of its own, with `tree`'s expbuf (None: this one); without
    `grow`, every push's groups in segments of their own (segments.GROW_BELOW = 0)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as root:
        if tree is not None:
            env["PYTHONPATH"] = f"{package(tree, Path(root))}{os.pathsep}{HERE}"
        argv = [sys.executable, __file__, "--child", ",".join(map(str, sizes)), "--experiences", str(count)]
        argv += ["--group", str(group)] + ([] if grow else ["--no-growth"])
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return {int(size): figures for size, figures in json.loads(done.stdout).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiences", type=int, default=4096)
    parser.add_argument("--sizes", default="1,4,16,256", help="experiences a push, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group", type=int, default=1, help="the table's group size (each push holds whole groups)")
    parser.add_argument("--before", type=Path, help="an earlier tree of expbuf to measure side by side")
    parser.add_argument("--out", type=Path, help="write the section into this RESULTS.md")
    parser.add_argument(
        "--without-growth",
        action="store_true",
        help="beside this tree, this tree with every push's groups in segments of their own (no newest segment grown)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--no-growth", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(size) for size in (args.child or args.sizes).split(",")]
    if any(size % args.group or args.experiences % size for size in sizes):
        parser.error(f"each push holds whole groups of {args.group}, and the pushes make {args.experiences}")
    if args.child:
        if args.no_growth:
            segments.GROW_BELOW = 0
        print(json.dumps({size: one(size, args.experiences, args.group) for size in sizes}))
        return
    trees: list[tuple[str, Path | None, bool]] = [("now", None, True)]
    if args.before:
        trees = [("after", None, True), ("before", args.before.resolve(), True)]
    elif args.without_growth:
        trees = [("after", None, True), ("before", None, False)]
    load = os.getloadavg()
    runs: dict[str, list[dict[int, dict[str, float]]]] = {name: [] for name, _, _ in trees}
    for round_ in range(args.rounds):
        for name, tree, grow in trees[round_ % 2 :] + trees[: round_ % 2]:
            runs[name].append(child(tree, sizes, args.experiences, args.group, grow))
        print(round_, {name: found[-1] for name, found in runs.items()}, file=sys.stderr)

    def median(name: str, size: int, what: str) -> float:
        return statistics.median(found[size][what] for found in runs[name])

    columns = ["experiences a push"]
    for name, _, _ in trees:
        columns += [f"{name}: fill µs", f"{name}: fill bytes", f"{name}: drain µs", f"{name}: segments"]
    if len(trees) == 2:
        columns += ["fill before / after", "drain before / after"]
    rows = []
    for size in sizes:
        cells = [f"{size:,}"]
        for name, _, _ in trees:
            cells += [f"{median(name, size, 'fill'):.1f}", f"{median(name, size, 'written'):,.0f}"]
            cells.append(f"{median(name, size, 'drain'):.1f}")
            cells.append(f"{median(name, size, 'segments'):,.0f}")
        if len(trees) == 2:
            for what in ("fill", "drain"):
                cells.append(f"**{median('before', size, what) / median('after', size, what):.2f}**")
        rows.append(f"| {' | '.join(cells)} |")
    command = f"python bench/bench_small_pushes.py --experiences {args.experiences} --sizes {args.sizes}"
    command += f" --group {args.group}" if args.group != 1 else ""
    command += f" --rounds {args.rounds}" + (" --before TREE" if args.before else "")
    command += " --without-growth" if args.without_growth and not args.before else ""
    about = (
        f"{os.cpu_count()} CPUs, shared; load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} at the start. "
        f"A fresh rows table of groups of {args.group} filled with {args.experiences:,} experiences of 8 KB in "
        "pushes of each size, one durable commit a push, then drained by held takes of 256, each confirmed by "
        "the next; CPU µs an experience (the process, the store's writer included) and bytes the fill wrote to "
        "storage an experience, medians of the rounds; the segments the table kept after the fill."
    )
    publish(section(HEADING, command, about, columns, rows), HEADING, args.out)


if __name__ == "__main__":
    main()
