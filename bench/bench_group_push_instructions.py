"""Instructions a rows table's pushes cost (valgrind's callgrind: every thread, counted around the
pushes measured alone), for groups pushed whole, spread over G pushes and completed a few at a time:
a count that a busy machine does not move, where CPU time moves 1.5x from run to run (issue 64).

    .venv/bin/python bench/bench_group_push_instructions.py [--group 8]
        [--ways whole,spread,opening,middle,completing,trickle] [--before DIR] [--out bench/RESULTS.md]

Experiences of 8 KB (bench_reverb's shape), pushes of 256 into a fresh rows table, no estimator;
instructions an experience measured:
- whole: groups one after the other, 2,048 experiences (8,192 for groups of more than 8);
- spread: run r of 256 tasks a push, as bench_group_pushes.py's spread, the same experiences; and its
  pushes apart: the `opening` push (the first runs, each opening its group), the `middle` ones (each
  run joining a group that stays pending) and the `completing` one (each run the last of its group);
- staggered: run r of task t in push r + t mod G, each push's groups opening, filling and completing
  side by side (tasks begun at different times: each push but the first and last G - 1 reaches
  every task);
- trickle: 256 tasks' first G - 1 runs spread (not counted), then their last runs 4 a push (each push
  completing 4 groups: workers finishing their last runs one after the other), those pushes alone.
With `--before`, another checkout's (its compiled codec built) beside this tree's, and published
under HEADING with `--out`. Needs valgrind (`apt install valgrind`). PYTHONHASHSEED is fixed, so a
tree's count repeats to 0.1 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_group_pushes as pushes_bench  # noqa: E402
import callgrind  # noqa: E402

from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

BATCH = pushes_bench.BATCH


HEADING = "## A group's runs pushed over many pushes, in instructions (issue 64, Deliver 4)"
SPREAD_PARTS = ("opening", "middle", "completing")


def batches(group: int, way: str) -> tuple[list[list[Entry]], list[list[Entry]]]:
    """The pushes before the measure (not counted) and those measured."""
    count = 2048 if group <= 8 or way == "trickle" else 8192
    made = pushes_bench.experiences(count, group, 0)
    if way == "whole":
        return [], pushes_bench.pushes(made, group, False)
    spread = pushes_bench.pushes(made, group, True)
    if way == "spread":
        return [], spread
    if way == "staggered":  # task t's run r in push r + t % group: each push's groups at every stage
        tasks = [made[at : at + group] for at in range(0, len(made), group)]
        return [], [
            [runs[step - task % group] for task, runs in enumerate(tasks) if 0 <= step - task % group < group]
            for step in range(2 * group - 1)
        ]
    if way in SPREAD_PARTS:  # the first 256 tasks' pushes: the opening one, those in the middle, the last
        tasks = spread[:group]
        parts = {"opening": (0, 1), "middle": (1, group - 1), "completing": (group - 1, group)}
        begin, end = parts[way]
        return tasks[:begin], tasks[begin:end]
    last = spread[group - 1]
    return spread[: group - 1], [last[at : at + 4] for at in range(0, len(last), 4)]


def child(group: int, way: str) -> None:
    """Under callgrind, collection off: the pushes measured with it on (callgrind_control)."""
    before, measured = batches(group, way)
    config = TableConfig.of(name="t", estimator="none", group_by="task", group_size=group, device="cpu")
    config = dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout="rows"))
    with tempfile.TemporaryDirectory() as data, Store(Path(data), map_size=8 << 30) as store:
        store.create_table(config)
        if not before:  # the first push's imports and first transaction, not counted: another task's run
            store.put_entries("t", pushes_bench.experiences(BATCH, group, 1 << 20)[:1])
        for batch in before:
            store.put_entries("t", batch)
        with callgrind.counted():
            for batch in measured:
                store.put_entries("t", batch)


def instructions(group: int, way: str, tree: Path | None = None) -> float:
    """Instructions an experience of the pushes measured, in `tree` where given."""
    total, _ = callgrind.run(__file__, ["--child", way, "--group", str(group)], tree)
    return total / sum(map(len, batches(group, way)[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--ways", default="whole,spread,opening,middle,completing,staggered,trickle")
    parser.add_argument("--before", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.group, args.child)
        return
    about = (
        f"Instructions an experience of a rows table's pushes of 256 experiences of 8 KB in groups of "
        f"{args.group} (callgrind, every thread): whole groups a push; spread, run r of 256 tasks a push, "
        "and its opening, middle and completing pushes apart; staggered, run r of task t in push r + t mod "
        f"{args.group}; trickle, the last runs 4 a push."
    )

    def count(way: str, tree: Path | None) -> float:
        return instructions(args.group, way, tree)

    callgrind.compare(HEADING, about, "way", args.ways.split(","), count, args.before, args.out)


if __name__ == "__main__":
    main()
