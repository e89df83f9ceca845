"""Writes per experience: the LMDB puts and deletes each stored experience costs the writer
(on a push, each experience its own group and groups of 8; a consume; a consume stream's takes,
each batch held and delivered in the next take's commit; a lease, then its ack),
what a tombstone costs in the data file, and push and sample throughput, optionally side by
side with an earlier tree of expbuf (each round runs both, alternating, in child processes).

    .venv/bin/python bench/bench_writes.py [--before DIR] [--rounds 3] [--out bench/RESULTS.md]

    .venv/bin/python bench/bench_writes.py --layouts records,rows [--rounds 3]

With --layouts, only the push stage, of a table of each storage layout (issue 64's hidden setting:
rows land a step at a time, and so far a rows table takes only pushes), side by side in one run.

DIR holds an earlier commit's files (`git archive COMMIT | tar -x -C DIR`). Puts are counted
through a wrapper around the writer's transaction (one row of a putmulti is a put); throughput
is of the Store itself (no gRPC), 64 experiences per durable write or per batch.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from results import write_section  # noqa: E402
from storage_writes import written  # noqa: E402

from expbuf.client import EID, Experience, trxp  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.disk.environment import Environment  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402
from expbuf.server.store.schema.table_parts import Storage  # noqa: E402

Counts = collections.Counter[str]


class _Cursor:
    def __init__(self, cur: lmdb.Cursor, name: str, counts: Counts) -> None:
        self._cur, self._name, self._counts = cur, name, counts

    def putmulti(self, rows: Any, *args: Any, **kwargs: Any) -> Any:
        rows = list(rows)
        self._counts["put " + self._name] += len(rows)
        return self._cur.putmulti(rows, *args, **kwargs)

    def put(self, *args: Any, **kwargs: Any) -> Any:
        self._counts["put " + self._name] += 1
        return self._cur.put(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        self._counts["del " + self._name] += 1
        return self._cur.delete(*args, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cur)

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cur.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _Txn:
    """A write transaction that counts what it writes, by database."""

    def __init__(self, txn: lmdb.Transaction, names: dict[int, str], counts: Counts) -> None:
        self._txn, self._names, self._counts = txn, names, counts

    def _name(self, db: Any) -> str:
        return self._names.get(id(db), "?")

    def put(self, key: bytes, value: bytes, *args: Any, db: Any = None, **kwargs: Any) -> Any:
        self._counts["put " + self._name(db)] += 1
        return self._txn.put(key, value, *args, db=db, **kwargs)

    def delete(self, key: bytes, *args: Any, db: Any = None, **kwargs: Any) -> Any:
        done = self._txn.delete(key, *args, db=db, **kwargs)
        self._counts["del " + self._name(db)] += bool(done)
        return done

    def cursor(self, db: Any = None) -> _Cursor:
        return _Cursor(self._txn.cursor(db=db), self._name(db), self._counts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


class _Env:
    """The LMDB environment, whose transactions nested in a counting one count too (a Sample
    stream's take runs nested in the transaction that delivers its confirmed batches)."""

    def __init__(self, env: lmdb.Environment, names: dict[int, str], counts: Counts) -> None:
        self._env, self._names, self._counts = env, names, counts

    def begin(self, *args: Any, parent: Any = None, **kwargs: Any) -> Any:
        if not isinstance(parent, _Txn):
            return self._env.begin(*args, parent=parent, **kwargs)
        return _Txn(self._env.begin(*args, parent=parent._txn, **kwargs), self._names, self._counts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def counting(store: Store, counted: Counts) -> None:
    """Make every request of the store's writer count its writes into `counted`."""
    env: Environment = store.environment
    names = {id(db): name for name, db in env.db.items()}

    def run(fn: Callable[[Any], Any], txn: lmdb.Transaction) -> tuple[bool, Any]:
        try:
            return True, fn(_Txn(txn, names, counted))
        except lmdb.MapFullError:
            raise
        except Exception as exc:
            return False, exc

    writer = getattr(env, "writer", env)  # a tree before the writer had a class of its own (--before)
    writer._run = run  # type: ignore[method-assign]
    env.env = writer.env = _Env(env.env, names, counted)  # type: ignore[assignment]


def entries(n: int, group: int, start: int = 0, size: int = 0) -> list[Entry]:
    """n experiences in groups of `group`, of about `size` bytes (small when 0)."""
    tokens = list(range(8 + size // 4))
    out = []
    for i in range(start, start + n):
        exp = Experience(
            eid=EID(batch=0, task=i // group, run=i % group, suffix=f"s{start}"),
            tokens=tokens,
            prompt_length=4,
            reward=float(i % 2),
            info={"model_version": 1},
        )
        out.append(Entry.of(trxp.from_experience(exp)))
    return out


def _table(group: int, layout: str = "records") -> TableConfig:
    table = TableConfig.of(name="t", estimator="none", group_size=group, drop_zero_variance=False)
    return table if table.storage.layout == layout else dataclasses.replace(table, storage=Storage(layout=layout))


def stream(store: Store, batches: int) -> None:
    """A consume stream's takes, 64 experiences each: every batch held when taken and delivered
    in the commit of the next take, as a Sample stream confirms it (the last one alone)."""
    spec = TakeSpec(table="t", batch_size=64, wait_seconds=0)
    held = ""
    for _ in range(batches):
        batch = store.sample(spec, hold=True, confirm=held)
        assert batch is not None
        held = batch.lease_id
    store.confirm(held, spec)


def counts(n: int, group: int, layout: str = "records") -> dict[str, dict[str, float]]:
    """The writes per experience of a push, a consume, a consume stream's takes (each batch
    held, then delivered in the next take's commit), and a lease and its ack, by database, of a
    table of `layout`."""
    stages: dict[str, Counts] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "d")
        store.create_table(_table(group, layout))
        counted: Counts = collections.Counter()
        counting(store, counted)
        for at in range(0, 3 * n, 64):
            store.put_entries("t", entries(64, group, at))
        stages["push"] = +counted
        counted.clear()
        for _ in range(n // 64):
            assert store.sample(TakeSpec(table="t", batch_size=64, wait_seconds=0)) is not None
        stages["consume"] = +counted
        counted.clear()
        stream(store, n // 64)
        stages["stream"] = +counted
        counted.clear()
        leases = []
        for _ in range(n // 64):
            batch = store.sample(TakeSpec(table="t", batch_size=64, delivery="lease", wait_seconds=0))
            assert batch is not None
            leases.append(batch.lease_id)
        stages["lease"] = +counted
        counted.clear()
        for lease_id in leases:
            store.ack(lease_id)
        stages["ack"] = +counted
        store.close()
    return {stage: {k: v / (3 * n if stage == "push" else n) for k, v in c.items()} for stage, c in stages.items()}


def speed(n: int, group: int, size: int) -> dict[str, float]:
    """Experiences per second of durable pushes, consumes, a consume stream's takes, and leases
    then acks (64 at a time), the process's CPU µs per experience of each (steadier than wall
    time on a busy machine) and the bytes it wrote to storage per experience (LMDB's dirty pages:
    not noisy at all)."""
    writes = [entries(64, group, at, size) for at in range(0, 3 * n, 64)]
    out: dict[str, float] = {}

    def timed(name: str, count: int, fn: Callable[[], None]) -> None:
        wall, cpu, wrote = time.perf_counter(), time.process_time(), written()
        fn()
        out[name] = count / (time.perf_counter() - wall)
        out[name + "_cpu_us"] = (time.process_time() - cpu) / count * 1e6
        out[name + "_bytes"] = (written() - wrote) / count

    def push() -> None:
        for batch in writes:
            store.put_entries("t", batch)

    def consume() -> None:
        for _ in range(n // 64):
            assert store.sample(TakeSpec(table="t", batch_size=64, wait_seconds=0)) is not None

    def lease_ack() -> None:
        for _ in range(n // 64):
            leased = store.sample(TakeSpec(table="t", batch_size=64, delivery="lease", wait_seconds=0))
            assert leased is not None
            store.ack(leased.lease_id)

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "d", map_size=4 << 30)
        store.create_table(_table(group))
        timed("push", 3 * n, push)
        timed("consume", n, consume)
        timed("stream", n, lambda: stream(store, n // 64))
        timed("lease_ack", n, lease_ack)
        store.close()
    return out


def tombstone_bytes(n: int, group: int) -> float:
    """Data-file bytes per tombstone: the pages of item records, tombstones, retired index and
    group records once n small experiences are pushed and consumed."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "d")
        store.create_table(_table(group))
        for at in range(0, n, 64):
            store.put_entries("t", entries(64, group, at))
        for _ in range(n // 64):
            assert store.sample(TakeSpec(table="t", batch_size=64, wait_seconds=0)) is not None
        pages = 0
        with store.environment.read() as txn:
            for name in ("items", "tombs", "retired", "groups"):
                if name not in store.db:  # a tree from before the tombs database
                    continue
                stat = txn.stat(store.db[name])
                pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
                psize = stat["psize"]
        store.close()
    return pages * psize / n


def pushes(n: int, group: int, size: int, layout: str) -> dict[str, Any]:
    """The push stage alone into a table of `layout`: its writes per experience by database (of
    3n small experiences), and of 3n of `size` bytes its experiences per second, the process's CPU
    µs and the bytes written to storage per experience."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "d", map_size=4 << 30)
        store.create_table(_table(group, layout))
        counted: Counts = collections.Counter()
        counting(store, counted)
        for at in range(0, 3 * n, 64):
            store.put_entries("t", entries(64, group, at))
        out["writes"] = {k: v / (3 * n) for k, v in counted.items()}
        store.close()
    writes = [entries(64, group, at, size) for at in range(0, 3 * n, 64)]
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "d", map_size=4 << 30)
        store.create_table(_table(group, layout))
        wall, cpu, wrote = time.perf_counter(), time.process_time(), written()
        for batch in writes:
            store.put_entries("t", batch)
        out["rate"] = 3 * n / (time.perf_counter() - wall)
        out["cpu_us"] = (time.process_time() - cpu) / (3 * n) * 1e6
        out["bytes"] = (written() - wrote) / (3 * n)
        store.close()
    return out


def layout_child(args: argparse.Namespace) -> None:
    result = {
        f"{size}/{group}": pushes(args.experiences, group, size, args.layout_child)
        for size in (0, 8192)
        for group in (1, 8)
    }
    print(json.dumps(result))


def layouts_report(command: str, results: dict[str, list[dict[str, Any]]]) -> str:
    """The push stage of each layout side by side: medians of the rounds, and the first layout's
    over each other's."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    names = list(results)
    first = names[0]
    lines = [
        "## The push of each storage layout (issue 64)",
        "",
        f"Command: `{command}`  ",
        f"{os.cpu_count()} CPUs, load average {load} at the end; the Store alone (no gRPC), fsync on every commit,"
        " 64 experiences a push; medians of the rounds, each layout in a child process of its own, their order"
        " alternating. Not like for like yet: a rows table keeps no priority, uniform or version index (issue 64,"
        " step 2.7), and only groups complete in their push with no estimator go to rows so far.",
        "",
        "| payload / group size | "
        + " | ".join(f"{name} CPU µs | {name} exp/s | {name} writes | {name} bytes written" for name in names)
        + " | "
        + " | ".join(f"CPU {first} / {name} | exp/s {name} / {first}" for name in names[1:])
        + " |",
        "| --- | "
        + " | ".join("--- | --- | --- | ---" for _ in names)
        + " | "
        + " | ".join("--- | ---" for _ in names[1:])
        + " |",
    ]
    for case in results[first][0]:
        med = {
            name: {m: statistics.median(r[case][m] for r in res) for m in ("cpu_us", "rate", "bytes")}
            for name, res in results.items()
        }
        cells = " | ".join(
            f"{med[n]['cpu_us']:.1f} | {med[n]['rate']:,.0f} | {sum(results[n][0][case]['writes'].values()):.2f}"
            f" | {med[n]['bytes']:,.0f}"
            for n in names
        )
        ratios = " | ".join(
            f"**{med[first]['cpu_us'] / med[n]['cpu_us']:.2f}** | **{med[n]['rate'] / med[first]['rate']:.2f}**"
            for n in names[1:]
        )
        lines.append(f"| {case} | {cells} | {ratios} |")
    lines += ["", "Writes per experience by database (puts and deletes, a putmulti row a put):", ""]
    for case in results[first][0]:
        for n in names:
            detail = ", ".join(f"{k} {v:.2f}" for k, v in sorted(results[n][0][case]["writes"].items()) if v >= 0.005)
            lines.append(f"- {case}, {n}: {detail}")
    return "\n".join(lines) + "\n"


def child(args: argparse.Namespace) -> None:
    result = {
        "counts": {group: counts(512, group) for group in (1, 8)},
        "speed": {f"{size}/{group}": speed(args.experiences, group, size) for size in (0, 8192) for group in (1, 8)},
        "tombstone": {group: tombstone_bytes(8192, group) for group in (1, 8)},
    }
    print(json.dumps(result))


def run_child(tree: Path | None, experiences: int, layout: str | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if tree is not None:  # an earlier tree's files, as the expbuf package
        pkg = Path(tempfile.mkdtemp(prefix="expbuf-before-")) / "expbuf"
        pkg.mkdir()
        for name in ("server", "client", "proto"):
            (pkg / name).symlink_to(tree / name)
        (pkg / "ray").symlink_to(tree / "server" / "ray")
        env["PYTHONPATH"] = str(pkg.parent)
    command = [sys.executable, __file__, "--child", "--experiences", str(experiences)]
    if layout is not None:
        command += ["--layout-child", layout]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _count_rows(result: dict[str, Any], label: str) -> list[str]:
    rows = []
    for group, stages in result["counts"].items():
        for stage, c in stages.items():
            puts = sum(v for k, v in c.items() if k.startswith("put"))
            dels = sum(v for k, v in c.items() if k.startswith("del"))
            detail = ", ".join(f"{k} {v:.2f}" for k, v in sorted(c.items()) if v >= 0.005)
            rows.append(f"| {label} | {group} | {stage} | {puts:.2f} | {dels:.2f} | {detail} |")
    return rows


def report(command: str, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        "## Writes per experience (issue 22)",
        "",
        f"Command: `{command}`  ",
        f"{os.cpu_count()} CPUs, load average {load} at the end; the Store alone (no gRPC), fsync on every commit.",
        "",
        "LMDB writes per experience (a putmulti row counts as a put):",
        "",
        "| tree | group size | stage | puts | deletes | by database |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    trees = [("before", before), ("after", after)] if before else [("now", after)]
    for label, results in trees:
        lines += _count_rows(results[0], label)
    lines += [
        "",
        "Data-file bytes per tombstone (the pages of item records, tombstones, retired index and group "
        "records, once all are consumed): "
        + "; ".join(
            f"{label}: {res[0]['tombstone']['1']:.0f} (groups of 1), {res[0]['tombstone']['8']:.0f} (groups of 8)"
            for label, res in trees
        ),
        "",
        "Experiences per second, the process's CPU µs and the bytes written to storage per experience,"
        " medians of the rounds (64 per durable write or per batch; payload 0 = small, else its bytes):",
        "",
        "| payload / group size | measure | "
        + " | ".join(f"{label} exp/s | {label} CPU µs | {label} bytes written" for label, _ in trees)
        + (" | exp/s after / before | CPU before / after | bytes before / after |" if before else " |"),
        "| --- | --- | " + " | ".join("--- | --- | ---" for _ in trees) + (" | --- | --- | --- |" if before else " |"),
    ]
    for case in after[0]["speed"]:
        for measure in ("push", "consume", "stream", "lease_ack"):
            rate, cpu, written = (
                [statistics.median(r["speed"][case][measure + suffix] for r in res) for _, res in trees]
                for suffix in ("", "_cpu_us", "_bytes")
            )
            ratio = (
                f" | **{rate[1] / rate[0]:.2f}** | **{cpu[0] / cpu[1]:.2f}** | **{written[0] / written[1]:.2f}**"
                if before
                else ""
            )
            cells = " | ".join(f"{r:,.0f} | {c:.0f} | {w:,.0f}" for r, c, w in zip(rate, cpu, written, strict=True))
            lines.append(f"| {case} | {measure} | {cells}{ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="an earlier tree of expbuf to measure side by side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--experiences", type=int, default=2048, help="per stage of the speed runs (a multiple of 64)")
    parser.add_argument("--out", help="write the section into this RESULTS.md")
    parser.add_argument("--layouts", help="only the push stage, of tables of these storage layouts: records,rows")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        (layout_child if args.layout_child else child)(args)
        return
    if args.layouts:
        names = args.layouts.split(",")
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for round_ in range(args.rounds):  # the order alternates, so that none is always first
            for name in names if round_ % 2 == 0 else names[::-1]:
                results[name].append(run_child(None, args.experiences, name))
        command = f"python bench/bench_writes.py --layouts {args.layouts} --rounds {args.rounds}"
        section = layouts_report(command + f" --experiences {args.experiences}", results)
        print(section)
        if args.out:
            write_section(Path(args.out), "## The push of each storage layout (issue 64)", section)
        return
    before, after = [], []
    for round_ in range(args.rounds):  # which tree goes first alternates, so neither is always second
        if args.before is not None and round_ % 2 == 0:
            before.append(run_child(args.before.resolve(), args.experiences))
        after.append(run_child(None, args.experiences))
        if args.before is not None and round_ % 2 == 1:
            before.append(run_child(args.before.resolve(), args.experiences))
    command = "python bench/bench_writes.py" + (" --before DIR" if args.before else "")
    command += f" --rounds {args.rounds} --experiences {args.experiences}"
    section = report(command, before, after)
    print(section)
    if args.out:
        write_section(Path(args.out), "## Writes per experience (issue 22)", section)


if __name__ == "__main__":
    main()
