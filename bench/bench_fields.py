"""What a trainer rank's columnar read of some fields costs the server, against all of them, for
MoE rollouts whose routing ids (`routed_experts`, uint8, 2 x 96 experts a token here: 192 B a
token against 9 B for tokens, log-probs and the mask) make most of their bytes. A stream's take
defers each experience's chunks to its reply, which reads and checks only the chunks its fields
lie in (store/disk/chunk_reads.Deferred). Side by side in one run on one directory: each round reads
the batch both ways, alternately first, the map's pages let go before each read; the time is
the take and the columns' build (what the reply copies from), not the network.

    python bench/bench_fields.py --tokens 131072 --experiences 8 --rounds 5
"""

from __future__ import annotations

import argparse
import os
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
from expbuf.server.store import Store  # noqa: E402
from expbuf.server.store.disk import residency  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

HEADING = "## Reading some fields of MoE rollouts (issue 41)"
SOME = ("tokens", "logprobs", "action_mask")
ALL = (*SOME, "routed_experts")


def rollout(task: int, tokens: int) -> trxp.RawItem:
    return trxp.from_experience(
        Experience(
            eid=EID(batch="moe", task=task, run=0),
            tokens=torch.arange(tokens + 1, dtype=torch.int32),
            prompt_length=1,
            logprobs=torch.full((tokens,), -0.5),
            action_mask=torch.ones(tokens, dtype=torch.bool),
            routed_experts=torch.randint(0, 255, (tokens + 1, 192), dtype=torch.uint8),
            reward=1.0,
        )
    )


def read(store: Store, experiences: int, fields: tuple[str, ...]) -> tuple[float, int]:
    """Seconds of a held take and its columns of `fields`, and the bytes of those columns."""
    residency.release(store.path / "data.mdb")
    start = time.perf_counter()
    batch = store.sample(TakeSpec("moe", num_groups=experiences, delivery="lease"), hold=True)
    assert batch is not None
    size = batch.columns(fields, lambda columns: sum(column.size for column in columns))
    seconds = time.perf_counter() - start
    batch.release()
    store.nack(batch.lease_id, "moe")
    return seconds, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131072, help="tokens a rollout")
    parser.add_argument("--experiences", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    times: dict[tuple[str, ...], list[float]] = {SOME: [], ALL: []}
    sizes: dict[tuple[str, ...], int] = {}
    with tempfile.TemporaryDirectory() as data, Store(data, map_size=8 << 30) as store:
        store.create_table(TableConfig.of("moe", group_size=1, estimator="none"))
        for task in range(args.experiences):
            store.put("moe", [rollout(task, args.tokens)])
        read(store, args.experiences, ALL)  # into the page cache
        for round_ in range(args.rounds):
            for fields in (SOME, ALL) if round_ % 2 == 0 else (ALL, SOME):
                seconds, sizes[fields] = read(store, args.experiences, fields)
                times[fields].append(seconds)
    load = os.getloadavg()
    rows = [
        f"| {', '.join(fields)} | {sizes[fields] / 2**20:,.0f} | {statistics.median(times[fields]) * 1e3:,.1f} |"
        for fields in (SOME, ALL)
    ]
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `python bench/bench_fields.py --tokens {args.tokens} --experiences {args.experiences} "
            f"--rounds {args.rounds}`  ",
            f"Load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} at the end; medians of {args.rounds} rounds, "
            f"alternating which goes first; a batch of {args.experiences} rollouts of {args.tokens:,} tokens.",
            "",
            "| fields read | MiB the reply copies | take and columns (ms) |",
            "| --- | --- | --- |",
            *rows,
            "",
        ]
    )
    print(section)
    write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
