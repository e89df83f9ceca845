"""A group's shared prompt stored once: bytes on disk per GRPO group, and push and sample
throughput, with the prompt stored once (shared_prompts.py) and with every run stored whole.

    .venv/bin/python bench/bench_shared_prompts.py [--groups 64] [--rounds 4] [--before DIR] [--out bench/RESULTS.md]

Groups of 16 runs, each a 2,048-token prompt (int64 tokens, the same for every run of the group)
and a 1,024-token response with its float32 log-probs and action mask. Both ways run in one
process, alternating round by round, on the same groups, each into a fresh directory: "whole"
raises shared_prompts.MIN_BYTES above any prompt, which stores each run as the store did before.
Bytes on disk are the pages the table's databases use (branch, leaf and overflow pages times the
page size). Throughput is of the Store itself (no gRPC, which carries the same bytes either way):
a push is one group a durable write; a sample consumes 8 groups a take, as TRXP payloads and as
the columns of tokens, log-probs and the action mask.

With --before DIR (an earlier tree of expbuf, `git archive COMMIT | tar -x -C DIR`), the same
groups also go through a server of each tree, alternating: pushed a group a call, then consumed
8 groups a batch by a Sample stream, as TRXP payloads and as columns, and the data file's
allocated bytes measured after the pushes.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_consume import Server  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402
from expbuf.server.store import Store  # noqa: E402
from expbuf.server.store.disk import shared_prompts  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

HEADING = "## A group's shared prompt stored once"
RUNS, PROMPT, RESPONSE = 16, 2048, 1024
MIB = 1 << 20


def groups(count: int) -> list[list[trxp.RawItem]]:
    made = []
    for task in range(count):
        prompt = torch.randint(0, 150_000, (PROMPT,), generator=torch.Generator().manual_seed(task))
        runs = []
        for run in range(RUNS):
            response = torch.randint(0, 150_000, (RESPONSE,), generator=torch.Generator().manual_seed(task * 97 + run))
            exp = Experience(
                eid=EID(batch=0, task=task, run=run, suffix="b"),
                tokens=torch.cat([prompt, response]),
                prompt_length=PROMPT,
                logprobs=torch.rand(RESPONSE),
                action_mask=torch.ones(RESPONSE, dtype=torch.bool),
                reward=float(run % 2),
            )
            runs.append(trxp.from_experience(exp))
        made.append(runs)
    return made


def used_bytes(store: Store) -> int:
    """The pages every database of the store uses, in bytes."""
    env = store.environment.env
    total = 0
    with env.begin() as txn:
        for db in store.environment.db.values():
            stat = txn.stat(db)
            total += (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]
    return total


def one(made: list[list[trxp.RawItem]], shared: bool) -> dict[str, float]:
    shared_prompts.MIN_BYTES = saved if shared else 1 << 62
    payload = sum(len(trxp.pack_item(item)) for runs in made for item in runs)
    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp) / "data", map_size=4 << 30, seed=1) as store:
        store.create_table(TableConfig.of(name="t", estimator="none", group_size=RUNS))
        empty = used_bytes(store)
        start = time.perf_counter()
        for runs in made:
            store.put("t", runs)
        push = time.perf_counter() - start
        assert store.stats("t")["ready"] == len(made) * RUNS
        disk = used_bytes(store) - empty
        half = len(made) // 2
        start = time.perf_counter()
        for _ in range(half // 8):
            batch = store.sample(TakeSpec("t", num_groups=8))
            assert batch is not None
            _ = batch.payload
            batch.release()
        sample = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(half // 8):
            batch = store.sample(TakeSpec("t", num_groups=8))
            assert batch is not None
            batch.columns(["tokens", "logprobs", "action_mask"], lambda columns: sum(c.size for c in columns))
            batch.release()
        columns = time.perf_counter() - start
        sampled = payload / 2 / MIB
        return {
            "disk": disk / len(made),
            "payload": payload / len(made),
            "push": payload / MIB / push,
            "sample": sampled / sample,
            "columns": sampled / columns,
        }


saved = shared_prompts.MIN_BYTES
FIELDS = ["tokens", "logprobs", "action_mask"]


def served(tree: Path | None, made: list[list[trxp.RawItem]]) -> dict[str, float]:
    """Through a server of `tree` (None: this one): push, disk, and consume as payloads and as columns."""
    pushes = [trxp.join([trxp.pack_item(item) for item in runs]) for runs in made]
    payload = sum(map(len, pushes))
    half = len(made) // 2
    with tempfile.TemporaryDirectory() as data:
        server = Server(tree, Path(data) / "d")
        try:
            server.wait_started()
            with BufferClient(server.target, timeout=120) as client:
                client.create_table("t", estimator="none", group_size=RUNS)
                start = time.perf_counter()
                for body in pushes:
                    client.push(body, table="t")
                push = time.perf_counter() - start
                disk = (Path(data) / "d" / "data.mdb").stat().st_blocks * 512
                start = time.perf_counter()
                got = 0
                for batch in client.sample("t", num_groups=8, delivery="consume", max_batches=half // 8, prefetch=0):
                    got += len(batch.payload)
                sample = time.perf_counter() - start
                start = time.perf_counter()
                batches = client.sample(
                    "t", num_groups=8, delivery="consume", max_batches=half // 8, prefetch=0, fields=FIELDS
                )
                for batch in batches:
                    assert len(batch.columns["tokens"].items) == 8 * RUNS
                columns = time.perf_counter() - start
        finally:
            server.stop()
    return {
        "disk": disk / len(made),
        "push": payload / MIB / push,
        "sample": got / MIB / sample,
        "columns": payload / 2 / MIB / columns,
    }


TREE = ["prefix_tokens", "branch_tokens", "prefix_of", "logprobs", "action_mask"]


def tree_form(made: list[list[trxp.RawItem]], rounds: int) -> dict[str, float]:
    """Through a server of this tree: the groups read 8 at a time (read_fields) as tokens, log-probs
    and mask, and as prefix + branches with the same log-probs and mask: bytes a group, groups a
    second (medians over `rounds` passes, the two forms alternating)."""
    with tempfile.TemporaryDirectory() as data:
        server = Server(None, Path(data) / "d")
        try:
            server.wait_started()
            with BufferClient(server.target, timeout=120) as client:
                client.create_table("t", estimator="none", group_size=RUNS)
                for runs in made:
                    client.push(trxp.join([trxp.pack_item(item) for item in runs]), table="t")
                steps = [[item.uid for runs in made[at : at + 8] for item in runs] for at in range(0, len(made), 8)]
                found: dict[str, list[float]] = {"tokens": [], "tree": []}
                size: dict[str, float] = {}
                for _ in range(rounds):
                    for name, fields in (("tokens", FIELDS), ("tree", TREE)):
                        start, nbytes = time.perf_counter(), 0
                        for uids in steps:
                            read = client.read_fields(uids, fields, table="t")
                            nbytes += sum(c.values.nbytes for c in read.columns.values() if c.values is not None)
                        found[name].append(len(made) / (time.perf_counter() - start))
                        size[name] = nbytes / len(made)
        finally:
            server.stop()
    return {
        "tokens_rate": statistics.median(found["tokens"]),
        "tree_rate": statistics.median(found["tree"]),
        "tokens_bytes": size["tokens"],
        "tree_bytes": size["tree"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--before", type=Path, help="an earlier tree of expbuf, to measure through servers")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = parser.parse_args()
    command = (
        ("python bench/bench_shared_prompts.py " + " ".join(sys.argv[1:])).strip().replace(str(args.before), "DIR")
    )
    made = groups(args.groups)
    found: dict[str, list[dict[str, float]]] = {"whole": [], "shared": []}
    one(made[:16], True)  # warm-up
    for round_ in range(args.rounds):
        for way in ("whole", "shared") if round_ % 2 == 0 else ("shared", "whole"):
            found[way].append(one(made, way == "shared"))
            print(way, {k: round(v, 1) for k, v in found[way][-1].items()}, flush=True)
    med = {way: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for way, rows in found.items()}
    whole, shared = med["whole"], med["shared"]

    def ratio(key: str) -> str:
        return f"{shared[key] / whole[key]:.2f}"

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    section = "\n".join(
        [
            HEADING,
            "",
            f"Command: `{command}`  ",
            f"{args.groups} groups of {RUNS} runs ({PROMPT}-token prompts, {RESPONSE}-token responses, int64 tokens, "
            f"float32 log-probs, bool mask); medians of {args.rounds} rounds a way, alternating, in one process; "
            f"load average {load} at the end. Store throughput (no gRPC), MiB of payload a second.",
            "",
            "| measure | runs stored whole | prompt stored once | ratio |",
            "| --- | --- | --- | --- |",
            f"| bytes on disk a group (payload {whole['payload'] / 1024:.0f} KiB) | {whole['disk'] / 1024:.0f} KiB | "
            f"{shared['disk'] / 1024:.0f} KiB | {ratio('disk')} ({(1 - shared['disk'] / whole['disk']) * 100:.0f}% "
            "less) |",
            f"| push, a group a durable write (MiB/s) | {whole['push']:.0f} | {shared['push']:.0f} | {ratio('push')} |",
            f"| sample, TRXP payloads, 8 groups a take (MiB/s) | {whole['sample']:.0f} | {shared['sample']:.0f} | "
            f"{ratio('sample')} |",
            f"| sample, columns of tokens, log-probs, mask (MiB/s) | {whole['columns']:.0f} | {shared['columns']:.0f} "
            f"| {ratio('columns')} |",
            "",
            *tree_rows(tree_form(made, args.rounds)),
            *(through(args, made) if args.before else []),
        ]
    )
    print(section)
    write_section(args.out, HEADING, section)


def tree_rows(got: dict[str, float]) -> list[str]:
    return [
        "Read as prefix + branches (`prefix_tokens`, `branch_tokens`, `prefix_of`, with `logprobs` and "
        "`action_mask`) against tokens, log-probs and mask, through a server, 8 groups a read_fields:",
        "",
        "| form | bytes a group | groups a second |",
        "| --- | --- | --- |",
        f"| tokens | {got['tokens_bytes'] / 1024:.0f} KiB | {got['tokens_rate']:.0f} |",
        f"| prefix + branches | {got['tree_bytes'] / 1024:.0f} KiB | {got['tree_rate']:.0f} |",
        "",
    ]


def through(args: argparse.Namespace, made: list[list[trxp.RawItem]]) -> list[str]:
    """The servers' rows: the tree before (whole runs) and this one, alternating round by round."""
    found: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for way in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
            found[way].append(served(args.before.resolve() if way == "before" else None, made))
            print(way, {k: round(v, 1) for k, v in found[way][-1].items()}, flush=True)
    med = {way: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for way, rows in found.items()}
    before, after = med["before"], med["after"]

    def row(what: str, key: str, scale: float = 1.0, unit: str = "") -> str:
        return (
            f"| {what} | {before[key] / scale:.0f}{unit} | {after[key] / scale:.0f}{unit} | "
            f"{after[key] / before[key]:.2f} |"
        )

    return [
        f"Through a server (`expbuf serve`, the client in this process), the tree before this change and this "
        f"one, medians of {args.rounds} rounds a tree, alternating:",
        "",
        "| measure | before | after | ratio |",
        "| --- | --- | --- | --- |",
        row("data file allocated a group", "disk", 1024, " KiB"),
        row("push, a group a call (MiB/s)", "push"),
        row("consume, TRXP payloads, 8 groups a batch (MiB/s)", "sample"),
        row("consume, columns of tokens, log-probs, mask (MiB/s)", "columns"),
        "",
    ]


if __name__ == "__main__":
    main()
