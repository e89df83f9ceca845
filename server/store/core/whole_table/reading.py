"""Reads of a table's records, off the writer or in it: an experience's record, its group's and
its payload's stored value by key, from a read transaction or a snapshot; a rows table's segment and
members; the rows of a batch read (`batch_rows`); the live experiences in insertion order, oldest
first (`oldest_groups`, `oldest_age`). A page of them is pages.py's.

A record a damaged page left undecodable is read as lost, as `TableState.item` and `.group` read it:
the reads here serve around it (a Get lists it missing) and leave it to the sample that meets it,
which fails its group (rules/quarantine.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import lmdb

from expbuf.client.schema.routing import uid_group_key
from expbuf.client.trxp.stored.pieces import Stored

from ...disk import digests
from ...disk.batch_rows import BatchRows, Reader
from ...disk.layout import u64
from ...disk.records import GroupRecord, ItemRecord, Lease
from ...disk.rows import (
    PendingHead,
    RowLease,
    SegmentView,
    SegState,
    agreeing,
    directory_entry,
)
from ...disk.stored_advantages import FinishBatch
from ...schema.errors import DAMAGE
from ...schema.states import FAILED, LEASED, LIVE
from ...schema.table_config import TableConfig
from ...schema.views import GroupView, MemberView
from ..table_state import oldest_index
from ..table_state.pending_reads import readable_rows, stored
from ..table_state.read_check import payload_problem, stored_problem
from ..table_state.state import TableState
from ..table_state.views import RowGroup, RowMember, group_rows, quarantined, row_members

Dbs = Mapping[str, lmdb._Database]
Value = bytes | memoryview

R = TypeVar("R", ItemRecord, GroupRecord)


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
    except DAMAGE:
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
        except DAMAGE:  # forgotten once its groups left the lease and retired; or damage, passed over
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
    (core/verbs/rows/select.Segments.readable), for a read to pass over its groups as a take does."""
    view = SegmentView(stored(reader, key, dbs["segs"], "segment"))
    return agreeing(view, SegState.decode(stored(reader, key, dbs["sstate"], "segment state")))


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
    except DAMAGE:
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
