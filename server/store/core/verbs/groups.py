"""A table's group records: a pending group opened and kept, its members added (their records,
payloads and places in the insertion order), its failed runs recorded, and its completion (its
lowest version, priority and place in the ready order, then ready or computing). What a push,
a report of failed runs, a seal or a timeout decides about its groups is rules/groups.py's.

A group whose own record is lost or does not decode is remade from what is left of it, so that it can
leave as any other does: a ready or computing one fails (rules/quarantine.py); a pending or computing one, as a
rows table's whose head is lost (rows/deletes.py), is removed whole by a Delete naming it or one of its
members, or by `expbuf repair` (retire.delete, .remove_lost_groups), its members counted damaged.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping, Sequence

import lmdb

from ...disk import layout
from ...disk.kinds import Entry
from ...disk.layout import put_rows, rows_under, u64
from ...disk.records import GroupRecord, ItemRecord
from ...schema.errors import DAMAGE, clip
from ...schema.states import COMPUTING, PENDING, READY, State
from ...schema.views import GroupView, Members, MemberView
from ..ordering.ready import Row
from ..table_state import rate_counts
from ..table_state.state import TableState
from ..table_state.views import RowGroup, group_record
from . import payloads, pieces
from .rows.deletes import damage_of

# A pending group about to complete: its key, view, members' views (closing), and whether it is in
# the pending index.
Closed = tuple[str, GroupView, dict[str, MemberView], bool]


def new(tt: TableState) -> GroupView:
    """A new pending group, counted (neither indexed as pending nor written yet)."""
    tt.counters.groups_pending += 1
    return GroupRecord(state=PENDING, created=tt.now)


def pend(tt: TableState, gkey: str, grp: GroupView) -> None:
    """A new group's row in the pending index (its timeout's)."""
    tt.txn.put(tt.pending_key(gkey, group_record(grp)), b"", db=tt.db["pending"])


def open_pending(tt: TableState, gkey: str) -> GroupView:
    """A new pending group, indexed and written."""
    grp = new(tt)
    pend(tt, gkey, grp)
    keep(tt, gkey, grp)
    return grp


def keep(tt: TableState, gkey: str, grp: GroupView) -> None:
    """A pending group changed (members added, runs recorded failed), written by save."""
    tt.put_group(gkey, group_record(grp))


def record_failed(grp: GroupView, uid: str, reason: str) -> GroupView:
    """A run reported failed: one of the group's runs, not a member. Returns the group's view with
    it (a rows table's is a new view, for rows/pending.keep to write)."""
    why = clip(reason or "failed", 200)
    if isinstance(grp, RowGroup):
        return grp._replace(failed={**grp.failed, uid: why})
    group_record(grp).failed[uid] = why
    return grp


def forget_failed(grp: GroupView, uids: Sequence[str]) -> None:
    """Runs reported failed, then pushed after all (a retry that worked): members, no more failed."""
    failed = group_record(grp).failed
    for uid in uids:
        failed.pop(uid, None)


def unlist_pending(tt: TableState, key: bytes) -> None:
    """A pending group leaves the pending index (its key there, from `expired`): one whose head does
    not decode, which its timeout cannot end, is met once, not at every pass."""
    tt.txn.delete(key, db=tt.db["pending"])


def expired(tt: TableState, created_before: float) -> list[tuple[str, bytes]]:
    """The pending groups created before the cutoff, oldest first, each with its key in the pending index."""
    found = []
    cutoff = layout.micros(created_before)
    with tt.txn.cursor(db=tt.db["pending"]) as cur:
        at = cur.set_range(tt.prefix)
        while at and cur.key().startswith(tt.prefix) and cur.key()[4:12] <= cutoff:
            found.append((cur.key()[12:].decode(), bytes(cur.key())))
            at = cur.next()
    return found


def oldest_pending(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> bytes | None:
    """When a table's oldest pending group was created (8 sortable bytes), None: it has none."""
    return layout.first_time(txn, dbs["pending"], prefix)


def add_members(tt: TableState, by_group: dict[str, list[Entry]], groups: dict[str, GroupView]) -> None:
    """New experiences as pending members of their groups, in push order: their records
    (written by save), payloads and places in the insertion order."""
    prefix, now, seq = tt.prefix, tt.now, tt.counters.next_seq
    order: list[tuple[bytes, bytes]] = []  # insertion order: T + seq -> uid
    for gkey, members in by_group.items():
        grp = group_record(groups[gkey])
        for entry in members:
            tt.put_item(entry.uid, entry.record(gkey, seq=seq, created=now))
            order.append((prefix + u64(seq), entry.uid.encode()))
            grp.members.append(entry.uid)
            seq += 1
    put_rows(tt.txn, tt.db["order"], order)
    payloads.store(tt, list(itertools.chain.from_iterable(by_group.values())))


def closing(tt: TableState, gkey: str, grp: GroupView, *, partial: bool) -> dict[str, MemberView]:
    """A pending group about to complete (or to be dropped as it does): flagged partial (sealed,
    timed out, runs reported failed); its runs still in pieces dropped, as they will not join it
    (complete, it takes no more pieces: even with all its runs, a run past them may hold some);
    its members' views."""
    recs = tt.members(grp)
    group_record(grp).partial = partial
    pieces.drop_group(tt, gkey)
    return recs


def complete(
    tt: TableState,
    groups: Sequence[Closed],
    *,
    ready: list[Row] | None = None,
    computing: list[Members] | None = None,
) -> None:
    """Pending groups (each with its members' views, and whether it is in the pending index:
    a group opened and filled by one push never is) become ready, or computing, together, in
    the ready order's next places, each with its members' lowest version (None unless every
    member has one) and highest priority. With `ready`, the ready groups' index entries are
    appended there for the caller to add with others (ReadyIndex.add_many) instead of added now.
    With `computing` (a push whose table has an advantage computation), the groups that need
    advantages are appended there, still pending, for the caller's compute_in_push."""
    now_ready: list[Members] = []
    placed: list[tuple[str, GroupRecord]] = []  # the ready ones' records
    queued: list[Members] = []
    estimated = tt.config.advantages.estimator != "none"
    for gkey, view, recs, indexed in groups:
        grp = group_record(view)
        if indexed:
            tt.txn.delete(tt.pending_key(gkey, grp), db=tt.db["pending"])
        grp.version, grp.priority = placed_by(recs)
        grp.rseq = tt.counters.next_rseq
        tt.counters.next_rseq += 1
        if not estimated:
            now_ready.append((gkey, grp, recs))
            placed.append((gkey, grp))
        elif computing is not None:
            computing.append((gkey, grp, recs))
        else:  # queued for its advantages (compute.py); sampled once they are stored (finish_compute)
            queued.append((gkey, grp, recs))
    if now_ready:
        tt.set_states(now_ready, READY)
        rate_counts.became_ready(tt, sum(len(recs) for _, _, recs in now_ready))
        rows = [(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in placed]
        if ready is None:
            tt.ready.add_many(rows)
        else:
            ready.extend(rows)
    if queued:
        tt.set_states(queued, COMPUTING)


def placed_by(recs: Mapping[str, MemberView]) -> tuple[int | None, float]:
    """A complete group's lowest version (None unless every member has one) and highest
    priority, from its members'."""
    versions = [rec.version for rec in recs.values() if rec.version is not None]
    version = min(versions) if versions and len(versions) == len(recs) else None
    return version, max((rec.priority for rec in recs.values()), default=0.0)


def _group_of(raw: bytes | memoryview) -> str | None:
    """The group an item record names; None where it is cut short of it."""
    try:
        return ItemRecord.group_of(raw)
    except DAMAGE:
        return None


def remade(tt: TableState, gkey: str) -> GroupView | None:
    """The record of a ready group that the directory lost, remade from what is left so that the
    group can leave as any other does: its members are the ready experiences whose records name
    it, in push order, found by reading every record of the table (damage is rare, and the request
    that meets it pays for it); its place and priority, as the ready indexes hold them
    (ReadyIndex.lost). None: the ready order does not name it. A record cut short of its group
    names none: it is its own reader's to meet as lost."""
    recs = _naming(tt, gkey, READY)
    version, priority = placed_by(recs)
    placed = tt.ready.lost(gkey.encode(), version, priority)
    if placed is None:
        return None
    return _remade(tt, gkey, READY, recs, placed.rseq, placed.priority)


def remade_computing(tt: TableState, gkey: str) -> GroupRecord | None:
    """The record of a computing group that the directory lost (or that does not decode), remade as
    `remade` makes a ready one's, so that it can fail: its members the computing experiences whose
    records name it, its place the one the compute queue holds it at (TableState.queued_place).
    None: its record is there (stored again meanwhile), or the queue no longer holds it."""
    place = tt.queued_place(gkey)
    if place is None or tt.group(gkey) is not None:
        return None
    recs = _naming(tt, gkey, COMPUTING)
    return _remade(tt, gkey, COMPUTING, recs, place, placed_by(recs)[1])


def remade_pending(tt: TableState, gkey: str) -> GroupRecord | None:
    """The record of a pending group that the directory lost (or that does not decode), remade as
    `remade` makes a ready one's, so that a Delete can remove it: its members the pending experiences
    whose records name it; its row in the pending index, found by the group's key (its creation time
    is in the lost record), goes. None: its record is there, or neither names it."""
    if tt.group(gkey) is not None:
        return None
    row, recs = tt.pending_place(gkey), _naming(tt, gkey, PENDING)
    if row is None and not recs:
        return None
    if row is not None:
        tt.txn.delete(row, db=tt.db["pending"])
    return _remade(tt, gkey, PENDING, recs, None, 0.0)


def _naming(tt: TableState, gkey: str, state: State) -> dict[str, ItemRecord]:
    """The experiences in `state` whose records name group `gkey`, found by reading every record of
    the table (damage is rare, and the request that meets it pays for it)."""
    uids = []
    with tt.txn.cursor(db=tt.db["items"]) as cur:
        found = cur.set_range(tt.prefix)
        while found and cur.key().startswith(tt.prefix):
            if _group_of(cur.value()) == gkey:
                uids.append(bytes(cur.key()[len(tt.prefix) :]).decode())
            found = cur.next()
    return {uid: rec for uid in uids if (rec := tt.item(uid)) is not None and rec.state == state}


def _remade(
    tt: TableState, gkey: str, state: State, recs: Mapping[str, ItemRecord], rseq: int | None, priority: float
) -> GroupRecord:
    """A lost group's record remade from its members' (in push order) at its place, and stored."""
    grp = GroupRecord(
        state=state,
        created=min((rec.created for rec in recs.values()), default=tt.now),
        members=sorted(recs, key=lambda uid: recs[uid].seq),
        rseq=rseq,
        priority=priority,
        version=placed_by(recs)[0],
    )
    tt.put_group(gkey, grp)
    return grp


def remade_lost(tt: TableState, gkey: str, *, named: bool = False) -> str | None:
    """Group `gkey`'s record remade where it is lost, or does not decode, and what is left of the group
    says it was pending or computing: returns what damage left of its record (rows/deletes.damage_of).
    None where it is no such group: its record is there, nothing of it is left, or its members say it
    was complete (a ready group whose record is lost fails when a sample meets it: quarantine.py). A
    group the caller did not find `named` in an index is looked for only where a member's record is."""
    if tt.group(gkey) is not None or not (named or tt.record_uids(gkey)):
        return None
    raw = tt.txn.get(tt.key(gkey), db=tt.db["groups"])
    if remade_computing(tt, gkey) is None and remade_pending(tt, gkey) is None:
        return None
    return damage_of(raw)


def named_lost(tt: TableState) -> list[str]:
    """The groups that the pending index, the compute queue or a pending or computing member's record
    names and that have no record that decodes: what `expbuf repair` removes (each read whole)."""
    names = [key[8:] for key, _ in rows_under(tt.txn, tt.db["pending"], tt.prefix)]
    names += [value for _, value in rows_under(tt.txn, tt.db["compute"], tt.prefix)]
    found = [name.decode(errors="replace") for name in names]
    with tt.txn.cursor(db=tt.db["items"]) as cur:
        more = cur.set_range(tt.prefix)
        while more and cur.key()[: len(tt.prefix)] == tt.prefix:
            with contextlib.suppress(DAMAGE):
                if ItemRecord.place(cur.value())[0] in (PENDING, COMPUTING):
                    found.append(ItemRecord.group_of(cur.value()))
            more = cur.next()
    return [gkey for gkey in dict.fromkeys(found) if tt.group(gkey) is None]
