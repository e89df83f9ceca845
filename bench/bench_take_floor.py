"""What the store's take and confirm cost beside the least a durable consume must do, side by side
in one process (issue 41).

    .venv/bin/python bench/bench_take_floor.py [--experiences 16384] [--rounds 3] [--out bench/RESULTS.md]
        [--ways store,rows,unheld,floor,rows-floor,rows-packed,rows-build] [--order fifo]

Each round fills three data directories with the same 8 KB experiences (bench_reverb's shape), each
its own group and in groups of 8, then drains each as a Sample stream's server does, in batches
of 256, taking a batch held while it confirms (consumes) the one before, in one durable commit:

- the store: `Store.sample(hold=True, confirm=...)`, its take and its confirm as the server runs
  them (records decoded and written, counters, every ready index, extension hooks, the checks);
- the store's over a rows table (issue 64's storage layout): the same calls;
- the store with no hold: `Store.sample()` consuming each batch in its take, which no stream does
  (a batch its client never had would be lost): what holding a batch until it is confirmed costs;
- the floor: the same reads and writes in plain py-lmdb, nothing else: the ready order's rows
  read and deleted, each group's and member's record read, its payload read from a read snapshot
  and its XXH3-128 digest checked, the group rewritten as held; at the confirm each payload,
  insertion-order row and record deleted, a tombstone, a retired mark and the group written;
- the rows floor: the same drain over the rows a table keeps per batch of groups (disk/rows/, issue
  64), in plain py-lmdb: the ready runs read from the front (a run cut where a batch ends), each
  run's segment state read and its segment viewed from the snapshot, the run's uids and digests
  read from the segment's columns, each payload read and checked, the state rewritten as held,
  one lease row of runs; at the confirm each payload deleted, the state rewritten as consumed, and
  a retired mark for a segment whose every group is retired;
- the rows floor with payloads per segment (`rows-packed`, issue 64's "payloads per segment"):
  the same, but a segment's payloads stored as one value, its members' end to end in their order,
  read once a run (each member's digest checked on its slice) and deleted with the segment's last
  run, not a value an experience read and deleted each.

`--order` takes the store's drains in another order (the floors are fifo's, and refused with it). A
records table keeps every order's index from its creation, its pushes writing them (not counted:
the fill is not); a rows table builds the index an order other than fifo and lifo reads at the first
request that reads it, before its drain's clock starts: `rows-build` is that build alone, CPU µs an
experience of the table it indexes (a replay of one group, which waits for it).

Beside the drains, what reading a take's fields costs: a segment of 64 groups of one (32 of 8)
viewed and its uids, digests, sizes, versions, rewards, lengths and advantages read, with its
state, against today's group and item records decoded, µs an experience.

CPU microseconds an experience (this process: the writer's thread included), medians of the
rounds; which goes first turns. The floor is what Python and LMDB cost for this work; the
difference is what the store's bookkeeping costs.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from bench_reverb import PER_PUSH, make_pushes  # noqa: E402
from results import write_section  # noqa: E402

from expbuf.client import EID, trxp  # noqa: E402
from expbuf.server.store import Entry, Store  # noqa: E402
from expbuf.server.store.disk.records import GroupRecord, ItemRecord  # noqa: E402
from expbuf.server.store.disk.rows import (  # noqa: E402
    SEGMENT_GROUPS,
    SEGMENT_MEMBERS,
    Group,
    GroupRef,
    Member,
    RowLease,
    RunRow,
    SegmentView,
    SegState,
    encode_segment,
)
from expbuf.server.store.schema.sample_spec import TakeSpec  # noqa: E402
from expbuf.server.store.schema.states import CONSUMED, LEASED, READY  # noqa: E402
from expbuf.server.store.schema.table_config import TableConfig  # noqa: E402

HEADING = "## The store's take and confirm beside the least they must do (issue 41)"
BATCH = 256
PREFIX = b"\0\0\0\1"
_U64 = struct.Struct(">Q")
_GROUP = struct.Struct("<BBdqdq")  # the head of a group record (records.GroupRecord)
_ITEM = struct.Struct("<BQ16sQdqIIqddQddd")  # the head of an item record (records.ItemRecord)


def entries(count: int, group: int, serial: Iterator[int], shape: str = "8k") -> list[list[Entry]]:
    """`count` experiences of `shape` (bench_reverb's: 8k, or 40k), groups of `group` (runs of one
    task), as pushes of bench_reverb's size for the shape."""
    pushes = make_pushes(shape, count // PER_PUSH[shape])
    for exps in pushes:
        for exp in exps:
            number = next(serial)
            exp.eid = EID(batch=number // group, task=0, run=number % group)
    return [[Entry.of(trxp.from_experience(exp)) for exp in exps] for exps in pushes]


def filled(store: Store, pushes: list[list[Entry]], group: int, layout: str) -> None:
    """Table t of `layout` (records, or the rows of issue 64), groups of `group`, holding `pushes`."""
    config = (
        TableConfig.of(name="t", estimator="none", group_by="none")
        if group == 1
        else TableConfig.of(name="t", estimator="none", group_by="task", group_size=group)
    )
    store.create_table(dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout=layout)))
    for push in pushes:
        store.put_entries("t", push)


