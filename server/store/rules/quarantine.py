"""Quarantine: an experience whose stored payload is not the one pushed (damage on disk, found
by a read's check of its digest or by the scrub) leaves the buffer in a state of its own,
`quarantined`, and is never served.

Its group fails: a batch holds whole groups, and the group's advantages were computed with the
damaged member. The group's other members keep their payloads, as failed experiences, for Get
and export until their tombstones are forgotten (`tombstone_seconds`), so nothing good is lost
with it. A member of a group that had failed already, whose payload was kept, is quarantined
alone. Each experience is logged once, with its uid, when it is quarantined, and counted: by
state (`quarantined`, a tombstone forgotten in time like the others) and in the total `damaged`.

A member its group names whose record the directory lost (found by a sample) is quarantined
alike: its tombstone is made from what is left (its payload's digest where the payload is, so
that a retried push of it is still a duplicate), and its payload and place in the insertion
order, found by its uid, go.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from ..core.read_check import payload_problem
from ..core.state import TableState
from ..disk import chunk_reads, chunked, digests
from ..disk.records import GroupRecord, ItemRecord
from ..schema.states import FAILED, LIVE, QUARANTINED, State
from .retirement import drop_payloads, retire

log = logging.getLogger("expbuf.store")


def quarantine_groups(tt: TableState, groups: Sequence[tuple[str, GroupRecord, dict[str, str]]]) -> int:
    """Live groups with damaged members (uid -> why) fail; those members are quarantined.
    Returns how many were."""
    quarantined: set[str] = set()
    lost: list[tuple[str, State, str]] = []  # members whose records are not stored: (group, its state, uid)
    for gkey, grp, damaged in groups:
        for uid, why in damaged.items():
            log.error(
                "table %s: experience %s quarantined (%s): never served; its group %s failed",
                tt.config.name, uid, why, gkey,
            )  # fmt: skip
        quarantined |= damaged.keys()
        lost += [(gkey, grp.state, uid) for uid in damaged if tt.item(uid) is None]
        tt.counters.groups_failed += 1
        uid, why = next(iter(damaged.items()))
        tt.counters.last_failure = f"group {gkey}: experience {uid} quarantined: {why}"
    tt.counters.damaged += len(quarantined)
    retire(tt, [(gkey, grp) for gkey, grp, _ in groups], FAILED, quarantined)  # leaves the lost alone
    for gkey, state, uid in lost:
        _bury_lost(tt, gkey, state, uid)
    return len(quarantined)


def _bury_lost(tt: TableState, gkey: str, state: State, uid: str) -> None:
    """A member of group `gkey` (which was in `state`) whose record is lost: what is left of it
    goes, its payload's bytes uncounted (the record's size was the payload's), and it becomes a
    quarantined tombstone, so that its failed group is whole and pruned in time as the others."""
    key = tt.key(uid)
    blob = chunk_reads.read_payload(tt.txn, tt.db, key)
    size = 0 if blob is None else len(blob)
    place = _place_of(tt, uid)
    drop_payloads(tt, [key], [size], [] if place is None else [place], size)
    rec = ItemRecord(
        state=QUARANTINED, group=gkey, seq=0, digest=bytes(16) if blob is None else digests.of(blob), size=0,
        created=tt.now, tid="", rid="", step=0, response_length=0, generated=0, retired=tt.now,
    )  # fmt: skip
    tt.txn.put(key, rec.tombstone(), db=tt.db["tombs"])
    tt.settle_item(uid, rec)
    tt.counters.add(state, -1)
    tt.counters.add(QUARANTINED, 1)


def _place_of(tt: TableState, uid: str) -> bytes | None:
    """The uid's key in the table's insertion order, found by reading the order through (its
    record, which says where, is lost): damage is rare, and its sample pays for it."""
    name = uid.encode()
    with tt.txn.cursor(db=tt.db["order"]) as cur:
        found = cur.set_range(tt.prefix)
        while found and cur.key().startswith(tt.prefix):
            if cur.value() == name:
                return cur.key()
            found = cur.next()
    return None


def quarantine_kept(tt: TableState, uid: str, rec: ItemRecord, why: str) -> None:
    """A failed experience whose kept payload is damaged: quarantined alone, its payload gone."""
    log.error("table %s: experience %s quarantined (%s): never served", tt.config.name, uid, why)
    key = tt.key(uid)
    chunked.delete(tt.txn, tt.db, [key], [rec.size])
    tt.txn.delete(key, db=tt.db["items"])
    rec.state = QUARANTINED
    tt.txn.put(key, rec.tombstone(), db=tt.db["tombs"])
    tt.settle_item(uid, rec)
    tt.counters.add(FAILED, -1)
    tt.counters.add(QUARANTINED, 1)
    tt.counters.damaged += 1


def quarantine_found(tt: TableState, uids: Iterable[str]) -> int:
    """Quarantine those of `uids` whose stored payload, read again here in the write
    transaction, is damaged; those changed or gone since they were found are left alone.
    Returns how many were quarantined."""
    groups: dict[str, tuple[GroupRecord, dict[str, str]]] = {}
    count = 0
    for uid in dict.fromkeys(uids):
        rec = tt.item(uid)
        if rec is None or rec.state not in (*LIVE, FAILED):
            continue
        blob = chunk_reads.read_payload(tt.txn, tt.db, tt.key(uid))
        why = None if blob is None else payload_problem(uid, rec, blob)
        if why is None:
            continue
        if rec.state == FAILED:
            quarantine_kept(tt, uid, rec, why)
            count += 1
            continue
        grp = tt.existing_group(rec.group)
        groups.setdefault(rec.group, (grp, {}))[1][uid] = why
    count += quarantine_groups(tt, [(gkey, grp, damaged) for gkey, (grp, damaged) in groups.items()])
    return count
