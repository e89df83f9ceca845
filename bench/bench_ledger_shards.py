"""The prompt ledger on a shard: what counting a shard's part of a dataset costs, where it is
counted, and what a claim costs when the cursor steps over the other shards' prompts.

    .venv/bin/python bench/bench_ledger_shards.py [--size 1000000] [--out bench/RESULTS.md]

One Store in a temporary directory plays shard s1 of s0, s1, s2. Its part of one epoch of
`size` prompts is counted (1) alone, (2) as CreateDataset does it, before the write (a claim
counts a later epoch's part the same way, before the transaction that starts the epoch), while
a thread pushes groups of 2 into another table, and (3) inside the writer, as a count by the
transaction that starts an epoch would be, beside the same pushes; the slowest push of (2) and
(3) shows whether the writer was held. Then 3000 prompts are claimed from the sharded dataset and from a plain
one of the same size.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_store import experience  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import trxp  # noqa: E402
from expbuf.server.store import Store  # noqa: E402
from expbuf.server.store.ledger.records import DatasetRecord  # noqa: E402
from expbuf.server.store.ledger.shards import count_part  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

SHARDS = ["s0", "s1", "s2"]
CLAIM = 3000
BATCHES = itertools.count()  # every pushed group new


def sharded(name: str, size: int) -> DatasetRecord:
    return DatasetRecord(name, size=size, seed=1, shards=list(SHARDS), shard="s1")


def beside_pushes(store: Store, work: Callable[[], object]) -> tuple[float, float]:
    """Seconds `work` took, and the slowest push of a thread pushing meanwhile."""
    slowest, stop = [0.0], threading.Event()

    def push() -> None:
        while not stop.is_set():
            batch = next(BATCHES)
            group = [trxp.from_experience(experience(batch, 0, run, tokens=16)) for run in (0, 1)]
            began = time.perf_counter()
            store.put("w", group)
            slowest[0] = max(slowest[0], time.perf_counter() - began)

    pusher = threading.Thread(target=push)
    pusher.start()
    time.sleep(0.5)
    slowest[0] = 0.0
    began = time.perf_counter()
    work()
    took = time.perf_counter() - began
    stop.set()
    pusher.join()
    return took, slowest[0]


def claim_cost(store: Store, name: str) -> float:
    """Microseconds per prompt of one claim of CLAIM prompts."""
    began = time.perf_counter()
    claimed, _ = store.claims.claim("t", name, CLAIM, seconds=600)
    return (time.perf_counter() - began) / len(claimed) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp)) as store:
        for table in ("t", "w"):
            store.create_table(TableConfig.of(name=table, group_size=2, estimator="none"))
        began = time.perf_counter()
        count_part(sharded("alone", args.size), 0)
        alone = time.perf_counter() - began
        before, before_push = beside_pushes(store, lambda: store.claims.create("t", sharded("math", args.size)))
        writer = sharded("inwriter", args.size)
        inside, inside_push = beside_pushes(
            store, lambda: store.claims._in_table("t", lambda tt: store.ledger.create(tt, writer, exist_ok=False))
        )
        store.claims.create("t", DatasetRecord("plain", size=args.size, seed=1))
        sharded_claim, plain_claim = claim_cost(store, "math"), claim_cost(store, "plain")
    section = (
        f"## The prompt ledger on shards: counting a shard's part (issue 28)\n\n"
        f"Command: `python bench/bench_ledger_shards.py --size {args.size}`  \n"
        f"Machine: 2 CPU threads, shared. One Store as shard s1 of 3; one epoch of {args.size:,} prompts.\n\n"
        f"| measure | seconds | slowest push meanwhile |\n| --- | --- | --- |\n"
        f"| count alone | {alone:.2f} | |\n"
        f"| count before the write (CreateDataset) | {before:.2f} | {before_push * 1000:.0f} ms |\n"
        f"| count in the writer (as at each epoch's start) | {inside:.2f} | {inside_push * 1000:.0f} ms |\n\n"
        f"Claims of {CLAIM}: {sharded_claim:.0f} µs per prompt on the shard (its cursor steps over the"
        f" others' prompts), {plain_claim:.0f} µs without shards.\n"
    )
    print(section)
    if args.out:
        write_section(args.out, "## The prompt ledger on shards", section)


if __name__ == "__main__":
    main()
