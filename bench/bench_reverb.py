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
- Pipelined pushes, window W (4 and 8): expbuf's `pusher(window=W)` (up to W pushes unanswered,
  the next one encoded meanwhile; timed to its close, when every push is durable) against
  Reverb's writers kept at most W pushes ahead of the server's confirmations (reverb_side.py),
  each flushed at the end. expbuf's go into a table of their own, dropped after each.
- Sample, batches of 256: expbuf's consume stream (each experience delivered once and deleted,
  decoded into tensors by the client before it confirms the batch), half of each round's read
  with `prefetch=0` and half with `prefetch=1` (the default: decoded on the stream's own thread),
  the tensors of each experience read (`Batch.experiences`, what a trainer reads), against
  Reverb's `client.sample` and its batched `TrajectoryDataset` (uniform, with replacement; it
  hands over decoded tensors).
Each round runs expbuf and Reverb in alternating order; the same warm-up precedes both.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
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
from collections.abc import Callable
from pathlib import Path

import lmdb
import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import Proc, drain, experience, uptime  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402
from expbuf.server.store import Entry  # noqa: E402

HEADING = "## Against DeepMind Reverb (issues 10, 22, 32)"
BATCH = 256
COLUMNS = ["tokens", "logprobs"]  # the fields a columnar sample reads
PER_PUSH = {"8k": 256, "40k": 64}
TABLE = {"8k": "small", "40k": "large"}
SERIAL = itertools.count()
WINDOWS = (4, 8)  # pipelined pushes: pushes in flight
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

    def pipelined(self, table: str, pushes: list[list[Experience]], window: int) -> float:
        """Push through a pusher of `window`: timed from the first push to the pusher's close, when
        every push is durable."""
        start = time.perf_counter()
        with self.client.pusher(table, window=window) as pusher:
            futures = [pusher.push(exps) for exps in pushes]
        seconds = time.perf_counter() - start
        stored = sum(len(f.result().stored) for f in futures)
        assert stored == sum(map(len, pushes)), (stored, window)
        return stored / seconds

    def sample(self, table: str, count: int, *, prefetch: int = 1) -> float:
        """Consume `count` experiences of `table` in batches, each experience's tensors read (what a
        trainer reads, and what Reverb's TrajectoryDataset hands over); the client decodes every
        batch, `prefetch` of them ahead of this loop on the stream's own thread."""
        start = time.perf_counter()
        got = drain(self.client, table, count // BATCH, prefetch=prefetch)
        assert got == count // BATCH * BATCH, (got, count)
        return got / (time.perf_counter() - start)

    def columns(self, table: str, count: int) -> float:
        """Consume `count` experiences of `table` as columns of their tokens and log-probs
        (`fields=`), one tensor a field a batch (`Batch.columns`), the default prefetch."""
        start = time.perf_counter()
        got = drain(self.client, table, count // BATCH, fields=COLUMNS)
        assert got == count // BATCH * BATCH, (got, count)
        return got / (time.perf_counter() - start)

    def frozen(self, table: str, count: int) -> float:
        """`sample` with the default prefetch after `gc.freeze()`, as the docs advise a trainer
        (docs/concepts/pushing-and-sampling.md): what this process holds (torch, the bench's
        pushes) moves out of the collector's reach, so the full collections a decoded batch's
        objects bring on stay short."""
        gc.freeze()
        try:
            return self.sample(table, count)
        finally:
            gc.unfreeze()

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) of a process and of its children alive now (an expbuf
    server's ingest processes), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    pids = [str(pid)]
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            pids += (task / "children").read_text().split()
    total = 0.0
    for one in pids:
        try:
            fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a child that ended meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


class Usage:
    """CPU seconds so far of one side's client (None: this process, all its threads) and server."""

    def __init__(self, client: int | None, server: int) -> None:
        self.client, self.server = client, server

    def read(self) -> tuple[float, float]:
        client = time.process_time() if self.client is None else cpu_seconds(self.client)
        return client, cpu_seconds(self.server)


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
    ours, theirs = Usage(None, exp.server.proc.pid), Usage(rev.client.pid, rev.server.pid)

    def measure(name: str, usage: Usage, items: int, run: Callable[[], float]) -> None:
        """Experiences per second of `run`, and its CPU µs per experience in each process."""
        before = usage.read()
        out[name] = run()
        for where, now, then in zip(("client", "server"), usage.read(), before, strict=True):
            out[f"{name} {where} cpu"] = (now - then) / items * 1e6

    def expbuf_side() -> None:
        measure("expbuf push", ours, count, lambda: exp.push(shape, pushes))
        halves = {0: count // 2 // BATCH * BATCH}
        halves[1] = count - halves[0]
        for prefetch in (0, 1) if reverb_first else (1, 0):  # which half drains the fuller table alternates
            measure(
                f"expbuf prefetch {prefetch}",
                ours,
                halves[prefetch] // BATCH * BATCH,
                functools.partial(exp.sample, TABLE[shape], halves[prefetch], prefetch=prefetch),
            )
        for window in WINDOWS:  # each into a table of its own, dropped after it (untimed)
            table = f"{TABLE[shape]}-w{window}"
            exp.client.create_table(table, estimator="none", group_by="none")
            measure(f"expbuf window {window}", ours, count, functools.partial(exp.pipelined, table, pushes, window))
            if window == WINDOWS[0]:  # its experiences drained as columns
                measure("expbuf columns", ours, count // BATCH * BATCH, functools.partial(exp.columns, table, count))
            if window == WINDOWS[-1]:  # its experiences drained as the default half is, the heap frozen
                measure("expbuf frozen", ours, count // BATCH * BATCH, functools.partial(exp.frozen, table, count))
            exp.client.drop_table(table)

    def reverb_side() -> None:
        per = PER_PUSH[shape]
        measure("reverb push", theirs, count, lambda: rev.run(op="push", shape=shape, pushes=len(pushes), per=per))
        measure("reverb legacy", theirs, count, lambda: rev.run(op="legacy", shape=shape, pushes=len(pushes), per=per))
        measure("reverb sample", theirs, count, lambda: rev.run(op="sample", shape=shape, count=count))
        reads = DATASET_READS * count // BATCH * BATCH
        measure("reverb dataset", theirs, reads, lambda: rev.run(op="dataset", shape=shape, count=reads, batch=BATCH))
        for window in WINDOWS:
            for op, name in (("push", f"reverb window {window}"), ("legacy", f"reverb legacy window {window}")):
                run = functools.partial(rev.run, op=op, shape=shape, pushes=len(pushes), per=per, window=window)
                measure(name, theirs, count, run)

    for side in (reverb_side, expbuf_side) if reverb_first else (expbuf_side, reverb_side):
        side()
    return out


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def cell(values: list[float]) -> str:
    return f"{median(values):,.0f} exp/s ({min(values):,.0f}-{max(values):,.0f})"


def report(
    command: str, load: tuple[str, str], rounds: int, pushes: dict[str, int], res: dict[str, dict[str, list[float]]]
) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores shared with other work running on the machine (load average "
        f"{load[0]} at the start, {load[1]} at the end, `uptime`); dm-reverb 0.14.0, "
        "tensorflow 2.15 in their own venv. Servers and clients in their own processes, one writer each. "
        f"Medians of {rounds} rounds, expbuf and Reverb in alternating order, after the same warm-up; "
        f"{pushes['8k']} pushes of 256 x 8 KB and {pushes['40k']} of 64 x 40 KB per round, the same "
        "random tensors on both sides. expbuf's push encodes, validates, packs and fsyncs every push "
        "before it acks; Reverb keeps items in memory and never writes to disk. expbuf's consume "
        "deletes what it delivers (durably); Reverb samples uniformly, with replacement, and its "
        f"`TrajectoryDataset` reads {DATASET_READS} x the pushed count per round (a longer, steadier measure).",
        "",
        "What each push waits for. `push`: expbuf's `client.push()` returns once the server has "
        "answered that the push is durable (stored and fsynced), and only then is the next one encoded; "
        "Reverb's writer `flush()` after each push returns once the server has confirmed every item "
        "made (inserted in its table, in memory). Window W: expbuf's `pusher(window=W).push()` encodes "
        "the push and sends it, waiting only while W pushes are unanswered, and the time ends when "
        "`close()` returns, every push durable; Reverb's trajectory writer sends each item as it is made "
        "and, after each push, `flush(block_until_num_items=(W-1) x per push)` waits until at most W - 1 "
        "pushes' items are unconfirmed; its legacy writer's `max_in_flight_items` (W x per push) makes "
        "`create_item` wait while W pushes' items are unconfirmed; each `flush()`es once at the end. "
        "Sample: expbuf's client decodes every batch into tensors before it confirms it (there is no "
        "read as bytes any more); with `prefetch=1`, the default, on the stream's own thread, one batch "
        "ahead of the caller; with `prefetch=0` in the caller's thread, when it asks; as columns of "
        "tokens and log-probs (`fields=`, from the window-4 pushes' table: one tensor a field a batch, "
        "no experience objects); and once more "
        "(from the window-8 pushes' table) after `gc.freeze()`, which takes what the process holds out "
        "of the garbage collector's full passes (docs/concepts/pushing-and-sampling.md).",
        "",
        "| measure | expbuf, median (min-max) | Reverb, median (min-max) | expbuf / Reverb, medians | goal |",
        "| --- | --- | --- | --- | --- |",
    ]
    cpu_rows: list[tuple[str, str, str, str]] = []
    goals = {  # issue 41's at 8 KB, issue 32's at 40 KB
        ("8k", "push"): "≥ 1.0",
        ("8k", "legacy"): "≥ 1.0",
        ("8k", "decoded"): "≥ 1.0",
        ("8k", "columns"): "≥ 1.5",
        ("40k", "push"): "≥ 1.0",
        ("40k", "legacy"): "≥ 1.0",
        ("40k", "decoded"): "≥ 1.0",
    }
    for shape, r in res.items():
        per = PER_PUSH[shape]
        size = f"{shape[:-1]} KB, {per} per push"
        kb = shape[:-1]
        rows = [
            ("push", f"push, {size} (`push` / trajectory writer + flush)", "expbuf push", "reverb push"),
            ("legacy", f"push, {size} (`push` / legacy `client.writer` + flush)", "expbuf push", "reverb legacy"),
        ]
        for w in WINDOWS:
            rows += [
                (
                    f"window {w}",
                    f"push, {size}, window {w} (`pusher(window={w})` / trajectory writer, "
                    f"`flush(block_until_num_items={(w - 1) * per})` after each push)",
                    f"expbuf window {w}",
                    f"reverb window {w}",
                ),
                (
                    f"legacy window {w}",
                    f"push, {size}, window {w} (`pusher(window={w})` / legacy `client.writer`, "
                    f"`max_in_flight_items={w * per}`)",
                    f"expbuf window {w}",
                    f"reverb legacy window {w}",
                ),
            ]
        rows += [
            (
                "sample",
                f"sample {kb} KB, batches of 256, decoded, prefetch 1 (consume / `client.sample`)",
                "expbuf prefetch 1",
                "reverb sample",
            ),
            (
                "prefetch 0",
                f"sample {kb} KB, batches of 256, decoded tensors, prefetch 0 (consume / `TrajectoryDataset` tf.data)",
                "expbuf prefetch 0",
                "reverb dataset",
            ),
            (
                "decoded",
                f"sample {kb} KB, batches of 256, decoded tensors, prefetch 1, the default "
                "(consume / `TrajectoryDataset` tf.data)",
                "expbuf prefetch 1",
                "reverb dataset",
            ),
            (
                "columns",
                f"sample {kb} KB, batches of 256, columns of tokens and log-probs, prefetch 1 "
                "(consume with `fields=` / `TrajectoryDataset` tf.data)",
                "expbuf columns",
                "reverb dataset",
            ),
            (
                "frozen",
                f"sample {kb} KB, batches of 256, decoded tensors, prefetch 1, after `gc.freeze()` "
                "(consume / `TrajectoryDataset` tf.data)",
                "expbuf frozen",
                "reverb dataset",
            ),
        ]
        for key, label, ours, theirs in rows:
            lines.append(
                f"| {label} | {cell(r[ours])} | {cell(r[theirs])} | **{median(r[ours]) / median(r[theirs]):.2f}** | "
                f"{goals.get((shape, key), '')} |"
            )
        cpu_rows.extend((shape, label, ours, theirs) for _, label, ours, theirs in rows)
    lines += [
        "",
        "CPU per experience of each process over the same measures (µs, medians of the rounds; user and "
        "system time from /proc: the expbuf client's every thread, gRPC's included, and each server with "
        "its child processes; Reverb's client is its process of TensorFlow and the writer or dataset):",
        "",
        "| measure | expbuf client | expbuf server | Reverb client | Reverb server |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for shape, label, ours, theirs in cpu_rows:
        r = res[shape]
        cpu = [median(r[f"{name} {where} cpu"]) for name in (ours, theirs) for where in ("client", "server")]
        lines.append(f"| {label} | " + " | ".join(f"{c:.1f}" for c in cpu) + " |")
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
    load = uptime()
    pushes = {"8k": make_pushes("8k", args.pushes_8k), "40k": make_pushes("40k", args.pushes_40k)}
    results: dict[str, dict[str, list[float]]] = {shape: collections.defaultdict(list) for shape in pushes}
    rev = ReverbSide(args.reverb_python)
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as data:
        exp = ExpbufSide(data)
        try:
            exp.server.wait_for("advantage worker")  # torch loads after the server listens: its steady state
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
    section = report(command, (load, uptime()), args.rounds, {"8k": args.pushes_8k, "40k": args.pushes_40k}, results)
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
