"""The prompt ledger's cost per prompt: claim + push + sample + ack, with and without it.

    .venv/bin/python bench/bench_ledger.py [--rounds 20] [--prompts 32] [--claims 8,32] [--per-push 1]
        [--before DIR] [--out bench/RESULTS.md]

One `expbuf serve` on loopback per claim size, two tables grouping by task (group_size 8,
grpo), one client. Per prompt, a rollout worker's and a trainer's work:
- with the ledger: prompts claimed `claim` at a time, each prompt's group (8 experiences of
  about 8 KB, EIDs from `prompt.eid(run)`) pushed on its own (`--per-push` groups a push: a
  worker that pushes several prompts' groups at once), leased in batches of 8 groups and acked;
- without: the same groups under plain EIDs pushed to a table without a dataset, leased in
  batches of 8 groups and acked.
Each round runs `--prompts` prompts on each side, the side that goes first alternating, after
one round of each to warm up. The ratio is the two sides' time per prompt, measured side by
side; the median of the rounds' own ratios leaves out rounds that a passing load on a shared
machine slowed on one side only (goal: at most 1.05). The server's CPU time and the bytes it
wrote to storage per prompt, read from /proc for each side's rounds, are steadier than wall
time and say where an extra goes. With `--before DIR` (an earlier tree of expbuf: `git archive
REV | tar -x -C DIR`), that tree's server runs beside this one's, each with both tables, the
rounds alternating which server goes first: the ledger's cost per prompt on each, measured in one
run (its server runs this venv's Python on DIR's sources, as bench_push_before.py's does).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_push_before import package  # noqa: E402
from bench_service import Proc  # noqa: E402
from bench_store import experience  # noqa: E402
from results import write_section  # noqa: E402
from storage_writes import written  # noqa: E402

from expbuf.client import EID, BufferClient, Experience  # noqa: E402

GROUP = 8  # experiences per prompt
BATCH = 8  # groups per sampled batch
TOKENS = 1000  # int32 tokens, float32 logprobs and a bool mask of 800: about 8 KB
WITH, WITHOUT = "ledger", "plain"
DATASET = "prompts"
PARTS = ("claim", "push", "sample + ack")
HEADING = "## The prompt ledger's cost per prompt (issue 28)"


def heading(per_push: int) -> str:
    """The section's heading: one for prompts pushed on their own, one for each other --per-push."""
    return HEADING if per_push == 1 else HEADING.replace(" (issue 28)", f", {per_push} groups a push (issue 28)")


