"""One table inside one transaction, as state: its records (read once, changed in a write-back
cache, written by `save`), its counters, its ready index, and the keys of its indexes.

The rules that change a table (rules/groups.py, capacity.py, tables/leases.py, ...) are
functions over this state; it imports none of them. A table's extensions (rules/extensions.py,
rooms above) are reached through `extensions`, as the `Events` they answer (events.py): the
state raises one `Moved` per step and state moved from. It holds no request's parameters (who
pushes, what computes): those are the arguments of the verbs that need them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TypeVar

import lmdb

from expbuf.client.schema.routing import uid_group_key

from ...disk import chunked, layout
from ...disk.chunked import Views
from ...disk.kinds import Entry
from ...disk.layout import put_rows, u64
from ...disk.records import GroupRecord, ItemRecord
from ...disk.rows import (
    Member,
    PendingHead,
    RunRow,
    SegmentView,
    SegState,
    group_entry,
    uid_hash,
)
from ...schema.errors import DAMAGE, DamagedGroup, StoreError, clip
from ...schema.states import COMPUTING, LEASED, LIVE, READY, State, check_move
from ...schema.table_config import TableConfig
from ...schema.views import GroupView, Members, MemberView
from ..ordering.indexes import Index, ReadyGroup, ReadyOrder
from ..ordering.ready import BuildStep, ReadyIndex
from .counters import read_counters, write_counters
from .events import Events, Moved
from .pending_reads import (
    group_uids,
    holding_payloads,
    member_from_payload,
    missing,
    pending_rows,
    readable_rows,
    stored,
)
from .views import RowGroup, group_record, group_rows, member_record, quarantined, row_members

# A member's record as the cache holds it: absent (None) when the table has no such uid.
Cached = ItemRecord | None
log = logging.getLogger("expbuf.store")
R = TypeVar("R", ItemRecord, GroupRecord)


def stored_state(state: State) -> State:
    """The state a member's record keeps while its group is in `state`."""
    return READY if state == LEASED else state


def member_state(rec: MemberView, grp: GroupView | None) -> State:
    """An experience's state: its record's, or leased while its group is."""
    return LEASED if grp is not None and grp.state == LEASED and rec.state == READY else rec.state


