"""Pushes as columns against the same experiences pushed as Experience objects, side by side in
one run (issue 41).

    .venv/bin/python bench/bench_column_push.py [--rounds 5] [--out bench/RESULTS.md]

One `expbuf serve` child on loopback (its defaults; estimator none, group_by none). Shapes: 8 KB
experiences (int32[1024] tokens, float32[1023] log-probs, 256 a push), 40 KB ones (int32[5000]
tokens, float32 log-probs and a bool mask, 64 a push), 1 MiB ones (int32[131072] tokens and
float32 log-probs, 8 a push) and 8 MiB ones (16,384 tokens with uint8 routing ids of 480 a token,
MoE routing data, 2 a push). After one round to warm up, each round pushes the same tensors
under fresh eids once in each arm, in rotating order, one push at a time (the blocking client):
- experiences: `push(list of Experience)`, the client's encode to TRXP included;
- columns: `push(ColumnBatch(...))` from jagged nested tensors a worker holds (made before the
  round), laying out the payload included;
- column lists: `push(ColumnBatch(...))` from a list of tensors per field (one torch.cat a field).
Each arm's table is dropped after its push, out of the time. Experiences a second, and the
client's and the server's CPU µs per experience (the client's process time, the server's from
/proc); medians of the rounds, ratios of medians from the same run.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_decode import server_cpu  # noqa: E402
from bench_service import main_on_a_server  # noqa: E402

from expbuf.client import EID, BufferClient, ColumnBatch, Experience  # noqa: E402

HEADING = "## Pushes as columns (issue 41)"
ARMS = ("experiences", "columns", "column lists")
TENSORS = ("tokens", "logprobs", "action_mask", "routed_experts")


def rollout(tokens: int, prompt: int, *, mask: bool = False, experts: int = 0, gen: torch.Generator) -> Experience:
    response = tokens - prompt
    return Experience(
        tokens=torch.randint(0, 150_000, (tokens,), dtype=torch.int32, generator=gen),
        prompt_length=prompt,
        logprobs=torch.randn(response, generator=gen),
        action_mask=torch.ones(response, dtype=torch.bool) if mask else None,
        routed_experts=torch.randint(0, 128, (tokens, experts), dtype=torch.uint8, generator=gen) if experts else None,
        reward=1.0,
        info={"model_version": 3},
    )


# shape -> (experiences a push, pushes a round, how one is made)
SHAPES: dict[str, tuple[int, int, Callable[[torch.Generator], Experience]]] = {
    "8 KB": (256, 16, lambda gen: rollout(1024, 1, gen=gen)),
    "40 KB": (64, 32, lambda gen: rollout(5000, 1000, mask=True, gen=gen)),
    "1 MiB": (8, 16, lambda gen: rollout(131_072, 1, gen=gen)),
    "8 MiB": (2, 8, lambda gen: rollout(16_384, 1_024, mask=True, experts=480, gen=gen)),
}


class Push:
    """One push's experiences, and the same tensors as a worker holding columns has them."""

    def __init__(self, made: list[Experience]) -> None:
        self.made = made
        self.names = [name for name in TENSORS if getattr(made[0], name) is not None]
        self.lists = {name: [getattr(exp, name) for exp in made] for name in self.names}
        self.nested = {name: torch.nested.nested_tensor(self.lists[name], layout=torch.jagged) for name in self.names}
        self.reward = torch.tensor([exp.reward for exp in made], dtype=torch.float64)
        self.prompt_length = torch.tensor([exp.prompt_length for exp in made])
        self.version = torch.tensor([exp.info["model_version"] for exp in made])

    def payload(self, arm: str, serial: int) -> Any:
        eids = [EID(batch=serial, task=index, run=0, suffix="x") for index in range(len(self.made))]
        if arm == "experiences":
            for exp, eid in zip(self.made, eids, strict=True):
                exp.eid = eid
            return self.made
        fields = self.nested if arm == "columns" else self.lists
        return ColumnBatch(
            eids, fields, reward=self.reward, prompt_length=self.prompt_length, model_version=self.version
        )


def measure(target: str, server: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {}
    serial = 0
    with BufferClient(target, timeout=300) as client:
        for shape, (per, count, make) in SHAPES.items():
            gen = torch.Generator().manual_seed(0)
            pushes = [Push([make(gen) for _ in range(per)]) for _ in range(count)]
            figures = results.setdefault(shape, {})
            for r in range(-1, rounds):  # round -1 warms up
                order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
                for arm in order:
                    client.create_table("push", estimator="none", group_by="none")
                    start, cpu, served = time.perf_counter(), time.process_time(), server_cpu(server)
                    for push in pushes:
                        serial += 1
                        result = client.push(push.payload(arm, serial), table="push")
                        assert len(result.stored) == per, result
                    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
                    served = server_cpu(server) - served
                    client.drop_table("push")
                    if r >= 0:
                        done = per * count
                        figures.setdefault(f"rate {arm}", []).append(done / wall)
                        figures.setdefault(f"client {arm}", []).append(cpu / done * 1e6)
                        figures.setdefault(f"server {arm}", []).append(served / done * 1e6)
            print(shape, {k: round(statistics.median(v), 1) for k, v in figures.items()}, file=sys.stderr)
    return results


def report(command: str, load: str, results: dict[str, dict[str, list[float]]]) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores shared with other work: load average {load} at the start "
        "(uptime). One push at a time, each durable before the next; medians of the rounds, ratios "
        "from the same run.",
        "",
        "| experience | push, experiences | push, columns | push, column lists | columns / experiences "
        "| column lists / experiences |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for shape, figures in results.items():
        med = {k: statistics.median(v) for k, v in figures.items()}
        exps, cols, lists = (med[f"rate {arm}"] for arm in ARMS)
        lines.append(
            f"| {shape} | {exps:,.0f} exp/s | {cols:,.0f} exp/s | {lists:,.0f} exp/s | **{cols / exps:.2f}** "
            f"| **{lists / exps:.2f}** |"
        )
    lines += [
        "",
        "CPU µs per experience in those pushes (medians), the client's and the server's:",
        "",
        "| experience | client: experiences / columns / column lists | server: experiences / columns / column lists |",
        "| --- | --- | --- |",
    ]
    for shape, figures in results.items():
        med = {k: statistics.median(v) for k, v in figures.items()}
        client = " / ".join(f"{med[f'client {arm}']:,.1f}" for arm in ARMS)
        server = " / ".join(f"{med[f'server {arm}']:,.1f}" for arm in ARMS)
        lines.append(f"| {shape} | {client} | {server} |")
    lines += [
        "",
        "Laying out a batch of columns from nested tensors costs the client a few µs an experience",
        "(the rest of its CPU is gRPC's send and the copies of the request), against the encode of",
        "each Experience to TRXP; where the client bounds the push (8 KB) columns push faster. The",
        "server's CPU is the same either way: it checks and packs each experience as a TRXP push's",
        "(check_meta, check_tensors, the canonical pickle, the digest), and its commit and records",
        "cost it the rest. From 1 MiB on the copies dominate and columns gain nothing, and a list of",
        "tensors costs one torch.cat more; the server stages a batch of columns' large experiences as",
        "they arrive, as a TRXP push's (its one-value columns first, the tensors in the store's order).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    main_on_a_server("bench_column_push.py", HEADING, 5, measure, report)


if __name__ == "__main__":
    main()
