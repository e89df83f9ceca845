"""What each context-parallel rank of a trainer receives of a batch of long MoE rollouts: its share
of every rollout's tokens (`read_fields(..., share=r, of=C)`) against the whole batch, which is
what a rank gets where the full routing data is broadcast to every rank (issue 41).

    .venv/bin/python bench/bench_rank_reads.py [--tokens 131072] [--experiences 8] [--ranks 2,4,8] [--rounds 5]

One `expbuf serve` child on loopback; rollouts with routing ids (uint8, 2 x 96 experts a token:
192 B a token against 9 B for tokens, log-probs and the mask), stored in chunks. Each round
reads, in alternating order, the whole batch's fields once and every rank's share for each rank
count, one after another from one client (the ranks of one machine would read side by side);
the map's pages stay in the page cache. Per read: seconds end to end (the call, its reply put
together, its tensors made) and MiB received; medians of the rounds, ratios of medians from the
same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience  # noqa: E402

HEADING = "## Each context-parallel rank's share of MoE rollouts (issue 41)"
FIELDS = ["tokens", "logprobs", "action_mask", "routed_experts"]


def rollout(task: int, tokens: int) -> Experience:
    return Experience(
        eid=EID(batch="cp", task=task, run=0),
        tokens=torch.arange(tokens + 1, dtype=torch.int32),
        prompt_length=1,
        logprobs=torch.full((tokens,), -0.5),
        action_mask=torch.ones(tokens, dtype=torch.bool),
        routed_experts=torch.randint(0, 255, (tokens + 1, 192), dtype=torch.uint8),
        reward=1.0,
    )


def read(client: BufferClient, uids: list[str], share: int, of: int) -> tuple[float, int]:
    """Seconds of one read (the whole batch with of=0), and the bytes of its columns."""
    start = time.perf_counter()
    got = client.read_fields(uids, FIELDS, table="cp", share=() if not of else share, of=of)
    seconds = time.perf_counter() - start
    assert got.uids == uids, got.missing_uids
    return seconds, sum(column.values.numel() * column.values.element_size() for column in got.columns.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131072, help="tokens a rollout")
    parser.add_argument("--experiences", type=int, default=8)
    parser.add_argument("--ranks", default="2,4,8", help="context-parallel rank counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    counts = [int(count) for count in args.ranks.split(",")]
    command = ("python bench/bench_rank_reads.py " + " ".join(sys.argv[1:])).strip()
    times: dict[int, list[float]] = {count: [] for count in [0, *counts]}  # 0: the whole batch
    sizes: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        argv = ["-m", "expbuf.server.cli", "serve", "--data", f"{tmp}/data", "--port", "0", "--metrics-port", "-1"]
        server = Proc(*argv)
        try:
            with BufferClient(server.target, timeout=600, max_message_bytes=1 << 30) as client:
                client.create_table("cp", group_size=1, estimator="none")
                made = [rollout(task, args.tokens) for task in range(args.experiences)]
                for exp in made:
                    client.push([exp], table="cp")
                uids = [exp.eid.uid for exp in made]
                read(client, uids, 0, 0)  # warm-up
                order = [0, *counts]
                for round_ in range(args.rounds):
                    for count in order[round_ % len(order) :] + order[: round_ % len(order)]:
                        spent, size = 0.0, 0
                        for rank in range(max(count, 1)):
                            seconds, got = read(client, uids, rank, count)
                            spent, size = spent + seconds, max(size, got)
                        times[count].append(spent / max(count, 1))
                        sizes[count] = size
        finally:
            server.stop()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    whole = statistics.median(times[0])
    rows = [f"| whole batch (every rank, as a broadcast) | {sizes[0] / 2**20:,.1f} | {whole * 1e3:,.1f} | 1.00 |"]
    for count in counts:
        median = statistics.median(times[count])
        rows.append(
            f"| share r of {count} | {sizes[count] / 2**20:,.1f} | {median * 1e3:,.1f} | **{whole / median:.2f}** |"
        )
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `{command}`  ",
            f"Loopback, 2 cores shared with other work: load average {load} at the end. A batch of "
            f"{args.experiences} rollouts of {args.tokens:,} tokens with routing ids (192 B a token), fields "
            f"{', '.join(FIELDS)}; medians of {args.rounds} rounds in alternating order.",
            "",
            "| each rank reads | MiB a rank receives (the largest share) | ms a rank's read | whole / share |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    print(section)
    write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
