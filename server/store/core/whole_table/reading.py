"""Reads of a table's records, off the writer or in it: an experience's record, its group's and
its payload's stored value by key, from a read transaction or a snapshot; the rows of a batch read
(`batch_rows`); the live experiences in insertion order, oldest first (`oldest_groups`,
`oldest_age`); and a page of them (`page`, `expbuf export`).

A page is read-only and bounded per call: it reads at most `SCAN_PER_ITEM` index entries per
experience it may return, so filters that match little cost a few short pages, never one long
read transaction that holds the map's old pages.

A record a damaged page left undecodable is read as lost, as `TableState.item` and `.group` read it:
the reads here serve around it (a Get lists it missing, a page passes over it, logged) and leave it
to the sample that meets it, which fails its group (rules/quarantine.py).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import heapq
import logging
import struct
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import lmdb

from expbuf.client.schema.routing import uid_group_key
from expbuf.client.trxp.stored.pieces import Stored

from ...disk import digests
from ...disk.batch_rows import BatchRows, Reader
from ...disk.layout import u64
from ...disk.records import GroupRecord, ItemRecord, Lease
from ...disk.rows import (
    Member,
    PendingHead,
    RowLease,
    SegmentView,
    SegState,
    directory_entry,
)
from ...disk.stored_advantages import FinishBatch
from ...schema.errors import clip
from ...schema.states import FAILED, LEASED, LIVE, READY, State
from ...schema.table_config import TableConfig
from ...schema.views import GroupView, MemberView
from ..table_state import oldest_index
from ..table_state.read_check import payload_problem, stored_problem
from ..table_state.state import TableState, member_state, readable_rows, stored
from ..table_state.views import RowGroup, RowMember, group_rows, quarantined, row_members

Dbs = Mapping[str, lmdb._Database]
Value = bytes | memoryview

SCAN_PER_ITEM = 10
_SEQ = struct.Struct(">Q")
# A damaged page can make a record's decoder raise almost anything: every exception is damage.
_DAMAGE = Exception
R = TypeVar("R", ItemRecord, GroupRecord)
log = logging.getLogger("expbuf.store")


def record_raw(reader: Reader, dbs: Dbs, key: bytes) -> Value | None:
    """An experience's record as stored, by its key (T + uid); None: the table holds no live one."""
    return reader.get(key, db=dbs["items"])


def record(reader: Reader, dbs: Dbs, key: bytes) -> MemberView | None:
    """A live experience's view by its key (T + uid); None: the table holds no live one, or its
    record is lost to damage (`_readable`)."""
    return _readable(ItemRecord.decode, record_raw(reader, dbs, key))


def group(reader: Reader, dbs: Dbs, key: bytes) -> GroupView | None:
    """A group's view by its key (T + group key); None: no such group, or its record is lost to
    damage (`_readable`)."""
    return _readable(GroupRecord.decode, reader.get(key, db=dbs["groups"]))


def _readable(decode: Callable[[Value], R], raw: Value | None) -> R | None:
    """A stored record decoded; None where it is not stored, or a damaged page left it undecodable."""
    if raw is None:
        return None
    try:
        return decode(raw)
    except _DAMAGE:
        return None


def lease_groups(
    reader: Reader, dbs: Dbs, prefix: bytes, lease_id: str, lease: Lease | RowLease
) -> dict[str, Sequence[str]]:
    """The groups still held under a lease of the table (of `prefix`), each with its members' uids,
    in the lease's order (a lease of runs: the ready order): a group deleted, consumed or given back
    meanwhile is not, nor one whose record or segment damage left undecodable (the lease's end passes
    over it)."""
    held: dict[str, Sequence[str]] = {}
    if isinstance(lease, Lease):
        for gkey in lease.groups:
            grp = group(reader, dbs, prefix + gkey.encode())
            if grp is not None and grp.state == LEASED and grp.lease == lease_id:
                held[gkey] = grp.members
        return held
    tag = bytes.fromhex(lease_id)
    for run in lease.runs:
        try:
            view, state = segment(reader, dbs, prefix + u64(run.seg))
        except _DAMAGE:  # forgotten once its groups left the lease and retired; or damage, passed over
            continue
        for g in range(run.first, run.first + run.length):
            if state.state(g) == LEASED and state.lease(g) == tag:
                lo, hi = view.span(g)
                uids = view.members.uids(lo, hi)
                held[view.keys(g, g + 1)[0]] = [uids[i - lo] for i in state.kept(lo, hi)]
    return held


