"""The prompt ledger's cost per prompt: claim + push + sample + ack, with and without it.

    .venv/bin/python bench/bench_ledger.py [--rounds 20] [--prompts 32] [--claims 8,32] [--out bench/RESULTS.md]

One `expbuf serve` on loopback per claim size, two tables grouping by task (group_size 8,
grpo), one client. Per prompt, a rollout worker's and a trainer's work:
- with the ledger: prompts claimed `claim` at a time, each prompt's group (8 experiences of
  about 8 KB, EIDs from `prompt.eid(run)`) pushed on its own, leased in batches of 8 groups
  and acked;
- without: the same groups under plain EIDs pushed to a table without a dataset, leased in
  batches of 8 groups and acked.
Each round runs `--prompts` prompts on each side, the side that goes first alternating, after
one round of each to warm up. The ratio is the two sides' time per prompt, measured side by
side; the median of the rounds' own ratios leaves out rounds that a passing load on a shared
machine slowed on one side only (goal: at most 1.05). The server's CPU time and the bytes it
wrote to storage per prompt, read from /proc for each side's rounds, are steadier than wall
time and say where an extra goes.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from bench_service import Proc  # noqa: E402
from bench_store import experience  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience  # noqa: E402

GROUP = 8  # experiences per prompt
BATCH = 8  # groups per sampled batch
TOKENS = 1000  # int32 tokens, float32 logprobs and a bool mask of 800: about 8 KB
WITH, WITHOUT = "ledger", "plain"
DATASET = "prompts"
PARTS = ("claim", "push", "sample + ack")
HEADING = "## The prompt ledger's cost per prompt (issue 28)"


def server_use(pid: int) -> tuple[float, int]:
    """The server's CPU seconds and the bytes it has sent to storage (LMDB's pages), from /proc:
    steadier than wall time on a busy machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    written = int(io["write_bytes"])
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), written


class Side:
    """One side's work, the time each part of it took, and the server's CPU and writes for it."""

    def __init__(self, client: BufferClient, table: str, template: list[Experience], claim: int, pid: int) -> None:
        self.client, self.table, self.template, self.claim, self.pid = client, table, template, claim, pid
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
            for row in eids:
                group = [dataclasses.replace(exp, eid=eid) for exp, eid in zip(self.template, row, strict=True)]
                assert len(self.client.push(group, table=self.table).stored) == GROUP
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


def bench(rounds: int, prompts: int, claim: int) -> dict[str, float]:
    template = [experience(0, 0, run, TOKENS) for run in range(GROUP)]
    with tempfile.TemporaryDirectory() as data:
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1")
        try:
            with BufferClient(server.target, timeout=60) as client:
                for table in (WITH, WITHOUT):
                    client.create_table(table, group_size=GROUP)
                size = (rounds + 1) * prompts
                client.create_dataset(WITH, DATASET, size, max_attempts=1)
                sides = {table: Side(client, table, template, claim, server.proc.pid) for table in (WITH, WITHOUT)}
                for side in sides.values():
                    side.run(prompts, timed=False)
                ratios = []
                for r in range(rounds):
                    order = (WITH, WITHOUT) if r % 2 == 0 else (WITHOUT, WITH)
                    took = {table: sides[table].run(prompts) for table in order}
                    ratios.append(took[WITH] / took[WITHOUT])
                info = client.ledger(WITH, DATASET)
                assert info.done and info.total("trained") == size, info
        finally:
            server.stop()
    row = {f"{table}_{part}": side.ms(part) for table, side in sides.items() for part in ("", *PARTS)}
    row["prompts"] = sides[WITH].prompts
    for table, side in sides.items():
        row[f"{table}_cpu"] = side.cpu / side.prompts * 1e3
        row[f"{table}_kb"] = side.written / side.prompts / 1024
    row["median_ratio"] = statistics.median(ratios)
    print(claim, row, file=sys.stderr)
    return row


def report(command: str, rows: dict[int, dict[str, float]]) -> str:
    prompts = next(iter(rows.values()))["prompts"]
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores, fsync on every commit; one `expbuf serve` and one client per claim size. "
        f"Per prompt: a group of {GROUP} experiences of about 8 KB pushed on its own (grpo advantages), leased in "
        f"batches of {BATCH} groups and acked; with the ledger the prompts are claimed `claim` per call. "
        f"{prompts:.0f} prompts a side per claim size, in alternating rounds; ms per prompt.",
        "",
        "| claim | without the ledger | with the ledger | of which claim / push / sample + ack (extra) "
        "| ratio | median of rounds | goal | server CPU without / with | written to storage without / with |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for claim, row in rows.items():
        without, with_ = row[f"{WITHOUT}_"], row[f"{WITH}_"]
        parts = " / ".join(f"{row[f'{WITH}_{part}'] - row[f'{WITHOUT}_{part}']:+.2f}" for part in PARTS)
        lines.append(
            f"| {claim} | {without:.2f} ms | {with_:.2f} ms | {parts} ms | {with_ / without:.3f} "
            f"| **{row['median_ratio']:.3f}** | ≤ 1.05 | {row[f'{WITHOUT}_cpu']:.2f} / {row[f'{WITH}_cpu']:.2f} ms "
            f"| {row[f'{WITHOUT}_kb']:.0f} / {row[f'{WITH}_kb']:.0f} KB |"
        )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per side and round")
    parser.add_argument("--claims", default="8,32", help=f"prompts per claim, each a multiple of {BATCH}")
    parser.add_argument("--out", type=Path, default=None, help="write the section into this RESULTS.md")
    args = parser.parse_args()
    claims = [int(claim) for claim in args.claims.split(",")]
    if any(claim % BATCH or args.prompts % claim for claim in claims):
        parser.error(f"each claim must be a multiple of {BATCH} that divides --prompts ({args.prompts})")
    rows = {claim: bench(args.rounds, args.prompts, claim) for claim in claims}
    command = f"python bench/bench_ledger.py --rounds {args.rounds} --prompts {args.prompts} --claims {args.claims}"
    section = report(command, rows)
    print(section)
    if args.out:
        write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
