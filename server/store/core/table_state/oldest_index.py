"""A rows table's oldest live experience (stats' oldest_age_seconds, the metric
expbuf_oldest_age_seconds), kept as it changes so that a stats call reads one key, not every live
segment (issue 64).

The `oldest` database holds one key for each segment of the table with a live member, and one for
each pending or computing group with a member: T + when its oldest live member was pushed
(`stamp`: 8 bytes that sort as the times do) + what holds it (SEGMENT and the segment's id, or HEAD
and the group's key). The table's oldest live experience is the first key of its range (`oldest`).

What a segment's oldest live member is (`in_segment`): the least creation time of its members where
every group is live and no member deleted, else of each live group's first member not deleted (a
group's members are in push order). A pending or computing group's is its first member in push order
(its first fragment's first, or its head's where it has no fragment). A segment's key comes with it, written live
(core/verbs/rows/segments.write); it moves when its state row is written with another live shape (a
group leaving the live states, a member deleted: core/verbs/rows/select.Segments.save), never for a
take or a give-back, which move groups between live states, and goes once none of its members is
live. A group's key comes with its first member, moves when a Delete writes its members again,
and goes with its head (core/verbs/rows/pending.py).

A directory whose rows tables were written without the database gets it built in its open's
transaction (`build`, core/whole_table/migrate.py).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import lmdb

from ...disk.layout import put_rows, u64
from ...disk.rows import PendingHead, SegmentView, SegState, directory_entry, first_created, fragment_key
from ...schema.errors import DAMAGE
from .state import TableState

SEGMENT, HEAD = b"\x00", b"\x01"  # what holds a key's member: a segment (its id follows) or a group (its key)
_F64, _U64 = struct.Struct(">d"), struct.Struct(">Q")
_SIGN = 1 << 63


def stamp(when: float) -> bytes:
    """A time as 8 bytes that sort as the times do: IEEE 754's bits, the sign bit flipped on a
    positive time, every bit on a negative one."""
    (bits,) = _U64.unpack(_F64.pack(when))
    return _U64.pack(bits ^ (0xFFFF_FFFF_FFFF_FFFF if bits & _SIGN else _SIGN))


def unstamp(raw: bytes | memoryview) -> float:
    (bits,) = _U64.unpack(raw)
    when: float = _F64.unpack(_U64.pack(bits ^ (_SIGN if bits & _SIGN else 0xFFFF_FFFF_FFFF_FFFF)))[0]
    return when


def segment_key(prefix: bytes, when: float, seg: int) -> bytes:
    return prefix + stamp(when) + SEGMENT + u64(seg)


def head_key(prefix: bytes, when: float, gkey: str) -> bytes:
    return prefix + stamp(when) + HEAD + gkey.encode()


def group_of(key: bytes) -> bytes:
    """The key of the group a key of the index (its table's prefix taken off) is of; empty where it is
    a segment's."""
    return key[9:] if key[8:9] == HEAD else b""


def oldest(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes) -> float | None:
    """When a rows table's oldest live experience was pushed (None: it holds none): its first key."""
    with txn.cursor(db=dbs["oldest"]) as cur:
        if cur.set_range(prefix) and cur.key()[: len(prefix)] == prefix:
            return unstamp(cur.key()[len(prefix) : len(prefix) + 8])
    return None


def in_segment(view: SegmentView, state: SegState) -> float | None:
    """When a segment's oldest live member was pushed (None: it has none): its created column read
    once; of a segment whose members are all live (not deleted, their groups live), its least value,
    else each live group's first member's not deleted (a group's members are in push order)."""
    mask = state.live_mask()
    live = mask.count(1)
    if not live:
        return None
    count = view.members.count
    created = cast(Sequence[float], view.members.column("created", 0, count))  # never absent
    if live == view.groups and not state.any_flags:
        return min(created) if count else None
    ends, groups = view.ends, itertools.compress(range(view.groups), mask)
    if state.any_flags:
        firsts = [kept[0] for g in groups if (kept := state.kept(ends[g - 1] if g else 0, ends[g]))]
    else:
        firsts = [first for g in groups if (first := ends[g - 1] if g else 0) < ends[g]]
    return min(created[i] for i in firsts) if firsts else None


def _moved(tt: TableState, was: bytes | None, now: bytes | None) -> None:
    """A key of the index replaced: `was` deleted, `now` written (None: none)."""
    if was != now:
        if was is not None:
            tt.txn.delete(was, db=tt.db["oldest"])
        if now is not None:
            tt.txn.put(now, b"", db=tt.db["oldest"])


def segment_saved(tt: TableState, seg: int, was: SegState, now: SegState, view: Callable[[int], SegmentView]) -> None:
    """A segment's state row written again (`was` before): its key moved where its live shape changed,
    its rows read then (`view`)."""
    if was.live_shape() == now.live_shape():
        return
    rows = view(seg)
    before, after = in_segment(rows, was), in_segment(rows, now)
    prefix = tt.prefix
    _moved(
        tt,
        None if before is None else segment_key(prefix, before, seg),
        None if after is None else segment_key(prefix, after, seg),
    )


def segment_grown(tt: TableState, seg: int, was: float, now: float) -> None:
    """A live segment grown by groups after its own (segments._grow_tail): its key moved where one of
    them was pushed before its oldest member (a group completed now whose first run came long ago)."""
    _moved(tt, segment_key(tt.prefix, was, seg), segment_key(tt.prefix, now, seg))


def segments_written(tt: TableState, written: Sequence[tuple[int, float]]) -> None:
    """New live segments, each (its id, its oldest member's time): their keys."""
    put_rows(tt.txn, tt.db["oldest"], [(segment_key(tt.prefix, when, seg), b"") for seg, when in written])


def head_changed(tt: TableState, gkey: str, was: float | None, now: float | None) -> None:
    """A pending or computing group's first member now pushed at `now` (None: it has no member
    kept any more), at `was` before (None: it had none)."""
    prefix = tt.prefix
    _moved(
        tt,
        None if was is None else head_key(prefix, was, gkey),
        None if now is None else head_key(prefix, now, gkey),
    )


def head_gone(tt: TableState, gkey: str, head: PendingHead) -> None:
    """A pending or computing group's head gone (it completed or left): its key goes, found by the
    group's key among the table's where damage left its first member unreadable."""
    try:
        first = head_first(tt, gkey, head)
    except DAMAGE:
        first = None
    if first is not None and tt.txn.delete(head_key(tt.prefix, first, gkey), db=tt.db["oldest"]):
        return
    if head.hashes:  # else no member: no key
        group_gone(tt, gkey)


def heads_opened(tt: TableState, keys: Sequence[bytes], when: float) -> None:
    """Pending groups opened by one request, each with its first member pushed at `when` (`keys`:
    their keys, encoded): their keys, made in C over them all."""
    begin = tt.prefix + stamp(when) + HEAD
    put_rows(tt.txn, tt.db["oldest"], sorted(zip(map(begin.__add__, keys), itertools.repeat(b""))))


def heads_gone(tt: TableState, gone: Sequence[tuple[str, float]]) -> None:
    """Pending or computing groups gone, each with when its first member was pushed (read from its
    head's bytes: PendingHead.outline): their keys, each found by the group's key among the table's
    where it is not at that time."""
    prefix, txn, db = tt.prefix, tt.txn, tt.db["oldest"]
    for gkey, first in gone:
        if not txn.delete(head_key(prefix, first, gkey), db=db):
            group_gone(tt, gkey)


def group_gone(tt: TableState, gkey: str) -> bool:
    """A pending or computing group gone whose first member's time is not known: its key, if any,
    found by the group's key among the table's; whether there was one."""
    held = HEAD + gkey.encode()
    with tt.txn.cursor(db=tt.db["oldest"]) as cur:
        more = cur.set_range(tt.prefix)
        while more and cur.key()[: len(tt.prefix)] == tt.prefix:
            if cur.key()[len(tt.prefix) + 8 :] == held:
                cur.delete()
                return True
            more = cur.next()
    return False


def head_first(tt: TableState, gkey: str, head: PendingHead) -> float | None:
    """When a pending or computing group's first member was pushed, as its first fragment holds it,
    or its head where it has none (None: it has no member, or its fragment is not stored)."""
    return _first(tt.txn, tt.db, tt.prefix, gkey, head)


def _first(
    txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes, gkey: str, head: PendingHead
) -> float | None:
    if not head.fragments:
        return first_created(head.inline) if head.inline else None
    raw = txn.get(fragment_key(prefix, gkey, 0), db=dbs["frags"])
    return None if raw is None else first_created(raw)


def build(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database]) -> None:
    """The index of every rows table of the directory, from its segments and pending groups' heads (a
    directory written before it kept one). A row that does not decode is passed over: `verify` and
    `expbuf check` name it."""
    found: list[tuple[bytes, bytes]] = []
    for key, raw in txn.cursor(db=dbs["segs"]):
        try:
            raw_state = txn.get(key, db=dbs["sstate"])
            when = None if raw_state is None else in_segment(SegmentView(raw), SegState.decode(raw_state))
        except DAMAGE:
            continue
        if when is not None:
            found.append((segment_key(bytes(key[:4]), when, int.from_bytes(key[4:], "big")), b""))
    for key, raw in txn.cursor(db=dbs["gdir"]):
        try:
            head = directory_entry(raw)
            if not isinstance(head, PendingHead):
                continue
            gkey = bytes(key[4:]).decode()
            when = _first(txn, dbs, bytes(key[:4]), gkey, head)
        except DAMAGE:
            continue
        if when is not None:
            found.append((head_key(bytes(key[:4]), when, gkey), b""))
    put_rows(txn, dbs["oldest"], sorted(found))
