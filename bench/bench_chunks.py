"""Store a push once? The server's push, part by part, as it is and with each push's experiences
stored as one chunk (Reverb's chunks), side by side in one run.

    .venv/bin/python bench/bench_chunks.py [--rounds 5] [--pushes 32] [--out bench/RESULTS.md]

Each round pushes the same kind of experiences (fresh uids) into a Store (no gRPC; fsync on every
commit) three ways, each in a process and a store of its own, which goes first rotating:
- `now`: today's path: parse the pushed payload, repack each experience (`Entry.of`: canonical
  metadata pickle, its own safetensors header, XXH3-128), one blob per experience;
- `chunk`: the same entries, but each push's packed experiences written as one value (a chunk)
  and each record carrying where its experience lies in it (12 bytes: the chunk and the offset);
  a prototype of the cheapest layout that keeps the digest per experience and `join`'s splice;
- `raw`: the bound on storing the pushed payload as it came, with no repack: parse, then the
  payload written as one value and the records pointing into it, with no per-experience work at
  all (not even a digest: the bound, not a design).
And the consume side of storing the pushed payload as it came: what it costs to get one
experience back out of a chunk of 256 (the pushed metadata is one pickle with a memo, so an
item is read by parsing the whole payload), against reading and checking one stored experience.

µs of the process's CPU per experience (user and system, so the kernel's page writes count),
median of the rounds; LMDB puts per experience; bytes written to storage per experience.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_reverb import small  # noqa: E402
from bench_store import experience  # noqa: E402
from bench_writes import _written, counting  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, trxp  # noqa: E402
from expbuf.server.rpc.sample.replies import keep_reply_memory  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.core.table_state.read_check import payload_problem  # noqa: E402
from expbuf.server.store.disk.layout import put_rows, u64  # noqa: E402
from expbuf.server.store.disk.records import ItemRecord  # noqa: E402
from expbuf.server.store.rules import groups  # noqa: E402
from expbuf.server.store.schema.states import PENDING  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

HEADING = "## Store a push once: chunks against the per-experience repack (issue 32)"
SHAPES = {"8k": 256, "40k": 64}  # experiences per push
ARMS = ("now", "chunk", "raw")
TABLE = TableConfig.of("t", estimator="none", group_by="none")
_CHUNK = b"\xff"  # no UTF-8 uid starts with this byte: chunk keys never meet an experience's


@dataclasses.dataclass(slots=True, kw_only=True)
class _Placed(ItemRecord):
    """A record that says where its experience lies in its push's chunk."""

    ref: bytes = b""

    def encode(self) -> bytes:
        return ItemRecord.encode(self) + self.ref


def _chunked_insert(raw: dict[int, bytes]) -> Callable[..., None]:
    """groups._insert writing each push's experiences as one chunk: their packed payloads
    back to back (`raw` empty), or the pushed payload itself (`raw[id(first entry)]`)."""

    def insert(tt, by_group, grps) -> None:
        counters = tt.counters
        prefix, now, seq, nbytes = tt.prefix, tt.now, counters.next_seq, 0
        chunk_key = prefix + _CHUNK + u64(seq)
        parts, order, offset = [], [], 0
        for gkey, members in by_group.items():
            grp = grps[gkey]
            for entry in members:
                size = len(entry.blob)
                ref = u64(seq) + offset.to_bytes(4, "little")
                tt.put_item(entry.uid, _placed(entry, gkey, seq, now, ref))
                parts.append(entry.blob)
                order.append((prefix + u64(seq), entry.uid.encode()))
                grp.members.append(entry.uid)
                offset += size
                seq += 1
                nbytes += size
        first = next(iter(by_group.values()))[0]
        tt.txn.put(chunk_key, raw.get(id(first)) or b"".join(parts), db=tt.db["blobs"])
        put_rows(tt.txn, tt.db["order"], order)
        counters.pending += seq - counters.next_seq
        counters.next_seq = seq
        counters.bytes += nbytes
        counters.bytes_pushed += nbytes

    return insert


def _placed(entry: Entry, gkey: str, seq: int, now: float, ref: bytes) -> _Placed:
    """Entry.record, with where the experience lies in its chunk."""
    return _Placed(
        state=PENDING, group=gkey, seq=seq, digest=entry.digest, size=len(entry.blob), created=now,
        tid=entry.tid, rid=entry.rid, step=entry.step, response_length=entry.response_length,
        generated=entry.generated, version=entry.version, reward=entry.reward, priority=entry.priority, ref=ref,
    )  # fmt: skip


def _unpacked(items: list[trxp.RawItem]) -> list[Entry]:
    """Entries that carry the pushed experience's identity and no packed payload (the `raw`
    bound): what the store needs of each, read from the parsed item."""
    return [
        Entry(
            uid=item.eid.uid,
            tid=item.eid.tid,
            rid=item.eid.rid,
            sid=item.eid.sid,
            blob=b"",
            digest=b"\0" * 16,
            size=0,
            version=item.model_version,
            reward=item.meta.get("reward"),
            priority=0.0,
            has_token_rewards=False,
            step=item.eid.step,
            response_length=item.response_length,
            generated=item.generated_tokens,
            prompt_bytes=0,
        )
        for item in items
    ]


