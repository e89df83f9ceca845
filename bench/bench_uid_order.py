"""What the order of a table's uids costs its store: the same pushes and consumes with uids that come
in push order, as Trinity-RFT's eids do (batch = the explorer's step, task = the index in it), beside
uids in no order, as the eids of verl's agent loop and TorchRL's storage are (a group's task is
verl's uuid4, a digest of the prompt; AReaL's workflow's was a uuid4 hex), and uids whose task is
an `ordered_id()` (AReaL's workflow's now); and, under each, raw LMDB's least: the same stored
values put and deleted under the same keys.

    .venv/bin/python bench/bench_uid_order.py [--live 50000] [--steps 40] [--rounds 3] [--groups 1,8]
        [--out bench/RESULTS.md]

Each round fills a fresh rows table (no estimator, grouped by task in groups of G) with `--live`
experiences of 8 KB (bench_reverb's shape), 256 a push, then times `--steps` steps of the steady
state a consume stream keeps: a push of 256 and a take of 256 / G groups consumed (their payloads
deleted in the take's commit, as Store.sample does). The raw side puts the same table keys' stored
values, one durable commit a push of 256, and deletes the oldest 256 in one commit a step. CPU µs an
experience of the pushes and of the consumes (this process: the store's writer thread included), and
the bytes handed to write calls an experience (storage_writes.py), medians of the rounds; which
order goes first turns.

Why the order matters: LMDB keeps payloads by their key (a table's prefix and the uid), so a commit
writes every B-tree leaf its keys land on. Uids in push order land on the tree's last leaves, a
push's 256 on a few; uids in no order land each on a leaf of its own among all the leaves the live
experiences fill, and a consume's deletes do the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes  # noqa: E402
from results import publish, section  # noqa: E402
from storage_writes import written  # noqa: E402

from expbuf.client import EID, ordered_id, trxp  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

HEADING = "## The order of a table's uids (issue 64)"
PUSH = 256
ORDERS = ("in order", "no order", "ordered_id")
PREFIX = b"T000"  # a stand-in table prefix for the raw side's keys


def eids(order: str, group: int) -> Callable[[int], EID]:
    """Experience n's eid: groups of `group` runs; in order, PUSH // group tasks an explorer step (as
    Trinity-RFT numbers them); in no order, 32 hex digits of a digest a task (as a uuid4 hex, verl's
    and AReaL's, or TorchRL's digest of the prompt are), the same in every round; `ordered_id`, an
    ordered_id() a task, made as the experience is (AReaL's workflow names an episode's group so)."""
    tasks = PUSH // group
    if order == "in order":
        return lambda n: EID(batch=n // PUSH, task=n // group % tasks, run=n % group)
    if order == "ordered_id":
        named: dict[int, str] = {}
        return lambda n: EID(batch="areal", task=named.setdefault(n // group, ordered_id()), run=n % group)
    return lambda n: EID(batch="verl", task=hashlib.md5(str(n // group).encode()).hexdigest(), run=n % group)


def pushes(order: str, group: int) -> Iterator[list[Entry]]:
    """Pushes of PUSH experiences of 8 KB, one after the other, their eids as `eids` gives them."""
    made = [exp for push in make_pushes("8k", 4) for exp in push]
    eid = eids(order, group)
    for first in itertools.count(0, PUSH):
        batch = []
        for n in range(first, first + PUSH):
            exp = made[n % len(made)]
            exp.eid = eid(n)
            batch.append(Entry.of(trxp.from_experience(exp)))
        yield batch


@dataclasses.dataclass
class Found:
    push: float  # CPU µs an experience
    consume: float
    wrote: float  # bytes handed to write calls an experience, push and consume


def store_side(path: Path, order: str, group: int, live: int, rounds: int) -> Found:
    """A rows table's steady state: `rounds` steps of a push and a consume of PUSH experiences."""
    made = pushes(order, group)
    config = TableConfig.of(name="t", estimator="none", group_by="task", group_size=group, device="cpu")
    with Store(path, map_size=16 << 30) as store:
        store.create_table(config)
        for _ in range(live // PUSH):
            store.put_entries("t", next(made))
        steps = [next(made) for _ in range(rounds)]
        push = consume = 0.0
        wrote = written()
        for batch in steps:
            began = time.process_time()
            store.put_entries("t", batch)
            middle = time.process_time()
            taken = store.sample(TakeSpec("t", num_groups=PUSH // group))
            consume += time.process_time() - middle
            push += middle - began
            assert taken is not None and len(taken.uids) == PUSH, taken
        wrote = written() - wrote
        assert store.stats("t")["ready"] == live // PUSH * PUSH
    count = rounds * PUSH
    return Found(push / count * 1e6, consume / count * 1e6, wrote / count)


def raw_side(path: Path, order: str, group: int, live: int, rounds: int) -> Found:
    """The same keys' stored values put, one durable commit a push, and the oldest deleted, one a step."""
    made = pushes(order, group)
    env = lmdb.open(str(path), map_size=16 << 30, max_dbs=2)
    blobs = env.open_db(b"blobs")
    held: list[bytes] = []

    def put(batch: list[Entry]) -> None:
        rows = sorted((PREFIX + entry.uid.encode(), entry.blob) for entry in batch)
        with env.begin(write=True) as txn, txn.cursor(db=blobs) as cursor:
            cursor.putmulti(rows)
        held.extend(key for key, _ in rows)

    for _ in range(live // PUSH):
        put(next(made))
    steps = [next(made) for _ in range(rounds)]
    push = consume = 0.0
    wrote = written()
    for batch in steps:
        began = time.process_time()
        put(batch)
        middle = time.process_time()
        with env.begin(write=True) as txn:
            for key in sorted(held[:PUSH]):
                txn.delete(key, db=blobs)
        del held[:PUSH]
        consume += time.process_time() - middle
        push += middle - began
    wrote = written() - wrote
    env.close()
    count = rounds * PUSH
    return Found(push / count * 1e6, consume / count * 1e6, wrote / count)


SIDES = {"store": store_side, "raw LMDB": raw_side}


def measure(live: int, rounds: int, steps: int, groups: list[int]) -> dict[tuple[int, str, str], list[Found]]:
    """Each (group, side, order)'s figures, a value a round, the orders in turn."""
    found: dict[tuple[int, str, str], list[Found]] = {}
    for round_ in range(rounds):
        for group in groups:
            for side, run in SIDES.items():
                for order in ORDERS[::-1] if round_ % 2 else ORDERS:
                    with tempfile.TemporaryDirectory() as tmp:
                        figures = run(Path(tmp) / "d", order, group, live, steps)
                    found.setdefault((group, side, order), []).append(figures)
                    print(group, side, order, figures, flush=True)
    return found


def report(command: str, load: str, live: int, steps: int, found: dict[tuple[int, str, str], list[Found]]) -> str:
    """A row a group size, side and order of uids: medians, and each beside the same side in order."""

    def median(key: tuple[int, str, str], name: str) -> float:
        return statistics.median(getattr(figures, name) for figures in found[key])

    rows = []
    for group, side in sorted({(group, side) for group, side, _ in found}, key=lambda k: (k[0], k[1] != "store")):
        base = {name: median((group, side, ORDERS[0]), name) for name in ("push", "consume", "wrote")}
        for order in ORDERS:
            if (group, side, order) not in found:
                continue
            got = {name: median((group, side, order), name) for name in base}
            cells = [f"{got['push']:.1f}", f"{got['consume']:.1f}", f"{got['wrote']:,.0f}"]
            cells += [f"**{got[name] / base[name]:.2f}x**" for name in base]
            rows.append(f"| {group} | {side} | {order} | " + " | ".join(cells) + " |")
    columns = ["groups of", "side", "uids", "push µs", "consume µs", "bytes written"]
    columns += ["push / in order", "consume / in order", "bytes / in order"]
    about = (
        f"2 cores (load average {load} at the start); {live:,} experiences of 8 KB held, then {steps} steps of a push "
        f"of {PUSH} and a consume of {PUSH}; CPU µs an experience and bytes handed to write calls an experience "
        "(push and consume), medians of the rounds."
    )
    return section(HEADING, command, about, columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--live", type=int, default=50_000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", default="1,8")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    found = measure(args.live, args.rounds, args.steps, [int(g) for g in args.groups.split(",")])
    command = "python bench/bench_uid_order.py " + " ".join(sys.argv[1:])
    publish(report(command, load, args.live, args.steps, found), HEADING, args.out)


if __name__ == "__main__":
    main()
