"""What a claim costs under the difficulty orders against the permutation, at 10**6 prompts.

    .venv/bin/python bench/bench_claim_orders.py [--size 1000000] [--claim 4096] [--out bench/RESULTS.md]

One `expbuf serve` on loopback, three tables grouping by task, each with a dataset of `size`
prompts over 2 epochs with a seed: one per claim order (permutation, pools, pass_rate). One
client claims every prompt of both epochs, `claim` at a time, the three datasets in turn (the
one that goes first alternating each round), so the three are measured side by side through
the same spells of a shared machine. Epoch 0 walks the permutation under every order (a
difficulty order also reads each prompt's statistics and files it under its bin for epoch 1);
epoch 1 is drawn from the bins. Per prompt, for each order and epoch: the client's wall time of
the calls and the server's CPU time over them (from /proc, steadier on a busy machine); the
ratio to the permutation's is the measure (goal: within 1.5x). No group is pushed, so every
prompt has the statistics of one never generated and sits in one bin: a draw's cost does not
depend on how the prompts spread over the bins (one key range read for each prompt taken).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient  # noqa: E402

HEADING = "## Claim orders by difficulty: a claim's cost at 10**6 prompts (issue 45)"
ORDERS = ("permutation", "pools", "pass_rate")


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(size: int, claim: int) -> dict[tuple[str, int], tuple[float, float, int]]:
    """(order, epoch) -> (wall seconds, server CPU seconds, prompts claimed)."""
    spent: dict[tuple[str, int], list[float]] = {(o, e): [0.0, 0.0, 0] for o in ORDERS for e in (0, 1)}
    with tempfile.TemporaryDirectory() as data:
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1")
        try:
            with BufferClient(server.target, timeout=600) as client:
                for order in ORDERS:
                    client.create_table(order, group_size=2, estimator="none")
                    client.create_dataset(order, "d", size, epochs=2, seed=1, order=order)
                left = dict.fromkeys(ORDERS, 2 * size)
                round_ = 0
                while any(left.values()):
                    turn = ORDERS[round_ % 3 :] + ORDERS[: round_ % 3]
                    for order in turn:
                        if not left[order]:
                            continue
                        began, used = time.perf_counter(), cpu(server.proc.pid)
                        prompts = client.claim(order, "d", min(claim, left[order]), lease_seconds=36000).prompts
                        wall, busy = time.perf_counter() - began, cpu(server.proc.pid) - used
                        epochs = {p.epoch for p in prompts}
                        row = spent[(order, max(epochs))]
                        if len(epochs) == 1:  # a call that crosses the epochs' border counts in neither
                            row[0] += wall
                            row[1] += busy
                            row[2] += len(prompts)
                        left[order] -= len(prompts)
                    round_ += 1
        finally:
            server.stop()
    return {key: (wall, busy, int(n)) for key, (wall, busy, n) in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=10**6)
    parser.add_argument("--claim", type=int, default=4096)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    got = run(args.size, args.claim)
    lines = [
        HEADING,
        "",
        f"`.venv/bin/python bench/bench_claim_orders.py --size {args.size} --claim {args.claim}`"
        f" ({os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}). Per prompt claimed, in calls of {args.claim},"
        " the three datasets in turn; ratios to the permutation's in the same epoch.",
        "",
        "| order | epoch | µs a prompt (client) | ratio | server CPU µs a prompt | ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for epoch in (0, 1):
        base_wall, base_cpu, base_n = got[("permutation", epoch)]
        for order in ORDERS:
            wall, busy, n = got[(order, epoch)]
            per_wall, per_cpu = 1e6 * wall / n, 1e6 * busy / n
            ratio_wall = per_wall / (1e6 * base_wall / base_n)
            ratio_cpu = per_cpu / (1e6 * base_cpu / base_n)
            lines.append(f"| {order} | {epoch} | {per_wall:.1f} | {ratio_wall:.2f} | {per_cpu:.1f} | {ratio_cpu:.2f} |")
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out:
        write_section(args.out, HEADING, section)


if __name__ == "__main__":
    main()
