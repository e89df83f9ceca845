"""Reads of a table's records, off the writer or in it: an experience's record, its group's and
its payload's stored value by key, from a read transaction or a snapshot; the rows of a batch read
(`batch_rows`); the live experiences in insertion order, oldest first (`oldest_groups`,
`oldest_age`); and a page of them (`page`, `expbuf export`).

A page is read-only and bounded per call: it reads at most `SCAN_PER_ITEM` index entries per
experience it may return, so filters that match little cost a few short pages, never one long
read transaction that holds the map's old pages.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import lmdb

from expbuf.client.schema.routing import uid_group_key
from expbuf.client.trxp.stored.pieces import Stored

from ...disk import digests
from ...disk.batch_rows import BatchRows, Reader
from ...disk.layout import micros, u64
from ...disk.records import GroupRecord, ItemRecord, Lease
from ...disk.rows import PendingHead, RowLease, SegmentView, SegState, decode_member_rows, directory_entry, fragment_key
from ...disk.stored_advantages import FinishBatch
from ...schema.states import LEASED, LIVE, READY
from ...schema.table_config import TableConfig
from ...schema.views import GroupView, MemberView
from ..table_state.read_check import payload_problem
from ..table_state.state import TableState, member_state, pending_rows, stored

Dbs = Mapping[str, lmdb._Database]
Value = bytes | memoryview

SCAN_PER_ITEM = 10
_SEQ = struct.Struct(">Q")


def record_raw(reader: Reader, dbs: Dbs, key: bytes) -> Value | None:
    """An experience's record as stored, by its key (T + uid); None: the table holds no live one."""
    return reader.get(key, db=dbs["items"])


def record(reader: Reader, dbs: Dbs, key: bytes) -> MemberView | None:
    """A live experience's view by its key (T + uid); None: the table holds no live one."""
    raw = record_raw(reader, dbs, key)
    return None if raw is None else ItemRecord.decode(raw)


def group(reader: Reader, dbs: Dbs, key: bytes) -> GroupView | None:
    """A group's view by its key (T + group key); None: no such group."""
    raw = reader.get(key, db=dbs["groups"])
    return None if raw is None else GroupRecord.decode(raw)


def lease_groups(
    reader: Reader, dbs: Dbs, prefix: bytes, lease_id: str, lease: Lease | RowLease
) -> dict[str, Sequence[str]]:
    """The groups still held under a lease of the table (of `prefix`), each with its members' uids,
    in the lease's order (a lease of runs: the ready order): a group deleted, consumed or given back
    meanwhile is not."""
    held: dict[str, Sequence[str]] = {}
    if isinstance(lease, Lease):
        for gkey in lease.groups:
            grp = group(reader, dbs, prefix + gkey.encode())
            if grp is not None and grp.state == LEASED and grp.lease == lease_id:
                held[gkey] = grp.members
        return held
    tag = bytes.fromhex(lease_id)
    for run in lease.runs:
        key = prefix + u64(run.seg)
        raw, raw_state = reader.get(key, db=dbs["segs"]), reader.get(key, db=dbs["sstate"])
        if raw is None or raw_state is None:
            continue
        view, state = SegmentView(raw), SegState.decode(raw_state)
        for g in range(run.first, run.first + run.length):
            if state.state(g) == LEASED and state.lease(g) == tag:
                held[view.keys(g, g + 1)[0]] = view.members.uids(*view.span(g))
    return held


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


class RowDigests:
    """A rows table's live members' digests and sizes by uid, for the scrub's walk over its payloads:
    each group read once a walk (from its segment, or a pending group's fragments), its segment's
    rows once."""

    def __init__(self, reader: lmdb.Transaction[memoryview], dbs: Dbs, prefix: bytes, group_by: str) -> None:
        self.reader, self.dbs, self.prefix, self.group_by = reader, dbs, prefix, group_by
        self._groups: dict[str, dict[str, tuple[bytes, int]]] = {}
        self._segments: dict[int, tuple[SegmentView, SegState]] = {}

    def of(self, uid: str) -> tuple[bytes, int] | None:
        """The uid's digest and size, while it is live; None: it is not."""
        gkey = uid_group_key(uid, self.group_by)
        if gkey is None:
            return None
        if gkey not in self._groups:
            self._groups[gkey] = self._live(gkey)
        return self._groups[gkey].get(uid)

    def _live(self, gkey: str) -> dict[str, tuple[bytes, int]]:
        raw = self.reader.get(self.prefix + gkey.encode(), db=self.dbs["gdir"])
        entry = None if raw is None else directory_entry(raw)
        if entry is None:
            return {}
        if isinstance(entry, PendingHead):
            rows = pending_rows(self.reader, self.dbs, self.prefix, gkey, entry)
            return {row.uid: (row.digest, row.size) for row in rows}
        if entry.seg not in self._segments:
            key = self.prefix + u64(entry.seg)
            view = SegmentView(stored(self.reader, key, self.dbs["segs"], "segment"))
            self._segments[entry.seg] = (
                view,
                SegState.decode(stored(self.reader, key, self.dbs["sstate"], "segment state")),
            )
        view, state = self._segments[entry.seg]
        if state.state(entry.group) not in LIVE:
            return {}
        lo, hi = view.span(entry.group)
        members = view.members
        sizes = [int(size or 0) for size in members.column("size", lo, hi)]
        return dict(zip(members.uids(lo, hi), zip(members.digests(lo, hi), sizes, strict=True), strict=True))


