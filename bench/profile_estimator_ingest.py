"""Where ingest with an estimator spends more than ingest without one, from sampling profiles.

    pip install py-spy   # into any environment; it attaches to the server from outside
    .venv/bin/python bench/profile_estimator_ingest.py [--py-spy PATH] [--payloads 48] [--rounds 2]

bench_advantages.py's ingest load (8 pushers, payloads of 64 x 40 KB experiences of 4,000
response tokens in groups of 8, durable acks) pushed into one table with estimator grpo and one
with none, on one server, alternating, while py-spy samples every thread of the `expbuf serve`
process at 250 Hz (native frames included, idle ones left out) from the first push until every
group is ready. Each busy sample goes to the first stage found on its stack. The figures are
busy samples per 1,000 experiences, so the two tables' costs compare stage by stage.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import PER_PAYLOAD, PUSHERS, Proc, make_payloads  # noqa: E402
from profile_push import STAGES as PUSH_STAGES  # noqa: E402
from profile_push import busy_samples  # noqa: E402

from expbuf.client import BufferClient  # noqa: E402

# (stage, a function name that puts a sample in it), most specific first: the advantages a
# push computes itself, the advantage worker's stages, then the push's.
STAGES = (
    ("advantages: computed by the push, before its transaction (compute_ahead)", "compute_ahead ("),
    ("advantages: computed or stored in the push's transaction (compute_in_push)", "compute_in_push ("),
    ("advantages: store them (records rewritten, groups made ready)", "finish_compute ("),
    ("advantages: read completed groups (compute_backlog)", "Store.compute_backlog "),
    ("advantages: compute (estimator, shaping, hand-off)", "AdvantageWorker."),
    *PUSH_STAGES,
)


def profile(py_spy: str, server: Proc, table: str, payloads: list[bytes], out: Path) -> tuple[float, dict[str, int]]:
    """Push `payloads` into `table` under py-spy until every group is ready: (seconds, busy samples by stage)."""
    spy = subprocess.Popen(
        [py_spy, "record", "-p", str(server.proc.pid), "-r", "250", "--native", "--threads", "-f", "raw",
         "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(1.0)  # py-spy attached
    shares = [payloads[i::PUSHERS] for i in range(PUSHERS)]

    def push(share: list[bytes]) -> None:
        with BufferClient(server.target, timeout=300) as client:
            for payload in share:
                client.push(payload, table=table)

    start = time.perf_counter()
    threads = [threading.Thread(target=push, args=(share,)) for share in shares]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with BufferClient(server.target, timeout=60) as client:
        while client.stats(table)[table].ready < len(payloads) * PER_PAYLOAD:
            time.sleep(0.002)
    seconds = time.perf_counter() - start
    spy.send_signal(signal.SIGINT)
    _, err = spy.communicate(timeout=60)
    if not out.exists():
        sys.exit(f"py-spy failed: {err.strip()}")
    return seconds, dict(busy_samples(out, STAGES))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--payloads", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    payloads = make_payloads(args.payloads)  # the same in every table
    totals = {name: collections.Counter() for name in ("grpo", "none")}
    seconds = {name: 0.0 for name in totals}
    experiences = args.payloads * PER_PAYLOAD * args.rounds
    with tempfile.TemporaryDirectory(prefix="expbuf-profile-") as data:
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1")
        try:
            for r in range(args.rounds):
                for estimator in ("grpo", "none") if r % 2 == 0 else ("none", "grpo"):
                    table = f"{estimator}{r}"
                    with BufferClient(server.target) as client:
                        client.create_table(table, estimator=estimator)
                    took, counts = profile(args.py_spy, server, table, payloads, Path(data) / f"{table}.txt")
                    seconds[estimator] += took
                    totals[estimator].update(counts)
                    with BufferClient(server.target) as client:
                        client.drop_table(table)
        finally:
            server.stop()
    mb = experiences * len(payloads[0]) / PER_PAYLOAD / 1e6
    print(f"ingest under py-spy, {experiences} experiences per table: ", end="")
    print(", ".join(f"{name} {mb / seconds[name]:.0f} MB/s" for name in totals))
    print("| stage | grpo: busy samples per 1,000 experiences | none | grpo - none |")
    print("| --- | --- | --- | --- |")
    per = {name: {stage: count * 1000 / experiences for stage, count in totals[name].items()} for name in totals}
    stages = sorted(set(per["grpo"]) | set(per["none"]), key=lambda s: -per["grpo"].get(s, 0))
    for stage in [*stages, "all"]:
        grpo = sum(per["grpo"].values()) if stage == "all" else per["grpo"].get(stage, 0.0)
        none = sum(per["none"].values()) if stage == "all" else per["none"].get(stage, 0.0)
        print(f"| {stage} | {grpo:.1f} | {none:.1f} | {grpo - none:+.1f} |")


if __name__ == "__main__":
    main()
