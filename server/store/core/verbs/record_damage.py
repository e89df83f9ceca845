"""A records table's group whose own record is lost or does not decode (storage damage), remade from
what is left of it so that it can leave as any other does: a ready or computing one fails
(rules/quarantine.py); a pending or computing one, as a rows table's whose head is lost (row_deletes.py),
is passed over by its timeout (rules/groups.py) and removed whole by a Delete naming it or one of its
members, or by `expbuf repair` with the server stopped (retire.delete, .remove_lost_groups): nothing
else can end it. Its members are then counted damaged.

A group the table does not hold is told from a damaged one by what is left of it: its members' records,
found by what their uids begin with (a seek in the records), before the whole table's records and its
pending index or compute queue are read; `expbuf repair` reads those indexes whole (`named`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from ...disk.layout import rows_under
from ...disk.records import GroupRecord, ItemRecord
from ...schema.errors import DAMAGE
from ...schema.states import COMPUTING, PENDING, READY, State
from ...schema.views import GroupView, MemberView
from ..table_state.state import TableState
from .row_deletes import damage_of


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
    says it was pending or computing: returns what damage left of its record (row_deletes.damage_of).
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
