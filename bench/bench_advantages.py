"""Advantage benchmark: batched estimators against a per-group loop, ingest with grpo on, and
sampling with an estimator whose statistics are taken over the sampled batch.

    .venv/bin/python bench/bench_advantages.py [--experiences 100000] [--tokens 1000] [--out bench/RESULTS.md]

1. Estimator throughput on N experiences (groups of 8, `tokens` response tokens each):
   each batched estimator (segment sums, repeat_interleave) against a loop of its own
   formula over groups on the same data, producing token-level advantages or one value
   per experience; both timed alike (a warm-up, then the best of `--repeats`); on the
   CPU, and on CUDA when present.
2. Ingest: 8 pushers push the same workload into a table with grpo and one with no
   estimator (one server, alternating); throughput counts until every group is ready
   to sample, i.e. including the advantage computation.
3. Sample: the same payloads in tables with grpo, grpo over the batch's std (its batch stage
   runs on every sampled batch), reinforce++_baseline and no estimator, sampled whole (consume,
   8 groups per batch), alternating; each with full advantages in the payload (an older
   client's request) and compact ones (expbuf's clients), as bytes and decoded; throughput in
   experiences per second and CPU (server and client) per experience.

`--ingest-only` and `--sample-only` run one part alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_service import PUSHERS, Proc, make_payloads  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import BufferClient  # noqa: E402
from expbuf.client.rpc.sample_spec import SampleSpec  # noqa: E402
from expbuf.proto.v1 import buffer_pb2 as pb  # noqa: E402
from expbuf.server.advantages.worker import estimators as est  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig, estimator_args  # noqa: E402

GROUP = 8


def flat_batch(n: int, tokens: int, seed: int = 0) -> est.FlatBatch:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.full((n,), tokens, dtype=torch.int64)
    mask = torch.rand(n * tokens, generator=gen) < 0.9
    rewards = torch.randint(0, 2, (n,), generator=gen).double()
    token_rewards = torch.zeros(n, tokens, dtype=torch.float64)
    token_rewards[:, -1] = rewards
    return est.FlatBatch(
        rewards=rewards,
        group=torch.arange(n) // GROUP,
        lengths=lengths,
        generated=mask.view(n, tokens).sum(1).double(),
        mask=mask,
        token_rewards=token_rewards.view(-1),
        task=torch.arange(n) // GROUP,
        run=torch.arange(n),
        step=torch.zeros(n, dtype=torch.int64),
    )


def _group_members(b: est.FlatBatch) -> list[list[int]]:
    members: dict[int, list[int]] = {}
    for i, g in enumerate(b.group.tolist()):
        members.setdefault(g, []).append(i)
    return list(members.values())


def _grpo_group(b: est.FlatBatch, idx: list[int], spans: list[tuple[int, int]], epsilon: float = 1e-6) -> list:
    rewards = b.rewards[idx]
    mean, std = (rewards.mean(), rewards.std()) if len(idx) > 1 else (0.0, 1.0)
    return [(r - mean) / (std + epsilon) for r in rewards]


def _rloo_group(b: est.FlatBatch, idx: list[int], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Leave-one-out on verl's score, each experience's sum of token-level rewards."""
    scores = [b.token_rewards[spans[i][0] : spans[i][0] + spans[i][1]].sum() for i in idx]
    n, total = len(scores), sum(scores)
    return [s - (total - s) / (n - 1) if n > 1 else s for s in scores]


