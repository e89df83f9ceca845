"""A sampled batch decoded as a trainer reads it: this tree's decode against an earlier
revision's, side by side in one run (issue 22).

    .venv/bin/python bench/bench_decode.py [--before c0c4723] [--rounds 5] [--out bench/RESULTS.md]

The earlier revision's codec (client/trxp and client/schema/experience.py, read with `git show`) is
loaded beside this tree's as a package of its own; both decode the same replies of one
`expbuf serve` child on loopback. Shapes: 8 KB experiences as bench_reverb.py pushes them
(int32[1024] tokens, float32[1023] logprobs), 40 KB as bench_store.experience makes them;
batches of 256, consume delivery, estimator none.
- Stream: one consume stream of `batches` batches, each decoded when it arrives by the
  earlier decode (`trxp.decode` then) or by `Batch.experiences` now; payload bytes only as
  a reference. Experiences per second, in alternating order within each round.
- CPU: the same sampled payloads decoded by each, in this process's CPU time per experience:
  the earlier decode, this tree's `trxp.decode` (a push's checks) and `trxp.decode_reply`
  (a reader's checks, what `Batch.experiences` runs).
Medians of the rounds; ratios are of medians from the same run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes, restamp  # noqa: E402
from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient, trxp  # noqa: E402

BATCH = 256
SHAPES = {"8 KB": ("8k", 8), "40 KB": ("40k", 32)}  # bench_reverb's shape, pushes of it per stream
HEADING = "## Sample decoded as a trainer reads it (issue 22)"


def load_before(revision: str, into: Path) -> Any:
    """The codec of `revision` as package `before` (its modules import one another relatively)."""
    root = HERE.parent
    files = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", revision, "client/trxp", "client/schema/experience.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in files:
        target = into / "before" / Path(name).relative_to("client")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(
            subprocess.run(["git", "show", f"{revision}:{name}"], cwd=root, check=True, capture_output=True).stdout
        )
    (into / "before" / "__init__.py").write_text("")
    sys.path.insert(0, str(into))
    return importlib.import_module("before.trxp")


def server_cpu(pid: int) -> float:
    """User + system CPU seconds the server has used, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream(
    client: BufferClient, server: int, table: str, batches: int, decode: Callable[[Any], list] | None
) -> tuple[float, float, float]:
    """Experiences per second of one consume stream, each batch decoded by `decode`, and the
    client's and the server's CPU µs per experience."""
    got = 0
    start, cpu, served = time.perf_counter(), time.process_time(), server_cpu(server)
    for batch in client.sample(table, batch_size=BATCH, delivery="consume", max_batches=batches, timeout=60):
        got += len(batch.uids) if decode is None else len(decode(batch))
    assert got == batches * BATCH, got
    wall, cpu, served = time.perf_counter() - start, time.process_time() - cpu, server_cpu(server) - served
    return got / wall, cpu / got * 1e6, served / got * 1e6


def cpu_per_experience(payloads: list[bytes], decode: Callable[[bytes], list]) -> float:
    start = time.process_time()
    count = sum(len(decode(payload)) for payload in payloads)
    return (time.process_time() - start) / count * 1e6


