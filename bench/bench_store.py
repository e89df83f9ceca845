"""Storage engine benchmark: expbuf's store side by side with raw LMDB on the same bytes.

    .venv/bin/python bench/bench_store.py [--rounds 30] [--sizes 10000,100000,1000000] [--out bench/RESULTS.md]

1. Durable writes: 40 KB experiences, 8 per group, 64 per write, fsync on every commit,
   against raw lmdb puts of the same bytes with the same sync policy, alternating
   round by round so that both see the same machine.
2. Group selection + read (consume, 64 experiences per batch) against a raw LMDB
   cursor read of the same bytes.
3. Selection latency at growing table sizes (small payloads: the index is measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import lmdb
import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from results import write_section  # noqa: E402

from expbuf.client import EID, Experience, trxp  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.core.ordering.ready import ReadyIndex  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

GROUP, PER_WRITE, TOKENS = 8, 64, 5000
# The storage engine alone: groups are ready as pushed (no advantage computation).
TABLE = TableConfig.of(name="bench", estimator="none")


def experience(batch: int, task: int, run: int, tokens: int = TOKENS) -> Experience:
    """About 40 KB of tensors: int32 tokens, float32 logprobs and a bool mask."""
    response = tokens * 4 // 5
    return Experience(
        eid=EID(batch=batch, task=task, run=run, step=0, suffix=f"r{run}"),
        tokens=torch.randint(0, 150_000, (tokens,), dtype=torch.int32),
        prompt_length=tokens - response,
        logprobs=torch.randn(response),
        action_mask=torch.ones(response, dtype=torch.bool),
        reward=float(run % 2),
        info={"model_version": batch},
    )


def write_batches(rounds: int) -> list[list[Entry]]:
    batches = []
    for b in range(rounds):
        items = [trxp.from_experience(experience(b, t, r)) for t in range(PER_WRITE // GROUP) for r in range(GROUP)]
        batches.append([Entry.of(item) for item in items])
    return batches


def bench_writes(tmp: Path, batches: list[list[Entry]]) -> dict[str, float]:
    raw_env = lmdb.open(str(tmp / "raw"), map_size=8 << 30, sync=True, metasync=True, readahead=False)
    store = Store(tmp / "store", map_size=8 << 30)
    store_conc = Store(tmp / "store4", map_size=8 << 30)
    store.create_table(TABLE)
    store_conc.create_table(TABLE)
    raw_t, store_t, conc_t = [], [], []
    for entries in batches:
        start = time.perf_counter()
        with raw_env.begin(write=True) as txn:
            for e in entries:
                txn.put(e.uid.encode(), e.blob)
        raw_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        store.put_entries(TABLE.name, entries)
        store_t.append(time.perf_counter() - start)
        # The same 64 experiences from 4 concurrent pushers (16 each): the writer groups them.
        quarters = [entries[i : i + 16] for i in range(0, PER_WRITE, 16)]
        threads = [threading.Thread(target=store_conc.put_entries, args=(TABLE.name, q)) for q in quarters]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conc_t.append(time.perf_counter() - start)
    nbytes = sum(len(e.blob) for e in batches[0])
    raw_env.close()
    store.close()
    store_conc.close()
    return {
        "bytes_per_write": nbytes,
        "raw_ms": statistics.median(raw_t) * 1e3,
        "store_ms": statistics.median(store_t) * 1e3,
        "store4_ms": statistics.median(conc_t) * 1e3,
    }


def bench_reads(tmp: Path, batches: list[list[Entry]]) -> dict[str, float]:
    """Sample whole groups (consume) versus a raw cursor read of the same bytes."""
    raw_env = lmdb.open(str(tmp / "raw_r"), map_size=8 << 30, sync=True, readahead=False)
    store = Store(tmp / "store_r", map_size=8 << 30)
    store.create_table(TABLE)
    for entries in batches:
        with raw_env.begin(write=True) as txn:
            for e in entries:
                txn.put(e.uid.encode(), e.blob)
        store.put_entries(TABLE.name, entries)
    raw_t, select_t, payload_t = [], [], []
    with raw_env.begin() as txn, txn.cursor() as cur:
        keys = [k for k, _ in cur]
    for i in range(len(batches)):
        wanted = keys[i * PER_WRITE : (i + 1) * PER_WRITE]
        start = time.perf_counter()
        with raw_env.begin() as txn, txn.cursor() as cur:
            cur.set_range(wanted[0])
            got = [v for _, v in zip(range(PER_WRITE), cur, strict=False)]
        raw_t.append(time.perf_counter() - start)
        assert sum(map(len, got)) > 0
        start = time.perf_counter()
        batch = store.sample(TakeSpec(TABLE.name, num_groups=PER_WRITE // GROUP))
        select_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        _ = batch.payload
        payload_t.append(time.perf_counter() - start)
    raw_env.close()
    store.close()
    return {
        "raw_ms": statistics.median(raw_t) * 1e3,
        "select_ms": statistics.median(select_t) * 1e3,
        "payload_ms": statistics.median(payload_t) * 1e3,
    }


def bench_selection(tmp: Path, sizes: list[int]) -> list[dict[str, float]]:
    """Selection latency as the table grows: pure index selection and a full sample call."""
    template = Entry.of(trxp.from_experience(experience(0, 0, 0, tokens=8)))
    store = Store(tmp / "sel", map_size=1 << 30)
    store.create_table(TableConfig.of(name="sel", group_size=GROUP, estimator="none"))
    filled, rows = 0, []
    for size in sizes:
        while filled < size:
            chunk = []
            for _ in range(1024 // GROUP):
                task = filled // GROUP
                for run in range(GROUP):
                    uid = f"0/{task}/{run}/0/r{run}"
                    chunk.append(dataclasses.replace(template, uid=uid, tid=f"0/{task}", rid=f"0/{task}/{run}"))
                filled += GROUP
            store.put_entries("sel", chunk)
        row: dict[str, float] = {"size": size}
        table_id, _ = store.catalog.lookup("sel")
        prefix = table_id.to_bytes(4, "big")
        for order in ("fifo", "lifo", "uniform", "priority"):
            # the first request in an order builds its index (a read transaction cannot)
            store.sample(TakeSpec("sel", num_groups=1, order=order, delivery="replay"))
            times = []
            for _ in range(300):
                start = time.perf_counter()
                with store.environment.read() as txn:
                    db = store.environment.db
                    index = ReadyIndex(db, txn, prefix)
                    it = index.candidates(order, store.sampling.rng)
                    picked = [next(it) for _ in range(4)]
                    it.close()
                    [txn.get(prefix + g, db=db["groups"]) for g in picked]
                times.append(time.perf_counter() - start)
            row[f"select_{order}_us"] = statistics.median(times) * 1e6
        times = []
        for _ in range(100):
            start = time.perf_counter()
            store.sample(TakeSpec("sel", num_groups=4, order="uniform", delivery="replay"))
            times.append(time.perf_counter() - start)
        row["sample_replay_us"] = statistics.median(times) * 1e6
        rows.append(row)
        print(row, file=sys.stderr)
    store.close()
    return rows


def report(command: str, writes: dict, reads: dict, selection: list[dict]) -> str:
    mb = writes["bytes_per_write"] / 1e6
    w_ratio = writes["raw_ms"] / writes["store_ms"]
    w4_ratio = writes["raw_ms"] / writes["store4_ms"]
    r_ratio = reads["raw_ms"] / reads["select_ms"]
    r2_ratio = reads["raw_ms"] / (reads["select_ms"] + reads["payload_ms"])
    lines = [
        "## Storage engine (issue 2)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {torch.get_num_threads()} CPU threads, LMDB {'.'.join(map(str, lmdb.version()))}, "
        f"fsync on every commit. Medians of alternating rounds in one run.",
        "",
        "| measure | expbuf | raw LMDB | ratio (raw time / expbuf time) | goal |",
        "| --- | --- | --- | --- | --- |",
        f"| durable write of 64 x 40 KB ({mb:.2f} MB), 8 per group | {writes['store_ms']:.2f} ms "
        f"({mb / writes['store_ms'] * 1e3:.0f} MB/s) | {writes['raw_ms']:.2f} ms "
        f"({mb / writes['raw_ms'] * 1e3:.0f} MB/s) | **{w_ratio:.2f}** | ≥ 0.8 |",
        f"| the same 64 from 4 concurrent pushers (group commit) | {writes['store4_ms']:.2f} ms | "
        f"{writes['raw_ms']:.2f} ms | {w4_ratio:.2f} | |",
        f"| select 8 whole groups + read their 64 payloads (consume, fsync) | {reads['select_ms']:.2f} ms | "
        f"{reads['raw_ms']:.2f} ms (cursor read) | **{r_ratio:.2f}** | ≥ 0.5 |",
        f"| the same + join into one TRXP batch payload | {reads['select_ms'] + reads['payload_ms']:.2f} ms | "
        f"{reads['raw_ms']:.2f} ms | {r2_ratio:.2f} | |",
        "",
        "Selection latency by stored experiences (groups of 8, small payloads; median µs):",
        "",
        "| stored | fifo | lifo | uniform | priority | full sample call (uniform, replay, fsync) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in selection:
        lines.append(
            f"| {row['size']:,} | {row['select_fifo_us']:.0f} | {row['select_lifo_us']:.0f} | "
            f"{row['select_uniform_us']:.0f} | {row['select_priority_us']:.0f} | {row['sample_replay_us']:.0f} |"
        )
    spread = {
        key: max(r[key] for r in selection) / min(r[key] for r in selection) for key in selection[0] if key != "size"
    }
    lines += [
        "",
        "Largest / smallest across sizes (goal: within 1.2): "
        + ", ".join(f"{k.replace('_us', '')} {v:.2f}" for k, v in spread.items()),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    args = parser.parse_args()
    command = "python bench/bench_store.py " + " ".join(sys.argv[1:])
    batches = write_batches(args.rounds)
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        writes = bench_writes(Path(tmp), batches)
        print(writes, file=sys.stderr)
        reads = bench_reads(Path(tmp), batches)
        print(reads, file=sys.stderr)
        selection = bench_selection(Path(tmp), [int(s) for s in args.sizes.split(",")])
    section = report(command.strip(), writes, reads, selection)
    print(section)
    write_section(Path(args.out), "## Storage engine (issue 2)", section)


if __name__ == "__main__":
    main()