def _centred_group(b: est.FlatBatch, idx: list[int], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    rewards = b.rewards[idx]
    mean = rewards.mean() if len(idx) > 1 else 0.0
    return [r - mean for r in rewards]


# What each batched estimator replaces: its ingest formula group by group, then experience
# by experience (reinforce++_baseline whitens at sample time; its ingest stage is r - mean_g).
LOOPS: dict[str, Callable[[est.FlatBatch, list[int], list[tuple[int, int]]], list[torch.Tensor]]] = {
    "grpo": _grpo_group,
    "rloo": _rloo_group,
    "reinforce++_baseline": _centred_group,
    "opmd": _centred_group,
}


def group_loop(b: est.FlatBatch, name: str, tokens: bool = True) -> torch.Tensor:
    """The loop that batched code replaces: an estimator's statistics group by group, then its
    value experience by experience (onto its tokens, or one value each)."""
    per_group = LOOPS[name]
    out = torch.empty(b.mask.numel() if tokens else b.rewards.numel(), dtype=torch.float32)
    spans = list(zip((torch.cumsum(b.lengths, 0) - b.lengths).tolist(), b.lengths.tolist(), strict=True))
    for idx in _group_members(b):
        for i, value in zip(idx, per_group(b, idx, spans), strict=True):
            if tokens:
                s, n = spans[i]
                out[s : s + n] = value * b.mask[s : s + n]
            else:
                out[i] = value
    return out


def time_it(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def best_of(fn: Callable[[], object], device: str, repeats: int) -> float:
    """One warm-up run, then the best of `repeats`: the same for the batched code and its loop."""
    fn()
    return min(time_it(fn, device) for _ in range(repeats))


def _args(name: str) -> dict:
    return estimator_args(TableConfig.of(name="bench", estimator=name))


def check_loops(tokens: int) -> None:
    """Every loop computes what its batched estimator computes (on a small batch)."""
    small = flat_batch(2000, tokens, seed=1)
    for name in LOOPS:
        result = est.estimate(name, small, _args(name))
        assert torch.allclose(result.scalar.float(), group_loop(small, name, tokens=False), atol=1e-5), name
        assert torch.allclose(result.tokens(small)[0], group_loop(small, name), atol=1e-5), name


def bench_estimators(n: int, tokens: int, repeats: int) -> list[dict]:
    check_loops(tokens)
    rows = []
    batch = flat_batch(n, tokens)
    loops = {
        (name, token_level): best_of(lambda k=name, t=token_level: group_loop(batch, k, tokens=t), "cpu", repeats)
        for name in LOOPS
        for token_level in (True, False)
    }
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        moved = batch.to(device)
        for name in LOOPS:
            args = _args(name)
            for token_level in (True, False):

                def run(m: est.FlatBatch = moved, k: str = name, t: bool = token_level, a: dict = args) -> None:
                    result = est.estimate(k, m, a)
                    if t:
                        result.tokens(m)

                seconds = best_of(run, device, repeats)
                row = {"device": device, "estimator": name, "tokens": token_level, "seconds": seconds}
                rows.append(row | {"loop": loops[name, token_level]})
                print(rows[-1], file=sys.stderr)
    return rows


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its live descendants (the server and its
    ingest processes), from /proc: on a shared machine a steadier measure of cost than time."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats[int(path.parent.name)] = path.read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
    tree, total = [pid], 0.0
    while tree:
        current = tree.pop()
        fields = stats.get(current)
        if fields is not None:
            total += (int(fields[11]) + int(fields[12])) / tick
        tree.extend(child for child, f in stats.items() if int(f[1]) == current)
    return total


def bench_ingest(data: Path, payloads: list[bytes], rounds: int) -> dict[str, float]:
    """Ingest MB/s with grpo and with none (medians), and the server's CPU seconds per GB."""
    server = Proc("-m", "expbuf.server.cli", "serve", "--data", str(data), "--port", "0", "--metrics-port", "0")
    results: dict[str, list[float]] = {"grpo": [], "none": [], "grpo_cpu": [], "none_cpu": []}
    size = sum(map(len, payloads))
    try:
        with BufferClient(server.target, timeout=300) as client:
            for r in range(rounds):
                for estimator in ("grpo", "none") if r % 2 == 0 else ("none", "grpo"):
                    table = f"{estimator.replace('+', 'p')}{r}"  # a fresh table per round: no duplicates
                    client.create_table(table, estimator=estimator)
                    shares = [payloads[i::PUSHERS] for i in range(PUSHERS)]

                    def push(share: list[bytes], table: str = table) -> None:
                        with BufferClient(server.target, timeout=300) as c:
                            for p in share:
                                c.push(p, table=table)

                    cpu = tree_cpu_seconds(server.proc.pid)
                    start = time.perf_counter()
                    threads = [threading.Thread(target=push, args=(s,)) for s in shares]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    while client.stats(table)[table].ready < len(payloads) * 64:
                        time.sleep(0.002)
                    results[estimator].append(size / (time.perf_counter() - start) / 1e6)
                    results[f"{estimator}_cpu"].append((tree_cpu_seconds(server.proc.pid) - cpu) / size * 1e9)
                    client.drop_table(table)
    finally:
        server.stop()
    return {name: sorted(v)[len(v) // 2] for name, v in results.items()}


SAMPLE_TABLES = {
    "batch_std": {"estimator": "grpo", "estimator_params": {"std_cal_level": "batch"}},
    "whiten": {"estimator": "reinforce++_baseline"},
    "grpo": {"estimator": "grpo"},
    "none": {},
}
SAMPLE_NAMES = {
    "none": "estimator none",
    "grpo": "grpo (advantages attached, no batch stage)",
    "batch_std": "grpo, std_cal_level batch (batch stage at sample time)",
    "whiten": "reinforce++_baseline (whitened over the batch at sample time)",
}


FORMS = ("full", "compact")


@contextlib.contextmanager
def sample_form(form: str) -> Iterator[None]:
    """BufferClient's sample requests as they are (compact advantages, rebuilt by the client
    before the batch is handed over), or for "full" as a client from before compact
    advantages sends them: the payload carries the expanded tensors."""
    build = SampleSpec.request

    def older(spec: SampleSpec, max_reply_bytes: int) -> pb.SampleRequest:
        request = build(spec, max_reply_bytes)
        request.compact_advantages = False
        return request

    SampleSpec.request = build if form == "compact" else older  # type: ignore[method-assign]
    try:
        yield
    finally:
        SampleSpec.request = build  # type: ignore[method-assign]


def bench_sample(data: Path, payloads: list[bytes], rounds: int) -> dict[tuple[str, str, bool], tuple[float, float]]:
    """Experiences per second sampled whole (8 groups a batch) from the same payloads, and the
    CPU time of server and client per experience (µs), for each table, request form, and with
    or without decoding each batch into tensors; keyed by (table, form, decoded)."""
    server = Proc("-m", "expbuf.server.cli", "serve", "--data", str(data), "--port", "0", "--metrics-port", "0")
    results: dict[tuple[str, str, bool], list[tuple[float, float]]] = {
        (name, form, decoded): [] for name in SAMPLE_TABLES for form in FORMS for decoded in (False, True)
    }
    try:
        with BufferClient(server.target, timeout=300) as client:
            for r in range(rounds):
                step = 1 if r % 2 == 0 else -1
                for name in list(SAMPLE_TABLES)[::step]:
                    for form in FORMS[::step]:
                        for decoded in (False, True)[::step]:
                            table = f"s{name}{form}{int(decoded)}r{r}"
                            client.create_table(table, **({"estimator": "none"} | SAMPLE_TABLES[name]))
                            for p in payloads:
                                client.push(p, table=table)
                            total = len(payloads) * 64
                            while client.stats(table)[table].ready < total:
                                time.sleep(0.002)
                            with sample_form(form):
                                cpu = tree_cpu_seconds(server.proc.pid) + time.process_time()
                                start, seen = time.perf_counter(), 0
                                for batch in client.sample(table, num_groups=8, timeout=5, delivery="consume"):
                                    if decoded:
                                        assert batch.experiences[0].advantages is not None or name == "none"
                                    seen += len(batch.uids)
                                    if seen >= total:
                                        break
                                rate = seen / (time.perf_counter() - start)
                                cpu = tree_cpu_seconds(server.proc.pid) + time.process_time() - cpu
                                results[name, form, decoded].append((rate, cpu / seen * 1e6))
                            client.drop_table(table)
    finally:
        server.stop()
    return {key: (_median([r for r, _ in v]), _median([c for _, c in v])) for key, v in results.items()}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def report(
    command: str,
    n: int,
    tokens: int,
    repeats: int,
    rows: list[dict],
    ingest: dict[str, float],
    sample: dict[tuple[str, str, bool], tuple[float, float]],
    rounds: int,
) -> str:
    lines = [
        "## Advantages (issue 4)",
        "",
        f"Command: `{command}`  ",
        f"{n:,} experiences in groups of {GROUP}, {tokens} response tokens each ({n * tokens / 1e6:.0f}M tokens), "
        "float64 statistics, float32 token-level output. Each estimator is compared with its own loop: its "
        "formula computed group by group and experience by experience on the same data (same results, checked); "
        f"both timed the same way, one warm-up run and then the best of {repeats}, with {torch.get_num_threads()} "
        "torch thread(s).",
        "",
        "| device | estimator | output | batched | its per-group loop (CPU) | speed-up | goal |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        output = "token-level advantages" if row["tokens"] else "one value per experience (what expbuf stores)"
        lines.append(
            f"| {row['device']} | {row['estimator']} | {output} | {row['seconds'] * 1e3:.1f} ms | "
            f"{row['loop'] * 1e3:.0f} ms | **{row['loop'] / row['seconds']:.1f}x** | ≥ 20x on the CPU |"
        )
    if not any(r["device"] == "cuda" for r in rows):
        lines.append("")
        lines.append("No GPU was lent to this session: the CUDA figures are still to be taken.")
    lines += [
        "",
        *ingest_table(ingest, rounds),
        "",
        *sample_table(sample),
        "",
    ]
    return "\n".join(lines)


def ingest_table(ingest: dict[str, float], rounds: int) -> list[str]:
    return [
        f"| ingest, 8 pushers, 64 x 40 KB per payload, until every group is ready (medians of {rounds}) | MB/s | "
        "server CPU s per GB (with its ingest processes) |",
        "| --- | --- | --- |",
        f"| estimator none | {ingest['none']:.0f} | {ingest['none_cpu']:.2f} |",
        f"| grpo | {ingest['grpo']:.0f} | {ingest['grpo_cpu']:.2f} |",
        f"| ratio grpo / none (goal ≥ 0.9; CPU: none / grpo) | **{ingest['grpo'] / ingest['none']:.2f}** | "
        f"**{ingest['none_cpu'] / ingest['grpo_cpu']:.2f}** |",
    ]


def sample_table(sample: dict[tuple[str, str, bool], tuple[float, float]]) -> list[str]:
    """Each table's rate and CPU per experience, and their ratios to estimator none. The
    reference is none's mean over both request forms (the same work: none has no advantages)."""

    def none(decoded: bool, part: int) -> float:
        return sum(sample["none", form, decoded][part] for form in FORMS) / len(FORMS)

    def cell(name: str, form: str, decoded: bool) -> str:
        rate, cpu = sample[name, form, decoded]
        return f"{rate:.0f} ({rate / none(decoded, 0):.2f}) | {cpu:.0f} ({none(decoded, 1) / cpu:.2f})"

    header = " | ".join(
        f"{what}, {form} ({'before' if form == 'full' else 'now'}): exp/s (ratio) | CPU µs/exp (ratio)"
        for what in ("bytes", "decoded")
        for form in FORMS
    )
    goal = [
        f"**{sample['batch_std', form, decoded][0] / none(decoded, 0):.2f}** | "
        f"**{none(decoded, 1) / sample['batch_std', form, decoded][1]:.2f}**"
        for decoded in (False, True)
        for form in FORMS
    ]
    return [
        f"| sample, consume, 8 groups a batch, same payloads | {header} |",
        "| --- |" + " --- |" * 8,
        *(
            f"| {SAMPLE_NAMES[k]} | "
            + " | ".join(cell(k, form, decoded) for decoded in (False, True) for form in FORMS)
            + " |"
            for k in SAMPLE_NAMES
        ),
        "| grpo batch std / none (goal ≥ 0.95) | " + " | ".join(goal) + " |",
    ]


def sample_report(
    command: str, rounds: int, load: tuple[str, str], sample: dict[tuple[str, str, bool], tuple[float, float]]
) -> str:
    """The sample comparison alone: tables with advantages against estimator none, each
    sampled with full and with compact advantages."""
    return "\n".join(
        [
            "## Sample from a batch-stage table: compact advantages (issues 20, 22)",
            "",
            f"Command: `{command}`  ",
            f"The sample part of the benchmark above, medians of {rounds} rounds that alternate the tables, the "
            "request forms and decoding. Each cell is its own fill of a fresh table with the same payloads (64 x 40 "
            "KB experiences of 4,000 response tokens each), then consumed whole. Full: the request an older client "
            "sends, the payload carrying `advantages` and `returns`; compact: what expbuf's clients ask now, one "
            "value per experience beside the payload, the tensors rebuilt by the client before it hands the batch "
            "over. Bytes: the loop only counts each batch (its payload is whole either way); decoded: it reads "
            "`batch.experiences` (tensors) too. CPU: user + system time of the server (with its ingest "
            "processes) and of the sampling client per experience, the steadier measure on a shared machine. "
            "Ratios are to estimator none's mean over both forms (the same work: none has no advantages); "
            "for CPU, none's / the table's.  ",
            f"Load (`uptime`) at the start: {load[0]}; at the end: {load[1]}.",
            "",
            *sample_table(sample),
            "",
        ]
    )


def _load() -> str:
    return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiences", type=int, default=100_000)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--payloads-per-pusher", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads for the estimator timings (default: torch's own)"
    )
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--sample-only", action="store_true", help="only the sample comparison, in its own section")
    parser.add_argument("--ingest-only", action="store_true", help="only the ingest comparison, printed")
    args = parser.parse_args()
    command = ("python bench/bench_advantages.py " + " ".join(sys.argv[1:])).strip()
    if args.sample_only:
        start = _load()
        with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
            sample = bench_sample(Path(tmp), make_payloads(PUSHERS * args.payloads_per_pusher), args.rounds)
        section = sample_report(command, args.rounds, (start, _load()), sample)
        print(section)
        write_section(Path(args.out), "## Sample from a batch-stage table", section)
        return
    if args.ingest_only:
        with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
            ingest = bench_ingest(Path(tmp), make_payloads(PUSHERS * args.payloads_per_pusher), args.rounds)
        print(ingest, f"ratio grpo / none {ingest['grpo'] / ingest['none']:.2f}", file=sys.stderr)
        print("\n".join(ingest_table(ingest, args.rounds)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench_estimators(args.experiences, args.tokens, args.repeats)
    payloads = make_payloads(PUSHERS * args.payloads_per_pusher)
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        ingest = bench_ingest(Path(tmp), payloads, args.rounds)
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        sample = bench_sample(Path(tmp), payloads, args.rounds)
    print(ingest, sample, file=sys.stderr)
    section = report(command, args.experiences, args.tokens, args.repeats, rows, ingest, sample, args.rounds)
    print(section)
    write_section(Path(args.out), "## Advantages (issue 4)", section)


if __name__ == "__main__":
    main()
