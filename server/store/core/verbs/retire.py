"""How experiences leave a table: retired groups (consumed, evicted, dropped, failed) keep
their members' records as tombstones, so that a retried push of the same uid is still a
duplicate, while their payloads go; tombstones are forgotten after `tombstone_seconds`; groups
a trainer trained are consumed (`consume`; rules/trained.py says which); a Delete removes
experiences outright, tombstones included; and a damaged experience becomes a quarantined
tombstone (`quarantine_kept`, `bury_lost`; rules/quarantine.py says when), as does a member
whose record is lost that a retirement meets, logged here, where it is found.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence, Set

import lmdb

from expbuf.client.schema.routing import uid_group_key

from ...disk import chunk_reads, digests, layout
from ...disk.layout import put_rows, u64
from ...disk.records import DELETED, GroupRecord, ItemRecord
from ...schema.errors import DAMAGE
from ...schema.states import COMPUTING, CONSUMED, FAILED, LIVE, PENDING, QUARANTINED, READY, RETIRED, State
from ...schema.views import Groups, MemberView
from ..table_state import rate_counts
from ..table_state.events import Retired
from ..table_state.state import TableState
from ..table_state.views import RowGroup, RowMember, group_record, member_record
from . import groups, payloads, pieces
from .rows import deletes as row_deletes
from .rows import ends as row_ends
from .rows import moves as row_moves
from .rows import pending as row_pending
from .rows import segments

log = logging.getLogger("expbuf.store")


def _delete_rows(txn: lmdb.Transaction[bytes], db: lmdb._Database, keys: Iterable[bytes]) -> None:
    """Delete keys (absent ones are no error) from one database."""
    for key in keys:
        txn.delete(key, db=db)


def retire(
    tt: TableState, groups: Groups, state: State, quarantined: Set[str] = frozenset(), *, keep_payloads: bool = False
) -> None:
    """Members leave the buffer (consumed, evicted, dropped, failed): payloads go (a failed
    group's stay with keep_failed, and those of a group failed for damage: a quarantined member,
    or `keep_payloads`), records stay as tombstones so that a retried push of the same uid is
    still recognised as a duplicate, pruned after tombstone_seconds: compact ones (records.py,
    in the tombs database) where the payload goes, full records where it is kept. The members
    among `quarantined` (their payloads damaged or their records lost, quarantine.py) become
    quarantined tombstones, their payloads gone, and so does a member whose record is lost
    (bury_lost), counted damaged and logged where the caller did not name it among them. Done
    in passes, one per database, over all the groups; a record not read yet in this transaction
    becomes a tombstone without being decoded (one a damaged page cut short is lost, as `item`
    reads it). The table's extensions hear of it first
    (`Retired`). A rows table's pending groups leave as row_ends.retire has it."""
    if groups and isinstance(groups[0][1], RowGroup):
        row_ends.retire(tt, groups, state, quarantined)
        return
    tt.extensions.on_retired(tt, Retired(groups, state))
    records = [(gkey, group_record(grp)) for gkey, grp in groups]
    for gkey, _ in records:
        pieces.drop_group(tt, gkey)
    if state != CONSUMED:
        for _, grp in records:
            if grp.state in rate_counts.COUNTED:
                rate_counts.forget(tt, grp, [rec for uid in grp.members if (rec := tt.item(uid)) is not None])
    ready = [(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in records if grp.state == READY]
    tt.ready.remove_many(ready)
    for gkey, grp in records:
        if grp.state != READY:
            leave_indexes(tt, gkey, grp)
    counters, now, prefix = tt.counters, tt.now, tt.prefix
    stamp = prefix + layout.micros(now)  # retired_key() of every group retired now
    # A kept payload keeps its full record, for Get.
    keep = state == FAILED and (tt.config.retention.keep_failed or keep_payloads or bool(quarantined))
    keys, sizes, places, marks, full, tombstones, damaged = [], [], [], [], [], [], []
    lost: list[tuple[str, State, str]] = []  # members whose records are not stored: (group, its state, uid)
    for gkey, grp in records:
        for uid in grp.members:
            key = tt.key(uid)
            kept = keep and uid not in quarantined
            became = QUARANTINED if uid in quarantined else state
            cached, rec = tt.cached_item(uid)
            if cached:
                if rec is None:
                    lost.append((gkey, grp.state, uid))
                    continue
                seq, size = rec.seq, rec.size
                rec.state, rec.retired = became, now
                if kept:
                    tt.put_item(uid, rec)
                else:
                    tt.settle_item(uid, rec)
                    tombstones.append((key, rec.tombstone()))
            else:
                raw = tt.txn.get(key, db=tt.db["items"])
                undecoded = None if raw is None else _retired_as(raw, became, now, kept=kept)
                if undecoded is None:
                    if raw is not None:  # a damaged page left it undecodable: lost, as `item` reads it (logged)
                        tt.item(uid)
                    lost.append((gkey, grp.state, uid))
                    continue
                seq, size, row = undecoded
                if kept:
                    full.append((key, row))
                else:
                    tombstones.append((key, row))
            counters.add(grp.state, -1)  # the members' state (the group's, while it is live)
            counters.add(became, 1)
            keys.append(key)
            sizes.append(size)
            places.append(prefix + u64(seq))
            if uid in quarantined:
                damaged.append((key, size))
        tt.move_group(gkey, grp, state)
        # its tombstone, members or none (runs all reported failed): a later report or push finds it complete
        marks.append((stamp + gkey.encode(), b""))
    drop_payloads(tt, keys, sizes, places, keep_blobs=keep)
    if keep:  # the quarantined members' payloads go all the same
        damaged.sort()
        tt.delete_payloads([key for key, _ in damaged], [size for _, size in damaged])
    gone = sorted(key for key, _ in tombstones)
    _delete_rows(tt.txn, tt.db["items"], gone)  # the records leave the live ones' pages, which stay dense
    for db, rows in ((tt.db["items"], full), (tt.db["tombs"], tombstones), (tt.db["retired"], marks)):
        rows.sort()
        put_rows(tt.txn, db, rows)
    _found_lost(tt, [(gkey, uid) for gkey, _, uid in lost if uid not in quarantined], state)
    bury_lost(tt, lost)


def _retired_as(raw: bytes, state: State, now: float, *, kept: bool) -> tuple[int, int, bytes] | None:
    """A live record retired as `state` without being decoded: its insertion sequence, its size and
    what it becomes (its full record where its payload is `kept`, else its compact tombstone); None
    where a damaged page cut it short of what these read."""
    try:
        _, seq, size = ItemRecord.place(raw)
        return seq, size, ItemRecord.retired_as(raw, state, now) if kept else ItemRecord.tombstone_of(raw, state, now)
    except DAMAGE:
        return None


def _found_lost(tt: TableState, lost: Sequence[tuple[str, str]], state: State) -> None:
    """Members of groups retired as `state` whose records are lost, found by the retirement
    itself: counted damaged and logged, once each, as the quarantine rule does those it names."""
    for gkey, uid in lost:
        why = tt.lost_why(uid)
        log.error(
            "table %s: experience %s quarantined (%s): never served; its group %s left as %s",
            tt.config.name, uid, why, gkey, state,
        )  # fmt: skip
        tt.counters.last_failure = f"group {gkey}: experience {uid} quarantined: {why}"
    tt.counters.damaged += len(lost)


def consume(tt: TableState, groups: Groups) -> None:
    """Groups a trainer trained without a lease of this table (ready, or leased with its token)
    consumed, as an ack consumes a lease's: a ready one, never taken, leaves the rate limiter's
    count as a delete does; a leased one's lease is over."""
    for _, grp in groups:
        if grp.state == READY:  # never taken: out of the rate limiter's count, as a delete is
            rate_counts.forget(tt, grp, tt.stored_members(grp).values())
        group_record(grp).lease = ""
    retire(tt, groups, CONSUMED)


def leave_indexes(tt: TableState, gkey: str, grp: GroupRecord) -> None:
    """A group leaves the ready, compute or pending index."""
    if grp.state == READY:
        tt.ready.remove(gkey.encode(), grp.ready_seq, grp.priority, grp.version)
    elif grp.state == COMPUTING:
        tt.unqueue([(gkey, grp)])
    elif grp.state == PENDING:
        tt.txn.delete(tt.pending_key(gkey, grp), db=tt.db["pending"])


def drop_payloads(
    tt: TableState,
    keys: list[bytes],
    sizes: list[int],
    places: list[bytes],
    *,
    keep_blobs: bool = False,
) -> None:
    """Experiences (their keys, their payloads' sizes, their keys in the insertion order) leave the
    live data: payloads, advantages and bytes as payloads.drop has it (`keep_blobs` keeps the
    payloads of failed experiences for Get), and their places in the insertion order."""
    payloads.drop(tt, keys, sizes, keep=keep_blobs)
    _delete_rows(tt.txn, tt.db["order"], sorted(places))


def forget_tombstone(tt: TableState, uid: str, rec: ItemRecord) -> None:
    """Remove a retired experience's record (and a failed one's kept payload): its uid
    may then be pushed again. Its group goes with its last member, and the group's place
    in the retired index with it."""
    tt.forget_item(uid)
    tt.delete_payloads([tt.key(uid)], [rec.size])
    tt.counters.add(rec.state, -1)
    grp = tt.group(rec.group)
    if grp is not None:
        if uid not in grp.members:
            return
        grp.members.remove(uid)
        if grp.members:
            tt.put_group(rec.group, grp)
            return
        tt.forget_group(rec.group)
    tt.txn.delete(tt.retired_key(rec.group, rec.retired or 0.0), db=tt.db["retired"])


def prune_tombstones(tt: TableState, retired_before: float, limit: int = 10_000) -> int:
    """Forget the tombstones of groups retired before the cutoff (at most `limit` groups per
    call; a rows table's, segments: segments.prune); returns how many were forgotten."""
    if tt.config.storage.layout == "rows":
        return segments.prune(tt, retired_before, limit)
    forgotten = 0
    for key in layout.stamped_before(tt.txn, tt.db["retired"], tt.prefix, retired_before, limit):
        gkey = key[12:].decode()
        grp = tt.group(gkey)
        for uid in list(grp.members) if grp is not None else ():
            rec = tt.item(uid)
            if rec is not None and rec.state in RETIRED:
                forget_tombstone(tt, uid, rec)
                forgotten += 1
        if grp is not None and not grp.members and grp.state in RETIRED:  # runs all reported failed
            tt.forget_group(gkey)
        tt.txn.delete(key, db=tt.db["retired"])  # gone with the group's last member, or left by damage
    return forgotten


def delete(tt: TableState, uids: Sequence[str], group_ids: Sequence[str]) -> int:
    """Experiences `uids` and the members of groups `group_ids` removed, tombstones included (their
    uids may be pushed again); a group goes with its last member, or named while pending with none (its
    runs in pieces or reported failed alone); the extensions hear a live one leave as DELETED, and its
    runs held in pieces go with it; a rows table's as row_deletes.py has it. The runs held in pieces
    of every group named go too, whatever its state or the table's group_size (pieces.drop_named),
    and so do those of every uid named, their group with them where it is left holding nothing
    (pieces.drop_deleted). A pending or computing group whose own record damage lost, named or one of
    its members named, goes whole, counted damaged (groups.remade_lost). Returns how many were live."""
    group_ids = [*group_ids, *pieces.drop_deleted(tt, uids)]
    pieces.drop_named(tt, group_ids)
    if tt.config.storage.layout == "rows":
        return row_deletes.delete(tt, uids, group_ids)
    lost = _lost_groups_of(tt, uids)  # groups remade to go whole: what damage left of each record, its size
    targets = list(uids)
    emptied: list[tuple[str, GroupRecord]] = []  # groups whose last member went: they go after the loop
    for gkey in dict.fromkeys([*group_ids, *lost]):
        grp = tt.group(gkey)
        if grp is None and (found := _remade(tt, gkey)) is not None:
            lost[gkey] = found
            grp = tt.group(gkey)
        if grp is not None:
            targets.extend(grp.members)
            if not grp.members and grp.state in LIVE:  # a pending group of runs in pieces or failed alone
                emptied.append((gkey, grp))
    deleted = 0
    for uid in dict.fromkeys(targets):
        rec = tt.item(uid)
        if rec is None:
            continue
        if rec.state not in LIVE:
            forget_tombstone(tt, uid, rec)
            continue
        grp = tt.existing_group(rec.group)
        rate_counts.forget(tt, grp, [rec])
        tt.forget_item(uid)
        tt.counters.add(grp.state, -1)
        deleted += 1
        drop_payloads(tt, [tt.key(uid)], [rec.size], [tt.prefix + u64(rec.seq)])
        grp.members.remove(uid)
        if grp.members:
            tt.put_group(rec.group, grp)
        else:
            emptied.append((rec.group, grp))
    live = [(gkey, grp) for gkey, grp in emptied if grp.state in LIVE]
    if live:
        tt.extensions.on_retired(tt, Retired(live, DELETED))
    for gkey, grp in emptied:
        pieces.drop_group(tt, gkey)  # its runs still in pieces leave with it
        leave_indexes(tt, gkey, grp)
        if grp.state in LIVE:
            tt.counters.add_groups(grp.state, -1)
            if gkey in lost:
                row_deletes.counted_removed(tt, gkey, grp.state, *lost[gkey])
        tt.forget_group(gkey)
    return deleted


def close_bare(tt: TableState, uids: Iterable[str]) -> int:
    """The pending groups of these uids left holding nothing (no member, no run in pieces or reported
    failed) go without a word to the extensions, as if never opened: a rollout whose pieces opened
    its group, then dropped as stale, leaves what a stale run pushed whole leaves, no group (one left
    pending empty held its places in the capacity until a timeout). Returns how many went."""
    if not tt.config.grouping.size:
        return 0
    by, closed = tt.config.grouping.by, 0
    for gkey in dict.fromkeys(uid_group_key(uid, by) or uid for uid in uids):
        if not pieces.bare(tt, gkey):
            continue
        if tt.config.storage.layout == "rows":
            head = row_pending.head(tt, gkey)
            if head is not None:
                row_ends.left(tt, gkey, head, [])
            tt.txn.delete(tt.key(gkey), db=tt.db["gdir"])
        else:
            leave_indexes(tt, gkey, tt.existing_group(gkey))
            tt.forget_group(gkey)
        tt.counters.add_groups(PENDING, -1)
        closed += 1
    return closed


def _lost_groups_of(tt: TableState, uids: Sequence[str]) -> dict[str, tuple[str, int]]:
    """The groups of the live experiences `uids` whose own records damage lost, remade (`_remade`): a
    Delete of a member removes such a group whole where it was pending or computing, and is refused
    (DamagedGroup, nothing of it removed) where its members say it was complete."""
    found: dict[str, tuple[str, int]] = {}
    for uid in uids:
        rec = tt.item(uid)
        if rec is None or rec.state not in LIVE or rec.group in found or tt.group(rec.group) is not None:
            continue
        remade = _remade(tt, rec.group)
        if remade is None:
            raise tt.lost_group(rec.group, pending=False)
        found[rec.group] = remade
    return found


def remove_lost_groups(tt: TableState) -> list[tuple[str, int, str]]:
    """Every pending or computing group of a records table whose own record is lost or does not decode
    (groups.named_lost) removed whole, as `expbuf repair` does with the server stopped: each
    group's key, how many members it had and what damage left of its record."""
    removed = []
    for gkey in groups.named_lost(tt):
        found = _remade(tt, gkey, named=True)
        if found is not None:
            state = tt.existing_group(gkey).state
            delete(tt, [], [gkey])
            row_deletes.counted_removed(tt, gkey, state, *found)
            removed.append((gkey, found[1], found[0]))
    return removed


def _remade(tt: TableState, gkey: str, *, named: bool = False) -> tuple[str, int] | None:
    """Group `gkey`'s lost record remade where it was pending or computing (groups.remade_lost):
    what damage left of its record and how many members it has; None: no such group."""
    why = groups.remade_lost(tt, gkey, named=named)
    return None if why is None else (why, len(tt.existing_group(gkey).members))


def bury_lost(tt: TableState, lost: Sequence[tuple[str, State, str]]) -> None:
    """Members whose records are lost, each (its group, the state the group was in, its uid): what
    is left of each goes (its payload, its place in the insertion order, found by its uid) and it
    becomes a quarantined tombstone, so that its group is whole and pruned in time as the others.
    The table's bytes are then recounted from the live records: a lost record's size, counted in
    them, is known nowhere else (its payload may be lost with it)."""
    if not lost:
        return
    keys = [tt.key(uid) for _, _, uid in lost]
    for (gkey, state, uid), key in zip(lost, keys, strict=True):
        blob = chunk_reads.read_payload(tt.txn, tt.db, key)
        rec = ItemRecord(
            state=QUARANTINED, group=gkey, seq=0, digest=bytes(16) if blob is None else digests.of(blob), size=0,
            created=tt.now, tid="", rid="", step=0, response_length=0, generated=0, retired=tt.now,
        )  # fmt: skip
        tt.txn.delete(key, db=tt.db["items"])  # a record that did not decode (TableState.item)
        tt.txn.put(key, rec.tombstone(), db=tt.db["tombs"])
        tt.settle_item(uid, rec)
        tt.counters.add(state, -1)
        tt.counters.add(QUARANTINED, 1)
    tt.delete_payloads(keys)  # no size to go by: each looked at
    nbytes, places = _live_bytes(tt, {uid for _, _, uid in lost})
    drop_payloads(tt, [], [], places, keep_blobs=True)
    tt.counters.bytes = nbytes


def _live_bytes(tt: TableState, lost: Set[str]) -> tuple[int, list[bytes]]:
    """The bytes of the table's live experiences whose records are stored, and the keys of the
    `lost` in the insertion order, read through the order (their records, which say where, are
    gone): damage is rare, and the request that meets it pays for it."""
    nbytes, places = 0, []
    with tt.txn.cursor(db=tt.db["order"]) as cur:
        found = cur.set_range(tt.prefix)
        while found and cur.key().startswith(tt.prefix):
            uid = bytes(cur.value()).decode(errors="replace")
            if uid in lost:
                places.append(bytes(cur.key()))
            else:
                nbytes += _size(tt, uid)
            found = cur.next()
    return nbytes, places


def _size(tt: TableState, uid: str) -> int:
    """The size its record gives a live experience's payload (0: its record is not stored, or cut
    short of its size: a lost one, which the request that reaches it buries, recounting then)."""
    cached, rec = tt.cached_item(uid)
    if cached:
        return 0 if rec is None else rec.size
    raw = tt.txn.get(tt.key(uid), db=tt.db["items"])
    try:
        return 0 if raw is None else ItemRecord.place(raw)[2]
    except DAMAGE:
        return 0


def quarantine_kept(tt: TableState, uid: str, view: MemberView) -> None:
    """A failed experience whose kept payload is damaged: quarantined alone, its payload gone (a
    rows table's flagged so in its segment's state: row_moves.quarantine_kept)."""
    key = tt.key(uid)
    tt.delete_payloads([key], [view.size])  # its bytes left the table's when its group failed
    if isinstance(view, RowMember):
        row_moves.quarantine_kept(tt, view.group, uid)
    else:
        rec = member_record(view)
        tt.txn.delete(key, db=tt.db["items"])
        rec.state = QUARANTINED
        tt.txn.put(key, rec.tombstone(), db=tt.db["tombs"])
        tt.settle_item(uid, rec)
    tt.counters.add(FAILED, -1)
    tt.counters.add(QUARANTINED, 1)
    tt.counters.damaged += 1


def oldest_retired(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> bytes | None:
    """When a table's earliest retired group retired (8 sortable bytes); None: it has none."""
    return layout.first_time(txn, dbs["retired"], prefix)