def row_payload_mismatch(found: tuple[bytes, int], blob: Stored | tuple[bytes, int]) -> bool:
    """Whether a rows table's member's stored payload (or its digest and length: chunk_reads.streamed)
    is not the one of the digest and size `found` (RowDigests.of)."""
    digest, size = found
    if isinstance(blob, tuple):
        return blob != (digest, size)
    return digests.mismatch(blob, size, digest) is not None


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
    """How long ago a table's oldest live experience was pushed (0: it holds none); one whose
    record is lost is passed over."""
    with txn.cursor(db=dbs["order"]) as cur:
        found = cur.set_range(prefix)
        while found and cur.key().startswith(prefix):
            raw = txn.get(prefix + cur.value(), db=dbs["items"])
            if raw is not None:
                return max(0.0, now - ItemRecord.decode(raw).created)
            found = cur.next()
    created = _oldest_row(txn, dbs, prefix) if "segs" in dbs else None  # a rows table keeps no order
    return 0.0 if created is None else max(0.0, now - created)


def _oldest_row(txn: lmdb.Transaction[bytes], dbs: Dbs, prefix: bytes) -> float | None:
    """When a rows table's oldest live experience was pushed (None: it holds none): the first member of
    each live group of its segments (a group that was pending completes after newer ones, so every
    live segment is read; a retired one by its state alone), and of each pending group's first
    fragment, read in the pending index's order (when each opened, before its first member came)
    while one may be older, and of each computing group's."""
    oldest: float | None = None
    with txn.cursor(db=dbs["segs"]) as cur:
        at = cur.set_range(prefix)
        while at and cur.key().startswith(prefix):
            state = SegState.decode(stored(txn, cur.key(), dbs["sstate"], "segment state"))
            if state.retired is None:
                view = SegmentView(cur.value())
                for g in range(view.groups):
                    if state.state(g) in LIVE:
                        first = view.span(g)[0]
                        created = float(view.members.column("created", first, first + 1)[0] or 0.0)
                        oldest = created if oldest is None else min(oldest, created)
            at = cur.next()
    with txn.cursor(db=dbs["pending"]) as cur:
        at = cur.set_range(prefix)
        while at and cur.key().startswith(prefix):
            if oldest is not None and bytes(cur.key()[4:12]) > micros(oldest):
                break
            oldest = _oldest_of_head(txn, dbs, prefix, bytes(cur.key()[12:]), oldest)
            at = cur.next()
    with txn.cursor(db=dbs["compute"]) as cur:  # the computing groups, each kept as a pending one is
        at = cur.set_range(prefix)
        while at and cur.key().startswith(prefix):
            oldest = _oldest_of_head(txn, dbs, prefix, bytes(cur.value()), oldest)
            at = cur.next()
    return oldest


def _oldest_of_head(
    txn: lmdb.Transaction[bytes], dbs: Dbs, prefix: bytes, gkey: bytes, oldest: float | None
) -> float | None:
    """The older of `oldest` and the first member of the group whose head is keyed `gkey`, if it has one."""
    raw = txn.get(prefix + gkey, db=dbs["gdir"])  # none: a records table's group
    head = None if raw is None else directory_entry(raw)
    if isinstance(head, PendingHead) and head.fragments:
        rows = stored(txn, fragment_key(prefix, gkey.decode(), 0), dbs["frags"], "fragment")
        created = decode_member_rows(rows)[0].created
        return created if oldest is None else min(oldest, created)
    return oldest


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


def page(
    txn: lmdb.Transaction[bytes],
    dbs: Dbs,
    prefix: bytes,
    *,
    states: Collection[str],
    min_version: int | None,
    max_version: int | None,
    after: int,
    limit: int,
) -> Page:
    """Live experiences from insertion sequence `after` on that pass the filters, at most `limit`."""
    items: list[Listed] = []
    budget = limit * SCAN_PER_ITEM
    with txn.cursor(db=dbs["order"]) as cur:
        found = cur.set_range(prefix + u64(after))
        while found and cur.key().startswith(prefix):
            seq = _SEQ.unpack(cur.key()[len(prefix) :])[0]
            if len(items) == limit or budget == 0:
                return Page(items, seq, False)
            budget -= 1
            uid = bytes(cur.value())
            rec = ItemRecord.decode(stored(txn, prefix + uid, dbs["items"], "experience"))
            state = rec.state
            if state == READY:  # or leased, as its group says
                state = member_state(
                    rec, GroupRecord.decode(stored(txn, prefix + rec.group.encode(), dbs["groups"], "group"))
                )
            if _passes(rec, state, states, min_version, max_version):
                items.append(Listed(uid.decode(), rec.group, state, rec.version, rec.reward, rec.times_sampled))
            found = cur.next()
            after = seq + 1
    return Page(items, after, True)


def _passes(
    rec: ItemRecord, state: str, states: Collection[str], min_version: int | None, max_version: int | None
) -> bool:
    if states and state not in states:
        return False
    if min_version is None and max_version is None:
        return True
    if rec.version is None:
        return False
    return (min_version is None or rec.version >= min_version) and (max_version is None or rec.version <= max_version)
