"""Off-policy control benchmark: the version index and the rate limiter's cost.

    .venv/bin/python bench/bench_offpolicy.py [--stale 1000000] [--rounds 200] [--out bench/RESULTS.md]

1. Sampling with `min_model_version` from a table whose front holds `--stale` stale
   experiences (groups of one, small payloads), against sampling a table of only the
   fresh groups: with the version index, the stale ones cost nothing (goal: ratio <= 1.2).
2. Push and sample throughput with the rate limiter on but never binding (an error
   buffer far wider than the workload) against the limiter off, round by round on the
   same machine (goal: >= 0.95).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from results import write_section  # noqa: E402

from expbuf.client import EID, Experience, trxp  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

FRESH = 2000  # fresh groups behind the stale ones
CHUNK = 10_000
SAMPLES = 300


def template() -> Entry:
    exp = Experience(
        eid=EID(batch=0, task=0, run=0),
        tokens=torch.arange(8, dtype=torch.int32),
        prompt_length=4,
        logprobs=torch.zeros(4),
        action_mask=torch.ones(4, dtype=torch.bool),
        reward=1.0,
    )
    return Entry.of(trxp.from_experience(exp))


def fill(store: Store, table: str, prefix: str, count: int, version: int) -> None:
    one = template()
    for start in range(0, count, CHUNK):
        n = min(CHUNK, count - start)
        entries = [dataclasses.replace(one, uid=f"{prefix}{start + i}", version=version) for i in range(n)]
        store.put_entries(table, entries)


def sample_ms(store: Store, spec: TakeSpec) -> float:
    times = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        assert store.sample(spec) is not None
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_index(tmp: Path, stale: int) -> dict[str, float]:
    """Fresh groups both before and after the stale ones: those before are leased while fifo
    is measured, those after consumed before lifo is, so each order meets the stale first."""
    row: dict[str, float] = {}
    with Store(tmp / "index", map_size=4 << 30) as store:
        for name in ("stale", "fresh"):
            store.create_table(TableConfig.of(name=name, estimator="none", group_by="none"))
        fill(store, "stale", "a", FRESH, 9)
        front = store.sample(TakeSpec("stale", num_groups=FRESH, delivery="lease", lease_seconds=3600))
        fill(store, "stale", "s", stale, 1)
        fill(store, "stale", "b", FRESH, 9)
        fill(store, "fresh", "f", FRESH, 9)
        print(f"filled {stale:,} stale between 2 x {FRESH} fresh", file=sys.stderr)
        for order in ("fifo", "lifo"):
            if order == "lifo":
                store.sample(TakeSpec("stale", num_groups=FRESH, min_model_version=5))  # the fresh at the back
                store.nack(front.lease_id)
            behind = TakeSpec("stale", num_groups=4, order=order, delivery="replay", min_model_version=5)
            alone = TakeSpec("fresh", num_groups=4, order=order, delivery="replay")
            assert store.sample(behind).group_ids[0][0] == ("b" if order == "fifo" else "a")
            row[f"{order}_behind_ms"] = sample_ms(store, behind)
            row[f"{order}_alone_ms"] = sample_ms(store, alone)
        print(row, file=sys.stderr)
    return row


def bench_limiter(tmp: Path, rounds: int) -> dict[str, float]:
    one = template()
    tables = {
        "off": TableConfig.of(name="off", estimator="none", group_by="none"),
        "on": TableConfig.of(
            name="on", estimator="none", group_by="none", samples_per_insert=1.0, samples_per_insert_error=1e12
        ),
    }
    spent = {name: 0.0 for name in tables}
    with Store(tmp / "limiter", map_size=4 << 30) as store:
        for config in tables.values():
            store.create_table(config)
        for r in range(rounds):
            for name in tables if r % 2 == 0 else reversed(list(tables)):
                entries = [dataclasses.replace(one, uid=f"{r}-{i}") for i in range(64)]
                start = time.perf_counter()
                store.put_entries(name, entries)
                assert store.sample(TakeSpec(name, num_groups=64)) is not None
                spent[name] += time.perf_counter() - start
    row = {f"{name}_per_s": rounds * 64 / seconds for name, seconds in spent.items()}
    print(row, file=sys.stderr)
    return row


def report(command: str, stale: int, index: dict[str, float], limiter: dict[str, float]) -> str:
    lines = [
        "## Off-policy control",
        "",
        f"Command: `{command}`  ",
        f"Machine: {torch.get_num_threads()} CPU threads, fsync on every commit; medians of {SAMPLES} samples.",
        "",
        f"Sample 4 groups (replay) with `min_model_version` behind {stale:,} stale experiences, against "
        f"a table of only the {FRESH} fresh groups without the filter:",
        "",
        "| order | behind the stale ones | fresh alone | ratio | goal |",
        "| --- | --- | --- | --- | --- |",
    ]
    for order in ("fifo", "lifo"):
        behind, alone = index[f"{order}_behind_ms"], index[f"{order}_alone_ms"]
        lines.append(f"| {order} | {behind:.3f} ms | {alone:.3f} ms | **{behind / alone:.2f}** | ≤ 1.2 |")
    on, off = limiter["on_per_s"], limiter["off_per_s"]
    lines += [
        "",
        "Push 64 and sample 64 experiences per round, the rate limiter on but never binding against off:",
        "",
        "| limiter | experiences / s (push + sample) | ratio | goal |",
        "| --- | --- | --- | --- |",
        f"| off | {off:,.0f} | | |",
        f"| on | {on:,.0f} | **{on / off:.2f}** | ≥ 0.95 |",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stale", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    args = parser.parse_args()
    command = "python bench/bench_offpolicy.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        limiter = bench_limiter(Path(tmp), args.rounds)
        index = bench_index(Path(tmp), args.stale)
    section = report(command.strip(), args.stale, index, limiter)
    print(section)
    write_section(Path(args.out), "## Off-policy control", section)


if __name__ == "__main__":
    main()
