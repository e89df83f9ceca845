"""A consume stream's cost to the server: its CPU and the bytes it writes per consumed experience,
through a real `expbuf serve`, optionally side by side with an earlier tree of expbuf, and where
that CPU goes (py-spy).

    .venv/bin/python bench/bench_consume.py [--before DIR] [--rounds 4] [--experiences 16384]
        [--shape 8k,40k] [--groups 1,8] [--layouts records,rows] [--profile OUT] [--threads] [--out bench/RESULTS.md]

Each round starts a server of each tree in turn (which goes first alternating), fills a table
with experiences of each shape (bench_reverb's: 8 KB, 256 a push; 40 KB, 64 a push; a 40 KB
drain holds the bytes of an 8 KB one), then drains it with one consume stream of batches of 256
(no decode at the client: the payload's bytes are read), and reads the server process's CPU time
(user and system, /proc) and bytes written to storage over the drain alone. Once per shape and
group size in a round: each experience its own group (group_by none) or groups of N. DIR holds
an earlier commit's files (`git archive COMMIT | tar -x -C DIR`; copy client/trxp/codec/_native there
for its compiled codec). With --profile, py-spy samples the last round's server of this tree over
its drains, and the busy samples go to stages of the consume path (written to OUT). With
--layouts records,rows, this tree's server runs once per storage layout of its tables (the rows
of issue 64, made by a TOML file's [[tables]], the hidden setting's one way in), side by side.
With --threads, the server's CPU over the drains by thread: its writer, its RPC threads (replies
built and sent), gRPC's polling thread and event engine, the rest.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes, restamp  # noqa: E402
from bench_writes import counts  # noqa: E402
from profile_push import busy_samples  # noqa: E402
from results import write_section  # noqa: E402
from storage_writes import written  # noqa: E402

from expbuf.client import EID, BufferClient, trxp  # noqa: E402

HEADING = "## A consume stream's cost to the server (issue 32)"
BATCH = 256
USAGE = ("cpu", "written", "minor", "major")  # what Server.usage reads, in its order
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
PER_PUSH = {"8k": 256, "40k": 64}  # bench_reverb.make_pushes' experiences a push
KB = {"8k": 8, "40k": 40}


class Case(NamedTuple):
    """One table a round fills and drains: its experiences' shape and its group size."""

    shape: str
    group: int

    @property
    def name(self) -> str:
        return f"{self.shape}-g{self.group}"

    def options(self) -> dict[str, Any]:
        """The table's grouping."""
        return {"group_by": "none"} if self.group == 1 else {"group_by": "task", "group_size": self.group}

    def count(self, experiences: int) -> int:
        """Experiences a drain of this shape: as many bytes as `experiences` of 8 KB, in whole batches."""
        return experiences * KB["8k"] // KB[self.shape] // BATCH * BATCH


# (stage, the names of functions that put a sample in it: a records table's, then a rows table's),
# most specific first.
STAGES = (
    ("durable commit (LMDB commit, fsync)", "_mdb_txn_commit"),
    ("confirm: consume the batch before (Leases.confirm, retire)", ("Leases.confirm ", "TableLeases.confirm ")),
    ("take: read payloads and check their digests", ("_Payloads.check ", "Payloads.check_columns ")),
    ("take: read member records (a rows table: member columns)", ("TableState.members ", "Spans.column ")),
    ("take: select groups (ready index, group records; ready runs)", ("_select ", "select ")),
    ("take: leave the ready index (ready runs)", ("ReadyIndex.remove_many ", "unready ")),
    ("take: the rest (states, records written, lease)", "take "),
    ("reply: splice the batch and frame it", "sample_reply "),
    ("write loop and hand-offs", ("Writer._write_loop", "Environment._write_loop")),  # the latter: earlier trees
    ("gRPC: the stream's handler and messages", "stream_batches "),
    ("gRPC: the server's polling thread", "_serve "),
)


