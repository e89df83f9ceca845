"""Pushes written by hand (client/rpc/frames.py) beside the same pushes made as protobuf
messages, side by side against one server (issue 41).

    .venv/bin/python bench/bench_push_frames.py [--rounds 5] [--mib 64] [--out bench/RESULTS.md]

One `expbuf serve` child. For each size, pushes of one experience each (int32 tokens and
float32 log-probs; 8 KB experiences 256 a push), `--mib` MiB a way and round, one push a call, as
a rollout worker's `push()` makes them: over Push, or PushStream in chunks of 4 MiB from 8 MiB on.
Two ways, alternating which goes first from round to round, into the same table: the client's
`push()`, whose requests are written by hand around the payload, and the same calls with each
request a `PushRequest` message (the payload copied into the message and out of it), made with the
generated stub. The payloads are encoded beforehand; each is pushed once. Medians over the rounds
of the pushes' MiB/s and of the client's CPU (this process, gRPC's threads included) per MiB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import serving  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402
from expbuf.client.rpc.connection import DEFAULT_PUSH_CHUNK_BYTES  # noqa: E402
from expbuf.proto.v1 import buffer_pb2 as pb  # noqa: E402

HEADING = "## Pushes written by hand against protobuf messages (issue 41)"
MB = 1 << 20
TABLE = "frames"
# (label, bytes an experience, experiences a push)
SIZES = (("8 KB x 256", 8 << 10, 256), ("256 KiB", 256 << 10, 1), ("1 MiB", MB, 1), ("8 MiB", 8 * MB, 1))
WAYS = ("written by hand (push())", "protobuf messages")


def payloads(size: int, per_push: int, total: int, serial: Iterator[int]) -> list[bytes]:
    """Pushes of `per_push` experiences of about `size` bytes each, `total` bytes in all."""
    tokens = size // 8
    count = max(2, total // (size * per_push))
    return [
        trxp.encode(
            [
                Experience(
                    eid=EID(batch=next(serial), task=0, run=0),
                    tokens=torch.randint(0, 150_000, (tokens,), dtype=torch.int32),
                    prompt_length=1,
                    logprobs=torch.randn(tokens - 1),
                    reward=1.0,
                )
                for _ in range(per_push)
            ]
        )
        for _ in range(count)
    ]


def as_messages(client: BufferClient) -> Callable[[bytes], None]:
    """A push made as the client made it with protobuf messages: whole over Push, in chunks over PushStream."""
    stub, chunk = client._stub, DEFAULT_PUSH_CHUNK_BYTES

    def push(body: bytes) -> None:
        if len(body) <= chunk:
            stub.Push(pb.PushRequest(table=TABLE, payload=body), timeout=120, wait_for_ready=True)
            return
        requests = [pb.PushRequest(table=TABLE, payload=body[:chunk], total_bytes=len(body))]
        requests += [pb.PushRequest(payload=body[start : start + chunk]) for start in range(chunk, len(body), chunk)]
        replies = list(stub.PushStream(iter(requests), timeout=120, wait_for_ready=True))
        assert len(replies) == 1 and replies[0].stored_uids, replies

    return push


def timed(push: Callable[[bytes], None], bodies: list[bytes]) -> tuple[float, float]:
    """MiB/s of the pushes, and the client's CPU ms per MiB."""
    cpu, start = time.process_time(), time.perf_counter()
    for body in bodies:
        push(body)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    mib = sum(map(len, bodies)) / MB
    return mib / seconds, cpu / mib * 1e3


def measure(target: str, pid: int, rounds: int, mib: int) -> dict[str, dict[str, list[tuple[float, float]]]]:
    serial = iter(range(1 << 62))
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    with BufferClient(target, timeout=120) as client:
        ways = {WAYS[0]: lambda body: client.push(body, table=TABLE), WAYS[1]: as_messages(client)}
        for label, size, per_push in SIZES:
            client.create_table(TABLE, estimator="none", group_by="none")  # dropped after each size
            found: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
            timed(ways[WAYS[0]], payloads(size, per_push, 4 * MB, serial))  # warm-up, both ways
            timed(ways[WAYS[1]], payloads(size, per_push, 4 * MB, serial))
            for round_ in range(rounds):
                order = WAYS if round_ % 2 == 0 else WAYS[::-1]
                for way in order:
                    bodies = payloads(size, per_push, mib * MB, serial)
                    found[way].append(timed(ways[way], bodies))
            client.drop_table(TABLE)
            results[label] = found
            print(label, {way: [f"{r:.0f} MiB/s {c:.2f} ms" for r, c in runs] for way, runs in found.items()})
    return results


def report(command: str, load: str, results: dict[str, dict[str, list[tuple[float, float]]]]) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, 2 cores (load average {load} at the start); one `expbuf serve`; medians of the rounds.",
        "",
        "| push | MiB/s, by hand / messages | ratio | client CPU ms a MiB, by hand / messages |",
        "| --- | --- | ---: | --- |",
    ]
    for label, found in results.items():
        rate = {way: statistics.median(r for r, _ in runs) for way, runs in found.items()}
        cpu = {way: statistics.median(c for _, c in runs) for way, runs in found.items()}
        hand, msg = WAYS
        lines.append(
            f"| {label} | {rate[hand]:,.0f} / {rate[msg]:,.0f} | **{rate[hand] / rate[msg]:.2f}** "
            f"| {cpu[hand]:.2f} / {cpu[msg]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64, help="MiB pushed each way, each round and size")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = ("python bench/bench_push_frames.py " + " ".join(sys.argv[1:])).strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    with serving() as server:
        results = measure(server.target, server.proc.pid, args.rounds, args.mib)
    section = report(command, load, results)
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
