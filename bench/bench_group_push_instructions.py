"""Instructions a rows table's pushes cost (valgrind's callgrind: every thread, counted around the
pushes measured alone), for groups pushed whole, spread over G pushes and completed a few at a time:
a count that a busy machine does not move, where CPU time moves 1.5x from run to run (issue 64).

    .venv/bin/python bench/bench_group_push_instructions.py [--group 8] [--ways whole,spread,trickle]

Experiences of 8 KB (bench_reverb's shape), pushes of 256 into a fresh rows table, no estimator:
- whole: groups one after the other, 2,048 experiences (8,192 for groups of more than 8);
- spread: run r of 256 tasks a push, as bench_group_pushes.py's spread, the same experiences;
- trickle: 256 tasks' first G - 1 runs spread (not counted), then their last runs 4 a push (each push
  completing 4 groups: workers finishing their last runs one after the other), those pushes alone.
Needs valgrind (`apt install valgrind`). PYTHONHASHSEED is fixed, so a tree's count repeats to 0.1 %.
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


def batches(group: int, way: str) -> tuple[list[list[Entry]], list[list[Entry]]]:
    """The pushes before the measure (not counted) and those measured."""
    count = 2048 if group <= 8 or way == "trickle" else 8192
    made = pushes_bench.experiences(count, group, 0)
    if way != "trickle":
        return [], pushes_bench.pushes(made, group, way == "spread")
    spread = pushes_bench.pushes(made, group, True)
    last = spread[group - 1]
    return spread[: group - 1], [last[at : at + 4] for at in range(0, len(last), 4)]


def child(group: int, way: str) -> None:
    """Under callgrind, collection off: the pushes measured with it on (callgrind_control)."""
    before, measured = batches(group, way)
    config = TableConfig.of(name="t", estimator="none", group_by="task", group_size=group, device="cpu")
    config = dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout="rows"))
    with tempfile.TemporaryDirectory() as data, Store(Path(data), map_size=8 << 30) as store:
        store.create_table(config)
        for batch in before:
            store.put_entries("t", batch)
        if not before:  # the first push's imports and first transaction, not counted
            store.put_entries("t", measured[0][:1])
            measured[0] = measured[0][1:]
        with callgrind.counted():
            for batch in measured:
                store.put_entries("t", batch)


def instructions(group: int, way: str) -> int:
    total, _ = callgrind.run(__file__, ["--child", way, "--group", str(group)])
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--ways", default="whole,spread,trickle")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.group, args.child)
        return
    for way in args.ways.split(","):
        print(f"groups of {args.group}, {way}: {instructions(args.group, way):,} instructions", flush=True)


if __name__ == "__main__":
    main()