@contextlib.contextmanager
def _insert_as(fn: Callable[..., None] | None) -> Iterator[None]:
    kept = groups._insert
    if fn is not None:
        groups._insert = fn
    try:
        yield
    finally:
        groups._insert = kept


def pushes_of(shape: str, count: int, serial: Iterator[int]) -> list[bytes]:
    """Encoded pushes of the shape, with uids never pushed before."""
    gen = torch.Generator().manual_seed(0)
    per = SHAPES[shape]
    out = []
    for _ in range(count):
        if shape == "8k":
            exps = [small(0, gen) for _ in range(per)]
        else:
            exps = [experience(0, i // 8, i % 8) for i in range(per)]
        for exp in exps:
            exp.eid = EID(batch=next(serial), task=0, run=0)
        out.append(trxp.encode(exps))
    return out


class Arm:
    """One way of pushing, into its own store, with its totals: CPU seconds of parse, pack and
    store, experiences, and bytes written to storage."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path
        self.store = self._open()
        self.store.create_table(TABLE)
        self.raw: dict[int, bytes] = {}
        self.insert = None if name == "now" else _chunked_insert(self.raw)
        self.reset()

    def _open(self) -> Store:
        return Store(self.path, map_size=8 << 30)

    def reset(self) -> None:
        self.parse = self.pack = self.put = 0.0
        self.count = self.written = 0

    def count_writes(self, payloads: list[bytes]) -> float:
        """Push payloads counting the store's puts (through a wrapper around the writer's
        transaction, which slows it: not timed); returns the puts per experience. The store is
        opened again after, its writer unwrapped."""
        counted: Counter[str] = Counter()
        counting(self.store, counted)
        for payload in payloads:
            self.push(payload)
        puts = sum(v for k, v in counted.items() if k.startswith("put ")) / self.count
        self.store.close()
        self.store = self._open()
        self.reset()
        return puts

    def push(self, payload: bytes) -> None:
        """Push one payload this arm's way."""
        with _insert_as(self.insert):
            written = _written()
            cpu = time.process_time()
            items = trxp.parse(payload)
            parsed = time.process_time()
            if self.name == "raw":
                entries = _unpacked(items)
                self.raw.clear()
                self.raw[id(entries[0])] = payload
            else:
                entries = [Entry.of(item) for item in items]
            packed = time.process_time()
            self.store.put_entries(TABLE.name, entries)
            stored = time.process_time()
            self.written += _written() - written
        self.parse += parsed - cpu
        self.pack += packed - parsed
        self.put += stored - packed
        self.count += len(items)

    def figures(self) -> dict[str, float]:
        """The totals since the last reset, per experience (CPU in µs)."""
        n = self.count
        return {
            "parse": self.parse / n * 1e6,
            "pack": self.pack / n * 1e6,
            "store": self.put / n * 1e6,
            "server": (self.parse + self.pack + self.put) / n * 1e6,
            "written": self.written / n,
        }


def read_back(shape: str, serial: Iterator[int]) -> dict[str, float]:
    """CPU µs to get one experience out: a stored one read and checked against its digest (what a
    sample does today), against one of a pushed payload of SHAPES[shape] items parsed whole."""
    (payload,) = pushes_of(shape, 1, serial)
    items = trxp.parse(payload)
    stored = [Entry.of(item) for item in items]
    recs = [e.record(e.uid, seq=i, created=0.0) for i, e in enumerate(stored)]
    rounds = 5
    cpu = time.process_time()
    for _ in range(rounds):
        for entry, rec in zip(stored, recs, strict=True):
            assert payload_problem(entry.uid, rec, memoryview(entry.blob)) is None
    check = (time.process_time() - cpu) / rounds / len(stored) * 1e6
    cpu = time.process_time()
    for _ in range(rounds):
        trxp.parse(payload, trusted=True)
    whole = (time.process_time() - cpu) / rounds * 1e6
    return {"check": check, "parse_chunk": whole, "per_item_of_chunk": whole / len(stored)}


def held_space(per_chunk: int, live: int, uniform: bool, seed: int = 0) -> float:
    """The bytes a chunked table holds per live byte in a steady state: `live` experiences, a
    push of `per_chunk` (one chunk) for each `per_chunk` consumed, in fifo or uniform order, and a
    chunk's bytes freed when its last experience goes (they cannot be before: its pages are one
    value). Averaged over 20 turnovers after 5 of warm-up."""
    rng = random.Random(seed)
    remaining: dict[int, int] = {}
    items: list[int] = []  # the chunk of each live experience, oldest first
    held = samples = 0
    pushes = 25 * live // per_chunk
    for chunk in range(pushes):
        remaining[chunk] = per_chunk
        items.extend([chunk] * per_chunk)
        while len(items) > live:
            if uniform:
                at = rng.randrange(len(items))
                items[at], items[-1] = items[-1], items[at]
            gone = items.pop() if uniform else items.pop(0)
            remaining[gone] -= 1
            if not remaining[gone]:
                del remaining[gone]
        if chunk >= 5 * live // per_chunk:
            held += len(remaining) * per_chunk
            samples += len(items)
    return held / samples


Rows = dict[str, dict[str, list[dict[str, float]]]]


def child(arm_name: str, shape: str, pushes: int, first: int) -> dict[str, float]:
    """One arm in this process: its writes counted on two pushes, then the same warm-up as every
    arm's, then `pushes` timed; uids from `first` on."""
    serial = itertools.count(first)
    keep_reply_memory()  # as the server does: a chunk's megabytes come from the heap, not fresh pages
    with tempfile.TemporaryDirectory() as tmp:
        arm = Arm(arm_name, Path(tmp) / "d")
        puts = arm.count_writes(pushes_of(shape, 2, serial))
        for payload in pushes_of(shape, 2, serial):
            arm.push(payload)
        arm.reset()
        for payload in pushes_of(shape, pushes, serial):
            arm.push(payload)
        arm.store.close()
    return arm.figures() | {"puts": puts}


def run(rounds: int, pushes: int) -> Rows:
    """Each shape's rounds of every arm, each arm in a process of its own (so that no arm's heap
    or page cache is another's), which arm goes first rotating from round to round."""
    out: Rows = {shape: {arm: [] for arm in ARMS} for shape in SHAPES}
    first = itertools.count(0, 10**7)
    for round_ in range(rounds):
        for shape in SHAPES:
            turn = round_ % len(ARMS)
            for arm in ARMS[turn:] + ARMS[:turn]:
                command = [sys.executable, __file__, "--child", arm, shape, str(pushes), str(next(first))]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                out[shape][arm].append(json.loads(done.stdout))
            print(shape, round_, {arm: round(out[shape][arm][-1]["server"], 1) for arm in ARMS}, file=sys.stderr)
    return out


def report(
    command: str,
    results: Rows,
    reads: dict[str, dict[str, float]],
    load: tuple[str, str],
) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"{os.cpu_count()} CPUs, shared; load average {load[0]} at the start, {load[1]} at the end (`uptime`). "
        "The Store alone (no gRPC), fsync on every commit; each arm in a process and a store of its own, "
        "the same warm-up, the arms in rotating order each round. µs of the process's CPU per experience "
        "(user and system), medians of the rounds; 8 KB experiences 256 a push, 40 KB ones 64 a push.",
        "",
        "| shape | arm | parse | pack | store and commit | server's push | ratio to now | puts | bytes written |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shape, arms in results.items():
        base = statistics.median(r["server"] for r in arms["now"])
        for arm, rows in arms.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            cells = [f"{med[k]:.1f}" for k in ("parse", "pack", "store", "server")]
            cells += [f"**{med['server'] / base:.2f}**", f"{med['puts']:.2f}", f"{med['written']:,.0f}"]
            lines.append(f"| {shape} | {arm} | {' | '.join(cells)} |")
    lines += [
        "",
        "Getting one experience back (µs of CPU): read and checked against its digest as stored today, "
        "against parsing the pushed payload it came in (the `raw` layout's read):",
        "",
        "| shape | check one stored experience | parse its pushed payload | the parse per experience in it |",
        "| --- | ---: | ---: | ---: |",
    ]
    for shape, r in reads.items():
        lines.append(f"| {shape} | {r['check']:.1f} | {r['parse_chunk']:,.0f} | {r['per_item_of_chunk']:.1f} |")
    lines += [
        "",
        "Space a chunked table holds per live byte (a chunk's bytes go with its last experience), in a "
        "steady state of 8,192 live experiences, one push of a chunk for each chunk's worth consumed "
        "(`held_space`, a simulation): "
        + "; ".join(
            f"{k} a chunk: fifo {held_space(k, 8192, False):.2f}, uniform {held_space(k, 8192, True):.2f}"
            for k in (64, 256)
        ),
        "",
        'Not kept: each experience stays its own repacked value (why: bench/HISTORY.md, "Store a push once").',
    ]
    return "\n".join(lines) + "\n"


def _uptime() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pushes", type=int, default=32, help="pushes per arm per round")
    parser.add_argument("--out", help="write the section into this RESULTS.md")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        arm, shape, pushes, first = args.child
        print(json.dumps(child(arm, shape, int(pushes), int(first))))
        return
    start = _uptime()
    results = run(args.rounds, args.pushes)
    serial = itertools.count(10**9)
    reads = {shape: read_back(shape, serial) for shape in SHAPES}
    command = f".venv/bin/python bench/bench_chunks.py --rounds {args.rounds} --pushes {args.pushes}"
    section = report(command, results, reads, (start, _uptime()))
    print(section)
    if args.out:
        write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