def segment(reader: Reader, dbs: Dbs, key: bytes) -> tuple[SegmentView, SegState]:
    """A rows table's segment, by its key (T + its id): its rows and its state, which agree. Raises where
    either is not stored or damage left it undecodable (StoreError, ValueError, ...), as a take finds it
    (row_select.Segments.readable), for a read to pass over its groups as a take does."""
    view = SegmentView(stored(reader, key, dbs["segs"], "segment"))
    return _agreeing(view, SegState.decode(stored(reader, key, dbs["sstate"], "segment state")))


def _agreeing(view: SegmentView, state: SegState) -> tuple[SegmentView, SegState]:
    """A segment's rows and state; ValueError where they do not agree (damage)."""
    if (state.groups, state.members) != (view.groups, view.members.count):
        raise ValueError(f"its state is of {state.groups} groups and {state.members} members")
    return view, state


def payload_mismatch(uid: str, raw: Value, blob: Stored | tuple[bytes, int]) -> bool:
    """Whether an experience's stored payload (or its digest and length: chunk_reads.streamed) is not
    the one its record (`raw`, as stored) names; a tombstone keeps none (`expbuf check` reports one
    that has). Raises where the record does not decode (a damaged page)."""
    if ItemRecord.compact(raw):
        return False
    digest, size = ItemRecord.digest_of(raw)
    if isinstance(blob, tuple):
        return blob != (digest, size)
    if len(blob) == size and digests.of(blob) == digest:
        return False
    return payload_problem(uid, ItemRecord.decode(raw), blob) is not None


class RowMembers:
    """A rows table's live and failed members by uid (`member`, as views; `of`, their digests and sizes, for the
    scrub's walk over its payloads), read from `reader` (a transaction, or a snapshot while it is
    read): each group read once (from its segment, or a pending group's fragments and head), each segment's
    rows once."""

    def __init__(self, reader: Reader, dbs: Dbs, prefix: bytes, group_by: str) -> None:
        self.reader, self.dbs, self.prefix, self.group_by = reader, dbs, prefix, group_by
        self._groups: dict[str, dict[str, RowMember]] = {}
        self._segments: dict[int, tuple[SegmentView, SegState]] = {}

    def member(self, uid: str) -> RowMember | None:
        """The uid's view, while it is live or its group failed (its payload may be kept, for Get, as a
        records table's failed record is); None: it is not (retired else, deleted, or never pushed)."""
        gkey = uid_group_key(uid, self.group_by)
        if gkey is None:
            return None
        if gkey not in self._groups:
            self._groups[gkey] = self._live(gkey)
        return self._groups[gkey].get(uid)

    def of(self, uid: str) -> tuple[bytes, int] | None:
        """The uid's digest and size, while it is live; None: it is not."""
        found = self.member(uid)
        return None if found is None else (found.digest, found.size)

    def _live(self, gkey: str) -> dict[str, RowMember]:
        raw = self.reader.get(self.prefix + gkey.encode(), db=self.dbs["gdir"])
        entry = None if raw is None else directory_entry(raw)
        if entry is None:
            return {}
        if isinstance(entry, PendingHead):  # its members whose rows damage lost are not among them
            pending = tuple(readable_rows(self.reader, self.dbs, self.prefix, gkey, entry))
            return row_members(RowGroup(gkey, entry.state, pending))
        if entry.seg not in self._segments:
            self._segments[entry.seg] = segment(self.reader, self.dbs, self.prefix + u64(entry.seg))
        view, state = self._segments[entry.seg]
        now = state.state(entry.group)
        if now not in LIVE and now != FAILED:  # a failed group's payloads may be kept, for Get
            return {}
        rows = group_rows(view, state, entry.group)
        found = quarantined(view, state, entry.group)
        return row_members(RowGroup(gkey, now, rows, times=state.times(entry.group), quarantined=found))


def members_of(reader: Reader, dbs: Dbs, prefix: bytes, config: TableConfig) -> Callable[[str], MemberView | None]:
    """A table's live experiences' views by uid, read from `reader`: a records table's records (a
    failed one's whose payload is kept among them), or a rows table's members (`RowMembers`). One
    whose record, or segment, damage left undecodable has none: lost, as a sample reads it."""
    if config.storage.layout == "rows":
        return functools.partial(_row_member, RowMembers(reader, dbs, prefix, config.grouping.by))
    return lambda uid: record(reader, dbs, prefix + uid.encode())


