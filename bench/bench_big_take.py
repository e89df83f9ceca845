"""How long a take of large experiences holds the store's one writer, whose commits every push
waits for: a Sample stream's take (held, its experiences stored in chunks read and checked where
its reply is built: store/disk/chunk_reads.Deferred) against a take that reads and checks them in
the writer (the Store's own sample without a stream, as every take did before). Side by side in
one run, on the same directory: each round takes a batch both ways, alternately first, and
gives it back; the writer's time is the sample call's, measured with nothing else queued.
Before each take the process lets go of the map's pages (residency.release), as a server's are
for a batch it has not read yet: they come from the page cache (a minor fault a page), not
from disk, which would make the take that reads in the writer hold it longer still.

    python bench/bench_big_take.py --size 64 --experiences 4 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_big import MB, payload  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import trxp  # noqa: E402
from expbuf.server.store import Store  # noqa: E402
from expbuf.server.store.disk import residency  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

HEADING = "## A take of large experiences and the writer (issue 41)"


def take(store: Store, experiences: int, hold: bool) -> float:
    """Seconds of one take of `experiences` groups (the writer's); the batch is built, then given back."""
    spec = TakeSpec("big", num_groups=experiences, delivery="lease", lease_seconds=60)
    residency.release(store.path / "data.mdb")
    start = time.perf_counter()
    batch = store.sample(spec, hold=hold)
    seconds = time.perf_counter() - start
    assert batch is not None
    batch.columns(("tokens",), lambda columns: None)  # where a stream's reply reads and checks them
    batch.release()
    store.nack(batch.lease_id, "big")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64, help="MiB an experience")
    parser.add_argument("--experiences", type=int, default=4, help="experiences (groups of one) a batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    times: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as data, Store(data, map_size=4 << 30) as store:
        store.create_table(TableConfig.of("big", group_size=1, estimator="none"))
        for index in range(args.experiences):
            store.put("big", trxp.parse(payload(index, args.size * MB)))
        take(store, args.experiences, False)  # the pages into the page cache
        for round_ in range(args.rounds):
            for hold in (True, False) if round_ % 2 == 0 else (False, True):
                times[hold].append(take(store, args.experiences, hold))
    held, whole = statistics.median(times[True]), statistics.median(times[False])
    load = os.getloadavg()
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `python bench/bench_big_take.py --size {args.size} --experiences {args.experiences} "
            f"--rounds {args.rounds}`  ",
            f"Load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} at the end; medians of {args.rounds} rounds, "
            "alternating which goes first.",
            "",
            "| take of a batch | writer held (ms) |",
            "| --- | --- |",
            f"| {args.experiences} x {args.size} MiB, a Sample stream's (read and checked as its reply is built) "
            f"| {held * 1e3:.1f} |",
            f"| the same, read and checked in the writer | {whole * 1e3:.1f} |",
            "",
        ]
    )
    print(section)
    write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