def build(store: Store, order: str) -> None:
    """The index `order` reads, which a rows table builds at the first request that reads it: a
    replay of one group, which waits for it and leaves every group where it was."""
    spec = TakeSpec("t", num_groups=1, delivery="replay", order=order, wait_seconds=600)
    batch = store.sample(spec)
    assert batch is not None
    batch.release()


def store_drain(
    path: Path,
    pushes: list[list[Entry]],
    group: int,
    order: str = "fifo",
    *,
    hold: bool = True,
    layout: str = "records",
) -> float:
    """CPU seconds of the store's drain in `order` (its fill not counted, nor a rows table's build of
    the order's index): each batch held, then consumed when the next is taken, as a Sample stream's
    server does; or (`hold=False`) consumed in its take, one commit a batch, as no stream does (a
    batch the client never had would be lost): what the hold costs. `layout`: the table's storage
    layout (records, or the rows of issue 64)."""
    with Store(path, map_size=8 << 30) as store:
        filled(store, pushes, group, layout)
        if layout == "rows" and order not in ("fifo", "lifo"):
            build(store, order)
        spec = TakeSpec("t", batch_size=BATCH, delivery="consume", order=order)
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


def unheld_drain(path: Path, pushes: list[list[Entry]], group: int, order: str) -> float:
    return store_drain(path, pushes, group, order, hold=False)


def rows_store_drain(path: Path, pushes: list[list[Entry]], group: int, order: str) -> float:
    return store_drain(path, pushes, group, order, layout="rows")


def rows_build(path: Path, pushes: list[list[Entry]], group: int, order: str) -> float:
    """CPU seconds of a rows table's build of the index `order` reads (none for fifo or lifo, which
    read the runs), from the first request that reads it until it is kept."""
    with Store(path, map_size=8 << 30) as store:
        filled(store, pushes, group, "rows")
        start = time.process_time()
        if order not in ("fifo", "lifo"):
            build(store, order)
        return time.process_time() - start


def floor_drain(path: Path, pushes: list[list[Entry]], group: int, order: str = "fifo") -> float:
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


def segments(pushes: list[list[Entry]], group: int) -> list[list[Group]]:
    """The pushes' groups cut into segments as the rows keep them (at most SEGMENT_GROUPS groups and
    SEGMENT_MEMBERS members each), every member's fields as the store records them."""
    found: list[list[Group]] = [[]]
    entries = [entry for push in pushes for entry in push]
    for start in range(0, len(entries), group):
        members = [
            Member(e.uid, e.digest, e.size, start + k, 0.0, e.step, e.response_length, e.generated, e.version, e.reward)
            for k, e in enumerate(entries[start : start + group])
        ]
        key = members[0].uid if group == 1 else entries[start].tid
        if len(found[-1]) == SEGMENT_GROUPS or sum(len(g.members) for g in found[-1]) + group > SEGMENT_MEMBERS:
            found.append([])
        found[-1].append(Group(key=key, created=0.0, members=members))
    return found