def measure(target: str, server: int, before: Any, rounds: int) -> dict[str, dict[str, list[float]]]:
    streams: dict[str, Callable[[Any], list] | None] = {
        "bytes": None,
        "before": lambda batch: before.decode(batch.payload),
        "now": lambda batch: batch.experiences,
    }
    decoders: dict[str, Callable[[bytes], list]] = {
        "before": before.decode,
        "decode": trxp.decode,
        "decode_reply": trxp.decode_reply,
    }
    results: dict[str, dict[str, list[float]]] = {}
    with BufferClient(target, timeout=120) as client:
        for shape, (kind, per_stream) in SHAPES.items():
            table = f"decode{kind}"
            client.create_table(table, estimator="none", group_by="none")
            pushes = make_pushes(kind, per_stream)
            batches = sum(map(len, pushes)) // BATCH
            rates = results.setdefault(shape, {})
            names = list(streams)
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    restamp(pushes, SERIAL)
                    for exps in pushes:
                        client.push(exps, table=table)
                    rate, cpu, served = stream(client, server, table, batches, streams[name])
                    rates.setdefault(f"stream {name}", []).append(rate)
                    rates.setdefault(f"client {name}", []).append(cpu)
                    rates.setdefault(f"server {name}", []).append(served)
            restamp(pushes, SERIAL)
            for exps in pushes:
                client.push(exps, table=table)
            payloads = [
                b.payload for b in client.sample(table, batch_size=BATCH, delivery="consume", max_batches=batches)
            ]
            order = list(decoders)
            for r in range(rounds):
                for name in order[r % len(order) :] + order[: r % len(order)]:
                    rates.setdefault(f"cpu {name}", []).append(cpu_per_experience(payloads, decoders[name]))
            print(shape, {k: round(statistics.median(v), 1) for k, v in rates.items()}, file=sys.stderr)
    return results


SERIAL = iter(range(1 << 40))


def report(command: str, load: str, revision: str, results: dict[str, dict[str, list[float]]]) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores shared with other work: load average {load} at the start "
        f"(uptime). Before: revision {revision}'s decode; now: this tree's. Batches of 256, consume "
        "delivery; medians of the rounds, ratios from the same run.",
        "",
        "| experiences | stream, bytes only | stream, decoded before | stream, decoded now | now / before "
        "| best now / best before |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for shape, rates in results.items():
        med = {k: statistics.median(v) for k, v in rates.items()}
        best = {k: max(v) for k, v in rates.items()}
        raw, old, new = med["stream bytes"], med["stream before"], med["stream now"]
        lines.append(
            f"| {shape} | {raw:,.0f} exp/s | {old:,.0f} exp/s | {new:,.0f} exp/s | **{new / old:.2f}** "
            f"| {best['stream now'] / best['stream before']:.2f} |"
        )
    lines += [
        "",
        "CPU µs per experience in those streams (medians), the client's and the server's:",
        "",
        "| experiences | client, bytes only | client, decoded before | client, decoded now | server, each stream |",
        "| --- | --- | --- | --- | --- |",
    ]
    for shape, rates in results.items():
        med = {k: statistics.median(v) for k, v in rates.items()}
        served = statistics.median([v for name in ("bytes", "before", "now") for v in rates[f"server {name}"]])
        lines.append(
            f"| {shape} | {med['client bytes']:.1f} | {med['client before']:.1f} | {med['client now']:.1f} "
            f"| {served:.1f} |"
        )
    lines += [
        "",
        "Decode of the same sampled batches, CPU µs per experience (median of the rounds, the least in brackets):",
        "",
        "| experiences | before | `decode` now (a push's checks) | `decode_reply` now (a reader's) | before / reply |",
        "| --- | --- | --- | --- | --- |",
    ]
    for shape, rates in results.items():
        med = {k: statistics.median(v) for k, v in rates.items()}
        low = {k: min(v) for k, v in rates.items()}
        cells = [
            f"{med[f'cpu {name}']:.1f} ({low[f'cpu {name}']:.1f})" for name in ("before", "decode", "decode_reply")
        ]
        ratio = med["cpu before"] / med["cpu decode_reply"]
        lines.append(
            f"| {shape} | {' | '.join(cells)} | **{ratio:.2f}** ({low['cpu before'] / low['cpu decode_reply']:.2f}) |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="c0c4723", help="the revision whose decode to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = ("python bench/bench_decode.py " + " ".join(sys.argv[1:])).strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        before = load_before(args.before, Path(tmp) / "code")
        server = Proc(
            "-m", "expbuf.server.cli", "serve", "--data", f"{tmp}/data", "--port", "0", "--metrics-port", "-1"
        )
        try:
            results = measure(server.target, server.proc.pid, before, args.rounds)
        finally:
            server.stop()
    section = report(command, load, args.before, results)
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