def _row_member(rows: RowMembers, uid: str) -> RowMember | None:
    """`rows.member`, None where the uid's segment (or its pending group's head) does not decode."""
    try:
        return rows.member(uid)
    except _DAMAGE:
        return None


def row_payload_mismatch(uid: str, found: tuple[bytes, int], blob: Stored | tuple[bytes, int]) -> bool:
    """Whether a rows table's member's stored payload (or its digest and length: chunk_reads.streamed)
    is not the one of the digest and size `found` (RowMembers.of)."""
    digest, size = found
    if isinstance(blob, tuple):
        return blob != (digest, size)
    return stored_problem(uid, size, digest, blob) is not None


def payload_value(reader: Reader, dbs: Dbs, key: bytes) -> Value | None:
    """An experience's payload as stored (the one-item TRXP payload, a chunked one's head or a shared
    prompt's reference: chunk_reads reads it), by its key; None: not stored."""
    return reader.get(key, db=dbs["blobs"])


def payload_cursor(txn: lmdb.Transaction[memoryview], dbs: Dbs) -> lmdb.Cursor[memoryview]:
    """A cursor over the stored payloads of every table, in key order (the scrub's walk)."""
    return txn.cursor(db=dbs["blobs"])


def batch_rows(reader: Reader, dbs: Dbs, config: TableConfig, finish: FinishBatch | None) -> BatchRows:
    """The rows of a batch being read from `reader`, with their stored advantages."""
    return BatchRows(reader, dbs["adv"], config, finish)


def oldest_groups(tt: TableState) -> Iterator[str]:
    """Groups of the live experiences, oldest first. The caller retires groups between
    steps, so each step opens a fresh cursor after the last key seen. An experience whose record
    is lost is passed over (its record named its group): its group, reached through its other
    members or a sample, buries it."""
    seen: set[str] = set()
    position = tt.prefix
    while True:
        with tt.txn.cursor(db=tt.db["order"]) as cur:
            if not cur.set_range(position) or not cur.key().startswith(tt.prefix):
                return
            position = cur.key() + b"\0"
            rec = tt.item(cur.value().decode(errors="replace"))
        if rec is None:
            continue
        gkey = rec.group
        if gkey not in seen:
            seen.add(gkey)
            yield gkey


def oldest_age(txn: lmdb.Transaction[bytes], dbs: Dbs, prefix: bytes, now: float) -> float:
    """How long ago a table's oldest live experience was pushed (0: it holds none): a records table's
    first in its insertion order (one whose record is lost, or does not decode, is passed over), a rows table's first in
    its index of the oldest (core/table_state/oldest_index.py; it keeps no insertion order)."""
    with txn.cursor(db=dbs["order"]) as cur:
        found = cur.set_range(prefix)
        while found and cur.key().startswith(prefix):
            rec = _readable(ItemRecord.decode, txn.get(prefix + cur.value(), db=dbs["items"]))
            if rec is not None:
                return max(0.0, now - rec.created)
            found = cur.next()
    created = oldest_index.oldest(txn, dbs, prefix) if "oldest" in dbs else None
    return 0.0 if created is None else max(0.0, now - created)


@dataclass(frozen=True, slots=True)
class Listed:
    """One live experience as a page lists it."""

    uid: str
    group: str
    state: str
    version: int | None
    reward: float | None
    times_sampled: int  # a batch still under a lease counts once the lease ends


@dataclass(frozen=True, slots=True)
class Page:
    items: list[Listed]
    next: int  # the insertion sequence the next page starts from
    done: bool  # nothing live lies past this page


# An experience's insertion sequence, and its listing read when paged (None: its record is lost, passed over).
Listing = tuple[int, Callable[[], Listed | None]]


@dataclass(frozen=True, slots=True)
class Filters:
    """What a page lists of the live experiences: those in `states` (every live state if none) and of
    a known model version from `min_version` to `max_version` (either bound None: none)."""

    states: Collection[str] = ()
    min_version: int | None = None
    max_version: int | None = None

    def passes(self, listed: Listed) -> bool:
        if self.states and listed.state not in self.states:
            return False
        low, high = self.min_version, self.max_version
        if low is None and high is None:
            return True
        version = listed.version
        return version is not None and (low is None or version >= low) and (high is None or version <= high)


