"""Where a table's compression pays (issue 41): MoE rollouts pushed and consumed through an
`expbuf serve` child into tables that keep their tensor data as it is and as zstd frames, side
by side in one run, with the bytes each keeps on disk.

    .venv/bin/python bench/bench_compression.py [--out bench/RESULTS.md] [--tokens 32768,4096] [--mib 256]

Each rollout: `--tokens` tokens (each count in turn) as int64 (ids drawn uniformly from a 151k
vocabulary), float32 log-probs (random), a bool mask (the first eighth is prompt) and its
routing ids (`routed_experts`: 48 layers x top-8 of 128 experts a token, drawn uniformly: the
worst case for compression, real routing is skewed) as int32, or as uint8; `--mib` of them a
table (at least 4). Each rollout is one push over the client's defaults, then all are consumed
as columns (every field), one rollout a batch; `--rounds` rounds of the tables in turn, each
rate the best of its table's rounds (the plain rows are the noisiest: fsyncs and first touches
of the map). Rates are of the rollouts' bytes as pushed;
"kept" is the pages of the payloads and chunks databases after the pushes (LMDB's own count),
against the same rollouts kept as they are.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lmdb  # noqa: E402
import torch  # noqa: E402
from bench_service import Proc  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, BufferClient, Experience, trxp  # noqa: E402
from expbuf.server.store.disk import layout  # noqa: E402

MB = 1 << 20
HEADING = "## Compressed chunks: where they pay (issue 41)"
FIELDS = ["tokens", "logprobs", "action_mask", "routed_experts"]
TABLES = {
    "as they are": {},
    "zstd 1": {"compression": "zstd"},
    "zstd 3": {"compression": "zstd", "compression_level": 3},
}


def rollout(index: int, tokens: int, routing: torch.dtype) -> bytes:
    gen = torch.Generator().manual_seed(index)
    response = tokens - tokens // 8
    experience = Experience(
        eid=EID(batch="moe", task=index, run=0),
        tokens=torch.randint(0, 151_000, (tokens,), dtype=torch.int64, generator=gen),
        prompt_length=tokens - response,
        logprobs=torch.randn(response, generator=gen) - 2.0,
        action_mask=torch.ones(response, dtype=torch.bool),
        routed_experts=torch.randint(0, 128, (tokens, 48 * 8), generator=gen).to(routing),
        reward=1.0,
    )
    return trxp.build([trxp.from_experience(experience)])


def kept(data: str) -> int:
    """The bytes of the pages the payloads and the chunks databases hold (read beside the
    server, as a reader)."""
    env = lmdb.open(data, readonly=True, max_dbs=layout.MAX_DBS)
    try:
        pages, size = 0, 0
        with env.begin() as txn:
            for name in (b"blobs", b"chunks"):
                stat = txn.stat(env.open_db(name, txn=txn, create=False))
                pages, size = pages + stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"], stat["psize"]
        return int(pages * size)
    finally:
        env.close()


def run(settings: dict[str, object], bodies: list[bytes]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="expbuf-bench-") as tmp:
        data = f"{tmp}/data"
        server = Proc("-m", "expbuf.server.cli", "serve", "--data", data, "--port", "0", "--metrics-port", "-1")
        try:
            server.wait_for("advantage worker")
            with BufferClient(server.target, timeout=600, max_message_bytes=256 * MB) as client:
                client.create_table("moe", group_size=1, estimator="none", **settings)  # type: ignore[arg-type]
                start = time.perf_counter()
                for body in bodies:
                    client.push(body, table="moe")
                push = time.perf_counter() - start
                on_disk = kept(data)
                start = time.perf_counter()
                got = 0
                for batch in client.sample(
                    "moe", num_groups=1, max_batches=len(bodies), timeout=30, delivery="consume", fields=FIELDS
                ):
                    got += len(batch.uids)
                consume = time.perf_counter() - start
                assert got == len(bodies)
        finally:
            server.stop()
        size = sum(map(len, bodies))
        return {"push": size / push / MB, "consume": size / consume / MB, "kept": on_disk}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", default="32768,4096", help="tokens a rollout, each count in turn")
    parser.add_argument("--mib", type=int, default=256, help="MiB of rollouts a table")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every table, in turn")
    args = parser.parse_args()
    lines = [
        "| tokens | routing ids | rollout | table | push MB/s | consume MB/s | kept on disk "
        "| push / consume vs as they are |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tokens in map(int, args.tokens.split(",")):
        for routing in (torch.int32, torch.uint8):
            size = len(rollout(0, tokens, routing))
            bodies = [rollout(index, tokens, routing) for index in range(max(4, args.mib * MB // size))]
            results: dict[str, dict[str, float]] = {}
            for _ in range(args.rounds):  # the tables in turn each round; each rate its best round's
                for name, settings in TABLES.items():
                    got = run(settings, bodies)
                    best = results.setdefault(name, got)
                    for measure in ("push", "consume"):
                        best[measure] = max(best[measure], got[measure])
            plain = results["as they are"]
            for name, got in results.items():
                lines.append(
                    f"| {tokens} | {str(routing).removeprefix('torch.')} | {size / MB:.1f} MiB | {name} "
                    f"| {got['push']:.0f} | {got['consume']:.0f} | {got['kept'] / plain['kept']:.2f}x "
                    f"| {got['push'] / plain['push']:.2f} / {got['consume'] / plain['consume']:.2f} |"
                )
                print(lines[-1], flush=True)
    command = f"python bench/bench_compression.py --tokens {args.tokens} --mib {args.mib} --rounds {args.rounds}"
    body = "\n".join([HEADING, "", f"`{command}`", "", *lines, ""])
    if args.out:
        write_section(args.out, HEADING, body)


if __name__ == "__main__":
    main()
