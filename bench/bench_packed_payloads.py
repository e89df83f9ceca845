"""What storing payloads packed, several experiences' to a value, would save LMDB's writes and reads
against a value an experience (issue 64's "payloads per segment"), in plain py-lmdb.

    .venv/bin/python bench/bench_packed_payloads.py [--rounds 5] [--segments 16] [--packs 1,8,32,256]
        [--out bench/RESULTS.md]

Each round fills a data directory with segments of 256 experiences' payloads of 8,723 bytes (the
stored one-item payload of bench_reverb's 8 KB experience), one durable commit a segment (a push),
then drains them as a consume stream's confirm does, one durable commit a segment: each payload
read from a read snapshot and its XXH3-128 digest checked, then deleted; three fills and drains in
turn in one environment, so that the later ones allocate from a freelist the earlier left. A pack of
1 is a value an experience (keyed by uid: the store's layout); a pack of N, values of N payloads end
to end (keyed by segment and first member), each member checked on its slice. CPU µs (this process)
and bytes written (LMDB's pages handed to write calls: storage_writes.py) an experience, medians of
the rounds; which pack goes first turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import xxhash

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results  # noqa: E402
from storage_writes import written  # noqa: E402

SIZE = 8723  # the stored one-item payload of bench_reverb's 8 KB experience
PER_SEGMENT = 256
CYCLES = 3
PREFIX = b"\0\0\0\1"
HEADING = "## Payloads packed several to a value, in py-lmdb (issue 64)"
COLUMNS = ["payloads a value", "value bytes", "push CPU µs", "push vs", "push bytes written"]
COLUMNS += ["consume CPU µs", "consume vs", "consume bytes written"]


def value_keys(segment: int, pack: int) -> list[bytes]:
    """The keys of a segment's values: each experience's uid (a pack of 1), else the segment and the
    first member of each value."""
    if pack == 1:
        return [PREFIX + f"{segment}/{i}/0/0/".encode() for i in range(PER_SEGMENT)]
    return [PREFIX + segment.to_bytes(8, "big") + i.to_bytes(2, "big") for i in range(0, PER_SEGMENT, pack)]


def drain_cycles(segments: int, pack: int, payloads: list[bytes]) -> dict[str, tuple[float, float]]:
    """CPU seconds and bytes written of the fills and of the drains, CYCLES of each, a pack of `pack`."""
    digests = [xxhash.xxh3_128_digest(payload) for payload in payloads]
    found = {"push": [0.0, 0], "consume": [0.0, 0]}
    with tempfile.TemporaryDirectory(dir=HERE.parent) as data:
        env = lmdb.open(data, map_size=8 << 30, max_dbs=2, sync=True, metasync=True, readahead=False)
        blobs = env.open_db(b"blobs")
        serial = 0
        for _ in range(CYCLES):
            keys = [value_keys(serial + s, pack) for s in range(segments)]
            serial += segments
            cpu, wrote = time.process_time(), written()
            for s in range(segments):
                with env.begin(write=True) as txn:
                    for at, key in enumerate(keys[s]):
                        value = payloads[at] if pack == 1 else b"".join(payloads[at * pack : (at + 1) * pack])
                        txn.put(key, value, db=blobs)
            found["push"][0] += time.process_time() - cpu
            found["push"][1] += written() - wrote
            cpu, wrote = time.process_time(), written()
            for s in range(segments):
                snapshot = env.begin(buffers=True)
                with env.begin(write=True) as txn:
                    for at, key in enumerate(keys[s]):
                        value = snapshot.get(key, db=blobs)
                        for k in range(0, len(value), SIZE):
                            if xxhash.xxh3_128_digest(value[k : k + SIZE]) != digests[at * pack + k // SIZE]:
                                raise AssertionError(f"segment {s}, value {at}: digest")
                    for key in keys[s]:
                        txn.delete(key, db=blobs)
                snapshot.abort()
            found["consume"][0] += time.process_time() - cpu
            found["consume"][1] += written() - wrote
        env.close()
    count = segments * PER_SEGMENT * CYCLES
    return {stage: (seconds / count * 1e6, nbytes / count) for stage, (seconds, nbytes) in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--packs", default="1,8,32,256", help="payloads a value, comma-separated (1: a value each)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    packs = [int(pack) for pack in args.packs.split(",")]
    if not packs or any(pack < 1 or PER_SEGMENT % pack for pack in packs):
        parser.error(f"--packs takes divisors of {PER_SEGMENT}")
    payloads = [os.urandom(SIZE) for _ in range(PER_SEGMENT)]
    load = os.getloadavg()
    runs: dict[int, list[dict[str, tuple[float, float]]]] = {pack: [] for pack in packs}
    for round_ in range(args.rounds):
        for pack in packs[round_ % len(packs) :] + packs[: round_ % len(packs)]:
            runs[pack].append(drain_cycles(args.segments, pack, payloads))
    rows = []
    base = {stage: statistics.median(run[stage][0] for run in runs[packs[0]]) for stage in ("push", "consume")}
    for pack in packs:
        cells = []
        for stage in ("push", "consume"):
            cpu = statistics.median(run[stage][0] for run in runs[pack])
            nbytes = statistics.median(run[stage][1] for run in runs[pack])
            cells += [f"{cpu:.2f}", f"**{base[stage] / cpu:.2f}x**", f"{nbytes:,.0f}"]
        rows.append(f"| {pack} | {pack * SIZE:,} | " + " | ".join(cells) + " |")
    section = results.section(
        HEADING,
        "python bench/bench_packed_payloads.py " + " ".join(sys.argv[1:]),
        f"{os.cpu_count()} CPUs, shared; load average {', '.join(f'{x:.2f}' for x in load)} at the start. "
        f"{args.segments} segments of {PER_SEGMENT} payloads of {SIZE:,} bytes, filled then drained {CYCLES} times "
        "in one environment, a durable commit a segment each way; CPU µs and bytes written an experience, "
        f"medians of {args.rounds} rounds; the ratios against a pack of {packs[0]}.",
        COLUMNS,
        rows,
    )
    results.publish(section, HEADING, args.out)


if __name__ == "__main__":
    main()
