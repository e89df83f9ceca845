"""What a group whose runs arrive over many pushes costs the store, beside the same groups pushed whole,
for a records table and a rows table (issue 64, 2.8), side by side in one process.

    .venv/bin/python bench/bench_group_pushes.py [--experiences 8192] [--rounds 3] [--groups 8,32]
        [--estimator grpo] [--out bench/RESULTS.md]

Each round makes the same 8 KB experiences (bench_reverb's shape) in groups of G runs of a task, and
pushes them into a fresh data directory, BATCH a push, two ways:

- whole: each push holds whole groups, one after the other (a worker that ran every run of its tasks);
- spread: each push holds one run of each of BATCH tasks, run r of them all, then run r + 1 (GRPO's
  workers each pushing their own runs): every group completes over G pushes, each push reaching BATCH
  pending groups, the worst case for a group kept pending.

CPU microseconds an experience of the pushes (`Store.put_entries`, this process: the writer's thread
included) and bytes they wrote to storage (/proc/self/io), medians of the rounds; which goes first
turns. The drain is not measured. With `--estimator`, the tables compute that estimator's advantages
in the pushes that complete their groups, as a server's do (AdvantageWorker.in_push, on the CPU), and
the worker those a push leaves (one completing more than IN_PUSH_LIMIT experiences): its CPU is
counted with the pushes'.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, trxp  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

HEADING = "## Groups pushed over many pushes beside groups pushed whole (issue 64)"
BATCH = 256
WAYS = ("records whole", "records spread", "rows whole", "rows spread")


def experiences(count: int, group: int, first_task: int) -> list[Entry]:
    """`count` experiences of 8 KB, groups of `group` runs of a task each, in group order."""
    made = [exp for push in make_pushes("8k", count // BATCH) for exp in push]
    for number, exp in enumerate(made):
        exp.eid = EID(batch=0, task=first_task + number // group, run=number % group)
    return [Entry.of(trxp.from_experience(exp)) for exp in made]


def pushes(made: list[Entry], group: int, spread: bool) -> list[list[Entry]]:
    """The experiences as pushes of BATCH: whole groups one after the other, or (`spread`) run r of
    BATCH tasks a push."""
    if not spread:
        return [made[at : at + BATCH] for at in range(0, len(made), BATCH)]
    found = []
    for block in range(0, len(made), BATCH * group):  # BATCH tasks
        tasks = made[block : block + BATCH * group]
        found.extend([tasks[task * group + r] for task in range(len(tasks) // group)] for r in range(group))
    return found


def written() -> int:
    """Bytes this process has had written to storage (/proc/self/io), the commits' pages and fsyncs."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("write_bytes"))


def push_all(path: Path, layout: str, group: int, batches: list[list[Entry]], estimator: str) -> tuple[float, int]:
    """CPU seconds of the pushes into a fresh table of `layout`, and the bytes they wrote; every group
    ready after them."""
    config = TableConfig.of(name="t", estimator=estimator, group_by="task", group_size=group, device="cpu")
    config = dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout=layout))
    with Store(path, map_size=8 << 30) as store:
        worker = None
        if estimator != "none":
            from expbuf.server.advantages.worker import AdvantageWorker

            worker = AdvantageWorker(store)
            store.in_push = worker.in_push
        store.create_table(config)
        start, wrote = time.process_time(), written()
        for batch in batches:
            store.put_entries("t", batch)
        while worker is not None and worker.run_once():  # what the pushes left to the worker
            pass
        spent, wrote = time.process_time() - start, written() - wrote
        stats = store.stats("t")
        assert stats["ready"] == sum(map(len, batches)) and stats["groups_pending"] == 0, stats
    return spent, wrote


Found = dict[int, dict[str, list[float]]]  # group size -> way -> a value a round


def measure(count: int, rounds: int, groups: list[int], estimator: str) -> tuple[Found, Found]:
    """CPU µs and bytes written an experience, by group size and way, a value a round."""
    results: Found = {}
    wrote: Found = {}
    tasks = itertools.count(step=count)
    for group in groups:
        found: dict[str, list[float]] = {way: [] for way in WAYS}
        written_by: dict[str, list[float]] = {way: [] for way in WAYS}
        for round_ in range(rounds):
            made = experiences(count, group, next(tasks))
            for way in WAYS[round_ % len(WAYS) :] + WAYS[: round_ % len(WAYS)]:
                layout, how = way.split()
                with tempfile.TemporaryDirectory(prefix="expbuf-groups-") as data:
                    spent, nbytes = push_all(Path(data), layout, group, pushes(made, group, how == "spread"), estimator)
                found[way].append(spent / count * 1e6)
                written_by[way].append(nbytes / count)
        results[group], wrote[group] = found, written_by
        print(group, {way: [f"{value:.1f}" for value in values] for way, values in found.items()})
    return results, wrote


RATIOS = (("records spread", "records whole"), ("rows spread", "rows whole"), ("records spread", "rows spread"))


def report(command: str, load: str, count: int, results: Found, wrote: Found, heading: str) -> str:
    lines = [
        heading,
        "",
        f"Command: `{command}`  ",
        f"2 cores (load average {load} at the start); {count:,} experiences of 8 KB a way, pushes of {BATCH}; "
        "CPU µs an experience of the pushes, medians of the rounds.",
        "",
        "| groups of | " + " | ".join(WAYS) + "".join(f" | {a} / {b}" for a, b in RATIOS) + " |",
        "| ---: |" + " ---: |" * (len(WAYS) + len(RATIOS)),
    ]
    for group, found in results.items():
        median = {way: statistics.median(found[way]) for way in WAYS}
        cells = [f"{median[way]:.1f}" for way in WAYS] + [f"**{median[a] / median[b]:.2f}x**" for a, b in RATIOS]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    lines += ["", "Bytes written to storage an experience (/proc/self/io), medians of the rounds:", ""]
    lines += ["| groups of | " + " | ".join(WAYS) + " |", "| ---: |" + " ---: |" * len(WAYS)]
    for group, found in wrote.items():
        lines.append(f"| {group} | " + " | ".join(f"{statistics.median(found[way]):,.0f}" for way in WAYS) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiences", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", default="8,32")
    parser.add_argument("--estimator", default="none", help="computed in the pushes (one value an experience)")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    groups = [int(size) for size in args.groups.split(",")]
    if any(args.experiences % (BATCH * size) for size in groups):
        parser.error(f"--experiences must be a multiple of {BATCH} times each group size")
    command = ("python bench/bench_group_pushes.py " + " ".join(sys.argv[1:])).strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    heading = HEADING if args.estimator == "none" else f"{HEADING}, {args.estimator} computed in the pushes"
    results, wrote = measure(args.experiences, args.rounds, groups, args.estimator)
    section = report(command, load, args.experiences, results, wrote, heading)
    print(section)
    write_section(Path(args.out), heading, section)


if __name__ == "__main__":
    main()
