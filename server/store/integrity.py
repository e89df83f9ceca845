"""The integrity check behind `expbuf check`: every index, group and counter of a table
against its stored experiences. A consistent table gives no problems."""

from __future__ import annotations

from collections import defaultdict

from expbuf.client import trxp

from ..selection import u64, version_key
from .groups import TableTxn
from .records import COMPUTING, FAILED, LIVE, PENDING, READY, RETIRED, STATES, GroupRecord, ItemRecord


def verify(tt: TableTxn) -> list[str]:
    """The problems found in one table; [] when consistent."""
    problems: list[str] = []
    p, txn, db = tt.prefix, tt.txn, tt.db
    counts: dict[str, int] = defaultdict(int)
    groups: dict[str, GroupRecord] = {}
    with txn.cursor(db=db["groups"]) as cur:
        found = cur.set_range(p)
        while found and cur.key().startswith(p):
            groups[cur.key()[4:].decode()] = GroupRecord.decode(cur.value())
            found = cur.next()
    with txn.cursor(db=db["items"]) as cur:
        found = cur.set_range(p)
        while found and cur.key().startswith(p):
            uid, rec = cur.key()[4:].decode(), ItemRecord.decode(cur.value())
            problems.extend(_check_item(tt, uid, rec, groups.get(rec.group), counts))
            found = cur.next()
    ready_groups = set()
    versioned = 0  # ready groups of a known version
    for gkey, grp in groups.items():
        if grp.state in LIVE:
            counts["groups_" + grp.state] += 1
        if grp.state == COMPUTING and txn.get(tt.rseq_key(grp), db=db["compute"]) != gkey.encode():
            problems.append(f"computing group {gkey} is missing from the compute queue")
        if grp.state == READY:
            ready_groups.add(gkey)
            if txn.get(tt.rseq_key(grp), db=db["ready"]) != gkey.encode():
                problems.append(f"ready group {gkey} is missing from the ready index")
            if grp.version is not None:
                versioned += 1
                raw = txn.get(p + version_key(grp.version) + u64(grp.rseq), db=db["byver"])
                if raw is None or raw[8:] != gkey.encode():
                    problems.append(f"ready group {gkey} is missing from the version index")
        if grp.state == PENDING and txn.get(tt.pending_key(gkey, grp), db=db["pending"]) is None:
            problems.append(f"pending group {gkey} is missing from the timeout index")
    tombstones = sum(counts[state] for state in RETIRED)
    if _prefix_count(tt, "retired") != tombstones:
        problems.append(f"the retired index holds {_prefix_count(tt, 'retired')} of {tombstones} tombstones")
    if _prefix_count(tt, "compute") != counts["groups_computing"]:
        problems.append(f"the compute queue holds {_prefix_count(tt, 'compute')} groups")
    for name in ("ready", "prio", "slotof"):
        indexed = _prefix_count(tt, name)
        if indexed != len(ready_groups):
            problems.append(f"the {name} index holds {indexed} groups, {len(ready_groups)} are ready")
    if _prefix_count(tt, "byver") != versioned:
        problems.append(f"the version index holds {_prefix_count(tt, 'byver')} groups, {versioned} have a version")
    if tt.ready.count() != len(ready_groups):
        problems.append(f"{tt.ready.count()} uniform slots for {len(ready_groups)} ready groups")
    for name in (*STATES, "bytes", *(f"groups_{state}" for state in LIVE)):
        if tt.counters[name] != counts[name]:
            problems.append(f"counter {name} is {tt.counters[name]} but {counts[name]} were found")
    live = sum(counts[state] for state in LIVE)
    if _prefix_count(tt, "order") != live:
        problems.append(f"the insertion order holds {_prefix_count(tt, 'order')} of {live} live items")
    return problems


def _check_item(tt: TableTxn, uid: str, rec: ItemRecord, grp: GroupRecord | None, counts: dict[str, int]) -> list[str]:
    problems = []
    counts[rec.state] += 1
    live = rec.state in LIVE
    blob = tt.txn.get(tt.key(uid), db=tt.db["blobs"])
    if live != (blob is not None) and not (rec.state == FAILED and tt.config.keep_failed):
        problems.append(f"item {uid} is {rec.state} but its payload is {'missing' if live else 'present'}")
    if live:
        counts["bytes"] += rec.size
        trxp.parse(blob, trusted=True)
        if tt.txn.get(tt.prefix + u64(rec.seq), db=tt.db["order"]) != uid.encode():
            problems.append(f"item {uid} is missing from the insertion order")
    if grp is None or uid not in grp.members:
        problems.append(f"item {uid} is not a member of its group {rec.group}")
    elif grp.state != rec.state:
        problems.append(f"item {uid} is {rec.state} but its group {rec.group} is {grp.state}")
    return problems


def _prefix_count(tt: TableTxn, name: str) -> int:
    n = 0
    with tt.txn.cursor(db=tt.db[name]) as cur:
        found = cur.set_range(tt.prefix)
        while found and cur.key().startswith(tt.prefix):
            n += len(cur.key()) > len(tt.prefix)
            found = cur.next()
    return n