def page(
    txn: lmdb.Transaction[bytes], dbs: Dbs, prefix: bytes, filters: Filters, *, after: int, limit: int, table: str
) -> Page:
    """Live experiences from insertion sequence `after` on that pass the filters, at most `limit`; one
    whose record is lost is passed over, logged naming `table` (the table's name)."""
    with contextlib.closing(_in_order(txn, dbs, prefix, after, table)) as found:
        return _paged(found, filters, after, limit)


def _in_order(txn: lmdb.Transaction[bytes], dbs: Dbs, prefix: bytes, after: int, table: str) -> Generator[Listing]:
    """A records table's live experiences from insertion sequence `after` on, in its insertion order."""
    with txn.cursor(db=dbs["order"]) as cur:
        found = cur.set_range(prefix + u64(after))
        while found and cur.key().startswith(prefix):
            seq = _SEQ.unpack(cur.key()[len(prefix) :])[0]
            yield seq, functools.partial(_listed_record, txn, dbs, prefix, cur.value(), table)
            found = cur.next()


def _listed_record(txn: lmdb.Transaction[bytes], dbs: Dbs, prefix: bytes, uid: bytes, table: str) -> Listed | None:
    """An experience as a page lists it; None where its record is lost (passed over, logged, as a Get
    lists it missing). One whose group's record is lost is listed in its own record's state."""
    rec = record(txn, dbs, prefix + uid)
    if rec is None:
        log.error(
            "table %s: ListExperiences passed over experience %s: its record is not stored or does not decode; "
            "run `expbuf check`",
            table, clip(uid.decode(errors="replace")),
        )  # fmt: skip
        return None
    # ready, or leased as its group says
    state = member_state(rec, group(txn, dbs, prefix + rec.group.encode())) if rec.state == READY else rec.state
    return Listed(uid.decode(), rec.group, state, rec.version, rec.reward, rec.times_sampled)


def row_page(
    txn: lmdb.Transaction[memoryview], dbs: Dbs, prefix: bytes, filters: Filters, *, after: int, limit: int, table: str
) -> Page:
    """`page` of a rows table, read from a transaction with buffers: the same page, its experiences read
    from its live segments and pending groups (it keeps no insertion order), the first in insertion
    order from `after` on: as many as the page takes (the next one tells where the next page starts),
    more while filters leave it short, up to as many as a records table's page would read."""
    most, wanted = limit * SCAN_PER_ITEM + 1, limit + 1
    while True:
        found = _row_listings(txn, dbs, prefix, after, wanted, table)
        page = _paged(iter(found), filters, after, limit)
        if not page.done or len(found) < wanted or wanted == most:
            return page
        wanted = min(most, 4 * wanted)


def _row_listings(
    txn: lmdb.Transaction[memoryview], dbs: Dbs, prefix: bytes, after: int, wanted: int, table: str
) -> list[Listing]:
    """The first `wanted` live members of a rows table from insertion sequence `after` on, in its
    insertion order: each live segment's insertion numbers read as one column, and passed over whole
    where none of them can be among those found so far (segments are in completion order, mostly the
    order their members came in); each pending and computing group's rows that read (those damage
    lost passed over, logged, as a records table's page passes over a member whose record is lost)."""
    found: list[tuple[int, int, int]] = []  # a heap of (-seq, its source, its index there)
    sources: list[Callable[[int], Listed]] = []  # each one's listing of its member i

    def offer(seqs: Sequence[int], indexes: Iterable[int]) -> None:
        source = len(sources) - 1
        for i in indexes:
            seq = seqs[i]
            if seq < after:
                continue
            if len(found) < wanted:
                heapq.heappush(found, (-seq, source, i))
            elif seq < -found[0][0]:
                heapq.heapreplace(found, (-seq, source, i))

    with txn.cursor(db=dbs["segs"]) as cur:
        at = cur.set_range(prefix)
        while at and cur.key()[: len(prefix)] == prefix:
            read = _listed_segment(txn, dbs, bytes(cur.key()), cur.value(), table)
            if read is not None:
                view, state, seqs = read
                if seqs and max(seqs) >= after and not (len(found) == wanted and min(seqs) > -found[0][0]):
                    sources.append(functools.partial(_listed_row, view, state))
                    offer(seqs, _live_members(view, state))
            at = cur.next()
    for gkey in _heads(txn, dbs, prefix):
        pending = _listed_head(txn, dbs, prefix, gkey, table)
        if pending is not None:
            now, rows = pending
            sources.append(functools.partial(_listed_pending, gkey, now, rows))
            offer([m.seq for m in rows], range(len(rows)))
    return [(-seq, functools.partial(sources[source], i)) for seq, source, i in sorted(found, reverse=True)]


