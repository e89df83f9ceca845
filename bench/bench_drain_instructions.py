"""Instructions a rows table's drain costs (valgrind's callgrind: every thread, counted around the
drain alone): a count that a busy machine does not move, where CPU time moves 1.5x from run to run,
so that a step of a few percent in the store's take and confirm shows (issue 64).

    .venv/bin/python bench/bench_drain_instructions.py [--groups 1,8] [--shape 8k] [--before TREE]
        [--out bench/RESULTS.md]

A rows table is filled with 2,048 experiences of 8 KB (bench_take_floor's `entries` and `filled`:
bench_reverb's shape, its own group or groups of 8; `--shape 40k`: its 40 KB ones), then drained
as a Sample stream's server drains it: held takes of 256, each confirming the one before, one
durable commit each. The first take (its imports, the first transaction) is not counted; the
rest, the last confirm included, are. `--before TREE` counts another checkout's store beside this
one's (its `server/` and `client/` imported in place of these, with this tree's benchmark and
interpreter). Needs valgrind
(callgrind.py).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_take_floor as floor  # noqa: E402
import callgrind  # noqa: E402

COUNT = 2048
HEADING = "## Instructions of a rows table's drain (issue 64)"


def child(group: int, shape: str) -> None:
    """Under callgrind, collection off: the drain counted with it on (callgrind_control)."""
    from expbuf.server.store import Store

    pushes = floor.entries(COUNT, group, itertools.count(), shape)
    with tempfile.TemporaryDirectory() as data, Store(Path(data), map_size=8 << 30) as store:
        floor.filled(store, pushes, group, "rows")
        spec = floor.TakeSpec("t", batch_size=floor.BATCH, delivery="consume", order="fifo")
        batch = store.sample(spec, hold=True, confirm="")
        assert batch is not None
        taken, held = len(batch.uids), batch.lease_id
        batch.release()
        with callgrind.counted():
            while taken < COUNT:
                batch = store.sample(spec, hold=True, confirm=held)
                assert batch is not None
                taken += len(batch.uids)
                held = batch.lease_id
                batch.release()
            store.confirm(held, spec)


def instructions(group: str, tree: Path | None, shape: str = "8k") -> float:
    """Instructions an experience counted of the drain of `shape`, this tree's store or `tree`'s."""
    total, _ = callgrind.run(__file__, ["--child", group, "--shape", shape], tree)
    return total / (COUNT - floor.BATCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="1,8")
    parser.add_argument("--shape", default="8k", choices=floor.PER_PUSH, help="bench_reverb's experiences: 8k or 40k")
    parser.add_argument("--before", type=Path, help="another checkout whose store is counted beside this one's")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.shape)
        return
    about = (
        f"callgrind, every thread; {COUNT:,} experiences of {args.shape.upper()}B in a rows table, drained by held "
        "takes of 256 each confirming the one before, the first take not counted."
    )
    count = partial(instructions, shape=args.shape)
    callgrind.compare(HEADING, about, "groups of", args.groups.split(","), count, args.before, args.out)


if __name__ == "__main__":
    main()