def rows_drain(path: Path, pushes: list[list[Entry]], group: int, order: str = "fifo", packed: bool = False) -> float:
    """CPU seconds of the same drain over the rows (disk/rows/) in plain py-lmdb (its fill not counted).
    `packed`: a segment's payloads are one value (`spay`, by segment), its members' end to end in their
    order, read once a run and deleted with the segment's last run, not one value an experience."""
    env = lmdb.open(str(path), map_size=8 << 30, max_dbs=16, sync=True, metasync=True, readahead=False)
    names = ("blobs", "segs", "sstate", "gdir", "ready", "retired", "leases", "spay")
    db = {name: env.open_db(name.encode()) for name in names}
    with env.begin(write=True) as txn:
        blobs = {entry.uid: bytes(entry.blob) for push in pushes for entry in push}
        rseq = 0
        for seg, groups in enumerate(segments(pushes, group)):
            txn.put(PREFIX + _U64.pack(seg), encode_segment(groups, rseq, 0.0), db=db["segs"])
            members = sum(len(g.members) for g in groups)
            txn.put(PREFIX + _U64.pack(seg), SegState.new([READY] * len(groups), members).encode(), db=db["sstate"])
            for index, g in enumerate(groups):
                txn.put(PREFIX + g.key.encode(), GroupRef(seg, index).encode(), db=db["gdir"])
                for m in g.members if not packed else ():
                    txn.put(PREFIX + m.uid.encode(), blobs[m.uid], db=db["blobs"])
            if packed:
                joined = b"".join(blobs[m.uid] for g in groups for m in g.members)
                txn.put(PREFIX + _U64.pack(seg), joined, db=db["spay"])
            txn.put(PREFIX + _U64.pack(rseq), RunRow(seg, 0, len(groups)).encode(), db=db["ready"])
            rseq += len(groups)
    start = time.process_time()
    held: list[tuple[RunRow, list[str]]] = []
    tag, drained = b"12345678", 0
    while True:
        with env.begin(write=True) as txn:
            for run, uids in held:  # the confirm: consumed
                for uid in uids if not packed else ():
                    txn.delete(PREFIX + uid.encode(), db=db["blobs"])
                key = PREFIX + _U64.pack(run.seg)
                state = SegState.decode(txn.get(key, db=db["sstate"]))
                for g in range(run.first, run.first + run.length):
                    state.set_state(g, CONSUMED)
                if run.first + run.length == state.groups:  # drained from the front: the segment's last run
                    state.retired = 1.0
                    txn.put(PREFIX + b"\0" * 8 + _U64.pack(run.seg), b"", db=db["retired"])
                    if packed:
                        txn.delete(key, db=db["spay"])
                txn.put(key, state.encode(), db=db["sstate"])
            held = []
            snapshot = env.begin(buffers=True)
            taken = 0
            with txn.cursor(db=db["ready"]) as cursor:
                found = cursor.set_range(PREFIX)
                while found and taken < BATCH:
                    run = RunRow.decode(cursor.value())
                    key = PREFIX + _U64.pack(run.seg)
                    state = SegState.decode(txn.get(key, db=db["sstate"]))
                    view = SegmentView(snapshot.get(key, db=db["segs"]))
                    end = run.first
                    while end < run.first + run.length and taken + view.span(end)[1] - view.span(end)[0] <= BATCH:
                        taken += view.span(end)[1] - view.span(end)[0]
                        state.set_state(end, LEASED)
                        state.set_lease(end, tag)
                        end += 1
                    if end == run.first:  # its first group does not fit in the batch
                        break
                    lo, hi = view.span(run.first)[0], view.span(end - 1)[1]
                    uids = view.members.uids(lo, hi)
                    if packed:
                        sizes = view.members.column("size", 0, hi)
                        joined, at = snapshot.get(key, db=db["spay"]), sum(sizes[:lo])
                        for uid, digest, size in zip(uids, view.members.digests(lo, hi), sizes[lo:], strict=True):
                            if xxhash.xxh3_128_digest(joined[at : at + size]) != digest:
                                raise AssertionError(f"{uid}: digest")
                            at += size
                    else:
                        for uid, digest in zip(uids, view.members.digests(lo, hi), strict=True):
                            blob = snapshot.get(PREFIX + uid.encode(), db=db["blobs"])
                            if xxhash.xxh3_128_digest(blob) != digest:
                                raise AssertionError(f"{uid}: digest")
                    txn.put(key, state.encode(), db=db["sstate"])
                    held.append((RunRow(run.seg, run.first, end - run.first), uids))
                    found = cursor.delete()
                    if end < run.first + run.length:  # the rest of the run stays ready, keyed by its first group
                        rest = RunRow(run.seg, end, run.first + run.length - end)
                        txn.put(PREFIX + _U64.pack(view.rseq0 + end), rest.encode(), db=db["ready"])
                        break
            drained += taken
            lease = RowLease(table_id=1, runs=[run for run, _ in held], expires=None)
            txn.put(b"lease", lease.encode(), db=db["leases"])
            snapshot.abort()
        if not held:
            break
    env.close()
    if drained != sum(map(len, pushes)):
        raise AssertionError(f"the rows' drain took {drained} of {sum(map(len, pushes))} experiences")
    return time.process_time() - start


def decode_costs(pushes: list[list[Entry]], group: int, repeat: int = 20) -> dict[str, float]:
    """CPU µs an experience of reading what a take reads of a segment's groups: as rows (the segment
    viewed, its columns read, its state decoded) and as today's records (a group record and each
    member's item record decoded)."""
    groups = segments(pushes, group)[0]
    seg = memoryview(encode_segment(groups, 0, 0.0))
    count = sum(len(g.members) for g in groups)
    state = SegState.new([READY] * len(groups), count).encode()
    records = [
        (
            GroupRecord(state=READY, created=0.0, members=[m.uid for m in g.members], rseq=0).encode(),
            [
                ItemRecord(
                    state=READY, group=g.key, seq=m.seq, digest=m.digest, size=m.size, created=0.0, tid=g.key,
                    rid=m.uid, step=m.step, response_length=m.response_length, generated=m.generated,
                    version=m.version, reward=m.reward,
                ).encode()
                for m in g.members
            ],
        )
        for g in groups
    ]  # fmt: skip
    start = time.process_time()
    for _ in range(repeat):
        view, read = SegmentView(seg), SegState.decode(state)
        read.states(0, view.groups)
        members = view.members
        members.uids(0, count)
        members.digests(0, count)
        for name in ("size", "version", "reward", "response_length", "advantage"):
            members.column(name, 0, count)
    rows = time.process_time() - start
    start = time.process_time()
    for _ in range(repeat):
        for grp, items in records:
            GroupRecord.decode(grp)
            for item in items:
                ItemRecord.decode(item)
    return {"rows": rows / repeat / count * 1e6, "records": (time.process_time() - start) / repeat / count * 1e6}


