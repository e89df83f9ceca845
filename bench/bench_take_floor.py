"""What the store's take and confirm cost beside the least a durable consume must do, side by side
in one process (issue 41).

    .venv/bin/python bench/bench_take_floor.py [--experiences 16384] [--rounds 3] [--out bench/RESULTS.md]

Each round fills three data directories with the same 8 KB experiences (bench_reverb's shape), each
its own group and in groups of 8, then drains each as a Sample stream's server does, in batches
of 256, taking a batch held while it confirms (consumes) the one before, in one durable commit:

- the store: `Store.sample(hold=True, confirm=...)`, its take and its confirm as the server runs
  them (records decoded and written, counters, every ready index, extension hooks, the checks);
- the store with no hold: `Store.sample()` consuming each batch in its take, which no stream does
  (a batch its client never had would be lost): what holding a batch until it is confirmed costs;
- the floor: the same reads and writes in plain py-lmdb, nothing else: the ready order's rows
  read and deleted, each group's and member's record read, its payload read from a read snapshot
  and its XXH3-128 digest checked, the group rewritten as held; at the confirm each payload,
  insertion-order row and record deleted, a tombstone, a retired mark and the group written.

CPU microseconds an experience (this process: the writer's thread included), medians of the
rounds; which goes first turns. The floor is what Python and LMDB cost for this work; the
difference is what the store's bookkeeping costs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import xxhash

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_reverb import make_pushes  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, trxp  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

HEADING = "## The store's take and confirm beside the least they must do (issue 41)"
BATCH = 256
PREFIX = b"\0\0\0\1"
_U64 = struct.Struct(">Q")
_GROUP = struct.Struct("<BBdqdq")  # the head of a group record (records.GroupRecord)
_ITEM = struct.Struct("<BQ16sQdqIIqddQddd")  # the head of an item record (records.ItemRecord)


def entries(count: int, group: int, serial: Iterator[int]) -> list[list[Entry]]:
    """`count` experiences of 8 KB, groups of `group` (runs of one task), as pushes of BATCH."""
    pushes = make_pushes("8k", count // BATCH)
    for exps in pushes:
        for exp in exps:
            number = next(serial)
            exp.eid = EID(batch=number // group, task=0, run=number % group)
    return [[Entry.of(trxp.from_experience(exp)) for exp in exps] for exps in pushes]


def store_drain(path: Path, pushes: list[list[Entry]], group: int, *, hold: bool = True) -> float:
    """CPU seconds of the store's drain (its fill not counted): each batch held, then consumed when the
    next is taken, as a Sample stream's server does; or (`hold=False`) consumed in its take, one commit
    a batch, as no stream does (a batch the client never had would be lost): what the hold costs."""
    config = (
        TableConfig.of(name="t", estimator="none", group_by="none")
        if group == 1
        else TableConfig.of(name="t", estimator="none", group_by="task", group_size=group)
    )
    with Store(path, map_size=8 << 30) as store:
        store.create_table(config)
        for push in pushes:
            store.put_entries("t", push)
        spec = TakeSpec("t", batch_size=BATCH, delivery="consume")
        count, taken, held = sum(map(len, pushes)), 0, ""
        start = time.process_time()
        while taken < count:
            batch = store.sample(spec, hold=True, confirm=held) if hold else store.sample(spec)
            assert batch is not None
            taken += len(batch.uids)
            held = batch.lease_id
            batch.release()
        if hold:
            store.confirm(held, spec)
        return time.process_time() - start


def unheld_drain(path: Path, pushes: list[list[Entry]], group: int) -> float:
    return store_drain(path, pushes, group, hold=False)


def floor_drain(path: Path, pushes: list[list[Entry]], group: int) -> float:
    """CPU seconds of the same drain in plain py-lmdb (its fill not counted)."""
    env = lmdb.open(str(path), map_size=8 << 30, max_dbs=16, sync=True, metasync=True, readahead=False)
    names = ("items", "blobs", "groups", "order", "ready", "tombs", "retired", "leases")
    db = {name: env.open_db(name.encode()) for name in names}
    members: dict[bytes, list[bytes]] = {}
    with env.begin(write=True) as txn:
        seq = 0
        for push in pushes:
            for entry in push:
                uid, gkey = entry.uid.encode(), entry.tid.encode() if group > 1 else entry.uid.encode()
                record = entry.record(gkey.decode(), seq=seq, created=0.0)
                txn.put(PREFIX + uid, record.encode(), db=db["items"])
                txn.put(PREFIX + uid, bytes(entry.blob), db=db["blobs"])
                txn.put(PREFIX + _U64.pack(seq), uid, db=db["order"])
                members.setdefault(gkey, []).append(uid)
                seq += 1
        for rseq, (gkey, uids) in enumerate(members.items()):
            head = _GROUP.pack(2, 0, 0.0, rseq, 0.0, 0) + b"\0\0" + struct.pack("<I", len(uids))
            txn.put(PREFIX + gkey, head + b"".join(struct.pack("<H", len(u)) + u for u in uids), db=db["groups"])
            txn.put(PREFIX + _U64.pack(rseq), gkey, db=db["ready"])
    start = time.process_time()
    held: list[tuple[bytes, list[tuple[bytes, bytes]], bytes]] = []
    while True:
        with env.begin(write=True) as txn:
            for gkey, recs, grp in held:  # the confirm: consumed
                for uid, raw in recs:
                    key = PREFIX + uid
                    txn.delete(key, db=db["blobs"])
                    txn.delete(PREFIX + _U64.pack(_ITEM.unpack_from(raw)[1]), db=db["order"])
                    txn.delete(key, db=db["items"])
                    tomb = b"\x84" + raw[9:25] + struct.pack("<dH", 1.0, len(gkey)) + gkey
                    txn.put(key, tomb, db=db["tombs"])
                txn.put(PREFIX + gkey, b"\x04" + grp[1:], db=db["groups"])
                txn.put(PREFIX + b"\0" * 8 + gkey, b"", db=db["retired"])
            held = []
            snapshot = env.begin(buffers=True)
            taken = 0
            with txn.cursor(db=db["ready"]) as cursor:
                found = cursor.set_range(PREFIX)
                while found and taken < BATCH:
                    gkey = bytes(cursor.value())
                    grp = txn.get(PREFIX + gkey, db=db["groups"])
                    _GROUP.unpack_from(grp)
                    recs = []
                    for uid in members[gkey]:
                        raw = txn.get(PREFIX + uid, db=db["items"])
                        blob = snapshot.get(PREFIX + uid, db=db["blobs"])
                        if xxhash.xxh3_128_digest(blob) != _ITEM.unpack_from(raw)[2]:
                            raise AssertionError(f"{uid!r}: digest")
                        recs.append((uid, raw))
                    found = cursor.delete()
                    txn.put(PREFIX + gkey, b"\x03" + grp[1:], db=db["groups"])
                    held.append((gkey, recs, grp))
                    taken += len(recs)
            txn.put(b"lease", b"x" * 16 * len(held), db=db["leases"])
            snapshot.abort()
        if not held:
            break
    env.close()
    return time.process_time() - start


def measure(count: int, rounds: int) -> dict[int, dict[str, list[float]]]:
    serial = itertools.count()
    results: dict[int, dict[str, list[float]]] = {}
    ways: dict[str, Callable[[Path, list[list[Entry]], int], float]] = {
        "store": store_drain,
        "unheld": unheld_drain,
        "floor": floor_drain,
    }
    for group in (1, 8):
        found: dict[str, list[float]] = {way: [] for way in ways}
        for round_ in range(rounds):
            pushes = entries(count, group, serial)
            for way in list(ways)[round_ % len(ways) :] + list(ways)[: round_ % len(ways)]:
                with tempfile.TemporaryDirectory(prefix="expbuf-floor-") as data:
                    found[way].append(ways[way](Path(data), pushes, group) / count * 1e6)
        results[group] = found
        print(group, {way: [f"{value:.1f}" for value in values] for way, values in found.items()})
    return results


def report(command: str, load: str, count: int, results: dict[int, dict[str, list[float]]]) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"2 cores (load average {load} at the start); {count:,} experiences of 8 KB a drain, batches of "
        f"{BATCH}; CPU µs an experience, medians of the rounds.",
        "",
        "| groups of | the store's take and confirm | the store's take consuming, no hold | the same reads and "
        "writes in py-lmdb | store / floor | no hold / floor |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for group, found in results.items():
        store, unheld, floor = (statistics.median(found[way]) for way in ("store", "unheld", "floor"))
        lines.append(
            f"| {group} | {store:.1f} | {unheld:.1f} | {floor:.1f} | **{store / floor:.1f}x** | {unheld / floor:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiences", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    command = ("python bench/bench_take_floor.py " + " ".join(sys.argv[1:])).strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    section = report(command, load, args.experiences, measure(args.experiences, args.rounds))
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