def _listed_segment(
    txn: lmdb.Transaction[memoryview], dbs: Dbs, key: bytes, raw: Value, table: str
) -> tuple[SegmentView, SegState, Sequence[int]] | None:
    """A segment a page may list members of (its rows `raw`), with its state and its members' insertion
    numbers; None where its groups have all retired, or where it does not decode (passed over, logged,
    as a take passes over it)."""
    try:
        state = SegState.decode(stored(txn, key, dbs["sstate"], "segment state"))
        if state.retired is not None:
            return None
        view, _ = _agreeing(SegmentView(raw), state)
        return view, state, cast(Sequence[int], view.members.column("seq", 0, view.members.count))
    except _DAMAGE as exc:
        log.error(
            "table %s: ListExperiences passed over segment %d: it does not decode (%s: %s); run `expbuf check`",
            table, _SEQ.unpack(key[-8:])[0], type(exc).__name__, clip(str(exc), 200),
        )  # fmt: skip
        return None


def _listed_head(
    txn: lmdb.Transaction[memoryview], dbs: Dbs, prefix: bytes, gkey: str, table: str
) -> tuple[State, list[Member]] | None:
    """A pending or computing group's state and its rows that read, as a page lists them; those damage
    lost are passed over, logged, as a records table's page passes over a member whose record is lost.
    None where the group is no longer pending, or its head does not decode (passed over, logged)."""
    try:
        head = directory_entry(stored(txn, prefix + gkey.encode(), dbs["gdir"], "pending or computing group"))
    except _DAMAGE as exc:
        log.error(
            "table %s: ListExperiences passed over pending group %s: its head does not decode (%s: %s); "
            "run `expbuf check`",
            table, clip(gkey), type(exc).__name__, clip(str(exc), 200),
        )  # fmt: skip
        return None
    if not isinstance(head, PendingHead):
        return None
    rows = readable_rows(txn, dbs, prefix, gkey, head)
    if len(rows) < len(head.hashes):
        log.error(
            "table %s: ListExperiences passed over %d member(s) of group %s: their rows do not read; "
            "run `expbuf check`",
            table, len(head.hashes) - len(rows), clip(gkey),
        )  # fmt: skip
    return head.state, rows


def _live_members(view: SegmentView, state: SegState) -> Iterable[int]:
    """The indexes of a segment's members in live groups, those deleted left out."""
    groups = state.states(0, view.groups)
    if not state.any_flags and all(s in LIVE for s in groups):
        return range(view.members.count)
    return [i for g, s in enumerate(groups) if s in LIVE for i in state.kept(*view.span(g))]


def _listed_row(view: SegmentView, state: SegState, i: int) -> Listed:
    """Member i of a live segment, as a page lists it."""
    g, members = bisect.bisect_right(view.ends, i), view.members
    version, reward = members.column("version", i, i + 1)[0], members.column("reward", i, i + 1)[0]
    return Listed(
        members.uid(i), view.keys(g, g + 1)[0], state.state(g), None if version is None else int(version), reward,
        state.times(g),
    )  # fmt: skip


def _heads(txn: lmdb.Transaction[memoryview], dbs: Dbs, prefix: bytes) -> Iterator[str]:
    """The keys of a rows table's pending groups (its pending index's) and computing ones (its compute
    queue's)."""
    for name in ("pending", "compute"):
        with txn.cursor(db=dbs[name]) as cur:
            at = cur.set_range(prefix)
            while at and cur.key()[: len(prefix)] == prefix:
                yield bytes(cur.key()[12:] if name == "pending" else cur.value()).decode()
                at = cur.next()


def _listed_pending(gkey: str, state: State, rows: Sequence[Member], i: int) -> Listed:
    """Member i of a pending or computing group, as a page lists it."""
    m = rows[i]
    return Listed(m.uid, gkey, state, m.version, m.reward, 0)


def _paged(found: Iterator[Listing], filters: Filters, after: int, limit: int) -> Page:
    """A page of the live experiences `found` (in insertion order, from `after` on) that pass the
    filters: at most `limit`, and at most SCAN_PER_ITEM experiences read for each."""
    items: list[Listed] = []
    budget = limit * SCAN_PER_ITEM
    for seq, listing in found:
        if len(items) == limit or budget == 0:
            return Page(items, seq, False)
        budget -= 1
        listed = listing()
        if listed is not None and filters.passes(listed):
            items.append(listed)
        after = seq + 1
    return Page(items, after, True)
