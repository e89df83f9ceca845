"""What an estimator adds to ingest at the storage engine, without gRPC or other threads.

    .venv/bin/python bench/bench_estimator_store.py [--payloads 16] [--rounds 3]

bench_advantages.py's payloads (64 x 40 KB experiences of 4,000 response tokens, groups of
8), validated and packed once, then put into a fresh Store table with estimator grpo, computed
by the push (as `expbuf serve` does: the store's `in_push`), with grpo left to the worker, and
with none, in turns, one put (one durable commit) per payload. For grpo by the worker the
advantage work follows, in its three steps: read the completed groups' item records back
(`compute_backlog`), compute, and store the values (`finish_compute`: each member's record
rewritten with its value, the group made ready, one more durable commit). CPU time of this
process per experience (µs), medians of the rounds; the payloads are all put before the
worker computes, so its work is one large job, its cheapest case.

Then what computing in the push adds to its latency, for groups of 64 experiences of 4,000
tokens (the size a group's estimator reads nothing more of: rewards, lengths and ids from the
records): the wall time of a put of 1, 4 and 16 such groups (the last, 1,024 experiences, the
most a push computes itself) into a grpo table computing in the push and into a none table, and
within the first the time of the computation before the transaction (`compute_ahead`, on the
pushing thread) and of storing the values in it (`compute_in_push`, on the
writer), medians and the largest.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import PER_PAYLOAD, make_payloads  # noqa: E402
from bench_store import experience  # noqa: E402

from expbuf.client import trxp  # noqa: E402
from expbuf.server.advantages.worker import AdvantageWorker, compute  # noqa: E402
from expbuf.server.store import Store  # noqa: E402
from expbuf.server.store.disk.kinds import Entry  # noqa: E402
from expbuf.server.store.rules import groups, pushed_advantages  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

# column -> (estimator, whether the push computes the advantages)
VARIANTS = {"grpo, in the push": ("grpo", True), "grpo, by the worker": ("grpo", False), "none": ("none", False)}


def one(entries: list[list[Entry]], estimator: str, in_push: bool) -> dict[str, float]:
    """CPU µs per experience of each step, for one table."""
    count = len(entries) * PER_PAYLOAD
    steps: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as data, Store(data) as store:
        if in_push:
            store.in_push = AdvantageWorker(store).in_push
        store.create_table(TableConfig.of("t", estimator=estimator))
        start = time.process_time()
        for batch in entries:
            store.put_entries("t", batch)
        steps["put"] = time.process_time() - start
        if estimator != "none" and not in_push:
            start = time.process_time()
            jobs = store.compute_backlog()
            steps["read the completed groups back"] = time.process_time() - start
            start = time.process_time()
            results = [compute(job) for job in jobs]
            steps["compute"] = time.process_time() - start
            start = time.process_time()
            for job, (values, ready, dropped, failed, update) in zip(jobs, results, strict=True):
                store.finish_compute(job.table, values, ready, dropped, failed, update)
            steps["store the values, groups ready"] = time.process_time() - start
        assert store.stats("t")["ready"] == count
    return {step: seconds / count * 1e6 for step, seconds in steps.items()}


def timed(module: ModuleType, name: str, into: list[float]) -> Callable[[], None]:
    """Time every call of `module`'s function `name` (as the callers there find it) into
    `into`; returns the undo."""
    inner = getattr(module, name)

    @functools.wraps(inner)
    def timing(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args)
        finally:
            into.append(time.perf_counter() - start)

    setattr(module, name, timing)
    return lambda: setattr(module, name, inner)


def latency(groups_per_push: int, pushes: int, rounds: int) -> dict[str, list[float]]:
    """Put wall times (s) of pushes of groups of 64 into grpo (in the push) and none, and within
    the grpo puts the times of the computation before the transaction (compute_ahead) and of
    storing the values in it (compute_in_push)."""
    payloads = [
        [Entry.of(item) for item in trxp.parse(trxp.encode([experience(p, t, r, 5000) for t in range(groups_per_push)
                                                             for r in range(64)]))]
        for p in range(pushes)
    ]  # fmt: skip
    times: dict[str, list[float]] = {"grpo": [], "none": [], "compute_ahead": [], "compute_in_push": []}
    undo = [
        timed(pushed_advantages, "compute_ahead", times["compute_ahead"]),  # called there by the store
        timed(groups, "compute_in_push", times["compute_in_push"]),  # called by pushes.put
    ]
    try:
        for r in range(rounds):
            for estimator in ("grpo", "none") if r % 2 == 0 else ("none", "grpo"):
                with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as data, Store(data) as store:
                    store.in_push = AdvantageWorker(store).in_push
                    store.create_table(TableConfig.of("t", estimator=estimator, group_size=64))
                    for batch in payloads:
                        start = time.perf_counter()
                        store.put_entries("t", batch)
                        times[estimator].append(time.perf_counter() - start)
                    assert store.stats("t")["ready"] == pushes * groups_per_push * 64
    finally:
        for step in undo:
            step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--payloads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    entries = [[Entry.of(item) for item in trxp.parse(p)] for p in make_payloads(args.payloads)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(one(entries, *VARIANTS[name]))
    print(f"| step, CPU µs per 40 KB experience (medians of {args.rounds}) | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for step in runs["grpo, by the worker"][0]:
        cells = [statistics.median(run.get(step, 0.0) for run in runs[name]) for name in names]
        print(f"| {step} | " + " | ".join(f"{cell:.1f}" for cell in cells) + " |")
    totals = [statistics.median(sum(run.values()) for run in runs[name]) for name in names]
    print("| all | " + " | ".join(f"{total:.1f}" for total in totals) + " |")
    print()
    print("| push of groups of 64 x 40 KB | put, grpo (ms) | put, none (ms) | computed before the transaction (ms) "
          "| stored in it (ms) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for per_push in (1, 4, 16):
        times = latency(per_push, max(2, 16 // per_push), args.rounds)
        cells = [f"{statistics.median(times[name]) * 1e3:.2f}" for name in ("grpo", "none")]
        cells += [f"{statistics.median(times[n]) * 1e3:.2f} (largest {max(times[n]) * 1e3:.2f})"
                  for n in ("compute_ahead", "compute_in_push")]  # fmt: skip
        print(f"| {per_push} group{'s' if per_push > 1 else ''} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
