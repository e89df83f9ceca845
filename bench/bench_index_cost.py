"""What keeping every ready-group index costs a push, over gRPC: the server's CPU per experience
and experiences per second of pushes of 64 small experiences (groups of 1 and of 4) into a new
table, with this tree (every index kept from the table's creation) and an earlier tree (`--before
TREE`, run as the expbuf package) whose tables, read only in fifo order, kept the ready order
alone. Each round runs every case of both trees, the tree going first alternating.

    .venv/bin/python bench/bench_index_cost.py --before TREE [--rounds 6] [--experiences 32768]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_consume import package  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402

from helpers import ServerProcess  # noqa: E402

PER_PUSH = 64
GROUPS = (1, 4)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def payload(first: int, count: int, group: int) -> bytes:
    """Experiences first..first+count-1 in groups of `group`, each with a version and a priority."""
    items = []
    for i in range(first, first + count):
        exp = Experience(
            eid=EID(batch=0, task=i // group, run=i % group),
            tokens=list(range(8)),
            prompt_length=4,
            reward=float(i % 2),
            info={"model_version": 1, "priority": (i * 7919 % 1000) / 1000},
        )
        items.append(trxp.from_experience(exp))
    return trxp.build(items)


def run(tree: Path | None, group: int, experiences: int) -> tuple[float, float]:
    """Experiences per second and the server's CPU µs per experience, the first push left out."""
    data = Path(tempfile.mkdtemp(prefix="expbuf-index-cost-"))
    env = None if tree is None else {"PYTHONPATH": str(package(tree, data))}
    config = data / "cost.toml"
    config.write_text(
        f'scrub_mb_per_second = 0\n[[tables]]\nname = "t"\ngroup_size = {group}\nestimator = "none"\n'
        "drop_zero_variance = false\n"
    )
    pushes = [payload(first, PER_PUSH, group) for first in range(0, experiences, PER_PUSH)]
    server = ServerProcess(str(data / "data"), "--config", str(config), env=env)
    try:
        with BufferClient(server.target) as client:
            client.push(pushes[0], "t")
            cpu, began = cpu_seconds(server.proc.pid), time.perf_counter()
            for push in pushes[1:]:
                client.push(push, "t")
            seconds, cpu = time.perf_counter() - began, cpu_seconds(server.proc.pid) - cpu
    finally:
        server.proc.terminate()
        server.proc.wait(60)
        shutil.rmtree(data)
    counted = experiences - PER_PUSH
    return counted / seconds, cpu / counted * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the earlier tree")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--experiences", type=int, default=32768, help="per case and round (a multiple of 64)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    found: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        trees = [("before", args.before.resolve()), ("after", None)]
        for name, tree in trees if round_ % 2 == 0 else trees[::-1]:
            for group in GROUPS:
                found.setdefault((name, group), []).append(run(tree, group, args.experiences))
                print(f"round {round_} {name} groups of {group}: {found[(name, group)][-1]}", file=sys.stderr)
    rows = []
    for group in GROUPS:
        rate = {name: statistics.median(r for r, _ in found[(name, group)]) for name in ("before", "after")}
        cpu = {name: statistics.median(c for _, c in found[(name, group)]) for name in ("before", "after")}
        rows.append(
            f"| {group} | {rate['before']:,.0f} | {rate['after']:,.0f} | {rate['after'] / rate['before']:.2f} "
            f"| {cpu['before']:.1f} | {cpu['after']:.1f} | {cpu['after'] / cpu['before']:.2f} |"
        )
    print(
        "\n".join(
            [
                f"Command: `.venv/bin/python bench/bench_index_cost.py --before TREE --rounds {args.rounds} "
                f"--experiences {args.experiences}`; {os.cpu_count()} CPU threads, load {load:.1f} at the start and "
                f"{os.getloadavg()[0]:.1f} at the end; medians of the rounds.",
                "",
                "| group size | before exp/s | after exp/s | after / before | before server CPU µs/exp "
                "| after server CPU µs/exp | after / before |",
                "| --- | --- | --- | --- | --- | --- | --- |",
                *rows,
            ]
        )
    )


if __name__ == "__main__":
    main()