def package(tree: Path, root: Path) -> Path:
    """A directory under `root` that holds `tree` as the expbuf package, laid out as the install
    maps it."""
    pkg = root / "tree" / "expbuf"
    pkg.mkdir(parents=True)
    for name, target in (("server", "server"), ("client", "client"), ("proto", "proto/expbuf"), ("ray", "server/ray")):
        (pkg / name).symlink_to(tree / target)
    return pkg.parent


# The parts of the server's CPU by thread (bench_consume --threads): its writer, the RPC threads that
# build replies, gRPC's polling thread (grpc's `_serve`) and its event engine's (C++) threads.
THREAD_PARTS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("writer", lambda name: name == "expbuf-writer"),
    ("rpc", lambda name: name.startswith("expbuf-rpc")),
    ("poller", lambda name: "(_serve)" in name),
    ("engine", lambda name: name == "event_engine"),
)


class Server:
    """An `expbuf serve` of one tree (None: this one) on a fresh data directory."""

    def __init__(self, tree: Path | None, data: Path, config: Path | None = None) -> None:
        env = dict(os.environ)
        if tree is not None:
            env["PYTHONPATH"] = str(package(tree, data.parent))
        argv = [sys.executable, "-m", "expbuf.server.cli", "serve", "--data", str(data), "--port", "0"]
        argv += ["--metrics-port", "-1", "--ingest-processes", "0"]
        argv += ["--config", str(config)] if config is not None else []
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
        assert self.proc.stderr is not None
        self.log: list[str] = []
        for line in self.proc.stderr:
            self.log.append(line)
            if "listening on" in line:
                self.target = line.split("listening on ")[1].split()[0]
                break
        else:
            raise RuntimeError("the server did not start:\n" + "".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr or ()), daemon=True).start()

    def wait_started(self, timeout: float = 120.0) -> None:
        """Until the advantage worker has started (torch loaded): the server's steady state."""
        deadline = time.monotonic() + timeout
        while not any("advantage worker" in line or "advantages cannot" in line for line in self.log):
            if time.monotonic() > deadline:
                raise RuntimeError("the server's advantage worker did not start:\n" + "".join(self.log))
            time.sleep(0.1)

    def usage(self) -> tuple[float, int, int, int]:
        """The process's CPU seconds (user and system), bytes handed to write calls (storage_writes.py), and minor and
        major page faults so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        return cpu, written(self.proc.pid), int(fields[7]), int(fields[9])

    def threads(self) -> dict[str, tuple[str, float]]:
        """Each of the server's threads by its id: its part (THREAD_PARTS), named as py-spy's dump
        of the process names it (the server's Python threads), else as the kernel does, and its CPU
        seconds so far. By id, not by part: a dump that names a thread once and not the next time
        moved its whole CPU from one part to another (`spent`)."""
        ticks, names = os.sysconf("SC_CLK_TCK"), {}
        dump = subprocess.run([PY_SPY, "dump", "-p", str(self.proc.pid)], capture_output=True, text=True, check=False)
        for line in dump.stdout.splitlines():
            if line.startswith("Thread ") and '"' in line:
                names[line.split()[1]] = line.split('"')[1]
        found: dict[str, tuple[str, float]] = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            name = names.get(task.name, stat[stat.index("(") + 1 : stat.rindex(")")])
            fields = stat.rsplit(")", 1)[1].split()
            part = next((part for part, match in THREAD_PARTS if match(name)), "other")
            found[task.name] = (part, (int(fields[11]) + int(fields[12])) / ticks)
        return found

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def spent(before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by part between two `Server.threads` readings, each thread's own difference
    (one started between them from zero), under the part it was first named with."""
    parts: collections.Counter[str] = collections.Counter()
    for tid, (part, seconds) in after.items():
        named, earlier = before.get(tid, (part, 0.0))
        parts[named if named != "other" else part] += seconds - earlier
    return dict(parts)


def payloads(count: int, case: Case, serial: collections.abc.Iterator[int]) -> list[bytes]:
    """`count` experiences of the case's shape as pushes of bench_reverb's size, fresh uids; with
    groups of the case's size."""
    pushes = make_pushes(case.shape, count // PER_PUSH[case.shape])
    restamp(pushes, serial)
    group = case.group
    if group > 1:
        for exps in pushes:
            for i, exp in enumerate(exps):
                exp.eid = EID(batch=exps[i - i % group].eid.batch, task=0, run=i % group)
    return [trxp.encode(exps) for exps in pushes]


def drain(target: str, table: str, count: int) -> int:
    """Consume `count` experiences in batches of BATCH; returns the payload bytes received."""
    total = 0
    with BufferClient(target, timeout=120) as client:
        batches = client.sample(table, batch_size=BATCH, delivery="consume", max_batches=count // BATCH, prefetch=0)
        for batch in batches:
            total += len(batch.payload)
    return total


def tables_file(cases: list[Case], layout: str, path: Path) -> Path:
    """A TOML file that makes the cases' tables in `layout` at the server's start."""
    blocks = []
    for case in cases:
        settings = {"name": case.name, "estimator": "none", "layout": layout, **case.options()}
        blocks.append("[[tables]]\n" + "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in settings.items()))
    path.write_text("\n".join(blocks))
    return path


def one_server(
    tree: Path | None,
    cases: list[Case],
    experiences: int,
    cycles: int,
    spy: Path | None,
    layout: str = "records",
    by_thread: bool = False,
) -> dict[Case, dict[str, float]]:
    """A server of `tree`: each case filled then drained, `cycles` times in turn; CPU µs and bytes
    written per consumed experience over its drains (and the CPU per pushed one over its fills).
    With `spy`, py-spy records the last cycle's drains there. `layout`: its tables' storage layout.
    `by_thread`: the drains' CPU by part of the server too (THREAD_PARTS)."""
    totals: dict[Case, collections.Counter[str]] = {case: collections.Counter() for case in cases}
    serial = iter(range(10**9))
    with tempfile.TemporaryDirectory() as data:
        # this tree's tables name their layout (rows is its default); an earlier tree's are records,
        # its default, where it may know no layout setting
        named = tree is None or layout != "records"
        config = tables_file(cases, layout, Path(data) / "tables.toml") if named else None
        server = Server(tree, Path(data) / "d", config)
        try:
            with BufferClient(server.target, timeout=120) as client:
                for case in cases if config is None else ():
                    client.create_table(case.name, estimator="none", **case.options())
            server.wait_started()
            for cycle in range(cycles):
                for case in cases:
                    table, total, count = case.name, totals[case], case.count(experiences)
                    pushes = payloads(count, case, serial)
                    filled = server.usage()
                    with BufferClient(server.target, timeout=120) as client:
                        for payload in pushes:
                            client.push(payload, table=table)
                    total["push_cpu"] += server.usage()[0] - filled[0]
                    total["n"] += count
                    del pushes
                    recorder = None
                    if spy is not None and cycle == cycles - 1:
                        command = [PY_SPY, "record", "-p", str(server.proc.pid), "-r", "250", "--native"]
                        command += ["--threads", "-f", "raw", "-o", f"{spy}.{case.name}"]
                        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        time.sleep(1.0)  # attached
                    parts = server.threads() if by_thread else {}
                    before = server.usage()
                    wall = time.perf_counter()
                    drain(server.target, table, count)
                    total["wall"] += time.perf_counter() - wall
                    for key, now, then in zip(USAGE, server.usage(), before, strict=True):
                        total[key] += now - then
                    for part, seconds in (spent(parts, server.threads()) if by_thread else {}).items():
                        total[f"thread {part}"] += seconds
                    if recorder is not None:
                        recorder.send_signal(signal.SIGINT)
                        recorder.wait(60)
        finally:
            server.stop()
    return {
        case: {
            "cpu_us": t["cpu"] / t["n"] * 1e6,
            "push_cpu_us": t["push_cpu"] / t["n"] * 1e6,
            "written": t["written"] / t["n"],
            "exp_s": t["n"] / t["wall"],
            "minor": t["minor"] / t["n"],
            "major": t["major"] / t["n"],
            **{key: seconds / t["n"] * 1e6 for key, seconds in t.items() if key.startswith("thread ")},
        }
        for case, t in totals.items()
    }


def report(
    command: str, cases: list[Case], runs: dict[str, list[dict[Case, Any]]], load: tuple[str, str], cycles: int
) -> str:
    trees = list(runs)
    pair = len(trees) > 1
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"{os.cpu_count()} CPUs, shared; load average {load[0]} at the start, {load[1]} at the end (`uptime`). "
        f"A real `expbuf serve` (ingest processes 0, each tree's in turn), one table per shape and group size "
        f"filled then drained by one consume stream of batches of {BATCH} (`prefetch=0`, the "
        f"payload's bytes read, not decoded), {cycles} times in turn, fsync on every commit. The server process's "
        "CPU (user and system, /proc) and bytes written to storage over the drains, per consumed experience, "
        "medians of the rounds; the CPU of its fills per pushed experience beside them.",
        "",
        "| shape | group size | "
        + " | ".join(f"{t} CPU µs | {t} bytes written | {t} exp/s | {t} push CPU µs" for t in trees)
        + (
            "".join(f" | {what} {trees[0]} / {trees[1]}" for what in ("consume CPU", "bytes", "push CPU")) + " |"
            if pair
            else " |"
        ),
        "| --- | ---: | "
        + " | ".join("---: | ---: | ---: | ---:" for _ in trees)
        + (" | ---: | ---: | ---: |" if pair else " |"),
    ]
    keys = ("cpu_us", "written", "exp_s", "push_cpu_us")
    for case in cases:
        med = {t: {k: statistics.median(r[case][k] for r in runs[t]) for k in keys} for t in trees}
        cells = " | ".join(
            f"{m['cpu_us']:.1f} | {m['written']:,.0f} | {m['exp_s']:,.0f} | {m['push_cpu_us']:.1f}"
            for m in med.values()
        )
        ratio = ""
        if pair:
            b, a = med[trees[0]], med[trees[1]]
            ratio = " | " + " | ".join(f"**{b[k] / a[k]:.2f}**" for k in ("cpu_us", "written", "push_cpu_us"))
        lines.append(f"| {case.shape} | {case.group} | {cells}{ratio} |")
    return "\n".join(lines) + "\n"


def by_thread(cases: list[Case], runs: dict[str, list[dict[Case, Any]]]) -> str:
    """The drains' server CPU per consumed experience by part (THREAD_PARTS), medians of the rounds."""
    parts = [part for part, _ in THREAD_PARTS] + ["other"]
    lines = [
        "",
        "The server's CPU per consumed experience by thread (µs; `--threads`: /proc per thread, named by "
        "py-spy's dump; medians of the rounds):",
        "",
        "| shape | group size | tree | " + " | ".join(parts) + " |",
        "| --- | ---: | --- | " + " | ".join("---:" for _ in parts) + " |",
    ]
    for case in cases:
        for tree, rounds in runs.items():
            cells = [statistics.median(r[case].get(f"thread {part}", 0.0) for r in rounds) for part in parts]
            lines.append(f"| {case.shape} | {case.group} | {tree} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def writes_per_experience(groups: list[int], layouts: list[str]) -> str:
    """The LMDB writes per consumed experience of a consume stream (bench_writes.py's count, the
    Store alone: each batch held when taken, delivered in the next take's commit), for a table of
    each layout measured."""
    cells = []
    for layout in layouts:
        for group in groups:
            stream = counts(512, group, layout)["stream"]
            puts = sum(v for k, v in stream.items() if k.startswith("put "))
            deletes = sum(v for k, v in stream.items() if k.startswith("del "))
            cells.append(f"{layout}, groups of {group}: {puts:.2f} puts and {deletes:.2f} deletes")
    return (
        "\nLMDB writes per consumed experience of the stream (`bench_writes.py`'s stream stage, batches "
        "of 64): " + "; ".join(cells) + ".\n"
    )


def profile_shares(profile: Path, cases: list[Case]) -> str:
    """The stages of the profiled drains (py-spy, native frames), as shares of the busy samples."""
    heading = (
        "Where the server's busy samples went over the last round's drains (`--profile`, py-spy at 250 Hz, "
        "native frames; a thread waiting in fsync counts as busy; shares move by tens of points from run to run):"
    )
    lines = ["", heading, ""]
    lines += ["| stage | " + " | ".join(f"{case.shape}, groups of {case.group}" for case in cases) + " |"]
    lines += ["| --- | " + " | ".join("---:" for _ in cases) + " |"]
    shares = {}
    for case in cases:
        found = busy_samples(Path(f"{profile}.{case.name}"), STAGES)
        busy = sum(found.values())
        shares[case] = {stage: count / busy for stage, count in found.items()}
    for stage in [name for name, _ in STAGES] + ["other"]:
        lines.append(f"| {stage} | " + " | ".join(f"{shares[case].get(stage, 0.0):.0%}" for case in cases) + " |")
    return "\n".join(lines) + "\n"


def _uptime() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="an earlier tree of expbuf to measure side by side")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--experiences", type=int, default=16384, help="8 KB experiences per drain; a 40 KB drain holds their bytes"
    )
    parser.add_argument("--shape", default="8k", help="experience sizes, comma-separated: 8k, 40k")
    parser.add_argument("--groups", default="1,8", help="group sizes, comma-separated (each divides 64)")
    parser.add_argument("--cycles", type=int, default=3, help="fills and drains of each case per server")
    parser.add_argument(
        "--layouts", default="records", help="this tree's storage layouts, comma-separated: records, rows"
    )
    parser.add_argument("--profile", type=Path, help="py-spy the last round's server of this tree; its stages here")
    parser.add_argument(
        "--threads", action="store_true", help="the drains' server CPU by thread too: writer, RPC, gRPC's (py-spy dump)"
    )
    parser.add_argument("--out", help="write the section into this RESULTS.md")
    args = parser.parse_args()
    groups = [int(group) for group in args.groups.split(",")]
    cases = [Case(shape, group) for shape in args.shape.split(",") for group in groups]
    for case in cases:
        if case.shape not in PER_PUSH or PER_PUSH[case.shape] % case.group or not case.count(args.experiences):
            parser.error(f"no drain of {case.shape} in groups of {case.group} from {args.experiences} experiences")
    layouts = args.layouts.split(",")
    if set(layouts) - {"records", "rows"} or (args.before and len(layouts) > 1):
        parser.error("--layouts takes records and rows, and one of them with --before")
    start = _uptime()
    label = "after" if args.before else "now"
    servers: list[tuple[Path | None, str, str]] = [(None, layout, layout) for layout in layouts]
    if args.before:
        servers = [(args.before.resolve(), layouts[0], "before"), (None, layouts[0], label)]
    elif len(layouts) == 1:
        servers = [(None, layouts[0], label)]
    runs: dict[str, list[dict[Case, Any]]] = {name: [] for _, _, name in servers}
    for round_ in range(args.rounds):
        for tree, layout, name in servers[round_ % 2 :] + servers[: round_ % 2]:
            spy = args.profile if tree is None and args.profile and round_ == args.rounds - 1 else None
            runs[name].append(one_server(tree, cases, args.experiences, args.cycles, spy, layout, args.threads))
        print(round_, {t: {c.name: v for c, v in r[-1].items()} for t, r in runs.items()}, file=sys.stderr)
    command = "python bench/bench_consume.py" + (" --before DIR" if args.before else "")
    command += f" --rounds {args.rounds} --experiences {args.experiences} --cycles {args.cycles}"
    command += f" --shape {args.shape} --groups {args.groups}" + (
        f" --layouts {args.layouts}" if layouts != ["records"] else ""
    )
    section = report(command, cases, runs, (start, _uptime()), args.cycles)
    if args.threads:
        section += by_thread(cases, runs)
    section += writes_per_experience(groups, layouts)
    if args.profile:
        section += profile_shares(args.profile, cases)
    print(section)
    if args.out:
        write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
