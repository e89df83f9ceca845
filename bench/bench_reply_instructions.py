"""Instructions a consumed batch's reply costs to build (valgrind's callgrind: every thread, counted
around `sample_reply` alone): the RPC thread's share of a consume beside gRPC's send, a count that a
busy machine does not move (issue 64).

    .venv/bin/python bench/bench_reply_instructions.py [--replies plain,grpo,plain-columns,grpo-columns]
        [--shape 8k] [--before TREE] [--out bench/RESULTS.md]

A rows table is filled with 2,048 experiences of 8 KB (bench_reverb's shape: each its own group with
no estimator, or groups of 8 whose grpo advantages the pushes compute; `--shape 40k`: its 40 KB
ones, tokens, log-probs and an action mask), then taken by held takes of 256, each confirming the
one before; the replies of all but the first batch are built and counted, decoded (a TRXP payload)
or as columns (`tokens,logprobs`, and `advantages` with grpo). `--before TREE` counts another
checkout's beside this one's (callgrind.py). Needs valgrind.
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
GROUP = 8  # runs of a task, with grpo
REPLIES = {  # name -> (estimator, fields asked as columns; none: decoded)
    "plain": ("none", ()),
    "grpo": ("grpo", ()),
    "plain-columns": ("none", ("tokens", "logprobs")),
    "grpo-columns": ("grpo", ("tokens", "logprobs", "advantages")),
}
HEADING = "## Instructions of a sample reply's build (issue 64)"


def child(reply: str, shape: str) -> None:
    """Under callgrind, collection off: the replies counted with it on (callgrind_control)."""
    from bench_reverb import PER_PUSH, make_pushes

    from expbuf.client import trxp
    from expbuf.client.schema.experience import EID
    from expbuf.server.advantages.worker import AdvantageWorker
    from expbuf.server.rpc.sample.replies import sample_reply
    from expbuf.server.store import Entry, Store
    from expbuf.server.store.schema.table_config import TableConfig

    estimator, fields = REPLIES[reply]
    group = GROUP if estimator != "none" else 1
    pushes = make_pushes(shape, COUNT // PER_PUSH[shape])
    serial = itertools.count()
    for exps in pushes:
        for exp in exps:
            number = next(serial)
            exp.eid = EID(batch=number // group, task=0, run=number % group)
            exp.reward = float(number % group)  # rewards that differ within a group: none is dropped
    entries = [[Entry.of(trxp.from_experience(exp)) for exp in exps] for exps in pushes]
    grouping = {"group_by": "task", "group_size": group} if group > 1 else {"group_by": "none"}
    with tempfile.TemporaryDirectory() as data, Store(Path(data), map_size=8 << 30) as store:
        store.in_push = AdvantageWorker(store).in_push
        store.create_table(TableConfig.of(name="t", estimator=estimator, device="cpu", **grouping))
        for push in entries:
            store.put_entries("t", push)
        spec = floor.TakeSpec("t", batch_size=floor.BATCH, delivery="consume", order="fifo", fields=fields)
        batches = []
        while sum(len(batch.uids) for batch in batches) < COUNT:
            batch = store.sample(spec, hold=True, confirm=batches[-1].lease_id if batches else "")
            assert batch is not None
            batches.append(batch)
        for _ in sample_reply(batches[0], spec, 0.0, 64 << 20, True):  # its imports, not counted
            pass
        with callgrind.counted():
            for batch in batches[1:]:
                for _ in sample_reply(batch, spec, 0.0, 64 << 20, True):
                    pass


def instructions(reply: str, tree: Path | None, shape: str = "8k") -> float:
    """Instructions an experience counted of the replies of `shape`, this tree's or `tree`'s."""
    total, _ = callgrind.run(__file__, ["--child", reply, "--shape", shape], tree)
    return total / (COUNT - floor.BATCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", default=",".join(REPLIES))
    parser.add_argument("--shape", default="8k", choices=floor.PER_PUSH, help="bench_reverb's experiences: 8k or 40k")
    parser.add_argument("--before", type=Path, help="another checkout whose reply is counted beside this one's")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=REPLIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.shape)
        return
    about = (
        f"callgrind, every thread; {COUNT:,} experiences of {args.shape.upper()}B in a rows table taken by held "
        "takes of 256, the replies of all but the first batch built and counted (`sample_reply`, before gRPC's send)."
    )
    count = partial(instructions, shape=args.shape)
    callgrind.compare(HEADING, about, "reply", args.replies.split(","), count, args.before, args.out)


if __name__ == "__main__":
    main()