WAYS: dict[str, Callable[[Path, list[list[Entry]], int, str], float]] = {
    "store": store_drain,
    "rows": rows_store_drain,
    "unheld": unheld_drain,
    "floor": floor_drain,
    "rows-floor": rows_drain,
    "rows-packed": lambda path, pushes, group, order: rows_drain(path, pushes, group, order, packed=True),
    "rows-build": rows_build,
}
FLOORS = ("floor", "rows-floor", "rows-packed")  # fifo's alone
ORDERS = ("fifo", "lifo", "priority", "uniform")


def measure(count: int, rounds: int, names: list[str], order: str = "fifo") -> dict[int, dict[str, list[float]]]:
    serial = itertools.count()
    results: dict[int, dict[str, list[float]]] = {}
    ways = {name: WAYS[name] for name in names}
    for group in (1, 8):
        found: dict[str, list[float]] = {way: [] for way in ways}
        for round_ in range(rounds):
            pushes = entries(count, group, serial)
            for way in list(ways)[round_ % len(ways) :] + list(ways)[: round_ % len(ways)]:
                with tempfile.TemporaryDirectory(prefix="expbuf-floor-") as data:
                    found[way].append(ways[way](Path(data), pushes, group, order) / count * 1e6)
            for way, cost in decode_costs(pushes, group).items():
                found.setdefault(f"decode {way}", []).append(cost)
        results[group] = found
        print(group, {way: [f"{value:.1f}" for value in values] for way, values in found.items()})
    return results


COLUMNS = {
    "store": "the store's take and confirm",
    "rows": "the same, a rows table (issue 64)",
    "unheld": "the store's take consuming, no hold",
    "floor": "the same reads and writes in py-lmdb",
    "rows-floor": "the same over rows (disk/rows/) in py-lmdb",
    "rows-packed": "the same, a segment's payloads one value",
    "rows-build": "a rows table's build of the order's index",
    "decode records": "a take's fields: records decoded",
    "decode rows": "a take's fields: a segment's columns read",
}
RATIOS = (
    ("store", "rows"),
    ("rows", "rows-floor"),
    ("store", "floor"),
    ("unheld", "floor"),
    ("floor", "rows-floor"),
    ("rows-floor", "rows-packed"),
    ("decode records", "decode rows"),
)


def report(command: str, load: str, count: int, results: dict[int, dict[str, list[float]]], order: str = "fifo") -> str:
    ways = [way for way in COLUMNS if all(way in found for found in results.values())]
    ratios = [(a, b) for a, b in RATIOS if a in ways and b in ways]
    lines = [
        HEADING,
        "",
        f"Command: `{command}`  ",
        f"2 cores (load average {load} at the start); {count:,} experiences of 8 KB a drain, batches of "
        f"{BATCH}, {order} order; CPU µs an experience, medians of the rounds.",
        "",
        "| groups of | "
        + " | ".join(COLUMNS[way] for way in ways)
        + "".join(f" | {a} / {b}" for a, b in ratios)
        + " |",
        "| ---: |" + " ---: |" * (len(ways) + len(ratios)),
    ]
    for group, found in results.items():
        median = {way: statistics.median(found[way]) for way in ways}
        cells = [f"{median[way]:.1f}" for way in ways] + [f"**{median[a] / median[b]:.1f}x**" for a, b in ratios]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiences", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--ways", default=",".join(WAYS), help=f"drains, comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--order", default="fifo", choices=ORDERS, help="the store's drains' order")
    args = parser.parse_args()
    names = args.ways.split(",")
    if not names or set(names) - set(WAYS):
        parser.error(f"--ways takes drains of {', '.join(WAYS)}")
    if args.order != "fifo" and set(names) & set(FLOORS):
        parser.error(f"--order {args.order}: the floors ({', '.join(FLOORS)}) drain in fifo order alone")
    command = ("python bench/bench_take_floor.py " + " ".join(sys.argv[1:])).strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    section = report(
        command, load, args.experiences, measure(args.experiences, args.rounds, names, args.order), args.order
    )
    print(section)
    write_section(Path(args.out), HEADING, section)


if __name__ == "__main__":
    main()
