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
included) and bytes they handed to write calls (LMDB's pages: storage_writes.py), medians of the
rounds; which goes first turns. A spread group's CPU is also given by push: the opening one (each
run the first of its group), those in the middle (each run joining a group that stays pending) and
the completing one, a run each. The drain is not measured. With `--estimator`, the tables compute
that estimator's advantages in the pushes that complete their groups, as a server's do
(AdvantageWorker.in_push, on the CPU), and the worker those a push leaves (one completing more than
IN_PUSH_LIMIT experiences): its CPU is counted with the pushes'.
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
from storage_writes import written  # noqa: E402

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


# A spread push's place among its group's G pushes: the first, those between, the last.
PHASES = ("opening", "middle", "completing")


def phase(index: int, group: int) -> str:
    """Which of PHASES the spread push `index` (in `pushes`' order) is."""
    at = index % group
    return PHASES[0] if at == 0 else PHASES[2] if at == group - 1 else PHASES[1]


def push_all(
    path: Path, layout: str, group: int, batches: list[list[Entry]], estimator: str, spread: bool = False
) -> tuple[float, int, dict[str, float]]:
    """CPU seconds of the pushes into a fresh table of `layout`, the bytes they wrote, and (`spread`)
    the CPU seconds of each of PHASES' pushes (the worker's after them not among them); every group
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
        by_phase = dict.fromkeys(PHASES, 0.0) if spread else {}
        for index, batch in enumerate(batches):
            began = time.process_time()
            store.put_entries("t", batch)
            if spread:
                by_phase[phase(index, group)] += time.process_time() - began
        while worker is not None and worker.run_once():  # what the pushes left to the worker
            pass
        spent, wrote = time.process_time() - start, written() - wrote
        stats = store.stats("t")
        assert stats["ready"] == sum(map(len, batches)) and stats["groups_pending"] == 0, stats
    return spent, wrote, by_phase


Found = dict[int, dict[str, list[float]]]  # group size -> way -> a value a round


def measure(count: int, rounds: int, groups: list[int], estimator: str) -> tuple[Found, Found, Found]:
    """CPU µs and bytes written an experience, by group size and way, a value a round; and CPU µs a
    run of a spread group's pushes, by group size and "layout phase" (`PHASES`), a value a round."""
    results: Found = {}
    wrote: Found = {}
    phases: Found = {}
    tasks = itertools.count(step=count)
    for group in groups:
        found: dict[str, list[float]] = {way: [] for way in WAYS}
        written_by: dict[str, list[float]] = {way: [] for way in WAYS}
        by_phase: dict[str, list[float]] = {}
        for round_ in range(rounds):
            made = experiences(count, group, next(tasks))
            for way in WAYS[round_ % len(WAYS) :] + WAYS[: round_ % len(WAYS)]:
                layout, how = way.split()
                with tempfile.TemporaryDirectory(prefix="expbuf-groups-") as data:
                    spread = how == "spread"
                    spent, nbytes, parts = push_all(
                        Path(data), layout, group, pushes(made, group, spread), estimator, spread
                    )
                found[way].append(spent / count * 1e6)
                written_by[way].append(nbytes / count)
                pushed = {PHASES[0]: count // group, PHASES[1]: count // group * (group - 2), PHASES[2]: count // group}
                for name, seconds in parts.items():  # runs of each phase: a group's first, middle, last
                    by_phase.setdefault(f"{layout} {name}", []).append(seconds / pushed[name] * 1e6)
        results[group], wrote[group], phases[group] = found, written_by, by_phase
        print(group, {way: [f"{value:.1f}" for value in values] for way, values in found.items()})
    return results, wrote, phases


RATIOS = (("records spread", "records whole"), ("rows spread", "rows whole"), ("records spread", "rows spread"))


def report(command: str, load: str, count: int, results: Found, wrote: Found, phases: Found, heading: str) -> str:
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
    lines += ["", "Bytes written an experience (LMDB's pages handed to write calls: storage_writes.py), medians:", ""]
    lines += ["| groups of | " + " | ".join(WAYS) + " |", "| ---: |" + " ---: |" * len(WAYS)]
    for group, found in wrote.items():
        lines.append(f"| {group} | " + " | ".join(f"{statistics.median(found[way]):,.0f}" for way in WAYS) + " |")
    lines += ["", "CPU µs a run of a spread group's pushes, by push (a whole group's: µs an experience), medians:", ""]
    lines += ["| groups of | layout | whole | " + " | ".join(PHASES) + " | spread / whole |"]
    lines += ["| ---: | --- |" + " ---: |" * 5]
    for group, found in phases.items():
        for layout in ("records", "rows"):
            cells = [statistics.median(results[group][f"{layout} whole"])]
            cells += [statistics.median(found[f"{layout} {name}"]) for name in PHASES]
            ratio = statistics.median(results[group][f"{layout} spread"]) / cells[0]
            shown = " | ".join(f"{cell:.1f}" for cell in cells)
            lines.append(f"| {group} | {layout} | {shown} | {ratio:.2f}x |")
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
    results, wrote, phases = measure(args.experiences, args.rounds, groups, args.estimator)
    section = report(command, load, args.experiences, results, wrote, phases, heading)
    print(section)
    write_section(Path(args.out), heading, section)


if __name__ == "__main__":
    main()
