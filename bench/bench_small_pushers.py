"""Many rollout workers, each pushing one experience at a time (an asynchronous agent's; GRPO's workers,
each pushing its own runs of a task), into this tree's server beside another tree's, side by side in
one run: what storing small pushes that wait side by side as one push buys (issue 64;
server/store/services/joined_pushes.py).

    cp -r --reflink=auto . /tmp/before && git -C /tmp/before checkout -q REV   (its compiled codec beside it)
    .venv/bin/python bench/bench_small_pushers.py --before /tmp/before [--pushers 64] [--experiences 4096]
        [--rounds 3] [--out bench/RESULTS.md]

Each server is an `expbuf serve` on loopback on a fresh directory (the other tree's through a package
of links, as bench_push_before.py starts it). Each round, for each server in turn (alternating which
goes first), a table of groups of 8 runs of a task (estimator grpo: a group's advantages computed as
its last run is stored) takes --experiences experiences of 8 KB (random int32[1024] tokens and
float32[1023] log-probs, bench_reverb's shape) pushed one a push by --pushers workers (threads spread
over 4 client processes, so the clients' own encoding and gRPC are not held by one interpreter),
each push durable before the worker's next, the runs of a task from different workers; then one
worker pushes the same experiences 256 a push (whole groups) into a table of its own. Experiences a
second and the server's CPU µs an experience (the server's process and its ingest processes, from
/proc), medians of the rounds. Then the store alone, each tree's in a process of its own: the same
experiences into a `Store` (groups of 8, no estimator) from --pushers threads, one a push, and the
CPU its writer thread spends an experience (`time.thread_time` around each batch it runs).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_advantages import tree_cpu_seconds  # noqa: E402
from bench_push_before import package, side_by_side  # noqa: E402
from results import publish  # noqa: E402

HEADING = "## Many workers each pushing one experience at a time, stored side by side as one push (issue 64)"
GROUP = 8
WHOLE = 256  # a whole push's experiences
CLIENTS = 4  # client processes
_MADE: dict[tuple[int, int], bytes] = {}  # a client process's payloads, made once


def payload(tag: int, index: int) -> bytes:
    """Experience `index` of a round's (`tag`) as a push of its own: run index % GROUP of task
    index // GROUP, 8 KB, its reward the run's parity (a group's rewards differ)."""
    import torch

    from expbuf.client import EID, Experience, trxp

    found = _MADE.get((tag, index))
    if found is None:
        gen = torch.Generator().manual_seed(index)
        made = Experience(
            eid=EID(batch=tag, task=index // GROUP, run=index % GROUP),
            tokens=torch.randint(0, 150_000, (1024,), dtype=torch.int32, generator=gen),
            prompt_length=1,
            logprobs=torch.randn(1023, generator=gen),
            reward=float(index % 2),
        )
        found = _MADE[(tag, index)] = trxp.encode([made])
    return found


def push_share(target: str, table: str, tag: int, workers: list[list[int]]) -> float:
    """In a client process: each worker (a thread, a channel of its own) pushes its experiences one a
    push; the seconds from the first push to the last reply."""
    from expbuf.client import BufferClient

    payloads = [[payload(tag, index) for index in indices] for indices in workers]
    clients = [BufferClient(target, timeout=300) for _ in workers]
    for client in clients:
        client.create_table(table, estimator="grpo", group_by="task", group_size=GROUP, exist_ok=True)
    start = threading.Barrier(len(workers) + 1)

    def work(client: object, mine: list[bytes]) -> None:
        start.wait()
        for one in mine:
            client.push(one, table=table)  # type: ignore[attr-defined]

    threads = [threading.Thread(target=work, args=pair) for pair in zip(clients, payloads, strict=True)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    took = time.perf_counter() - began
    for client in clients:
        client.close()
    return took


def push_whole(target: str, table: str, tag: int, count: int) -> None:
    """In a client process: the same experiences, WHOLE a push (whole groups), into `table`."""
    from expbuf.client import BufferClient, trxp

    with BufferClient(target, timeout=300) as client:
        client.create_table(table, estimator="grpo", group_by="task", group_size=GROUP, exist_ok=True)
        for at in range(0, count, WHOLE):
            items = [item for index in range(at, min(at + WHOLE, count)) for item in trxp.decode(payload(tag, index))]
            client.push(trxp.encode(items), table=table)


def one_round(
    pool: concurrent.futures.ProcessPoolExecutor, target: str, pid: int, tag: int, pushers: int, count: int
) -> dict[str, tuple[float, float]]:
    """One server's round: the pushers' exp/s and server µs an experience, then the whole pushes'."""
    workers = [list(range(worker, count, pushers)) for worker in range(pushers)]
    shares = [workers[at::CLIENTS] for at in range(CLIENTS)]
    figures = {}
    cpu, began = tree_cpu_seconds(pid), time.perf_counter()
    list(pool.map(push_share, *zip(*[(target, f"one-{tag}", tag, share) for share in shares], strict=True)))
    wall, cpu = time.perf_counter() - began, tree_cpu_seconds(pid) - cpu
    figures["one a push"] = (count / wall, cpu / count * 1e6)
    cpu, began = tree_cpu_seconds(pid), time.perf_counter()
    pool.submit(push_whole, target, f"whole-{tag}", tag, count).result()
    wall, cpu = time.perf_counter() - began, tree_cpu_seconds(pid) - cpu
    figures[f"{WHOLE} a push"] = (count / wall, cpu / count * 1e6)
    return figures


def store_child(pushers: int, count: int) -> None:
    """In a process of its own (the tree under test first on its path): --pushers threads push the
    experiences one a push into a Store; prints experiences a second and the writer's CPU µs an
    experience."""
    import dataclasses
    import json

    from expbuf.client import trxp
    from expbuf.server.store import Entry, Store
    from expbuf.server.store.schema.table_config import TableConfig

    try:
        from expbuf.server.store.disk.environment.writer import Writer
    except ImportError:  # a tree before the writer had a class of its own (--before)
        from expbuf.server.store.disk.environment import Environment as Writer  # type: ignore[assignment]

    spent = [0.0]
    apply = Writer._apply

    def timed(self: object, *args: object, **kwargs: object) -> object:
        began = time.thread_time()
        try:
            return apply(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent[0] += time.thread_time() - began

    Writer._apply = timed  # type: ignore[method-assign]
    made = [Entry.of(item) for index in range(count) for item in trxp.parse(payload(0, index))]
    config = TableConfig.of(name="t", estimator="none", group_by="task", group_size=GROUP, device="cpu")
    config = dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout="rows"))
    with tempfile.TemporaryDirectory() as data, Store(Path(data), map_size=4 << 30) as store:
        store.create_table(config)

        def push(mine: list[Entry]) -> None:
            for one in mine:
                store.put_entries("t", [one])

        threads = [threading.Thread(target=push, args=(made[at::pushers],)) for at in range(pushers)]
        spent[0], began = 0.0, time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
    print(json.dumps([count / wall, spent[0] / count * 1e6]))


def measure_store(before: Path, rounds: int, pushers: int, count: int) -> dict[tuple, list]:
    """Each tree's store alone, in a process of its own a round, alternating which goes first."""
    import json
    import subprocess

    found: dict[tuple, list] = {}
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        envs = {"before": {**os.environ, "PYTHONPATH": str(package(before, Path(tmp) / "before"))}, "after": None}
        for r in range(rounds):
            for side in ("before", "after") if r % 2 else ("after", "before"):
                argv = [sys.executable, __file__, "--store-child", str(pushers), str(count)]
                out = subprocess.run(argv, capture_output=True, text=True, env=envs[side], check=True).stdout
                found.setdefault((side, "store"), []).append(tuple(json.loads(out.splitlines()[-1])))
                print(r, side, found[(side, "store")][-1], file=sys.stderr, flush=True)
    return found


def measure(targets: dict[str, tuple[str, int]], rounds: int, pushers: int, count: int) -> dict[tuple, list]:
    found: dict[tuple, list] = {}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(CLIENTS, mp_context=context) as pool:
        for r in range(-1, rounds):  # round -1 warms both servers and the clients' payloads
            for side in ("before", "after") if r % 2 else ("after", "before"):
                target, pid = targets[side]
                figures = one_round(pool, target, pid, r + 1, pushers, count)
                print(r, side, figures, file=sys.stderr, flush=True)
                if r >= 0:
                    for way, pair in figures.items():
                        found.setdefault((side, way), []).append(pair)
    return found


def report(command: str, load: str, found: dict[tuple, list], pushers: int) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"Loopback, {os.cpu_count()} cores shared by both servers and the clients: load average {load} at the "
        f"start (uptime). {pushers} workers each pushing one 8 KB experience a push, durable, into a table of "
        f"groups of {GROUP} (estimator grpo), then the same experiences {WHOLE} a push; medians of the rounds.",
        "",
        "| pushes | before exp/s | after exp/s | after / before | server µs an experience, before / after |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for way in ("one a push", f"{WHOLE} a push"):
        lines.append(_row(way, found[("before", way)], found[("after", way)]))
    lines += [
        "",
        f"The store alone (a `Store` in a process of its own a round, no gRPC): {pushers} threads each pushing one "
        f"experience a push, groups of {GROUP}, no estimator; the writer thread's CPU µs an experience.",
        "",
        "| pushes | before exp/s | after exp/s | after / before | writer µs an experience, before / after |",
        "| --- | ---: | ---: | ---: | ---: |",
        _row("one a push", found[("before", "store")], found[("after", "store")]),
        "",
    ]
    return "\n".join(lines)


def _row(way: str, before: list, after: list) -> str:
    rb, ra = (statistics.median(x[0] for x in side) for side in (before, after))
    cb, ca = (statistics.median(x[1] for x in side) for side in (before, after))
    return f"| {way} | {rb:,.0f} | {ra:,.0f} | **{ra / rb:.2f}** | {cb:.1f} / {ca:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", help="another source tree of expbuf (required)")
    parser.add_argument("--pushers", type=int, default=64)
    parser.add_argument("--experiences", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--note", default="", help="a line on what the before tree lacks, for the section")
    parser.add_argument("--store-child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.store_child:
        store_child(*args.store_child)
        return
    if not args.before:
        parser.error("--before is required")
    command = (
        f"python bench/bench_small_pushers.py --before BEFORE --pushers {args.pushers} "
        f"--experiences {args.experiences} --rounds {args.rounds}"
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    with side_by_side(Path(args.before)) as targets:
        found = measure(targets, args.rounds, args.pushers, args.experiences)
    found |= measure_store(Path(args.before).resolve(), args.rounds, args.pushers, args.experiences)
    publish(
        report(command, load, found, args.pushers) + (f"{args.note}\n" if args.note else ""), HEADING, Path(args.out)
    )


if __name__ == "__main__":
    main()
