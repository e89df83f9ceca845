"""A rows table's picked groups moved (issue 64, 2.4): out of the ready runs (`unready`: the run cut
around them) and the indexes the table keeps, their state bytes marked, consumed, evicted, failed or
dropped (their payloads deleted, a segment all of whose groups left said so), and counted from one
state to another. Nothing here reads or writes a record per experience: a move writes one state row
a segment, and a run row a run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence, Set

from ....disk.layout import put_rows
from ....disk.rows import RunRow, SegState
from ....schema.states import COMPUTING, CONSUMED, EVICTED, FAILED, LEASED, PENDING, QUARANTINED, READY, RETIRED, State
from ....schema.views import Groups, GroupView
from ...table_state import rate_counts
from ...table_state.events import Retired
from ...table_state.pending_reads import missing
from ...table_state.picks import Picked, Picks, as_they_are, moved_view, picks
from ...table_state.state import TableState
from .. import payloads, pieces
from . import ends
from .segments import retired
from .select import NO_LEASE, Segments, complete_groups, placed, ranges, ready_runs, run_key, unleased


def unready(tt: TableState, picked: Sequence[Picked]) -> None:
    """Picked groups leave the runs that cover them (each such run cut around them) and the indexes
    the table keeps, in the order picked."""
    picked = Picks.of(picked)
    if picked and tt.ready.indexing():
        tt.ready.remove_many(placed(picked))
    runs = tt.db["runs"]
    for seg, indexes in picked.by_segment().items():
        gone = ranges(indexes)  # consecutive groups leave a run together
        at = 0
        while at < len(gone):
            key = _covering(tt, seg, gone[at][0])
            run = RunRow.decode(tt.txn.get(key, db=runs) or b"")
            tt.txn.delete(key, db=runs)
            left, end = [], run.first  # what is left of the run: from `end` to the next gone range
            stop = run.first + run.length
            while at < len(gone) and gone[at][0] < stop:
                first, n = gone[at]
                if first > end:
                    left.append((end, first - end))
                end = min(first + n, stop)
                if first + n > stop:  # the range goes on into the next run
                    gone[at] = (stop, first + n - stop)
                    break
                at += 1
            if end < stop:
                left.append((end, stop - end))
            put_rows(tt.txn, runs, [(run_key(tt, seg, a), RunRow(seg, a, n).encode()) for a, n in left])


def _covering(tt: TableState, seg: int, g: int) -> bytes:
    """The key of the run that covers group g of segment seg: the last run at or before its place
    (runs cover the ready groups exactly, and a segment's places are its own)."""
    key = run_key(tt, seg, g)
    with tt.txn.cursor(db=tt.db["runs"]) as cur:
        if cur.set_range(key) and cur.key() == key:
            return key
        found = cur.prev() if cur.key() else cur.last()
        at = bytes(cur.key()) if found else b""
        run = RunRow.decode(cur.value()) if found and at.startswith(tt.prefix) else None
    if run is None or run.seg != seg or not run.first <= g < run.first + run.length:
        raise missing("ready run", f"of group {g} of segment {seg}")
    return at


def mark(segments: Segments, picked: Sequence[Picked], state: State, tag: bytes) -> None:
    """Picked groups' state bytes and lease tags, a run of consecutive ones at a time."""
    for seg, places in Picks.of(picked).by_segment().items():
        row = segments.changed(seg)
        for first, n in ranges(places):
            row.set_states(first, first + n, state, tag)


def count_moved(tt: TableState, now: State, picked: Sequence[Picked]) -> None:
    """Picked groups' members counted from the state each group was in to `now`, and the groups too
    (live states only): one count a state."""
    counters = tt.counters
    for was, (groups, members) in Picks.of(picked).counts().items():
        counters.add(was, -members)
        counters.add(now, members)
        counters.add_groups(was, -groups)
        if now not in RETIRED:
            counters.add_groups(now, groups)


def retire(
    tt: TableState, segments: Segments, picked: Sequence[Picked], state: State, damaged: Set[str] = frozenset()
) -> None:
    """Picked groups (ready, or leased: out of their runs or leases) leave the table as `state`
    (consumed, evicted or failed): their state bytes say so, their payloads and token-level
    advantages go (payloads.drop; a failed group's payloads stay, as payloads.kept says), and a
    segment whose groups have all retired says when; the extensions hear of it first (`Retired`).
    One that leaves other than consumed leaves the rate limiter's count (as core/verbs/retire.retire
    has it), and rollouts still in pieces of a group that filled without them go, as that retire
    drops them. The groups' directory entries and their segment's columns stay: the members'
    tombstones (a retried push of one is a duplicate)."""
    tt.extensions.on_retired(tt, Retired(as_they_are(picked), state))
    _leave(tt, segments, picked, state, damaged)


def _leave(
    tt: TableState, segments: Segments, picked: Sequence[Picked], state: State, damaged: Set[str] = frozenset()
) -> None:
    """`retire`, the extensions told by the caller."""
    picked = Picks.of(picked)
    pieces.drop_groups(tt, picked.gkeys)
    if state != CONSUMED:
        for p in picked:
            rate_counts.forget(tt, p.group, p.members.values())
    mark(segments, picked, state, NO_LEASE)
    _quarantine(tt, segments, picked, damaged)
    spans = picked.spans()
    keys, sizes = spans.keys(tt.prefix), spans.column("size")
    for at in picked.segments():
        seg = segments.state(at)
        if seg.all_in(RETIRED):
            retired(tt, at, seg)
    count_moved(tt, state, picked)
    payloads.drop(tt, keys, sizes, keep=payloads.kept(tt, state, damaged))
    segments.save()


def quarantine_kept(tt: TableState, gkey: str, uid: str) -> None:
    """A failed group's member whose kept payload is damaged flagged quarantined in its segment's
    state (the caller deletes the payload and counts it)."""
    segments = Segments(tt)
    for p in complete_groups(tt, segments, [gkey]):
        _flag(segments, p, {uid})
    segments.save()


def _quarantine(tt: TableState, segments: Segments, picked: Sequence[Picked], damaged: Set[str]) -> None:
    """The `damaged` members of failing picked groups flagged quarantined in their segments' states,
    and counted so (`count_moved` counts them with their groups first)."""
    if not damaged:
        return
    count = sum(_flag(segments, p, damaged) for p in picked)
    tt.counters.add(FAILED, -count)
    tt.counters.add(QUARANTINED, count)


def _flag(segments: Segments, p: Picked, uids: Set[str]) -> int:
    """A picked group's members among `uids` flagged quarantined; returns how many."""
    row, count = segments.changed(p.seg), 0
    for i, member in zip(p.kept, p.rows, strict=True):
        if member.uid in uids:
            row.flag(i, SegState.QUARANTINED)
            count += 1
    return count


def fail(tt: TableState, groups: Groups, damaged: Set[str]) -> None:
    """Groups found damaged fail together, never to be served, heard of in one `Retired` event as a
    records table's are: the `damaged` members' payloads gone, the others' kept (payloads.kept); the
    complete ones (ready, or leased: their lease goes on without them) out of their runs, the pending
    or computing ones as ends.leave has them."""
    tt.extensions.on_retired(tt, Retired(groups, FAILED))
    segments = Segments(tt)
    complete = [gkey for gkey, grp in groups if grp.state not in (PENDING, COMPUTING)]
    picked = [p for p in complete_groups(tt, segments, complete) if p.state in (READY, LEASED)]
    unready(tt, [p for p in picked if p.state == READY])
    _leave(tt, segments, picked, FAILED, damaged)  # a leased one under its lease: its sample forgotten too
    ends.leave(tt, [(gkey, grp) for gkey, grp in groups if grp.state in (PENDING, COMPUTING)], FAILED, damaged)


def retire_ready(tt: TableState, gkeys: Sequence[str], state: State) -> int:
    """The ready groups of these keys retire as `state`: replayed ones that reached the table's
    max_times_sampled (consumed), stale ones (dropped); returns how many (one not ready stays)."""
    segments = Segments(tt)
    picked = unleased(tt, segments, gkeys, READY)
    unready(tt, picked)
    retire(tt, segments, picked, state)
    return len(picked)


def consume(tt: TableState, gkeys: Sequence[str]) -> None:
    """Groups a trainer trained without a lease of this table (ready, or leased: their lease goes
    on without them) are consumed, as an ack consumes a lease's: a ready one, never taken, leaves the
    rate limiter's count as a delete does."""
    segments = Segments(tt)
    picked = complete_groups(tt, segments, gkeys)
    ready = [p for p in picked if p.state == READY]
    for p in ready:
        rate_counts.forget(tt, p.group, p.members.values())
    unready(tt, ready)
    retire(tt, segments, [p.moved(lease="") for p in picked], CONSUMED)


def evict(tt: TableState, over: Callable[[int, int], bool], live: int, held: int) -> int:
    """The oldest ready groups in the ready order (the order they completed in) evicted in one step
    (one Retired event), as many as it takes for `over` to pass on the counts (live experiences,
    bytes held) they leave; returns the experiences evicted."""
    segments = Segments(tt)
    picked: list[Picked] = []
    with contextlib.closing(ready_runs(tt, False)) as runs:
        for _, run in runs:
            if not segments.readable(run.seg):  # damage: its groups passed over, the next ones evicted
                continue
            view, state = segments.view(run.seg), segments.state(run.seg)
            for g in range(run.first, run.first + run.length):
                p = picks(view, state, run.seg, [g], READY, "")[0]
                picked.append(p)
                live -= len(p.kept)
                held -= sum(p.block.column("size")[i - p.block.lo] for i in p.kept)
                if not over(live, held):
                    break
            else:
                continue
            break
    if picked:
        unready(tt, picked)
        retire(tt, segments, picked, EVICTED)
    return sum(len(p.kept) for p in picked)


def counted(segments: Segments, picked: Sequence[Picked]) -> Picks:
    """Picked groups a take consumes, their delivery counted (as a records table counts it in each
    member's record before it becomes a tombstone)."""
    picked = Picks.of(picked)
    for run in picked.runs:
        row = segments.changed(run.seg)
        for g, times in zip(run.places, run.times, strict=True):
            row.set_times(g, times + 1)
    return picked.moved(sampled=True)


def replayed(segments: Segments, picked: Sequence[Picked], limit: int) -> tuple[Picks, list[tuple[str, GroupView]]]:
    """Picked groups a take replays, still ready: their deliveries counted (saved), and their views
    once replayed, those that reach `limit` (0: none) as consumed, the others leased to no one where
    the table cools them (rules/reuse.py); returns the groups so counted."""
    counted_now = counted(segments, picked)
    segments.save()
    again = LEASED if segments.tt.config.reuse.cooldown_seconds > 0 else READY
    done: list[tuple[str, GroupView]] = [
        (p.gkey, moved_view(p, CONSUMED if limit and p.times >= limit else again)) for p in counted_now
    ]
    return counted_now, done
