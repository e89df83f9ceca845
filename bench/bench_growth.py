"""How one table grows: push and sample latency, selection by order, restart, RSS and bytes per
experience at 10 k, 1 M and 10 M experiences; and (--restart) a restart of a large table with
default settings, the scrub and the first build of a new order's index.

    .venv/bin/python bench/bench_growth.py [--sizes 10000,1000000,10000000] [--out bench/RESULTS.md]
    .venv/bin/python bench/bench_growth.py --restart --shape small --sizes 10000000 --data DIR [--out ...]

One `expbuf serve` child with a `grpo` table of groups of 4 small experiences (7 tokens,
4 response tokens, a random priority, model version = group // 1000). Pushers fill it to each
size in pushes of 256 groups; at each size the bench measures, with the fill stopped:
- push: p50/p90 of 200 pushes of one group;
- sample, per order (fifo, lifo, uniform, priority) and for `min_model_version` = the newest
  version: p50/p90 of 50 one-group Sample streams (window 1, consume), which is the selection
  plus one round trip; a stream of its own per sample, so nothing is read ahead;
- restart: SIGTERM, then a new server until it listens, with the full open check and with
  `check_at_open = "quick"`;
- the server's RSS after the restart and after the measurements;
- the data file's allocated bytes per stored experience.

--restart (issue 29) fills DIR once (`small`: the experiences above; `8k`: 1,024 tokens each,
about 8 KB; kept and topped up by later runs) and, with its server stopped each time, measures:
- restart to the first served sample with default settings (quick open, the scrub at its
  default bound): from the new `expbuf serve` to the first one-group batch received, and the
  server's RSS then;
- push and sample p50/p99 (200 one-group pushes, 100 one-group Sample streams) while that
  start's scrub pass runs, then with no scrub (`scrub_mb_per_second = 0`);
- the scrub's pass at the default bound, and with no bound: MB/s of payload, and RSS after it;
- the first priority request on a table that keeps no priority index (a forgotten one is
  dropped offline first): its wait, the server's RSS after it, and the waits of one-group
  pushes made meanwhile (p50, p99, max);
- with --full, a restart with `check_at_open = "full"` to its first sample, for comparison.
With --before TREE, --restart fills a directory of each tree under DIR instead (`before`, `now`) and
measures only their restarts to the first sample, with default settings and with the full open
check, three rounds of the two in turn.

--first-uniform (issue 39) fills DIR the same way to `--groups` ready groups of 4 small experiences
(kept between runs), makes the table as a release that kept the priority, uniform and version
indexes only from the first request in their order left it (forget_index), and measures, for this
tree and for `--before TREE` (another source tree, run as the expbuf package), one after the other:
- `at once`: a uniform request made as soon as the server listens; from the spawn of `expbuf
  serve` to the first one-group batch received, the request's own wait, and when every build
  ended (this tree builds the indexes a table lacks in the background from the open; the tree
  before builds the uniform slots on the request's path);
- `later`: the same request made once this tree's builds are done (the tree before: as long after
  its open): its wait;
- in both, the waits of one-group pushes made one after the other all along (from the first one's
  answer, which waits for torch to load): those made while a build ran, and those of the 3 s after
  it (p50 / p99 / max ms).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import lmdb  # noqa: E402
from bench_consume import package  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient, ScrubInfo, trxp  # noqa: E402
from expbuf.server.store.core.ordering import ready as core_ready  # noqa: E402
from expbuf.server.store.disk import layout  # noqa: E402

from helpers import ServerProcess, make_experience, scrape  # noqa: E402

HEADING = "## Growth of one table to 10 M experiences (issue 22)"
TABLE = "growth"
GROUP = 4
PER_PUSH = 256
ORDERS = ("fifo", "lifo", "uniform", "priority")
LAZY = ("prio", "slots", "slotof", "byver")  # the databases of the built-in lazy indexes
TEMPLATE = trxp.from_experience(make_experience(0, 0, 0))


def groups(first: int, count: int, template: trxp.RawItem = TEMPLATE) -> bytes:
    """TRXP bytes of groups first..first+count-1, each GROUP runs of its own task."""
    rng = random.Random(first)
    items = []
    for g in range(first, first + count):
        priority = rng.random()
        for run in range(GROUP):
            meta = copy.deepcopy(template.meta)
            meta["eid"].update(batch=g, task=g, run=run, suffix=f"r{run}")
            meta["info"] = {"model_version": g // 1000, "priority": priority}
            meta["reward"] = float(run)
            items.append(trxp.RawItem(meta, template.tensors))
    return trxp.build(items)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def quantiles(values: list[float], high: float = 0.9) -> str:
    ms = sorted(v * 1000 for v in values)
    return f"{statistics.median(ms):.1f} / {ms[min(len(ms) - 1, int(len(ms) * high))]:.1f}"


class Growth:
    """The server, its data directory and the next group number to push."""

    def __init__(self, data: str, config: Path) -> None:
        self.data = data
        self.config = config
        self.next_group = 0
        self.server = self.start("full")

    def start(self, check: str) -> ServerProcess:
        text = self.config.read_text().replace("CHECK", check)
        self.config.with_name(f"{check}.toml").write_text(text)
        # a full open check of 10 M experiences reads every byte of the data file
        return ServerProcess(
            self.data, "--config", str(self.config.with_name(f"{check}.toml")), start_seconds=1800, warm=False
        )

    def fill(self, groups_total: int, pushers: int = 2) -> float:
        """Push groups until the table holds groups_total; returns experiences per second."""
        lock = threading.Lock()
        start_group, started = self.next_group, time.perf_counter()

        def pusher() -> None:
            with BufferClient(self.server.target, timeout=600) as client:
                while True:
                    with lock:
                        first = self.next_group
                        count = min(PER_PUSH, groups_total - first)
                        self.next_group += max(count, 0)
                    if count <= 0:
                        return
                    client.push(groups(first, count), TABLE)

        threads = [threading.Thread(target=pusher) for _ in range(pushers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return (self.next_group - start_group) * GROUP / max(time.perf_counter() - started, 1e-9)

    def measure(self, client: BufferClient) -> dict[str, str]:
        row: dict[str, str] = {}
        pushes = []
        for _ in range(200):
            payload = groups(self.next_group, 1)
            self.next_group += 1
            begin = time.perf_counter()
            client.push(payload, TABLE)
            pushes.append(time.perf_counter() - begin)
        row["push"] = quantiles(pushes)
        newest = (self.next_group - 1) // 1000
        for name, spec in [(order, {"order": order}) for order in ORDERS] + [
            ("min_version", {"order": "fifo", "min_model_version": newest})
        ]:
            times = []
            for _ in range(50):
                begin = time.perf_counter()
                batches = list(
                    client.sample(TABLE, num_groups=1, delivery="consume", max_batches=1, window=1, timeout=30, **spec)
                )
                times.append(time.perf_counter() - begin)
                assert len(batches) == 1 and len(batches[0].experiences) == GROUP
            row[name] = quantiles(times)
        row["rss_after"] = f"{rss_mib(self.server.proc.pid):.0f}"
        return row

    def restart(self, check: str) -> float:
        self.server.proc.terminate()
        self.server.proc.wait(600)
        begin = time.perf_counter()
        self.server = self.start(check)
        return time.perf_counter() - begin

    def data_bytes(self) -> int:
        return allocated_bytes(Path(self.data))


def allocated_bytes(data: Path) -> int:
    """The bytes a data directory's files take on disk."""
    return sum(p.stat().st_blocks * 512 for p in data.rglob("*") if p.is_file())