def server_use(pid: int) -> tuple[float, int]:
    """The server's CPU seconds and the bytes it has handed to write calls (LMDB's pages), from /proc:
    steadier than wall time on a busy machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), written(pid)


class Side:
    """One side's work, the time each part of it took, and the server's CPU and writes for it."""

    def __init__(
        self, client: BufferClient, table: str, template: list[Experience], claim: int, pid: int, per_push: int
    ) -> None:
        self.client, self.table, self.template, self.claim, self.pid = client, table, template, claim, pid
        self.per_push = per_push
        self.next_task = 0
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.cpu, self.written = 0.0, 0
        self.prompts = 0

    def eids(self) -> list[list[EID]]:
        """The next `claim` groups' EIDs: with the ledger, of the prompts a claim hands out."""
        if self.table == WITH:
            claim = self.client.claim(WITH, DATASET, self.claim, lease_seconds=300)
            assert len(claim.prompts) == self.claim, claim
            return [[prompt.eid(run) for run in range(GROUP)] for prompt in claim.prompts]
        tasks = range(self.next_task, self.next_task + self.claim)
        self.next_task += self.claim
        return [[EID(batch="plain", task=task, run=run) for run in range(GROUP)] for task in tasks]

    def run(self, prompts: int, *, timed: bool = True) -> float:
        """Claim, push, lease and ack `prompts` prompts; the seconds it took."""
        spent = dict.fromkeys(PARTS, 0.0)
        cpu, written = server_use(self.pid)
        for _ in range(prompts // self.claim):
            start = time.perf_counter()
            eids = self.eids()
            mark = time.perf_counter()
            spent["claim"] += mark - start
            for at in range(0, len(eids), self.per_push):
                push = [
                    dataclasses.replace(exp, eid=eid)
                    for row in eids[at : at + self.per_push]
                    for exp, eid in zip(self.template, row, strict=True)
                ]
                assert len(self.client.push(push, table=self.table).stored) == len(push)
            start, mark = mark, time.perf_counter()
            spent["push"] += mark - start
            for batch in self.client.sample(
                self.table, num_groups=BATCH, delivery="lease", max_batches=self.claim // BATCH, timeout=30
            ):
                assert batch.ack() == BATCH * GROUP
            spent["sample + ack"] += time.perf_counter() - mark
        if timed:
            for part, seconds in spent.items():
                self.seconds[part] += seconds
            now_cpu, now_written = server_use(self.pid)
            self.cpu += now_cpu - cpu
            self.written += now_written - written
            self.prompts += prompts
        return sum(spent.values())

    def ms(self, part: str = "") -> float:
        """Milliseconds per prompt, of one part or of all."""
        seconds = self.seconds[part] if part else sum(self.seconds.values())
        return seconds / self.prompts * 1e3


@contextlib.contextmanager
def serving(tree: Path | None) -> Iterator[Proc]:
    """An `expbuf serve` of `tree` (None: this one) on a fresh data directory, stopped after."""
    with tempfile.TemporaryDirectory() as data:
        env = None if tree is None else {**os.environ, "PYTHONPATH": str(package(tree, Path(data) / "tree"))}
        server = Proc(
            "-m", "expbuf.server.cli", "serve", "--data", f"{data}/d", "--port", "0", "--metrics-port", "-1", env=env
        )
        try:
            yield server
        finally:
            server.stop()


def bench(
    rounds: int, prompts: int, claim: int, per_push: int = 1, trees: dict[str, Path | None] | None = None
) -> dict[str, dict[str, float]]:
    """Each tree's row (`trees`: label -> tree, None for this one; this one alone by default)."""
    trees = trees or {"now": None}
    template = [experience(0, 0, run, TOKENS) for run in range(GROUP)]
    size = (rounds + 1) * prompts
    with contextlib.ExitStack() as stack:
        sides: dict[str, dict[str, Side]] = {}
        clients: dict[str, BufferClient] = {}
        for label, tree in trees.items():
            server = stack.enter_context(serving(tree))
            client = clients[label] = stack.enter_context(BufferClient(server.target, timeout=60))
            for table in (WITH, WITHOUT):
                client.create_table(table, group_size=GROUP)
            client.create_dataset(WITH, DATASET, size, max_attempts=1)
            sides[label] = {
                table: Side(client, table, template, claim, server.proc.pid, per_push) for table in (WITH, WITHOUT)
            }
            for side in sides[label].values():
                side.run(prompts, timed=False)
        ratios: dict[str, list[float]] = {label: [] for label in trees}
        for r in range(rounds):
            order = (WITH, WITHOUT) if r % 2 == 0 else (WITHOUT, WITH)
            labels = list(trees) if r // 2 % 2 == 0 else list(reversed(trees))
            for label in labels:
                took = {table: sides[label][table].run(prompts) for table in order}
                ratios[label].append(took[WITH] / took[WITHOUT])
        for client in clients.values():
            info = client.ledger(WITH, DATASET)
            assert info.done and info.total("trained") == size, info
    rows = {}
    for label, by_table in sides.items():
        row = {f"{table}_{part}": side.ms(part) for table, side in by_table.items() for part in ("", *PARTS)}
        row["prompts"] = by_table[WITH].prompts
        for table, side in by_table.items():
            row[f"{table}_cpu"] = side.cpu / side.prompts * 1e3
            row[f"{table}_kb"] = side.written / side.prompts / 1024
        row["median_ratio"] = statistics.median(ratios[label])
        print(claim, label, row, file=sys.stderr)
        rows[label] = row
    return rows


def report(command: str, rows: dict[int, dict[str, dict[str, float]]], per_push: int = 1) -> str:
    """The table: a row a claim size and server (this tree's, or before and after side by side)."""
    labels = list(next(iter(rows.values())))
    paired = len(labels) > 1
    prompts = rows[next(iter(rows))][labels[0]]["prompts"]
    lines = [
        heading(per_push),
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores, fsync on every commit; one `expbuf serve` "
        f"{'of each tree ' if paired else ''}and one client per claim size. "
        f"Per prompt: a group of {GROUP} experiences of about 8 KB pushed "
        f"{'on its own' if per_push == 1 else f'{per_push} groups a push'} (grpo advantages), leased in "
        f"batches of {BATCH} groups and acked; with the ledger the prompts are claimed `claim` per call. "
        f"{prompts:.0f} prompts a side per claim size{' and server' if paired else ''}, in alternating rounds; "
        "ms per prompt. The ledger's CPU: the server's CPU per prompt with it less without it.",
        "",
        f"| claim |{' server |' if paired else ''} without the ledger | with the ledger "
        "| of which claim / push / sample + ack (extra) | ratio | median of rounds | goal "
        "| server CPU without / with | the ledger's CPU | written to storage without / with |",
        "| --- |" + (" --- |" if paired else "") + " --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for claim, by_label in rows.items():
        for label, row in by_label.items():
            without, with_ = row[f"{WITHOUT}_"], row[f"{WITH}_"]
            parts = " / ".join(f"{row[f'{WITH}_{part}'] - row[f'{WITHOUT}_{part}']:+.2f}" for part in PARTS)
            cpu = row[f"{WITH}_cpu"] - row[f"{WITHOUT}_cpu"]
            lines.append(
                f"| {claim} |{f' {label} |' if paired else ''} {without:.2f} ms | {with_:.2f} ms | {parts} ms "
                f"| {with_ / without:.3f} | **{row['median_ratio']:.3f}** | ≤ 1.05 "
                f"| {row[f'{WITHOUT}_cpu']:.2f} / {row[f'{WITH}_cpu']:.2f} ms | {cpu:+.2f} ms "
                f"| {row[f'{WITHOUT}_kb']:.0f} / {row[f'{WITH}_kb']:.0f} KB |"
            )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per side and round")
    parser.add_argument("--claims", default="8,32", help=f"prompts per claim, each a multiple of {BATCH}")
    parser.add_argument("--per-push", type=int, default=1, help="prompts' groups a push, dividing each claim")
    parser.add_argument("--before", type=Path, default=None, help="an earlier tree of expbuf, measured beside this one")
    parser.add_argument("--out", type=Path, default=None, help="write the section into this RESULTS.md")
    args = parser.parse_args()
    claims = [int(claim) for claim in args.claims.split(",")]
    if any(claim % BATCH or args.prompts % claim or claim % args.per_push for claim in claims):
        parser.error(
            f"each claim must be a multiple of {BATCH} and of --per-push ({args.per_push}) that divides "
            f"--prompts ({args.prompts})"
        )
    trees = {"now": None} if args.before is None else {"before": args.before.resolve(), "after": None}
    rows = {claim: bench(args.rounds, args.prompts, claim, args.per_push, trees) for claim in claims}
    command = f"python bench/bench_ledger.py --rounds {args.rounds} --prompts {args.prompts} --claims {args.claims}"
    if args.per_push != 1:
        command += f" --per-push {args.per_push}"
    if args.before is not None:
        command += " --before DIR"
    section = report(command, rows, args.per_push)
    print(section)
    if args.out:
        write_section(args.out, heading(args.per_push), section)


if __name__ == "__main__":
    main()
