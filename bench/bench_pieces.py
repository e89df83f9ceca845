"""Partial rollouts and per-token versions (issue 44), side by side on one `expbuf serve` child:

- a rollout pushed whole against the same rollout pushed in k pieces, one push each, in turns
  (the pieces' cost: each is stored apart, and the last push puts the rollout together in the
  writer), with the time a worker takes to read back a rollout held in pieces (get_partials);
- a consume stream of 8 KB experiences as columns (action mask and advantages) from a table
  without a token bound against one whose bound masks a prefix of every experience (each mask
  rewritten and each advantage expanded over it where the reply is built).

    .venv/bin/python bench/bench_pieces.py [--out bench/RESULTS.md] [--sizes 8,64] [--pieces 4,16] [--rounds 3]

Medians of `--rounds` rounds, the variants of a round in turns on the same server.
"""

from __future__ import annotations

import argparse
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
from expbuf.client.rollout_pieces import split  # noqa: E402

MB = 1 << 20
HEADING = "## Partial rollouts and per-token versions (issue 44)"


def rollout(task: str, size: int, versions: bool = False) -> Experience:
    """A rollout of about `size` bytes: int32 tokens, float32 log-probs and a bool mask."""
    tokens = max(size // 9, 16)
    info = {"version_segments": [[1, 0], [2, tokens // 2]]} if versions else {"model_version": 1}
    return Experience(
        eid=EID(batch="b", task=task, run=0, suffix="r"),
        tokens=torch.arange(tokens + 1, dtype=torch.int32),
        prompt_length=1,
        logprobs=torch.full((tokens,), -0.5),
        action_mask=torch.ones(tokens, dtype=torch.bool),
        reward=1.0,
        info=info,
    )


def timed(work: object) -> float:
    start = time.perf_counter()
    work()  # type: ignore[operator]
    return time.perf_counter() - start


def pieces_rows(client: BufferClient, sizes: list[int], counts: list[int], rounds: int) -> list[str]:
    rows = [
        "| rollout | pushed whole | in pieces | pieces / whole | the last piece's push "
        "| get_partials (held: all but the last) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    serial = 0
    for size in sizes:
        for count in counts:
            whole_s, pieces_s, read_s, last_s = [], [], [], []
            for _ in range(rounds):
                serial += 1
                exp = rollout(f"w{serial}", size * MB)
                whole_s.append(timed(lambda exp=exp: client.push([exp], table="t")))
                response = exp.tokens.numel() - exp.prompt_length
                cuts = [response * k // count for k in range(1, count)]
                parts = split(rollout(f"p{serial}", size * MB), cuts)
                start = time.perf_counter()
                for part in parts[:-1]:
                    client.push([part], table="t")
                held = time.perf_counter()
                read_s.append(timed(lambda s=serial: client.get_partials([f"b/p{s}"], table="t")))
                pushed = time.perf_counter()
                client.push([parts[-1]], table="t")
                last_s.append(time.perf_counter() - pushed)
                pieces_s.append(held - start + last_s[-1])
            whole, pieces, read, last = (statistics.median(v) for v in (whole_s, pieces_s, read_s, last_s))
            rows.append(
                f"| {size} MiB, {count} pieces | {whole * 1e3:.0f} ms ({size / whole:.0f} MiB/s) | "
                f"{pieces * 1e3:.0f} ms ({size / pieces:.0f} MiB/s) | {pieces / whole:.2f} | {last * 1e3:.0f} ms | "
                f"{read * 1e3:.0f} ms |"
            )
    return rows


def masking_rows(client: BufferClient, experiences: int, rounds: int) -> list[str]:
    """Consume rates as columns, without a bound and with one that masks half of each response."""
    fields = ["action_mask", "advantages"]
    for table, bound in (("plain", None), ("masked", 0)):
        client.create_table(table, group_size=8, max_token_staleness=bound)
        client.set_trainer_version(2, table)
    rates: dict[str, list[float]] = {"plain": [], "masked": []}
    serial = 0
    for _ in range(rounds):
        for table in ("plain", "masked"):
            serial += 1
            batch = [rollout(f"{serial}.{i // 8}", 8 << 10, versions=True) for i in range(experiences)]
            for i, exp in enumerate(batch):
                exp.eid = EID(batch="m", task=f"{serial}.{i // 8}", run=i % 8, suffix="r")
            for start in range(0, experiences, 512):
                client.push(batch[start : start + 512], table=table)
            start = time.perf_counter()
            got = 0
            for sampled in client.sample(table, num_groups=32, delivery="consume", timeout=30, fields=fields):
                got += len(sampled.uids)
                if got >= experiences:
                    break
            rates[table].append(got / (time.perf_counter() - start))
    plain, masked = (statistics.median(rates[t]) for t in ("plain", "masked"))
    return [
        "| consume as columns, 8 KB experiences | experiences/s |",
        "| --- | --- |",
        f"| no token bound | {plain:,.0f} |",
        f"| max_token_staleness masking half of every response | {masked:,.0f} ({masked / plain:.2f} of it) |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sizes", default="8,64")
    parser.add_argument("--pieces", default="4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--experiences", type=int, default=4096)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(s) for s in args.pieces.split(",")]
    with tempfile.TemporaryDirectory() as data:
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "0")
        try:
            server.wait_for("advantage worker")
            with BufferClient(server.target, timeout=600) as client:
                client.create_table("t", group_size=1, estimator="none")
                rows = pieces_rows(client, sizes, counts, args.rounds)
                rows += ["", *masking_rows(client, args.experiences, args.rounds)]
        finally:
            server.stop()
    command = "python bench/bench_pieces.py " + " ".join(sys.argv[1:])
    section = f"{HEADING}\n\nCommand: `{command}` (medians of {args.rounds} rounds)\n\n" + "\n".join(rows) + "\n"
    print(section)
    if args.out:
        write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
