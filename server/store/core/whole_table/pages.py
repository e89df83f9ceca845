"""Pages of a table's live experiences in insertion order (ListExperiences, `expbuf export`): a
records table's read along its insertion order (`page`), a rows table's from its live segments and
pending groups, which keep none (`row_page`).

A page is read-only and bounded per call: it reads at most `SCAN_PER_ITEM` index entries per
experience it may return, so filters that match little cost a few short pages, never one long
read transaction that holds the map's old pages. What damage left unreadable (a record, a segment, a
pending group's head or rows) is passed over, logged naming the table once a store (`Told`), as a
Get lists it missing: the sample that meets it fails its group.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import heapq
import logging
import struct
import threading
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import lmdb

from ...disk.layout import u64
from ...disk.rows import Member, PendingHead, SegmentView, SegState, agreeing, directory_entry
from ...schema.errors import DAMAGE, clip
from ...schema.states import LIVE, READY, State
from ..table_state.pending_reads import readable_rows, stored
from ..table_state.state import member_state
from .reading import Dbs, Value, group, record

SCAN_PER_ITEM = 10
_SEQ = struct.Struct(">Q")
log = logging.getLogger("expbuf.store")


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


class Reported:
    """The damage a store's reads logged, by table (its key prefix: a table made again under its name
    is another) and what they met (an experience, a segment, a group), so that a table read again and
    again (listed page after page, its uids polled with Get) logs each once: at most MOST remembered,
    the oldest forgotten first (logged again if met again)."""

    MOST = 10_000

    def __init__(self) -> None:
        self._seen: dict[tuple[bytes, str], None] = {}  # in the order first met
        self._lock = threading.Lock()  # reads run on many threads

    def first(self, prefix: bytes, what: str) -> bool:
        """Whether `what` of the table under `prefix` is met for the first time (remembered from now)."""
        key = (prefix, what)
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = None
            if len(self._seen) > self.MOST:
                del self._seen[next(iter(self._seen))]
            return True


@dataclass(frozen=True, slots=True)
class Told:
    """Where a read tells of the damage it passes over: its table's name and key prefix, and what the
    store's reads told already (`Reported`)."""

    table: str
    prefix: bytes
    reported: Reported

    def error(self, what: str, message: str, *args: object) -> None:
        """Log `message` (after "table <name>: ") unless `what` of this table was logged before."""
        if self.reported.first(self.prefix, what):
            log.error("table %s: " + message, self.table, *args)


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
    txn: lmdb.Transaction[bytes], dbs: Dbs, prefix: bytes, filters: Filters, *, after: int, limit: int, told: Told
) -> Page:
    """Live experiences from insertion sequence `after` on that pass the filters, at most `limit`; one
    whose record is lost is passed over, logged once (`told`)."""
    with contextlib.closing(_in_order(txn, dbs, prefix, after, told)) as found:
        return _paged(found, filters, after, limit)


def _in_order(txn: lmdb.Transaction[bytes], dbs: Dbs, prefix: bytes, after: int, told: Told) -> Generator[Listing]:
    """A records table's live experiences from insertion sequence `after` on, in its insertion order."""
    with txn.cursor(db=dbs["order"]) as cur:
        found = cur.set_range(prefix + u64(after))
        while found and cur.key().startswith(prefix):
            seq = _SEQ.unpack(cur.key()[len(prefix) :])[0]
            yield seq, functools.partial(_listed_record, txn, dbs, prefix, cur.value(), told)
            found = cur.next()


def _listed_record(txn: lmdb.Transaction[bytes], dbs: Dbs, prefix: bytes, uid: bytes, told: Told) -> Listed | None:
    """An experience as a page lists it; None where its record is lost (passed over, logged, as a Get
    lists it missing). One whose group's record is lost is listed in its own record's state."""
    rec = record(txn, dbs, prefix + uid)
    if rec is None:
        name = uid.decode(errors="replace")
        told.error(
            name,
            "ListExperiences passed over experience %s: its record is not stored or does not decode; "
            "run `expbuf check`",
            clip(name),
        )
        return None
    # ready, or leased as its group says
    state = member_state(rec, group(txn, dbs, prefix + rec.group.encode())) if rec.state == READY else rec.state
    return Listed(uid.decode(), rec.group, state, rec.version, rec.reward, rec.times_sampled)