def run(sizes: list[int]) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("EXPBUF_BENCH_DIR")) as tmp:
        config = Path(tmp) / "growth.toml"
        config.write_text(
            f'check_at_open = "CHECK"\nscrub_mb_per_second = 0\n'
            f'[[tables]]\nname = "{TABLE}"\ngroup_size = {GROUP}\nestimator = "grpo"\n'
            "tombstone_seconds = 0\n"
        )
        growth = Growth(f"{tmp}/data", config)
        try:
            for size in sizes:
                rate = growth.fill(size // GROUP)
                stored = growth.next_group * GROUP
                per_exp = growth.data_bytes() / stored
                full = growth.restart("full")
                rss_open = rss_mib(growth.server.proc.pid)
                quick = growth.restart("quick")
                with BufferClient(growth.server.target, timeout=120) as client:
                    row = growth.measure(client)
                rows.append(
                    f"| {stored:,} | {rate:,.0f} | {row['push']} | {row['fifo']} | {row['lifo']} | {row['uniform']} "
                    f"| {row['priority']} | {row['min_version']} | {full:.1f} / {quick:.1f} | {rss_open:.0f} / "
                    f"{row['rss_after']} | {per_exp:,.0f} |"
                )
                print(rows[-1], flush=True)
        finally:
            growth.server.proc.terminate()
            growth.server.proc.wait(600)
    return rows


SHAPES: dict[str, dict[str, int]] = {"small": {}, "8k": {"prompt": 256, "response": 768}}


class Restarts:
    """A data directory kept between runs (`--data`), its server started with settings of the
    run's own, and the next group number to push."""

    def __init__(self, data: Path, shape: str, tree: Path | None = None) -> None:
        self.data, self.template = data, trxp.from_experience(make_experience(0, 0, 0, **SHAPES[shape]))
        self.per_push = PER_PUSH if shape == "small" else 64
        self.configs = data.parent / f"{data.name}-configs"
        self.configs.mkdir(parents=True, exist_ok=True)
        self.next_group = 0
        # the servers of another tree (None: this one), run as the expbuf package
        self.env = None if tree is None else {"PYTHONPATH": str(package(tree, Path(tempfile.mkdtemp())))}

    def start(self, name: str, **settings: object) -> tuple[ServerProcess, float]:
        """A server with these settings (TOML values) and the growth table; it and when it was spawned."""
        lines = [f"{key} = {value!r}".replace("'", '"') for key, value in settings.items()]
        lines += [f'[[tables]]\nname = "{TABLE}"\ngroup_size = {GROUP}\nestimator = "grpo"\ntombstone_seconds = 0']
        config = self.configs / f"{name}.toml"
        config.write_text("\n".join(lines) + "\n")
        begin = time.perf_counter()
        server = ServerProcess(str(self.data), "--config", str(config), env=self.env, start_seconds=3600, warm=False)
        with BufferClient(server.target, timeout=600) as client:
            self.next_group = max(self.next_group, client.stats(TABLE)[TABLE].pushed // GROUP)
        return server, begin

    def top_up(self, experiences: int) -> float:
        """A server with no scrub fills the table until it was pushed `experiences`, then stops;
        experiences per second (0: none pushed)."""
        server, _ = self.start("fill", scrub_mb_per_second=0)
        try:
            return self.fill(server, experiences // GROUP)
        finally:
            stopped(server)

    def fill(self, server: ServerProcess, total_groups: int) -> float:
        """Push groups until the table was pushed total_groups; experiences per second (0: none pushed)."""
        lock, start_group, started = threading.Lock(), self.next_group, time.perf_counter()

        def pusher() -> None:
            with BufferClient(server.target, timeout=600) as client:
                while True:
                    with lock:
                        first, count = self.next_group, min(self.per_push, total_groups - self.next_group)
                        self.next_group += max(count, 0)
                    if count <= 0:
                        return
                    client.push(groups(first, count, self.template), TABLE)

        threads = [threading.Thread(target=pusher) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        pushed = (self.next_group - start_group) * GROUP
        return pushed / max(time.perf_counter() - started, 1e-9) if pushed else 0.0

    def push_one(self, client: BufferClient) -> float:
        payload = groups(self.next_group, 1, self.template)
        self.next_group += 1
        begin = time.perf_counter()
        client.push(payload, TABLE)
        return time.perf_counter() - begin

    def latencies(self, server: ServerProcess) -> tuple[list[float], list[float]]:
        """Seconds of 200 one-group pushes, and of 100 one-group Sample streams."""
        with BufferClient(server.target, timeout=120) as client:
            pushes = [self.push_one(client) for _ in range(200)]
            samples = []
            for _ in range(100):
                begin = time.perf_counter()
                batches = list(client.sample(TABLE, num_groups=1, delivery="consume", max_batches=1, window=1))
                samples.append(time.perf_counter() - begin)
                assert len(batches) == 1
        return pushes, samples

    def build(self, server: ServerProcess) -> dict[str, str]:
        """The first priority request, while one client pushes one group at a time."""
        done, waits = threading.Event(), []

        def pusher() -> None:
            with BufferClient(server.target, timeout=600) as client:
                while not done.is_set():
                    waits.append(self.push_one(client))

        with BufferClient(server.target, timeout=600) as client:
            ready = client.stats(TABLE)[TABLE].groups_ready
            thread = threading.Thread(target=pusher)
            thread.start()
            time.sleep(1.0)  # the pusher's own pace first
            before = len(waits)
            begin = time.perf_counter()
            next(client.sample(TABLE, num_groups=1, order="priority", delivery="consume", max_batches=1, timeout=3600))
            wait = time.perf_counter() - begin
            rss = rss_mib(server.proc.pid)
            during = waits[before:]
            done.set()
            thread.join()
        ms = sorted(w * 1000 for w in during)
        return {
            "ready": f"{ready:,}",
            "wait": f"{wait:.1f}",
            "rss": f"{rss:.0f}",
            "pushes": f"{len(ms)}: {statistics.median(ms):.1f} / {ms[int(len(ms) * 0.99)]:.1f} / {ms[-1]:.0f}",
        }


def scrub_of(server: ServerProcess) -> ScrubInfo:
    with BufferClient(server.target, timeout=60) as client:
        return client.server_info().scrub


def scrub_pass(server: ServerProcess, timeout: float = 7200) -> ScrubInfo:
    """Wait until the server completes a scrub pass; its ScrubInfo then."""
    deadline = time.monotonic() + timeout
    while (scrub := scrub_of(server)).passes < 1:
        assert time.monotonic() < deadline, "no scrub pass in time"
        time.sleep(1.0)
    return scrub


def forget_index(data: Path, *names: str) -> None:
    """Drop lazy indexes the growth table keeps (their databases' marks and rows, in transactions of
    100 k), as if an earlier release had made the table and no request had read them: the next run
    measures their first builds again."""
    size = (data / "data.mdb").stat().st_size
    env = lmdb.open(str(data), max_dbs=layout.MAX_DBS, readahead=False, map_size=2 * size + (1 << 30))
    try:
        with env.begin(write=True) as txn:
            dbs = {db: env.open_db(db.encode(), txn=txn) for db in ("tables", "counters", *names)}
            prefix = layout.table_prefix(json.loads(txn.get(TABLE.encode(), db=dbs["tables"]))["id"])
            used = core_ready.in_use(txn, dbs, prefix)
            core_ready.mark_in_use(txn, dbs, prefix, (set(LAZY) if used is None else used) - set(names))
            txn.delete(prefix + core_ready.BUILDING, db=dbs["counters"])
        for name in names:
            deleted = 1
            while deleted:
                deleted = 0
                with env.begin(write=True) as txn, txn.cursor(db=dbs[name]) as cur:
                    found = cur.set_range(prefix)
                    while found and deleted < 100_000 and cur.key().startswith(prefix):
                        found = cur.delete()
                        deleted += 1
    finally:
        env.close()


def builds_under_way(server: ServerProcess) -> bool:
    """Whether the server is building an index in the background (its expbuf_index_build_* metrics;
    a tree without them builds none)."""
    return any(name == "expbuf_index_build_ready_groups" for name, _ in scrape(server.metrics_port))


@dataclass(frozen=True)
class UniformRun:
    """One run of --first-uniform: seconds from the spawn of `expbuf serve`, and push waits."""

    ready: int  # the table's ready groups at the open (the pushes of earlier runs add to them)
    listening: float
    asked: float
    answered: float
    building: float  # when the builds began: at the open (this tree), or with the request (before)
    built: float  # when the last one ended
    during: list[float]  # the waits of the pushes made while a build ran
    after: list[float]  # and in the 3 s after


def first_uniform_run(data: Path, tree: Path | None, delay: float | None) -> UniformRun:
    """One server of a tree (None: this one) on the directory, its table's lazy indexes forgotten:
    a uniform request at once (`delay` None) or `delay` seconds after it listens (0: once its builds
    are done), while one client pushes one group at a time. Seconds, from the spawn."""
    step("forget the lazy indexes")
    forget_index(data, *LAZY)
    config = data.parent / f"{data.name}-configs" / "first-uniform.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f'scrub_mb_per_second = 0\n[[tables]]\nname = "{TABLE}"\ngroup_size = {GROUP}\nestimator = "grpo"\n'
        "tombstone_seconds = 0\n"
    )
    env = None
    if tree is not None:
        env = {"PYTHONPATH": str(package(tree, Path(tempfile.mkdtemp(prefix="expbuf-before-"))))}
    step(f"{tree or 'this tree'}: the first uniform request {'at once' if delay is None else 'later'}")
    spawned = time.perf_counter()
    server = ServerProcess(str(data), "--config", str(config), env=env, start_seconds=3600, warm=False)
    listening = time.perf_counter() - spawned
    runs = Restarts(data, "small")
    done, pushes = threading.Event(), list[tuple[float, float]]()
    with BufferClient(server.target, timeout=600) as client:
        stats = client.stats(TABLE)[TABLE]
    runs.next_group = stats.pushed // GROUP + 1

    def pusher() -> None:
        with BufferClient(server.target, timeout=600) as client:
            runs.push_one(client)  # not counted: it waits for torch to load (advantages/start.py)
            while not done.is_set():
                began = time.perf_counter() - spawned
                pushes.append((began, runs.push_one(client)))

    thread = threading.Thread(target=pusher)
    thread.start()
    built: float | None = None  # when the last build ended
    try:
        if delay == 0:
            while builds_under_way(server):
                time.sleep(0.2)
            built = time.perf_counter() - spawned
        elif delay is not None:
            time.sleep(max(0.0, spawned + listening + delay - time.perf_counter()))
        with BufferClient(server.target, timeout=3600) as client:
            asked = time.perf_counter() - spawned
            next(client.sample(TABLE, num_groups=1, order="uniform", delivery="consume", max_batches=1, timeout=3600))
            answered = time.perf_counter() - spawned
        if built is None and tree is None:
            while builds_under_way(server):
                time.sleep(0.2)
            built = time.perf_counter() - spawned
        if built is None:  # the tree before built the slots on the request's path
            built = answered
        time.sleep(3.0)
    finally:
        done.set()
        thread.join()
        stopped(server)
    for line in server.log:  # what an operator reads of the builds
        if "in the background" in line or " built, " in line:
            print(line.rstrip(), file=sys.stderr, flush=True)
    building = listening if tree is None else asked
    return UniformRun(
        stats.groups_ready,
        listening,
        asked,
        answered,
        building,
        built,
        during=[wait for began, wait in pushes if building <= began < built],
        after=[wait for began, wait in pushes if built <= began < built + 3.0],
    )


def ms3(values: list[float]) -> str:
    """Push waits: count, p50 / p99 / max in ms."""
    if not values:
        return "-"
    ms = sorted(v * 1000 for v in values)
    return f"{len(ms)}: {statistics.median(ms):.1f} / {ms[min(len(ms) - 1, int(len(ms) * 0.99))]:.1f} / {ms[-1]:.0f}"


def first_uniform_heading() -> str:
    return "## The first uniform request after an open: indexes built in the background (issue 39)"


def first_uniform_section(args: argparse.Namespace) -> str:
    """Fill (or top up) DIR, then the runs of each tree, side by side."""
    data, load = Path(args.data), os.getloadavg()[0]
    runs = Restarts(data, "small")
    step("fill")
    server, _ = runs.start("fill", scrub_mb_per_second=0)
    runs.fill(server, args.groups)
    stopped(server)
    trees: list[tuple[str, Path | None]] = [("before", Path(args.before).resolve()), ("after", None)]
    rows = []
    for name, tree in trees:
        run = first_uniform_run(data, tree, None)
        rows.append((name, "at once", run))
    later = first_uniform_run(data, None, 0)
    delay = later.asked - later.listening
    rows.append(("before", f"{delay:.0f} s after the open", first_uniform_run(data, trees[0][1], delay)))
    rows.append(("after", "once built", later))
    lines = [
        f"| {name} | {when} | {run.ready:,} | {run.listening:.1f} | {run.built - run.building:.1f} "
        f"| {run.answered - run.asked:.2f} | {run.answered:.1f} | {ms3(run.during)} | {ms3(run.after)} |"
        for name, when, run in rows
    ]
    return "\n".join(
        [
            first_uniform_heading(),
            "",
            f"Command: `.venv/bin/python bench/bench_growth.py --first-uniform --groups {args.groups} --data DIR "
            "--before TREE` (TREE: the main this tree branched from, `git archive`d, with this tree's compiled "
            "codec copied in)  ",
            f"Machine: {os.cpu_count()} CPU threads, shared; load {load:.1f} at the start and "
            f"{os.getloadavg()[0]:.1f} at the end. Ready groups of {GROUP} small experiences, the table as an "
            "earlier release left it: the ready order kept, no uniform, priority or version index. Default "
            "settings but the scrub (off). Seconds from the spawn of `expbuf serve`; a push is one group, one "
            "after the other all along; its waits as count: p50 / p99 / max ms.",
            "",
            "| tree | uniform request | ready groups | spawn to listening s | builds s | request's wait s "
            "| spawn to first uniform sample s | pushes while building | pushes the 3 s after |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *lines,
        ]
    )


def step(what: str) -> None:
    """A line on stderr as each measurement begins (a run takes many minutes), with the load."""
    print(f"{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}: {what}", file=sys.stderr, flush=True)


def p99_ratio(scrub: list[float], plain: list[float]) -> str:
    """How many times the p99 with a scrub running is the p99 without."""
    high = [sorted(values)[min(len(values) - 1, int(len(values) * 0.99))] for values in (scrub, plain)]
    return f"{high[0] / high[1]:.2f}"


def stopped(server: ServerProcess) -> None:
    server.proc.terminate()
    server.proc.wait(600)


def restart_row(data: Path, shape: str, size: int, full: bool) -> str:
    """One row of the restart table: fill (or top up) the directory, then each measurement."""
    runs = Restarts(data, shape)
    step("fill")
    rate = runs.top_up(size)
    stored = runs.next_group * GROUP
    file_gb = allocated_bytes(data) / 1e9
    step("forget the priority index")
    forget_index(data, "prio")
    step("restart with default settings")
    load = os.getloadavg()[0]
    server, begin = runs.start("default")  # every setting at its default
    with BufferClient(server.target, timeout=600) as client:
        next(client.sample(TABLE, num_groups=1, delivery="consume", max_batches=1, window=1, timeout=600))
    first = time.perf_counter() - begin
    rss_open = rss_mib(server.proc.pid)
    started_with = scrub_of(server).running
    step(f"first sample after {first:.2f} s, RSS {rss_open:.0f} MiB; latencies while the scrub runs")
    push_scrub, sample_scrub = runs.latencies(server)
    during = started_with and scrub_of(server).running  # else the "scrub" figures are partly without it
    step("the scrub's pass at the default bound")
    bound = scrub_pass(server)
    rss_pass = rss_mib(server.proc.pid)
    stopped(server)
    step("latencies with no scrub")
    server, _ = runs.start("no-scrub", scrub_mb_per_second=0)
    push_plain, sample_plain = runs.latencies(server)
    step("the first priority request")
    build = runs.build(server)
    stopped(server)
    step("an unbounded scrub pass")
    server, _ = runs.start("unbounded", scrub_mb_per_second=100000)
    free = scrub_pass(server)
    rss_free = rss_mib(server.proc.pid)
    stopped(server)
    full_cell = "-"
    if full:
        step("a restart with the full open check")
        seconds, rss = first_sample(runs, "full", check_at_open="full", scrub_mb_per_second=0)
        full_cell = f"{seconds:.1f} s, {rss:.0f} MiB"

    def rate_of(scrub: ScrubInfo) -> str:
        return f"{scrub.last_pass_bytes / 1e6 / max(scrub.last_pass_seconds, 1e-9):.1f}"

    row = (
        f"| {shape} | {stored:,} | {file_gb:.1f} | {'reused' if not rate else f'{rate:,.0f}'} "
        f"| {first:.2f} (load {load:.1f}) "
        f"| {rss_open:.0f} / {rss_pass:.0f} / {rss_free:.0f} | {quantiles(push_plain, 0.99)} "
        f"| {quantiles(push_scrub, 0.99)} (p99 x{p99_ratio(push_scrub, push_plain)}) | {quantiles(sample_plain, 0.99)} "
        f"| {quantiles(sample_scrub, 0.99)} (p99 x{p99_ratio(sample_scrub, sample_plain)})"
        f"{'' if during else ' (the pass ended meanwhile)'} "
        f"| {rate_of(bound)} ({bound.last_pass_bytes / 1e9:.1f} GB in {bound.last_pass_seconds:.0f} s) "
        f"/ {rate_of(free)} | {build['ready']}: {build['wait']} s, RSS {build['rss']} MiB; {build['pushes']} "
        f"| {full_cell} |"
    )
    print(row, flush=True)
    return row


def first_sample(runs: Restarts, name: str, **settings: object) -> tuple[float, float]:
    """A start of `runs`' server with these settings: seconds from its spawn to its first one-group
    batch received, and its RSS (MiB) then."""
    server, begin = runs.start(name, **settings)
    try:
        with BufferClient(server.target, timeout=600) as client:
            next(client.sample(TABLE, num_groups=1, delivery="consume", max_batches=1, window=1, timeout=600))
        return time.perf_counter() - begin, rss_mib(server.proc.pid)
    finally:
        stopped(server)


def restart_pair_section(args: argparse.Namespace) -> str:
    """--restart --before: a data directory of each tree filled to the size, then restarts of the
    two in turn (the first alternating), to the first sample: with default settings and with the full
    open check."""
    size, rounds = int(args.sizes.split(",")[-1]), 3
    trees = {"before": Path(args.before).resolve(), "now": None}
    runs = {name: Restarts(Path(args.data) / name, args.shape, tree) for name, tree in trees.items()}
    fills: dict[str, str] = {}
    for name, run in runs.items():
        step(f"fill {name}")
        rate = run.top_up(size)
        fills[name] = "reused" if not rate else f"{rate:,.0f}"
    load = os.getloadavg()[0]
    found: dict[str, dict[str, list[tuple[float, float]]]] = {name: {"quick": [], "full": []} for name in trees}
    for turn in range(rounds):
        for name in list(trees)[:: 1 if turn % 2 == 0 else -1]:
            step(f"round {turn}: {name}")
            found[name]["quick"].append(first_sample(runs[name], "default"))
            found[name]["full"].append(first_sample(runs[name], "full", check_at_open="full", scrub_mb_per_second=0))

    def cell(pairs: list[tuple[float, float]]) -> str:
        seconds, rss = statistics.median(s for s, _ in pairs), statistics.median(r for _, r in pairs)
        return f"{seconds:.2f} s ({', '.join(f'{s:.2f}' for s, _ in pairs)}), {rss:.0f} MiB"

    rows = []
    for name, run in runs.items():
        stored = run.next_group * GROUP
        data_gb = allocated_bytes(run.data) / 1e9
        rows.append(
            f"| {name} | {stored:,} | {data_gb:.1f} | {fills[name]} | {cell(found[name]['quick'])} "
            f"| {cell(found[name]['full'])} |"
        )
    return "\n".join(
        [
            restart_pair_heading(args.shape),
            "",
            f"Command: `.venv/bin/python bench/bench_growth.py --restart --shape {args.shape} --sizes {size} "
            f"--data DIR --before TREE`  ",
            f"Machine: {os.cpu_count()} CPU threads, shared; load {load:.1f} before the restarts and "
            f"{os.getloadavg()[0]:.1f} at the end. Each tree fills a directory of its own (its own format), then "
            f"{rounds} rounds restart each in turn, the first alternating: from the spawn of `expbuf serve` to its "
            "first one-group batch consumed, with default settings (a quick open, the scrub at its bound) and with "
            'the full open check (`check_at_open = "full"`); the median (the rounds) and the server\'s RSS then.',
            "",
            "| tree | stored | data GB | fill exp/s | restart to first sample, defaults | the same, full open check |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )


def restart_pair_heading(shape: str) -> str:
    return f"## Restart at 1 M experiences, this tree beside another: {shape} (issue 64)"


def restart_heading(shape: str) -> str:
    return f"## Restart at any size: {shape} experiences (issue 29)"


def restart_section(args: argparse.Namespace) -> str:
    load = os.getloadavg()[0]
    rows = [restart_row(Path(args.data), args.shape, int(size), args.full) for size in args.sizes.split(",")]
    return "\n".join(
        [
            restart_heading(args.shape),
            "",
            f"Command: `.venv/bin/python bench/bench_growth.py --restart --shape {args.shape} --sizes {args.sizes} "
            f"--data DIR{' --full' if args.full else ''}`  ",
            f"Machine: {os.cpu_count()} CPU threads, shared; load {load:.1f} at the start and "
            f"{os.getloadavg()[0]:.1f} at the end. Default settings "
            "but where a column says otherwise (a quick open, the scrub at 32 MB/s). Latencies in ms, p50 / p99; "
            "a sample is a one-group Sample stream.",
            "",
            "| shape | stored | data GB | fill exp/s | restart to first sample s | RSS MiB: open / after a "
            "pass at the bound / unbounded | push, no scrub | push, scrub running | sample, no scrub "
            "| sample, scrub running | scrub MB/s: at the bound / unbounded | first priority request: ready "
            "groups: wait, RSS after it; pushes meanwhile: count: p50 / p99 / max ms "
            "| full open check: to first sample, RSS |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000,10000000", help="table sizes to measure at, in experiences")
    parser.add_argument("--out", type=Path, help="write the table into this RESULTS.md")
    parser.add_argument("--restart", action="store_true", help="measure restarts, the scrub and index builds")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="small", help="--restart: the experiences' size")
    parser.add_argument("--data", help="--restart: the data directory, filled once and reused")
    parser.add_argument("--full", action="store_true", help="--restart: also a restart with the full open check")
    parser.add_argument("--first-uniform", action="store_true", help="the first uniform request after an open")
    parser.add_argument("--groups", type=int, default=1_003_520, help="--first-uniform: ready groups to fill to")
    parser.add_argument("--before", help="--first-uniform, --restart: the tree to measure beside this one")
    args = parser.parse_args()
    if args.first_uniform:
        if not (args.data and args.before):
            parser.error("--first-uniform needs --data DIR (filled once, reused) and --before TREE")
        section = first_uniform_section(args)
        print(section)
        if args.out:
            write_section(args.out, first_uniform_heading(), section)
        return
    if args.restart:
        if not args.data:
            parser.error("--restart needs --data DIR (filled once, reused by later runs)")
        section = restart_pair_section(args) if args.before else restart_section(args)
        print(section)
        if args.out:
            heading = restart_pair_heading if args.before else restart_heading
            write_section(args.out, heading(args.shape), section)
        return
    rows = run([int(s) for s in args.sizes.split(",")])
    body = "\n".join(
        [
            HEADING,
            "",
            f"`.venv/bin/python bench/bench_growth.py --sizes {args.sizes}`, {time.strftime('%Y-%m-%d')}, "
            f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end. Latencies are p50 / p90 in ms; "
            "a sample is a one-group Sample stream of its own (selection plus a round trip).",
            "",
            "| stored | fill exp/s | push | fifo | lifo | uniform | priority | min version | restart s full / quick "
            "| RSS MiB open / after | data bytes / exp |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(body)
    if args.out:
        write_section(args.out, HEADING, body)


if __name__ == "__main__":
    main()
