"""A Delete of a rows table's experiences (issue 64, 2.9), as core/verbs/retire.delete takes a records
table's out: a live member leaves its group (its payload gone, uncounted from its state and from the
rate limiter's count), a retired one's tombstone is forgotten (its uid is no duplicate any more; a
failed one's payload kept for Get goes with it, as a records table's: retire.forget_tombstone), and
a group left without members goes, as does a pending one named that has none (its runs in pieces or
reported failed alone): the extensions hear a live one leave as DELETED, and its key may be pushed
again. What the others of a group see is a records table's: the group stays as it was
(ready, leased, pending, retired), one member short.

What is written is per group touched, never a record per experience: a complete group's deleted
members are flagged in their segment's state (`SegState.DELETED`: never served, counted or a
duplicate again), and a group deleted whole also leaves its run (or lease: a lease of runs goes on
without it) and its directory entry, its state byte retired (dropped: it counts no member), so that
its segment retires and is forgotten in time as one whose groups all retired; a pending group's
members left are written again in its head (ends.left). A pending or computing group whose
head does not decode, or is lost, named or one of its members named, is removed whole (below), as a
records table's whose record is; a member named of a complete group whose directory entry does not
decode or is lost is refused (DamagedGroup), as a records table's ready group's is.

Such a group (its head, its directory entry, no longer decodes, or is lost) is removed whole by a
Delete naming it (`remove_damaged`), or by `expbuf repair` with the server stopped
(tables/integrity.repair): nothing else can end it, since what it holds cannot be read. Its members
removed are counted damaged (the table's `damaged`, as a quarantined experience is), and the group
named in its last failure. A group whose head is lost is told from one the table does not hold by
what is left of it: its payloads or fragments, then its rows in the indexes below.

Its head named its members, its fragments' count, its creation time (its key in the pending index)
and its place in the compute queue; without it each is found by the group's key: its fragments
under that key, its rows in the pending index, the compute queue and the index of the oldest among
the table's (a read of each, as long as the table's pending and computing groups), its members as
its fragments' rows and its stored payloads (whose uids begin with the group's key:
TableState.payload_uids). A member whose row was in the head and whose payload is lost too is
nowhere to be found, and stays counted.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from expbuf.client.schema.routing import uid_group_key

from ....disk.layout import expiry_of, rows_under, u64
from ....disk.records import DELETED
from ....disk.rows import PENDING as PENDING_ENTRY
from ....disk.rows import (
    REF,
    Member,
    PendingHead,
    SegState,
    decode_member_rows,
    directory_entry,
    fragment_key,
    uid_hash,
)
from ....schema.errors import DAMAGE, DamagedGroup
from ....schema.states import COMPUTING, DROPPED, FAILED, LIVE, PENDING, QUARANTINED, READY, RETIRED, State
from ...table_state import oldest_index, rate_counts
from ...table_state.events import Retired
from ...table_state.pending_reads import readable_rows
from ...table_state.picks import Picked
from ...table_state.state import TableState
from ...table_state.views import RowGroup, RowMember, quarantined, row_members
from .. import payloads, pieces
from . import ends, moves, pending, select
from .segments import retired
from .select import NO_LEASE, Segments

log = logging.getLogger("expbuf.store")

# The state byte of a complete group deleted whole: retired (its segment may retire), counting no member.
EMPTIED = DROPPED


@dataclass(slots=True)
class _Touched:
    """A group a delete meets, as it stood: its view and its members' views; of a complete group, its
    place (`picked`) and each member's index in its segment; of a pending one, its head, and the hashes
    of the members its head names whose rows damage lost (`lost`: not among its views, as a records
    table's member whose record is lost is not deleted, and kept in its head). `gone`: the members this
    delete takes out, in the order it takes them."""

    group: RowGroup
    members: dict[str, RowMember]
    picked: Picked | None = None
    places: dict[str, int] = field(default_factory=dict)
    head: PendingHead | None = None
    lost: list[int] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)

    @property
    def emptied(self) -> bool:
        return len(self.gone) == len(self.members) and not self.lost


def delete(tt: TableState, uids: Sequence[str], group_ids: Sequence[str]) -> int:
    """Experiences `uids` and the members of groups `group_ids` deleted (a records table's Delete,
    core/verbs/retire.delete); returns how many were live."""
    segments = Segments(tt)
    found: dict[str, _Touched | None] = {}

    def touched(gkey: str | None) -> _Touched | None:
        if gkey is None:
            return None
        if gkey not in found:
            found[gkey] = _read(tt, segments, gkey)
        return found[gkey]

    targets = list(uids)
    bare: dict[str, _Touched] = {}  # pending groups named that hold no member (runs in pieces, failed runs)
    deleted = 0
    for gkey in group_ids:
        try:
            grp = touched(gkey)
        except DamagedGroup:
            removed = remove_damaged(tt, gkey)
            if removed is None:
                raise
            deleted += removed
            continue
        if grp is None:  # none, or one whose head is lost
            deleted += remove_damaged(tt, gkey) or 0
        else:
            targets.extend(grp.members)
            if not grp.members and grp.group.state in LIVE:
                bare[gkey] = grp
    by, freed = tt.config.grouping.by, 0  # freed: the live bytes deleted
    # the live groups left without members: those named bare first, then in the order they were
    # emptied, as a records table's extensions hear them
    emptied: list[_Touched] = list(bare.values())
    keys: list[bytes] = []
    sizes: list[int] = []
    for uid in dict.fromkeys(targets):
        of = uid_group_key(uid, by)
        if of is None:  # not an experience's uid: no member of the table's
            continue
        try:
            grp, cut = touched(of), False
        except DamagedGroup:  # its head does not decode
            grp, cut = None, True
        if cut or (grp is None and _payload_stored(tt, uid)):
            deleted += _remove_member_s_group(tt, of)
            found[of] = None
            continue
        member = None if grp is None else grp.members.get(uid)
        if grp is None or member is None:
            continue
        state = grp.group.state
        tt.counters.add(QUARANTINED if uid in grp.group.quarantined else state, -1)
        grp.gone.append(uid)
        if state in LIVE or state == FAILED:  # a failed group's payload kept for Get goes with its tombstone
            keys.append(tt.key(uid))
            sizes.append(member.size)
        if state in LIVE:
            rate_counts.forget(tt, grp.group, [member])
            deleted += 1
            freed += member.size
            if grp.emptied:
                emptied.append(grp)
    changed = [grp for grp in found.values() if grp is not None and (grp.gone or grp.group.key in bare)]
    for grp in changed:
        if grp.picked is not None:
            row = segments.changed(grp.picked.seg)
            for uid in grp.gone:
                row.flag(grp.places[uid], SegState.DELETED)
        elif not grp.emptied:
            assert grp.head is not None
            rows = [m for m in grp.group.rows if m.uid not in grp.gone]
            ends.left(tt, grp.group.key, grp.head, rows, grp.lost)
    _gone(tt, segments, [grp for grp in changed if grp.emptied])
    segments.save()
    if emptied:  # as a records table's: each group as it stood, without members
        groups = [(grp.group.key, grp.group._replace(rows=())) for grp in emptied]
        tt.extensions.on_retired(tt, Retired(groups, DELETED))
    tt.delete_payloads(keys, sizes)
    tt.counters.bytes -= freed
    return deleted


def _payload_stored(tt: TableState, uid: str) -> bool:
    """Whether experience `uid`'s payload is stored: a member of a group whose directory entry is lost."""
    return tt.txn.get(tt.key(uid), db=tt.db["blobs"]) is not None


def _remove_member_s_group(tt: TableState, gkey: str) -> int:
    """A member named of group `gkey`, whose directory entry does not decode or is lost while its
    payload is stored: the group removed whole where it was pending or computing (`remove_damaged`), as
    a records table's is; refused where it was complete, as a records table's ready group is (its
    segment holds it, a sample serves it; `expbuf check` names it). How many members went."""
    removed = remove_damaged(tt, gkey, named=True)
    if removed is None:
        raw = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
        why = "a member's payload names it" if raw is None else "its directory entry does not decode"
        raise DamagedGroup(gkey, why, pending=False, lost=raw is None)
    return removed


def _read(tt: TableState, segments: Segments, gkey: str) -> _Touched | None:
    """The group of this key as a delete meets it; None: the table has none."""
    head = pending.head(tt, gkey)
    if head is not None:
        rows = tuple(readable_rows(tt.txn, tt.db, tt.prefix, gkey, head))
        now = head.state  # a computing one waits for the worker
        group = RowGroup(gkey, now, rows, dict(head.failed), created=head.created)
        read = {uid_hash(row.uid) for row in rows}
        return _Touched(group, row_members(group), head=head, lost=[h for h in head.hashes if h not in read])
    picked = select.complete_groups(tt, segments, [gkey])
    if not picked:
        return None
    p = picked[0]
    view, seg_state = segments.view(p.seg), segments.state(p.seg)
    group = p.group._replace(failed=view.failed(p.at), quarantined=quarantined(view, seg_state, p.at))
    places = dict(zip(group.members, seg_state.kept(*view.span(p.at)), strict=True))
    return _Touched(group, p.members, p, places)


def _gone(tt: TableState, segments: Segments, groups: Sequence[_Touched]) -> None:
    """Groups left without members go: a complete one's directory entry, and a live one's run (its
    state byte retired, no lease's), its segment retired with its last live group; a pending one's
    head, fragments and pending index row; the runs any of them holds in pieces."""
    moves.unready(tt, [grp.picked for grp in groups if grp.picked is not None and grp.group.state == READY])
    ended: set[int] = set()
    for grp in groups:
        gkey, state = grp.group.key, grp.group.state
        pieces.drop_group(tt, gkey)  # its runs still in pieces leave with it
        if state in LIVE:
            tt.counters.add_groups(state, -1)
        if grp.picked is not None and state in LIVE:
            row = segments.changed(grp.picked.seg)
            row.set_state(grp.picked.at, EMPTIED)
            row.set_lease(grp.picked.at, NO_LEASE)
            ended.add(grp.picked.seg)
        elif grp.head is not None:
            ends.left(tt, gkey, grp.head, [])
        tt.txn.delete(tt.key(gkey), db=tt.db["gdir"])
    for seg in sorted(ended):
        row = segments.state(seg)
        if row.all_in(RETIRED):
            retired(tt, seg, row)


def remove_damaged(tt: TableState, gkey: str, *, named: bool = False) -> int | None:
    """Group `gkey` removed whole where its directory entry is a pending or computing group's that
    does not decode, or is lost while what is left of the group (its payloads or fragments, then its
    rows in the pending index, the compute queue or the index of the oldest) says it was pending or
    computing: returns how many members it had, each counted damaged. None where it is no such group
    (a complete group's place that does not decode, or is lost, is not removed: its segment still
    holds the group; a group the table does not hold costs a read of its payloads' and fragments' keys,
    then the indexes' where some are stored or the caller found it `named` in one)."""
    raw = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
    if raw is not None and (raw[0] == REF or _decodes(raw)):
        return None
    uids = tt.payload_uids(gkey)
    was = _was_pending(tt, gkey, raw, bool(uids) or named)
    if was is None:
        return None
    state, created = was
    rows = _fragments(tt, gkey)
    found = {row.uid for row in rows}
    rows += [tt.member_from_payload(uid, created) for uid in uids if uid not in found]
    oldest_index.group_gone(tt, gkey)
    tt.txn.delete(tt.key(gkey), db=tt.db["gdir"])
    tt.counters.add(state, -len(rows))
    tt.counters.add_groups(state, -1)
    payloads.drop(tt, [tt.key(row.uid) for row in rows], [row.size for row in rows])
    tt.extensions.on_retired(tt, Retired([(gkey, RowGroup(gkey, state, (), created=created))], DELETED))
    counted_removed(tt, gkey, state, damage_of(raw), len(rows))
    return len(rows)


def counted_removed(tt: TableState, gkey: str, state: State, why: str, count: int) -> None:
    """A damaged group removed whole, a rows or a records table's: its `count` members counted damaged,
    as quarantined experiences are, the group named in the table's last failure, and logged."""
    tt.counters.damaged += count
    tt.counters.last_failure = f"group {gkey}: its record {why}; removed whole with {count} experience(s)"
    log.warning(
        "table %s: %s group %s, whose record %s, deleted whole: %d experience(s)",
        tt.config.name, state, gkey, why, count,
    )  # fmt: skip


def _was_pending(tt: TableState, gkey: str, raw: bytes | None, traces: bool) -> tuple[State, float] | None:
    """Whether group `gkey`, whose directory entry (`raw`; None: lost) does not decode, was pending
    (with its creation time where the pending index still names it) or computing; None: neither. Its
    rows in the pending index or the compute queue are deleted as they are found. One whose entry is
    lost is looked for in the indexes only where something of it is left (`traces`: its payloads, or
    an index the caller read names it) or its fragments are: a Delete naming a group the table does
    not hold reads no index."""
    fragments = raw is None and _has_fragments(tt, gkey)
    if raw is None and not (traces or fragments):
        return None
    listed = _listed(tt, gkey)
    if listed is not None:
        return listed
    if raw is not None:
        return (PENDING, tt.now) if raw[0] == PENDING_ENTRY else None
    # a complete group's members are its segment's, never under the group's key in the index of the oldest
    return (PENDING, tt.now) if fragments or oldest_index.group_gone(tt, gkey) else None


def damage_of(raw: bytes | None) -> str:
    """What damage left of a damaged group's directory entry, as its removal tells it."""
    return "was lost" if raw is None else "did not decode"


def remove_damaged_groups(tt: TableState) -> list[tuple[str, int, str]]:
    """Every pending or computing group of the table whose head does not decode, or is lost (an index
    or a fragment names a group the directory does not), removed whole (`remove_damaged`), as `expbuf
    repair` does with the server stopped: each group's key, how many members it had and what damage
    left of its head (`damage_of`). Its directory, pending index, compute queue, fragments and index of
    the oldest are read whole."""
    prefix, ref = tt.prefix, bytes([REF])
    found: dict[str, bytes | None] = {}
    with tt.txn.cursor(db=tt.db["gdir"]) as cur:
        more = cur.set_range(prefix)
        while more and cur.key()[: len(prefix)] == prefix:
            if cur.value()[:1] != ref and not _decodes(cur.value()):
                found[bytes(cur.key()[len(prefix) :]).decode(errors="replace")] = bytes(cur.value())
            more = cur.next()
    for gkey in _named_elsewhere(tt):
        if gkey not in found and tt.txn.get(tt.key(gkey), db=tt.db["gdir"]) is None:
            found[gkey] = None
    removed = ((gkey, remove_damaged(tt, gkey, named=True), damage_of(raw)) for gkey, raw in found.items())
    return [(gkey, count, why) for gkey, count, why in removed if count is not None]


def _named_elsewhere(tt: TableState) -> set[str]:
    """The keys of the pending and computing groups the pending index, the compute queue, the fragments
    and the index of the oldest name."""

    def rows(name: str) -> list[tuple[bytes, bytes]]:
        return rows_under(tt.txn, tt.db[name], tt.prefix)

    names = {key[8:] for key, _ in rows("pending")} | {value for _, value in rows("compute")}
    names |= {key[:-5] for key, _ in rows("frags")}  # a zero and its number follow the key (fragment_key)
    names |= {name for key, _ in rows("oldest") if (name := oldest_index.group_of(key))}
    return {name.decode(errors="replace") for name in names}


def _decodes(raw: bytes) -> bool:
    """Whether a directory entry decodes: one that does is the group's to end as any other."""
    try:
        directory_entry(raw)
    except DAMAGE:
        return False
    return True


def _listed(tt: TableState, gkey: str) -> tuple[State, float] | None:
    """Whether the pending index (pending, with its creation time) or the compute queue (computing)
    names the group, its row there deleted; None: neither does (a timeout passed over it)."""
    row, prefix = tt.pending_place(gkey), tt.prefix
    if row is not None:
        tt.txn.delete(row, db=tt.db["pending"])
        return PENDING, expiry_of(row[len(prefix) :])  # its creation time, as the key holds it
    place = tt.queued_place(gkey)
    if place is None:
        return None
    tt.txn.delete(prefix + u64(place), db=tt.db["compute"])
    return COMPUTING, tt.now


def _has_fragments(tt: TableState, gkey: str) -> bool:
    """Whether a fragment of the group is stored (one seek)."""
    begin = fragment_key(tt.prefix, gkey, 0)[:-4]
    with tt.txn.cursor(db=tt.db["frags"]) as cur:
        more = cur.set_range(begin)
        while more and cur.key()[: len(begin)] == begin:
            if len(cur.key()) == len(begin) + 4:  # else another group's, whose key goes on after this one's
                return True
            more = cur.next()
    return False


def _fragments(tt: TableState, gkey: str) -> list[Member]:
    """The rows of the group's fragments that decode, its fragments deleted."""
    begin = fragment_key(tt.prefix, gkey, 0)[:-4]
    rows: list[Member] = []
    with tt.txn.cursor(db=tt.db["frags"]) as cur:
        more = cur.set_range(begin)
        while more and cur.key()[: len(begin)] == begin:
            if len(cur.key()) != len(begin) + 4:  # another group's, whose key goes on after this one's
                more = cur.next()
                continue
            with contextlib.suppress(DAMAGE):
                rows.extend(decode_member_rows(cur.value()))
            more = cur.delete()
    return rows