class TableState:
    """One table inside one write (or read) transaction."""

    def __init__(
        self,
        txn: lmdb.Transaction[bytes],
        dbs: dict[str, lmdb._Database],
        table_id: int,
        config: TableConfig,
        now: float,
        extensions: Events,
        views: Views | None = None,
    ) -> None:
        self.txn, self.db, self.config, self.table_id, self.now = txn, dbs, config, table_id, now
        self.extensions = extensions
        self.views = views  # reads in place of large values, for the payloads its deletes look at
        self.prefix = layout.table_prefix(table_id)
        self.counters = read_counters(txn, dbs, self.prefix)
        self.ready = ReadyIndex(dbs, txn, self.prefix, buildable=True, rows=config.storage.layout == "rows")
        # Write-back caches: a record changed several times in one request is encoded and
        # written once, by save().
        self._items: dict[str, Cached] = {}
        self._groups: dict[str, GroupRecord | None] = {}
        self._dirty_items: dict[str, ItemRecord] = {}
        self._dirty_groups: dict[str, GroupRecord] = {}
        self._undecodable: set[str] = set()  # uids and group keys whose records do not decode (lost_why)

    def save(self) -> None:
        """Write changed records and the counters; every changing request ends with it."""
        put_rows(self.txn, self.db["items"], [(self.key(uid), rec.encode()) for uid, rec in self._dirty_items.items()])
        put_rows(self.txn, self.db["groups"], [(self.key(gkey), g.encode()) for gkey, g in self._dirty_groups.items()])
        self._dirty_items.clear()
        self._dirty_groups.clear()
        write_counters(self.txn, self.db, self.prefix, self.counters)

    # ---- records -----------------------------------------------------------------------

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def keys(self, names: Iterable[str]) -> list[bytes]:
        """`key` of each name, in their order: a push's uids, its groups' directory keys."""
        prefix = self.prefix
        return [prefix + name.encode() for name in names]

    def delete_payloads(self, keys: Iterable[bytes], sizes: Sequence[int] | None = None) -> None:
        """Delete these payloads (`keys`; `sizes`, their records' where known) with what they hold
        elsewhere (chunked.delete), those it looks at read in place (`views`), not copied."""
        chunked.delete(self.txn, self.db, keys, sizes, self.views)

    def item(self, uid: str) -> ItemRecord | None:
        """The uid's record: a live experience's (or a failed one's whose payload is kept), or
        else its compact tombstone. A view of it to code outside the core (`member`)."""
        if uid not in self._items:
            key = self.key(uid)
            raw = self.txn.get(key, db=self.db["items"])
            if raw is None:
                raw = self.txn.get(key, db=self.db["tombs"])
            self._items[uid] = None if raw is None else self._decoded(ItemRecord.decode, raw, "experience", uid)
        return self._items[uid]

    def existing_item(self, uid: str) -> ItemRecord:
        """The record of an experience an index or its group names, which exists while they do."""
        rec = self.item(uid)
        if rec is None:
            raise missing("experience", uid)
        return rec

    def member(self, uid: str) -> MemberView | None:
        """The uid's experience as code outside the core reads it (views.py), or its tombstone: a
        rows table's, among its group's rows (its segment's, or its pending group's fragments)."""
        if self.config.storage.layout != "rows":
            return self.item(uid)
        by = self.config.grouping.by
        gkey = uid if by == "none" else uid_group_key(uid, by)  # an experience its own group: any uid
        grp = None if gkey is None else self._row_group(gkey)
        return None if grp is None else row_members(grp).get(uid)

    def cached_item(self, uid: str) -> tuple[bool, Cached]:
        """Whether the uid's record was read in this transaction, and the record if it was:
        a caller that only rewrites a few bytes of the others (core/verbs/retire.py) leaves them
        undecoded."""
        return (True, self._items[uid]) if uid in self._items else (False, None)

    def put_item(self, uid: str, rec: ItemRecord) -> None:
        self._items[uid] = self._dirty_items[uid] = rec

    def settle_item(self, uid: str, rec: ItemRecord) -> None:
        """The record as the caller has just written it itself (a compact tombstone,
        core/verbs/retire.py): cached, and no longer for save() to write."""
        self._items[uid] = rec
        self._dirty_items.pop(uid, None)

    def forget_item(self, uid: str) -> None:
        """Remove the uid's record, or its tombstone."""
        self._items[uid] = None
        self._dirty_items.pop(uid, None)
        key = self.key(uid)
        if not self.txn.delete(key, db=self.db["items"]):
            self.txn.delete(key, db=self.db["tombs"])

    def group(self, gkey: str) -> GroupRecord | None:
        """The group's record; a view of it to code outside the core (`view`)."""
        if gkey not in self._groups:
            raw = self.txn.get(self.key(gkey), db=self.db["groups"])
            self._groups[gkey] = None if raw is None else self._decoded(GroupRecord.decode, raw, "group", gkey)
        return self._groups[gkey]

    def _decoded(
        self, decode: Callable[[bytes | memoryview], R], raw: bytes | memoryview, what: str, name: str
    ) -> R | None:
        """A record decoded; None where a damaged page left it undecodable: read as lost, as a record
        not stored is, which the verbs that meet it quarantine or fail (rules/quarantine.py) and the
        retirement replaces (retire.bury_lost, quarantine.fail_lost_groups); logged where it is not
        already the table's last failure."""
        try:
            return decode(raw)
        except DAMAGE as exc:
            self._undecodable.add(name)
            failure = f"the record of {what} {clip(name)} does not decode ({type(exc).__name__}: {clip(str(exc), 200)})"
            if self.counters.last_failure != failure:
                log.error("table %s: %s: read as lost; run `expbuf check`", self.config.name, failure)
                self.counters.last_failure = failure
            return None

    def lost_why(self, name: str) -> str:
        """Why the record of an experience or group `name` that `item` or `group` read as None is lost."""
        return "its record does not decode" if name in self._undecodable else "its record is not stored"

    def existing_group(self, gkey: str) -> GroupRecord:
        """The record of a group an index or a member names, which exists while they do."""
        grp = self.group(gkey)
        if grp is None:
            raise missing("group", gkey)
        return grp

    def view(self, gkey: str) -> GroupView | None:
        """The group as code outside the core reads it (views.py): a records table's record, or a
        rows table's group as its segment and state rows hold it, or while it is pending or computing,
        its head and fragments."""
        if self.config.storage.layout == "rows":
            return self._row_group(gkey)
        return self.group(gkey)

    def _row_group(self, gkey: str) -> RowGroup | None:
        raw = self.txn.get(self.key(gkey), db=self.db["gdir"])
        if raw is None:
            return None
        ref = group_entry(gkey, raw)
        if isinstance(ref, PendingHead):
            rows, damaged, lost = self.pending_members(gkey, ref)
            failed = MappingProxyType(dict(ref.failed))
            return RowGroup(gkey, ref.state, rows, failed, created=ref.created, quarantined=damaged, lost=lost)
        key = self.prefix + u64(ref.seg)
        view = SegmentView(stored(self.txn, key, self.db["segs"], "segment"))
        state = SegState.decode(stored(self.txn, key, self.db["sstate"], "segment state"))
        tag = state.lease(ref.group)
        lease = tag.hex() if any(tag) else ""
        rows = group_rows(view, state, ref.group)
        now, times, found = state.state(ref.group), state.times(ref.group), quarantined(view, state, ref.group)
        return RowGroup(gkey, now, rows, view.failed(ref.group), lease, times, quarantined=found)

    def pending_rows(self, gkey: str, head: PendingHead) -> list[Member]:
        """A rows table's pending group's members, in push order, as its fragments and head hold them."""
        return pending_rows(self.txn, self.db, self.prefix, gkey, head)

    def pending_members(self, gkey: str, head: PendingHead) -> tuple[tuple[Member, ...], frozenset[str], int]:
        """A pending or computing group's members, in push order, as `pending_rows` has them; where
        damage lost some of their rows (a fragment not stored or not decoding, the head's own rows not
        decoding), the rows that read, and each other member its head names made from its payload,
        found among the group's payloads by its uid's hash (the payload's digest and size as stored,
        the rest unknown): such a group is never served, it fails with those members quarantined
        (rules/quarantine.quarantine_lost), as a records table's whose member's record is lost does.
        Returns the rows, the uids of those made from payloads, and how many members its head names
        whose payloads are not stored either."""
        try:
            rows = self.pending_rows(gkey, head)
            if len(rows) == len(head.hashes):  # else a Delete left the hashes of those lost (rows/ends.left)
                return tuple(rows), frozenset(), 0
        except DAMAGE:
            pass
        read = {uid_hash(row.uid): row for row in readable_rows(self.txn, self.db, self.prefix, gkey, head)}
        made = self._from_payloads(gkey, set(head.hashes) - read.keys(), head.created)
        found = tuple(row for h in head.hashes if (row := read.get(h) or made.get(h)) is not None)
        return found, frozenset(row.uid for row in made.values()), len(head.hashes) - len(found)

    def _from_payloads(self, gkey: str, hashes: set[int], created: float) -> dict[int, Member]:
        """The members of group `gkey` whose uids' hashes are among `hashes`, by hash, made from what is
        left of them: their payloads (a digest of zeros and a size of 0 where one does not read)."""
        made = {}
        for uid in self.payload_uids(gkey) if hashes else ():
            if (h := uid_hash(uid)) in hashes:
                made[h] = self.member_from_payload(uid, created)
        return made

    def payload_uids(self, gkey: str) -> list[str]:
        """The uids of group `gkey`'s stored payloads, found by what its uids begin with (a read of the
        group's own payloads' keys): what is left of its members where no row names them."""
        return group_uids(self.txn, self.db["blobs"], self.prefix, self.config.grouping.by, gkey)

    def record_uids(self, gkey: str) -> list[str]:
        """The uids of group `gkey`'s live records (a records table's), found as `payload_uids` finds
        its payloads: what is left of its members where its own record is lost."""
        return group_uids(self.txn, self.db["items"], self.prefix, self.config.grouping.by, gkey)

    def holding_payloads(self, opened: Sequence[bytes], pushed: Mapping[str, Sequence[Entry]]) -> list[str]:
        """Of the groups a push opens (their directory keys), those with a payload stored
        (pending_reads.holding_payloads): a group whose head is lost while its runs are stored
        (rules/pushes.py)."""
        return holding_payloads(self.txn, self.db["blobs"], self.prefix, self.config.grouping.by, opened, pushed)

    def member_from_payload(self, uid: str, created: float) -> Member:
        """A member made from its payload alone (a digest of zeros and a size of 0 where it does not read)."""
        return member_from_payload(self.txn, self.db, self.key(uid), uid, created)

    def existing_view(self, gkey: str) -> GroupView:
        """The view of a group an index or a member names, which exists while they do. One whose record
        (a rows table's directory entry) is lost, or does not decode, is refused (DamagedGroup): a Delete
        naming a pending or computing one removes it (core/verbs/rows/deletes.py, groups.remade_lost)."""
        if self.config.storage.layout == "rows":
            grp = self._row_group(gkey)
            if grp is None:
                raise DamagedGroup(gkey, "its directory entry is lost", lost=True)
            return grp
        found = self.group(gkey)
        if found is None:
            raise self.lost_group(gkey)
        return found

    def lost_group(self, gkey: str, *, pending: bool = True) -> DamagedGroup:
        """The refusal of a records table's group an index or a member names whose record `group` read
        as None (`pending`: one a Delete naming it removes, groups.remade_lost)."""
        return DamagedGroup(gkey, "an index or a member names it", pending=pending, lost=gkey not in self._undecodable)

    def put_group(self, gkey: str, grp: GroupRecord) -> None:
        self._groups[gkey] = self._dirty_groups[gkey] = grp

    def forget_group(self, gkey: str) -> None:
        self._groups[gkey] = None
        self._dirty_groups.pop(gkey, None)
        self.txn.delete(self.key(gkey), db=self.db["groups"])

    def build_index(self, cls: type[Index], limit: int | None = None) -> BuildStep:
        """One chunk of the build of a lazy index this table does not keep (ReadyIndex.build_step)."""
        return self.ready.build_step(cls, self.ready_groups, limit)

    def ready_groups(
        self, start: int, limit: int, records: bool = True
    ) -> tuple[list[ReadyGroup], int | None, list[str]]:
        """Up to `limit` ready groups from rseq `start` on, in ready order, as a lazy index being
        built reads them (ready.ReadyIndex.build_step), each with its priority and version
        from the head of its record (without `records`: priority 0, no version); the rseq to
        go on from (None: none lies past them); and those whose records the directory lost, left
        out: damage the build's caller fails (rules/quarantine.fail_lost_groups). A rows table's are
        read from its runs, each group's place its segment's id plus its index there."""
        if self.ready.rows:
            found, place = self._ready_places(start, limit, records)
            return found, place, []
        rows, after = self.ready.of(ReadyOrder).from_rseq(start, limit)
        if not records:
            return [ReadyGroup(gkey, rseq, 0.0, None) for rseq, gkey in rows], after, []
        db, found, lost = self.db["groups"], [], []
        for _, gkey in rows:
            raw = self.txn.get(self.prefix + gkey, db=db)
            try:
                placed = None if raw is None else GroupRecord.placed(raw)
            except DAMAGE:  # its head damaged: lost, as `group` reads it (logged, and named by lost_why)
                placed = None
                self.group(gkey.decode())
            if placed is None:
                lost.append(gkey.decode())
            else:
                found.append(ReadyGroup(gkey, *placed))
        return found, after, lost

    def _ready_places(self, start: int, limit: int, columns: bool) -> tuple[list[ReadyGroup], int | None]:
        """A rows table's ready groups from place `start` on, up to `limit`, as its runs cover them
        (the run keyed before `start` too, which may reach past it), with their priority and version
        from their segment's columns (without `columns`: 0 and none); the place to go on from."""
        p, found = self.prefix, list[ReadyGroup]()
        with self.txn.cursor(db=self.db["runs"]) as cur:
            first = p + u64(start)
            more = cur.set_range(first)
            if not (more and cur.key() == first):  # the run keyed before `start` may cover it
                before = cur.prev() if more else cur.last()
                more = bool(before and cur.key().startswith(p)) or cur.set_range(first)
            while more and cur.key().startswith(p):
                run = RunRow.decode(cur.value())
                lo, hi = max(run.first, start - run.seg), run.first + run.length
                read = self._ready_columns(run.seg, lo, hi, columns) if lo < hi else None
                if read is not None:
                    keys, priorities, versions = read
                    for at, g in enumerate(range(lo, hi)):
                        if len(found) == limit:
                            return found, run.seg + g
                        found.append(ReadyGroup(keys[at].encode(), run.seg + g, priorities[at], versions[at]))
                more = cur.next()
        return found, None

    def _ready_columns(
        self, seg: int, lo: int, hi: int, columns: bool
    ) -> tuple[list[str], Sequence[float], Sequence[int | None]] | None:
        """The keys, priorities and versions (without `columns`: 0 and none) of segment `seg`'s groups
        lo to hi; None where its rows do not decode: an index build leaves them out, as a take passes
        them over (`passed_over`)."""
        try:
            view = SegmentView(stored(self.txn, self.prefix + u64(seg), self.db["segs"], "segment"))
            if not columns:
                return view.keys(lo, hi), (0.0,) * (hi - lo), [None] * (hi - lo)
            return view.keys(lo, hi), view.priorities(lo, hi), view.versions(lo, hi)
        except DAMAGE as exc:
            self.passed_over(seg, exc)
            return None

    def passed_over(self, seg: int, exc: Exception) -> None:
        """A segment whose rows or state do not decode (a damaged page): a take or an index build
        passes over its groups, which nothing can name (their keys and members are its rows), and
        leaves them to `expbuf check`; logged where it is not already the table's last failure."""
        failure = f"segment {seg} does not decode ({type(exc).__name__}: {clip(str(exc), 200)}); its groups passed over"
        if self.counters.last_failure != failure:
            log.error("table %s: %s: run `expbuf check` on a copy of the data directory", self.config.name, failure)
            self.counters.last_failure = failure

    def members(self, grp: GroupView) -> dict[str, MemberView]:
        """The group's members' views (uid -> view), in push order."""
        if isinstance(grp, RowGroup):
            return dict(row_members(grp))
        return {uid: self.existing_item(uid) for uid in grp.members}

    def stored_members(self, grp: GroupView) -> dict[str, MemberView]:
        """The group's members whose records are stored: a sample's, which quarantines the group
        of one that is not (quarantine.py) where `members` refuses it; a rows table's group's are
        its segment's."""
        if isinstance(grp, RowGroup):
            return dict(row_members(grp))
        return {uid: rec for uid in grp.members if (rec := self.item(uid)) is not None}

    # ---- keys of the per-table indexes ---------------------------------------------------

    def pending_key(self, gkey: str, grp: GroupRecord | PendingHead | float) -> bytes:
        """A pending group's key in the pending index: by when it opened (its record's or head's
        `created`, or that time itself where a head is not decoded: PendingHead.outline)."""
        created = grp if isinstance(grp, float) else grp.created
        return self.prefix + layout.micros(created) + gkey.encode()

    def pending_keys(self, names: Iterable[bytes], created: float) -> list[bytes]:
        """`pending_key` of groups opened at `created` (`names`: their keys, encoded), made in C."""
        return list(map((self.prefix + layout.micros(created)).__add__, names))

    def retired_key(self, gkey: str, retired: float) -> bytes:
        """A retired group's key in the retired index (when its members became tombstones)."""
        return self.prefix + layout.micros(retired) + gkey.encode()

    def rseq_key(self, grp: GroupRecord) -> bytes:
        return self.prefix + u64(grp.ready_seq)

    def queued_key(self, head: PendingHead) -> bytes:
        """A computing rows group's key in the compute queue: the place in the ready order it took
        when it completed (its head's `queued`), as a records group's is its rseq (`rseq_key`)."""
        if head.queued is None:
            raise StoreError("a pending group has no place in the compute queue")
        return self.prefix + u64(head.queued)

    def pending_place(self, gkey: str) -> bytes | None:
        """The key of group `gkey`'s row in the pending index, found by the group's key among the table's
        (a read as long as its pending groups): for a group whose own record, which holds the row's
        creation time, is lost or does not decode. None: the index does not name it."""
        name, prefix = gkey.encode(), self.prefix
        with self.txn.cursor(db=self.db["pending"]) as cur:
            more = cur.set_range(prefix)
            while more and cur.key()[: len(prefix)] == prefix:
                if cur.key()[len(prefix) + 8 :] == name:
                    return bytes(cur.key())
                more = cur.next()
        return None

    def queued_place(self, gkey: str) -> int | None:
        """Where the compute queue holds a computing group, found by the group's key among the table's
        (a read as long as its backlog): for a group whose own record, which names the place, is lost
        or does not decode. None: the queue does not hold it."""
        name = gkey.encode()
        with self.txn.cursor(db=self.db["compute"]) as cur:
            more = cur.set_range(self.prefix)
            while more and cur.key()[: len(self.prefix)] == self.prefix:
                if cur.value() == name:
                    return int.from_bytes(cur.key()[len(self.prefix) :], "big")
                more = cur.next()
        return None

    # ---- states and their counts ---------------------------------------------------------

    def set_states(self, groups: Sequence[Members], state: State) -> None:
        """Live groups and their members (key, record, member records) move to a live
        `state` (core/verbs/retire.py makes tombstones). Members share their group's state, and the
        records of a leased group's members say ready (its record says leased): a lease
        taken or ended rewrites no member record for the state alone. The compute queue (T +
        rseq -> group key: the computing groups, in the order they completed) follows, and the
        extensions hear one `Moved` per state the groups moved from."""
        counters, stored = self.counters, stored_state(state)
        moved: dict[State, list[tuple[str, GroupRecord]]] = {}
        for gkey, view, recs in groups:
            grp = group_record(view)
            counters.add(grp.state, -len(recs))
            counters.add(state, len(recs))
            for uid, member in recs.items():
                if member.state != stored:
                    rec = member_record(member)
                    rec.state = stored
                    self.put_item(uid, rec)
            was = grp.state
            self.move_group(gkey, grp, state)
            if was in LIVE and state in LIVE and was != state:
                moved.setdefault(was, []).append((gkey, grp))
        for was, batch in moved.items():
            if was == COMPUTING:
                self.unqueue(batch)
            if state == COMPUTING:
                put_rows(self.txn, self.db["compute"], [(self.rseq_key(grp), gkey.encode()) for gkey, grp in batch])
            self.extensions.on_moved(self, Moved(was, state, batch))

    def unqueue(self, groups: Sequence[tuple[str, GroupRecord]]) -> None:
        """Computing groups leave the compute queue (their advantages stored, or they leave)."""
        for _, grp in groups:
            self.txn.delete(self.rseq_key(grp), db=self.db["compute"])

    def move_group(self, gkey: str, grp: GroupRecord, state: State) -> None:
        """A group's own state and the counts of groups by live state. Every move of a group
        comes here, and is checked against the state machine (states.py)."""
        was = grp.state
        check_move(gkey, was, state)
        if was in LIVE:
            self.counters.add_groups(was, -1)
        if state in LIVE:
            self.counters.add_groups(state, 1)
        grp.state = state
        self.put_group(gkey, grp)
