"""expbuf against DeepMind Reverb 0.14, side by side in one run: push and sample of the same tensors.

    python3 -m venv /tmp/reverb-venv && /tmp/reverb-venv/bin/pip install 'dm-reverb[tensorflow]'
    .venv/bin/python bench/bench_reverb.py --reverb-python /tmp/reverb-venv/bin/python [--rounds 5]

The Reverb side (bench/reverb_side.py) runs with a Python that has `dm-reverb[tensorflow]`:
its server and its client each in their own process, like expbuf's server; the expbuf client
runs here. One writer each. Shapes: 8 KB experiences (int32[1024] tokens, float32[1023]
logprobs), 256 per push; 40 KB experiences (bench_store.experience), 64 per push.
- Push: expbuf's BufferClient.push of Experience objects (encode included) into a table with
  estimator none, group_by none, durable ack (fsync); Reverb's trajectory writer, one item per
  experience, flush after every push (in memory, no fsync).
- Push also against Reverb's legacy `client.writer` (one step, one item, flush after every push),
  its fastest insert.
- Sample, batches of 256: expbuf's consume stream (each experience delivered once and deleted),
  half of each round's read as bytes and half decoded into tensors (`Batch.experiences`, what a
  trainer reads), against Reverb's `client.sample` and its batched `TrajectoryDataset` (uniform,
  with replacement; it hands over decoded tensors).
Each round runs expbuf and Reverb in alternating order; the same warm-up precedes both.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import lmdb
import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import Proc, experience  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402
from expbuf.server.store import Entry  # noqa: E402

HEADING = "## Against DeepMind Reverb (issues 10, 22)"
BATCH = 256
PER_PUSH = {"8k": 256, "40k": 64}
TABLE = {"8k": "small", "40k": "large"}
SERIAL = itertools.count()
# The tf.data stream reads this many times the pushed count, so that it too runs for seconds, not a
# fraction of one (its start-up varies by a few hundred ms). It samples with replacement.
DATASET_READS = 4


def small(i: int, gen: torch.Generator) -> Experience:
    """8 KB: random int32[1024] tokens, float32[1023] logprobs (incompressible, like Reverb's side)."""
    return Experience(
        eid=EID(batch=i, task=0, run=0),
        tokens=torch.randint(0, 150_000, (1024,), dtype=torch.int32, generator=gen),
        prompt_length=1,
        logprobs=torch.randn(1023, generator=gen),
        reward=1.0,
    )


def make_pushes(shape: str, pushes: int) -> list[list[Experience]]:
    gen = torch.Generator().manual_seed(0)
    per = PER_PUSH[shape]
    if shape == "8k":
        return [[small(p * per + i, gen) for i in range(per)] for p in range(pushes)]
    return [[experience(p, i // 8, i % 8) for i in range(per)] for p in range(pushes)]


class ReverbSide:
    """Reverb's server and client processes, driven one JSON command a line."""

    def __init__(self, python: str) -> None:
        script = str(HERE / "reverb_side.py")
        self.server = subprocess.Popen(
            [python, script, "server"], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for line in self.server.stderr:
            match = re.search(r"listening on (\S+:\d+)", line)
            if match:
                self.target = match.group(1)
                break
        else:
            raise RuntimeError("the Reverb server did not start")
        threading.Thread(target=lambda: [None for _ in self.server.stderr], daemon=True).start()
        self.errors: collections.deque[str] = collections.deque(maxlen=20)
        self.client = subprocess.Popen(
            [python, script, "client", self.target],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=lambda: self.errors.extend(self.client.stderr), daemon=True).start()

    def run(self, **cmd: object) -> float:
        """Experiences per second of one command."""
        self.client.stdin.write(json.dumps(cmd) + "\n")
        self.client.stdin.flush()
        line = self.client.stdout.readline()
        if not line:
            raise RuntimeError("the Reverb client died: " + "".join(self.errors))
        answer = json.loads(line)
        return answer["count"] / answer["seconds"]

    def stop(self) -> None:
        for proc in (self.client, self.server):
            proc.stdin.close()
            proc.wait(30)


class ExpbufSide:
    """An `expbuf serve` process on a fresh data directory, one table per shape; `python` picks the
    tree it runs (the one that Python imports expbuf from), `args` are more of its flags."""

    def __init__(self, data: str, python: str = sys.executable, args: tuple[str, ...] = ()) -> None:
        serve = ("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1", *args)
        self.server = Proc(*serve, python=python)
        self.client = BufferClient(self.server.target, timeout=120)
        for table in TABLE.values():
            self.client.create_table(table, estimator="none", group_by="none")

    def push(self, shape: str, pushes: list[list[Experience]]) -> float:
        start = time.perf_counter()
        for exps in pushes:
            self.client.push(exps, table=TABLE[shape])
        return sum(map(len, pushes)) / (time.perf_counter() - start)

    def sample(self, shape: str, count: int, *, decoded: bool = False) -> float:
        """Consume `count` experiences in batches; `decoded` also makes each batch's tensors
        (what a trainer reads, and what Reverb's TrajectoryDataset hands over)."""
        start = time.perf_counter()
        got = 0
        for batch in self.client.sample(
            TABLE[shape], batch_size=BATCH, delivery="consume", max_batches=count // BATCH, timeout=60
        ):
            got += len(batch.experiences) if decoded else len(batch.uids)
        assert got == count // BATCH * BATCH, (got, count)
        return got / (time.perf_counter() - start)

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


def restamp(pushes: list[list[Experience]], serial: itertools.count) -> None:
    """Fresh ids for a round: a consumed experience's id stays a duplicate in expbuf."""
    for exps in pushes:
        for e in exps:
            e.eid = EID(batch=next(serial), task=0, run=0)


def push_split(data: Path, shape: str, pushes: list[list[Experience]]) -> dict[str, float]:
    """Microseconds per experience of parts of expbuf's push, each alone: the client's encode, the
    server's parse and `Entry.of` (repack and checksum), a raw durable LMDB commit (fsync) of the
    same payload bytes, one commit per push."""
    start = time.perf_counter()
    payloads = [trxp.encode(exps) for exps in pushes]
    encode = time.perf_counter() - start
    start = time.perf_counter()
    items = [trxp.parse(payload) for payload in payloads]
    parse = time.perf_counter() - start
    start = time.perf_counter()
    for batch in items:
        for item in batch:
            Entry.of(item)
    entry = time.perf_counter() - start
    env = lmdb.open(str(data / f"raw-{shape}"), map_size=4 << 30, sync=True, metasync=True)
    start = time.perf_counter()
    for payload in payloads:
        with env.begin(write=True) as txn:
            txn.put(f"{next(SERIAL)}".encode(), payload)
    commit = time.perf_counter() - start
    env.close()
    count = sum(map(len, pushes))
    return {
        name: seconds / count * 1e6
        for name, seconds in (("encode", encode), ("parse", parse), ("entry", entry), ("commit", commit))
    }


def one_round(exp: ExpbufSide, rev: ReverbSide, shape: str, pushes: list, reverb_first: bool) -> dict[str, float]:
    count = sum(map(len, pushes))
    restamp(pushes, SERIAL)
    out: dict[str, float] = {}

    def expbuf_side() -> None:
        out["expbuf push"] = exp.push(shape, pushes)
        half = count // 2 // BATCH * BATCH
        out["expbuf consume"] = exp.sample(shape, half)
        out["expbuf decoded"] = exp.sample(shape, count - half, decoded=True)

    def reverb_side() -> None:
        out["reverb push"] = rev.run(op="push", shape=shape, pushes=len(pushes), per=PER_PUSH[shape])
        out["reverb legacy"] = rev.run(op="legacy", shape=shape, pushes=len(pushes), per=PER_PUSH[shape])
        out["reverb sample"] = rev.run(op="sample", shape=shape, count=count)
        out["reverb dataset"] = rev.run(op="dataset", shape=shape, count=DATASET_READS * count, batch=BATCH)

    for side in (reverb_side, expbuf_side) if reverb_first else (expbuf_side, reverb_side):
        side()
    return out


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def cell(values: list[float]) -> str:
    return f"{median(values):,.0f} exp/s ({min(values):,.0f}-{max(values):,.0f})"


def report(
    command: str, load: float, rounds: int, pushes: dict[str, int], res: dict[str, dict[str, list[float]]]
) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores shared with other work running on the machine (load average "
        f"{load:.1f} at the start); dm-reverb 0.14.0, "
        "tensorflow 2.15 in their own venv. Servers and clients in their own processes, one writer each. "
        f"Medians of {rounds} rounds, expbuf and Reverb in alternating order, after the same warm-up; "
        f"{pushes['8k']} pushes of 256 x 8 KB and {pushes['40k']} of 64 x 40 KB per round, the same "
        "random tensors on both sides. expbuf's push encodes, validates, packs and fsyncs every push "
        "before it acks; Reverb keeps items in memory and never writes to disk. expbuf's consume "
        "deletes what it delivers (durably); Reverb samples uniformly, with replacement, and its "
        f"`TrajectoryDataset` reads {DATASET_READS} x the pushed count per round (a longer, steadier measure).",
        "",
        "| measure | expbuf, median (min-max) | Reverb, median (min-max) | expbuf / Reverb, medians | goal |",
        "| --- | --- | --- | --- | --- |",
    ]
    goals = {  # issue 22's
        ("8k", "push"): "≥ 1.0",
        ("8k", "legacy"): "≥ 1.0",
        ("8k", "decoded"): "≥ 0.8",
        ("40k", "push"): "≥ 1.0",
        ("40k", "decoded"): "≥ 1.0",
    }
    for shape, r in res.items():
        size = "8 KB, 256 per push" if shape == "8k" else "40 KB, 64 per push"
        kb = shape[:-1]
        rows = (
            ("push", f"push, {size} (`push` / trajectory writer + flush)", "expbuf push", "reverb push"),
            ("legacy", f"push, {size} (`push` / legacy `client.writer` + flush)", "expbuf push", "reverb legacy"),
            (
                "sample",
                f"sample {kb} KB, batches of 256 (consume / `client.sample`)",
                "expbuf consume",
                "reverb sample",
            ),
            (
                "bytes",
                f"sample {kb} KB, batches of 256, as bytes (consume / `TrajectoryDataset` tf.data)",
                "expbuf consume",
                "reverb dataset",
            ),
            (
                "decoded",
                f"sample {kb} KB, batches of 256, decoded tensors (consume / `TrajectoryDataset` tf.data)",
                "expbuf decoded",
                "reverb dataset",
            ),
        )
        for key, label, ours, theirs in rows:
            lines.append(
                f"| {label} | {cell(r[ours])} | {cell(r[theirs])} | **{median(r[ours]) / median(r[theirs]):.2f}** | "
                f"{goals.get((shape, key), '')} |"
            )
    lines += [
        "",
        "Parts of expbuf's push, each timed alone in the same run (µs per experience, medians): "
        + "; ".join(
            f"{shape[:-1]} KB: whole push {1e6 / median(r['expbuf push']):.0f}, "
            f"client encode {median(r['encode']):.0f}, server parse {median(r['parse']):.0f}, "
            f"`Entry.of` {median(r['entry']):.0f}, "
            f"a raw durable LMDB commit of the same payload bytes (one fsync per push) {median(r['commit']):.0f}"
            for shape, r in res.items()
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reverb-python", required=True, help="a Python with dm-reverb[tensorflow] installed")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pushes-8k", type=int, default=64)
    parser.add_argument("--pushes-40k", type=int, default=64)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = "python bench/bench_reverb.py " + " ".join(
        a if a != args.reverb_python else "REVERB_VENV/bin/python" for a in sys.argv[1:]
    )
    load = os.getloadavg()[0]
    pushes = {"8k": make_pushes("8k", args.pushes_8k), "40k": make_pushes("40k", args.pushes_40k)}
    results: dict[str, dict[str, list[float]]] = {shape: collections.defaultdict(list) for shape in pushes}
    rev = ReverbSide(args.reverb_python)
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as data:
        exp = ExpbufSide(data)
        try:
            for shape, batches in pushes.items():
                warm = batches[: 2 * BATCH // PER_PUSH[shape]]
                one_round(exp, rev, shape, warm, reverb_first=False)  # the same warm-up for both
            for round_ in range(args.rounds):
                for shape, batches in pushes.items():
                    measured = one_round(exp, rev, shape, batches, reverb_first=round_ % 2 == 1)
                    measured.update(push_split(Path(data), shape, batches))
                    for name, value in measured.items():
                        results[shape][name].append(value)
                        print(shape, name, f"{value:,.0f}", file=sys.stderr, flush=True)
        finally:
            exp.stop()
            rev.stop()
    section = report(command, load, args.rounds, {"8k": args.pushes_8k, "40k": args.pushes_40k}, results)
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
