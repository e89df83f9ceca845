"""What a table's stats call costs (every Prometheus scrape and every Stats RPC makes one a table),
a rows table beside a records table of the same experiences, side by side in one process.

    .venv/bin/python bench/bench_stats.py [--experiences 100000] [--group 1] [--calls 200] [--out bench/RESULTS.md]

Each layout's table is filled with the same small experiences (a few tokens: the stats read no
payload), each its own group (`--group 1`) or in groups of `--group`, pushed 256 a push; then
`Store.stats` is called `--calls` times at each of three stages: every group ready; the oldest
quarter consumed and the next quarter held under leases (the oldest live experience is then
leased, behind retired segments); a tenth of the live ones deleted at random, the held leases given
back. Milliseconds a call (wall time, median of the calls; nothing else runs in the process
meanwhile). The table's oldest live experience's age is the part that differs: a records table
reads it from the first row of its insertion order, a rows table from the first row of the index of
its live segments by their oldest live member (docs/internals/storage.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import write_section  # noqa: E402

from expbuf.client import EID, Experience, trxp  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

HEADING = "## A table's stats call, rows beside records (issue 64)"
BATCH = 256
LAYOUTS = ("records", "rows")


def entries(count: int, group: int) -> list[list[Entry]]:
    """`count` small experiences, groups of `group` (runs of one task), as pushes of BATCH."""
    found = []
    for number in range(count):
        exp = Experience(
            eid=EID(batch=number // group, task=0, run=number % group),
            tokens=torch.arange(6, dtype=torch.int32),
            prompt_length=2,
            logprobs=torch.full((4,), -0.5),
            reward=float(number % 3),
        )
        found.append(Entry.of(trxp.from_experience(exp)))
    return [found[at : at + BATCH] for at in range(0, count, BATCH)]


def create(store: Store, name: str, group: int, layout: str) -> None:
    config = (
        TableConfig.of(name=name, estimator="none", group_by="none")
        if group == 1
        else TableConfig.of(name=name, estimator="none", group_by="task", group_size=group)
    )
    store.create_table(dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout=layout)))


def per_call(store: Store, table: str, calls: int) -> tuple[float, float]:
    """Milliseconds a stats call (median of `calls`), and the oldest age the last one reported."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        age = store.stats(table)["oldest_age_seconds"]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, age


def run(count: int, group: int, calls: int) -> list[tuple[str, dict[str, float]]]:
    pushes = entries(count, group)
    stages: list[tuple[str, dict[str, float]]] = []
    clock = [1_000_000.0]  # both tables' pushes at the same times: their oldest ages agree
    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp), map_size=8 << 30, clock=lambda: clock[0]) as store:
        for layout in LAYOUTS:
            create(store, layout, group, layout)
        for push in pushes:
            clock[0] += 1.0
            for layout in LAYOUTS:
                store.put_entries(layout, push)

        def stage(name: str) -> None:
            found = {layout: per_call(store, layout, calls) for layout in LAYOUTS}
            ages = {age for _, age in found.values()}
            print(f"{name}: {found}", flush=True)
            assert len(ages) == 1, f"the layouts' oldest ages differ: {found}"
            stages.append((name, {layout: ms for layout, (ms, _) in found.items()}))

        stage("every group ready")
        quarter = count // 4
        held: dict[str, list[str]] = {layout: [] for layout in LAYOUTS}
        for layout in LAYOUTS:
            store.sample(TakeSpec(layout, batch_size=quarter, delivery="consume"))
            for _ in range(max(1, quarter // BATCH)):
                batch = store.sample(TakeSpec(layout, batch_size=BATCH, delivery="consume"), hold=True)
                assert batch is not None
                held[layout].append(batch.lease_id)
                batch.release()
        stage("oldest quarter consumed, next quarter held")
        rng = random.Random(0)
        live = [entry.uid for push in pushes[len(pushes) // 2 :] for entry in push]
        doomed = rng.sample(live, len(live) // 10)
        for layout in LAYOUTS:
            for lease in held[layout]:
                store.give_back(lease, layout)
            for at in range(0, len(doomed), 1000):
                store.delete(layout, uids=doomed[at : at + 1000])
        stage("then a tenth deleted, the held given back")
    return stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiences", type=int, default=100_000)
    parser.add_argument("--group", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    stages = run(args.experiences, args.group, args.calls)
    lines = [
        HEADING,
        "",
        f"`bench/bench_stats.py --experiences {args.experiences} --group {args.group} --calls {args.calls}`: "
        "ms a `Store.stats` call, median of the calls.",
        "",
        "| stage | records | rows | rows / records |",
        "| --- | --- | --- | --- |",
        *(
            f"| {name} | {ms['records']:.3f} | {ms['rows']:.3f} | {ms['rows'] / ms['records']:.2f} |"
            for name, ms in stages
        ),
        "",
    ]
    print("\n".join(lines))
    if args.out is not None:
        write_section(args.out, HEADING, "\n".join(lines))


if __name__ == "__main__":
    main()