def row_page(
    txn: lmdb.Transaction[memoryview], dbs: Dbs, prefix: bytes, filters: Filters, *, after: int, limit: int, told: Told
) -> Page:
    """`page` of a rows table, read from a transaction with buffers: the same page, its experiences read
    from its live segments and pending groups (it keeps no insertion order), the first in insertion
    order from `after` on: as many as the page takes (the next one tells where the next page starts),
    more while filters leave it short, up to as many as a records table's page would read."""
    most, wanted = limit * SCAN_PER_ITEM + 1, limit + 1
    while True:
        found = _row_listings(txn, dbs, prefix, after, wanted, told)
        page = _paged(iter(found), filters, after, limit)
        if not page.done or len(found) < wanted or wanted == most:
            return page
        wanted = min(most, 4 * wanted)


def _row_listings(
    txn: lmdb.Transaction[memoryview], dbs: Dbs, prefix: bytes, after: int, wanted: int, told: Told
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
            read = _listed_segment(txn, dbs, bytes(cur.key()), cur.value(), told)
            if read is not None:
                view, state, seqs = read
                if seqs and max(seqs) >= after and not (len(found) == wanted and min(seqs) > -found[0][0]):
                    sources.append(functools.partial(_listed_row, view, state))
                    offer(seqs, _live_members(view, state))
            at = cur.next()
    for gkey in _heads(txn, dbs, prefix):
        pending = _listed_head(txn, dbs, prefix, gkey, told)
        if pending is not None:
            now, rows = pending
            sources.append(functools.partial(_listed_pending, gkey, now, rows))
            offer([m.seq for m in rows], range(len(rows)))
    return [(-seq, functools.partial(sources[source], i)) for seq, source, i in sorted(found, reverse=True)]


def _listed_segment(
    txn: lmdb.Transaction[memoryview], dbs: Dbs, key: bytes, raw: Value, told: Told
) -> tuple[SegmentView, SegState, Sequence[int]] | None:
    """A segment a page may list members of (its rows `raw`), with its state and its members' insertion
    numbers; None where its groups have all retired, or where it does not decode (passed over, logged,
    as a take passes over it)."""
    try:
        state = SegState.decode(stored(txn, key, dbs["sstate"], "segment state"))
        if state.retired is not None:
            return None
        view, _ = agreeing(SegmentView(raw), state)
        return view, state, cast(Sequence[int], view.members.column("seq", 0, view.members.count))
    except DAMAGE as exc:
        seg = _SEQ.unpack(key[-8:])[0]
        told.error(
            f"segment {seg}",
            "ListExperiences passed over segment %d: it does not decode (%s: %s); run `expbuf check`",
            seg, type(exc).__name__, clip(str(exc), 200),
        )  # fmt: skip
        return None


def _listed_head(
    txn: lmdb.Transaction[memoryview], dbs: Dbs, prefix: bytes, gkey: str, told: Told
) -> tuple[State, list[Member]] | None:
    """A pending or computing group's state and its rows that read, as a page lists them; those damage
    lost are passed over, logged, as a records table's page passes over a member whose record is lost.
    None where the group is no longer pending, or its head does not decode (passed over, logged)."""
    try:
        head = directory_entry(stored(txn, prefix + gkey.encode(), dbs["gdir"], "pending or computing group"))
    except DAMAGE as exc:
        told.error(
            f"group {gkey}",
            "ListExperiences passed over pending group %s: its head does not decode (%s: %s); run `expbuf check`",
            clip(gkey), type(exc).__name__, clip(str(exc), 200),
        )  # fmt: skip
        return None
    if not isinstance(head, PendingHead):
        return None
    rows = readable_rows(txn, dbs, prefix, gkey, head)
    if len(rows) < len(head.hashes):
        told.error(
            f"rows of group {gkey}",
            "ListExperiences passed over %d member(s) of group %s: their rows do not read; run `expbuf check`",
            len(head.hashes) - len(rows), clip(gkey),
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
