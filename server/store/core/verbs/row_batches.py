"""A rows table's batches (issue 64, 2.4): ready groups read from the runs of the ready order, front
first (fifo) or back first (lifo), each segment's rows read once and its members' columns once a
run; a batch's groups consumed (their state bytes, their payloads deleted) or held under a lease of
runs (`RowLease`), which is then consumed or gives its groups back. Nothing here reads or writes a
record per experience: a take and a confirm write one state row a segment, and a run row a run.

The runs cover the ready groups exactly: a group leaving ready leaves its run (the run cut around
it), and one coming back gets a run of its own.

Any other order, and a lowest model version, read the index the order reads (core/ordering/), as a
records table's take does, each group it names found through its directory entry (2.7). A rows
table keeps such an index from the first request that read it (ready.ReadyIndex), so a table taken
in fifo or lifo order alone writes none; from then on its groups reach it where they become ready
(segments.write, `back`) and leave ready (`unready`), each at its place (its segment's id plus its
index there).
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable, Generator, Iterable, Sequence, Set
from typing import NamedTuple

from ...disk.layout import next_prefix, put_rows, u64
from ...disk.records import Counted
from ...disk.rows import GroupRef, RowLease, RunRow, SegmentView, SegState, directory_entry
from ...disk.snapshot import Snapshot
from ...schema.sample_spec import TakeSpec
from ...schema.states import COMPUTING, CONSUMED, EVICTED, FAILED, LEASED, PENDING, READY, RETIRED, State
from ...schema.views import Groups, GroupView, Members
from ..ordering.ready import BUILD_CHUNK, IndexBuilding
from ..table_state import rate_counts
from ..table_state.counters import read_counters
from ..table_state.events import Moved, Retired
from ..table_state.state import TableState, missing
from ..table_state.views import RowGroup, RowMember, kept_rows, row_members
from . import payloads, pieces, row_pending
from .segments import retired

NO_LEASE = bytes(SegState.LEASE)


class Picked(NamedTuple):
    """A group a take picked: its key, view and members' views, its place (segment, index), and its
    priority and lowest version, as the ready indexes hold it."""

    gkey: str
    group: RowGroup
    members: dict[str, RowMember]
    seg: int
    at: int  # its index in the segment
    priority: float = 0.0
    version: int | None = None


class Segments:
    """The segments a request reads in one transaction, each read once (its rows as a view of the
    map, its state as a bytearray), and the states it changed, written once by `save`."""

    def __init__(self, tt: TableState) -> None:
        self.tt = tt
        self._views: dict[int, SegmentView] = {}
        self._states: dict[int, SegState] = {}
        self._dirty: set[int] = set()

    def view(self, seg: int) -> SegmentView:
        view = self._views.get(seg)
        if view is None:
            raw = self.tt.txn.get(self.tt.prefix + u64(seg), db=self.tt.db["segs"])
            if raw is None:
                raise missing("segment", str(seg))
            view = self._views[seg] = SegmentView(raw)
        return view

    def state(self, seg: int) -> SegState:
        state = self._states.get(seg)
        if state is None:
            raw = self.tt.txn.get(self.tt.prefix + u64(seg), db=self.tt.db["sstate"])
            if raw is None:
                raise missing("segment state", str(seg))
            state = self._states[seg] = SegState.decode(raw)
        return state

    def changed(self, seg: int) -> SegState:
        """A segment's state, to change: written by `save`."""
        self._dirty.add(seg)
        return self.state(seg)

    def save(self) -> None:
        prefix = self.tt.prefix
        rows = [(prefix + u64(seg), self._states[seg].encode()) for seg in sorted(self._dirty)]
        put_rows(self.tt.txn, self.tt.db["sstate"], rows)
        self._dirty.clear()


def _runs(tt: TableState, newest: bool) -> Generator[tuple[bytes, RunRow]]:
    """The table's ready runs in the ready order, oldest first (or `newest` first). The caller
    changes none while it reads: it picks, then `unready` cuts the runs."""
    prefix = tt.prefix
    with tt.txn.cursor(db=tt.db["runs"]) as cur:
        if newest:
            end = next_prefix(prefix)
            found = (cur.prev() if cur.set_range(end) else cur.last()) if end is not None else cur.last()
            step = cur.prev
        else:
            found = cur.set_range(prefix)
            step = cur.next
        while found and cur.key()[: len(prefix)] == prefix:
            yield bytes(cur.key()), RunRow.decode(cur.value())
            found = step()


def select(tt: TableState, spec: TakeSpec, segments: Segments, rng: random.Random) -> tuple[list[Picked], int]:
    """Ready groups in the request's order until there are enough, and their experiences: in fifo
    or lifo order from the runs (the columns of the members taken from a run read once), in any
    other order or with a lowest model version from the index the order reads (`_indexed`)."""
    if spec.order in ("fifo", "lifo") and spec.min_model_version is None:
        return _from_runs(tt, spec, segments)
    for _ in range(_INLINE_BUILDS):
        try:
            return _indexed(tt, spec, segments, rng)
        except IndexBuilding as building:
            if tt.counters.groups_ready > BUILD_CHUNK or not tt.build_index(building.index).kept:
                raise
    return _indexed(tt, spec, segments, rng)


# The indexes a request may build in its own transaction: a table of few ready groups builds the
# index an order reads where the request meets its lack (one chunk, what a background build's
# chunk costs the writer), rather than waiting for the background's; with a lowest version, an
# order without a `fresh` of its own reads two (the version index and its own).
_INLINE_BUILDS = 2


def _indexed(tt: TableState, spec: TakeSpec, segments: Segments, rng: random.Random) -> tuple[list[Picked], int]:
    """Ready groups in the order of the request's index (core/ordering/), each found through its
    directory entry, until there are enough (core/verbs/take.select's way on records). Reading an
    index the table does not keep yet raises IndexBuilding before anything is changed."""
    places: list[tuple[int, int]] = []  # (segment, group) in the order's
    total = 0
    with contextlib.closing(tt.ready.candidates(spec.order, rng, spec.min_model_version)) as candidates:
        for raw in candidates:
            entry = tt.txn.get(tt.prefix + raw, db=tt.db["gdir"])
            ref = None if entry is None else directory_entry(entry)
            if not isinstance(ref, GroupRef) or segments.state(ref.seg).state(ref.group) != READY:
                raise missing("ready group", raw.decode(errors="replace"))
            places.append(ref)
            total += len(segments.state(ref.seg).kept(*segments.view(ref.seg).span(ref.group)))  # deleted left out
            if spec.filled(len(places), total):
                break
    found: dict[tuple[int, int], Picked] = {}
    for seg, indexes in _by_segment(places).items():  # each segment's members read once
        for p in _picked(segments.view(seg), segments.state(seg), seg, indexes, READY, ""):
            found[seg, p.at] = p
    return [found[place] for place in places], total


def _from_runs(tt: TableState, spec: TakeSpec, segments: Segments) -> tuple[list[Picked], int]:
    """Ready groups from the runs, front first (fifo) or back first (lifo), until there are enough."""
    picked: list[Picked] = []
    total = 0
    newest = spec.order == "lifo"
    with contextlib.closing(_runs(tt, newest)) as runs:
        for _, run in runs:
            view, state = segments.view(run.seg), segments.state(run.seg)
            places = range(run.first, run.first + run.length)
            chosen: list[int] = []
            for g in reversed(places) if newest else places:
                chosen.append(g)
                total += len(state.kept(*view.span(g)))
                if spec.filled(len(picked) + len(chosen), total):
                    break
            picked += _picked(view, state, run.seg, chosen, READY, "")
            if spec.enough(len(picked), total):
                break
    return picked, total


def _picked(
    view: SegmentView, state: SegState, seg: int, places: Sequence[int], now: State, lease: str
) -> list[Picked]:
    """Groups of one segment at `places` (in that order), in state `now` (under `lease`), with their
    members' views (those deleted left out): the columns of the members they span read once, or
    (groups far apart, as a uniform take's) each group's alone."""
    if not places:
        return []
    first, last = min(places), max(places)
    spans = [view.span(g) for g in places]
    lo, hi = view.span(first)[0], view.span(last)[1]
    together = 4 * sum(b - a for a, b in spans) >= hi - lo
    rows = view.members.members(lo, hi) if together else []
    keys = view.keys(first, last + 1) if together else []
    priorities, versions = view.priorities(first, last + 1), view.versions(first, last + 1)
    found = []
    for g, (a, b) in zip(places, spans, strict=True):
        gkey = keys[g - first] if together else view.keys(g, g + 1)[0]
        members = kept_rows(state, rows[a - lo : b - lo] if together else view.members.members(a, b), a)
        group = RowGroup(gkey, now, members, lease=lease, times=state.times(g))
        found.append(Picked(gkey, group, row_members(group), seg, g, priorities[g - first], versions[g - first]))
    return found


def _ranges(indexes: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted group indexes as (first, length) ranges of consecutive ones."""
    found: list[tuple[int, int]] = []
    for _, part in itertools.groupby(enumerate(sorted(indexes)), key=lambda pair: pair[1] - pair[0]):
        values = [g for _, g in part]
        found.append((values[0], len(values)))
    return found


def _by_segment(places: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for seg, g in places:
        found.setdefault(seg, []).append(g)
    return found


def _run_key(tt: TableState, seg: int, first: int) -> bytes:
    """A run's key: the ready order's place of its first group (the segment's id is its first's)."""
    return tt.prefix + u64(seg + first)


def _placed(picked: Sequence[Picked]) -> list[tuple[bytes, int, float, int | None]]:
    """Picked groups as the ready indexes hold them: key, place, priority, lowest version."""
    return [(p.gkey.encode(), p.seg + p.at, p.priority, p.version) for p in picked]


def unready(tt: TableState, picked: Sequence[Picked]) -> None:
    """Picked groups leave the runs that cover them (each such run cut around them) and the indexes
    the table keeps, in the order picked."""
    if picked and tt.ready.indexing():
        tt.ready.remove_many(_placed(picked))
    runs = tt.db["runs"]
    for seg, indexes in _by_segment((p.seg, p.at) for p in picked).items():
        gone, cut = set(indexes), set[int]()
        for g in sorted(gone):
            if g in cut:
                continue
            key = _covering(tt, seg, g)
            run = RunRow.decode(tt.txn.get(key, db=runs) or b"")
            tt.txn.delete(key, db=runs)
            span = range(run.first, run.first + run.length)
            cut.update(span)
            left = [x for x in span if x not in gone]
            put_rows(tt.txn, runs, [(_run_key(tt, seg, a), RunRow(seg, a, n).encode()) for a, n in _ranges(left)])


def _covering(tt: TableState, seg: int, g: int) -> bytes:
    """The key of the run that covers group g of segment seg: the last run at or before its place
    (runs cover the ready groups exactly, and a segment's places are its own)."""
    key = _run_key(tt, seg, g)
    with tt.txn.cursor(db=tt.db["runs"]) as cur:
        if cur.set_range(key) and cur.key() == key:
            return key
        found = cur.prev() if cur.key() else cur.last()
        at = bytes(cur.key()) if found else b""
        run = RunRow.decode(cur.value()) if found and at.startswith(tt.prefix) else None
    if run is None or run.seg != seg or not run.first <= g < run.first + run.length:
        raise missing("ready run", f"of group {g} of segment {seg}")
    return at


def _mark(segments: Segments, picked: Sequence[Picked], state: State, tag: bytes) -> None:
    """Picked groups' state bytes and lease tags, a segment at a time."""
    for seg, places in _by_segment((p.seg, p.at) for p in picked).items():
        row = segments.changed(seg)
        for at in places:
            row.set_state(at, state)
            row.set_lease(at, tag)


def _moved(tt: TableState, now: State, picked: Sequence[Picked]) -> None:
    """Picked groups' members counted from the state each group was in to `now`, and the groups too
    (live states only): one count a state."""
    members: dict[State, int] = {}
    groups: dict[State, int] = {}
    for p in picked:
        was = p.group.state
        members[was] = members.get(was, 0) + len(p.group.rows)
        groups[was] = groups.get(was, 0) + 1
    counters = tt.counters
    for was, count in members.items():
        counters.add(was, -count)
        counters.add(now, count)
    for was, count in groups.items():
        counters.add_groups(was, -count)
        if now not in RETIRED:
            counters.add_groups(now, count)


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
    tt.extensions.on_retired(tt, Retired([(p.gkey, p.group) for p in picked], state))
    _leave(tt, segments, picked, state, damaged)


def _leave(
    tt: TableState, segments: Segments, picked: Sequence[Picked], state: State, damaged: Set[str] = frozenset()
) -> None:
    """`retire`, the extensions told by the caller."""
    for p in picked:
        pieces.drop_group(tt, p.gkey)
    if state != CONSUMED:
        for p in picked:
            rate_counts.forget(tt, p.group, p.members.values())
    _mark(segments, picked, state, NO_LEASE)
    prefix = tt.prefix
    keys = [prefix + uid.encode() for p in picked for uid in p.members]
    sizes = [member.size for p in picked for member in p.group.rows]
    for at in {p.seg for p in picked}:
        seg = segments.state(at)
        if all(s in RETIRED for s in seg.states(0, seg.groups)):
            retired(tt, at, seg)
    _moved(tt, state, picked)
    payloads.drop(tt, keys, sizes, keep=payloads.kept(tt, state, damaged))
    segments.save()


def hold(tt: TableState, segments: Segments, picked: Sequence[Picked], lease_id: str) -> list[tuple[int, int, int]]:
    """Picked groups (ready, out of their runs) leased under `lease_id` (to no one where it is "": a
    cooling group, row_requeue.py): their state bytes and lease tags; returns the lease's runs
    (segment, first group, groups)."""
    _mark(segments, picked, LEASED, bytes.fromhex(lease_id) if lease_id else NO_LEASE)
    _moved(tt, LEASED, picked)
    segments.save()
    if tt.extensions.hears("on_moved"):
        tt.extensions.on_moved(tt, Moved(READY, LEASED, [(p.gkey, _as(p, LEASED, lease_id)) for p in picked]))
    reuse = tt.config.reuse
    return _lease_runs(picked, taken=reuse.priority_decay > 0 or reuse.cooldown_seconds > 0)


def _lease_runs(picked: Sequence[Picked], *, taken: bool = False) -> list[tuple[int, int, int]]:
    """Picked groups as runs (segment, first group, groups) of consecutive ones; with `taken`, in the
    order picked (a table that reuses replayed groups requeues a held batch's in the order it was
    taken, as a records table's lease names them: row_requeue.py)."""
    if not taken:
        places = _by_segment((p.seg, p.at) for p in picked)
        return [(seg, first, n) for seg, indexes in places.items() for first, n in _ranges(indexes)]
    runs: list[tuple[int, int, int]] = []
    for p in picked:
        seg, first, n = runs[-1] if runs else (-1, 0, 0)
        if seg == p.seg and first + n == p.at:  # the next group of the run before
            runs[-1] = (seg, first, n + 1)
        else:
            runs.append((p.seg, p.at, 1))
    return runs


def _as(p: Picked, state: State, lease: str = "", times: int | None = None) -> RowGroup:
    """A picked group's view once it moved to `state` (under `lease`; its deliveries `times`)."""
    return RowGroup(p.gkey, state, p.group.rows, lease=lease, times=p.group.times if times is None else times)


def views(picked: Sequence[Picked], state: State, lease: str = "") -> list[tuple[str, GroupView]]:
    """Picked groups' views once a take delivered them, as its `Taken` event names them."""
    return [(p.gkey, _as(p, state, lease)) for p in picked]


def counted(segments: Segments, picked: Sequence[Picked]) -> list[Picked]:
    """Picked groups a take consumes, their delivery counted (as a records table counts it in each
    member's record before it becomes a tombstone)."""
    found = []
    for p in picked:
        times = p.group.times + 1
        segments.changed(p.seg).set_times(p.at, times)
        group = _as(p, p.group.state, times=times)
        found.append(p._replace(group=group, members=row_members(group)))
    return found


def lease_row(
    table_id: int, runs: Sequence[tuple[int, int, int]], expires: float | None, owner: str, counted: Counted | None
) -> bytes:
    """The value of a lease of runs."""
    row_runs = [RunRow(*run) for run in runs]
    return RowLease(table_id=table_id, runs=row_runs, expires=expires, owner=owner, counted=counted).encode()


def leased(tt: TableState, segments: Segments, lease_id: str, lease: RowLease, *, ending: bool = False) -> list[Picked]:
    """The groups still under a lease of runs (one consumed or given back meanwhile is not); with
    `ending`, their views say they left it (as an ack's consume hears them)."""
    tag = bytes.fromhex(lease_id)
    under: dict[int, list[int]] = {}  # by segment, each read once
    order: list[tuple[int, int]] = []  # the runs' order (a reusing table's: the take's, _lease_runs)
    for run in lease.runs:
        state = segments.state(run.seg)
        span = range(run.first, run.first + run.length)
        held = [g for g in span if state.state(g) == LEASED and state.lease(g) == tag]
        under.setdefault(run.seg, []).extend(held)
        order.extend((run.seg, g) for g in held)
    found: dict[tuple[int, int], Picked] = {}
    for seg, places in under.items():
        for p in _picked(segments.view(seg), segments.state(seg), seg, places, LEASED, "" if ending else lease_id):
            found[seg, p.at] = p
    return [found[place] for place in order]


def held(tt: TableState, lease_id: str, lease: RowLease) -> int:
    """The experiences still under a lease of runs."""
    return sum(len(p.members) for p in leased(tt, Segments(tt), lease_id, lease))


def end(tt: TableState, lease_id: str, lease: RowLease, *, requeue: bool, unsent: bool) -> int:
    """A lease of runs ends: its groups consumed, or back to ready (`requeue`), counted as sampled
    unless `unsent` (a batch held for a stream that never sent it: what its take counted leaves the
    table's counters and the rate limiter's count); returns the experiences."""
    segments = Segments(tt)
    picked = leased(tt, segments, lease_id, lease, ending=not requeue)
    count = sum(len(p.members) for p in picked)
    if not requeue:  # the groups leave their lease, then the table
        retire(tt, segments, picked, CONSUMED)
        return count
    if unsent:
        counted = lease.counted or Counted(count, sum(m.size for p in picked for m in p.members.values()), 0)
        tt.counters.sampled -= counted.experiences
        tt.counters.bytes_sampled -= counted.nbytes
        tt.counters.tokens_masked -= counted.tokens_masked
        rate_counts.given_back(tt, count)
    back(tt, segments, picked, sampled=not unsent)
    return count


def replayed_back(tt: TableState, lease_id: str, lease: RowLease) -> list[Members]:
    """A held replay batch its client confirmed: its groups still under the lease are ready again,
    their deliveries counted; returns them, counted, for reuse to retire the spent."""
    segments = Segments(tt)
    picked = leased(tt, segments, lease_id, lease)
    back(tt, segments, picked, sampled=True)
    again = [p._replace(group=_as(p, READY, times=p.group.times + 1)) for p in picked]
    return taken([p._replace(members=row_members(p.group)) for p in again])


def back(tt: TableState, segments: Segments, picked: Sequence[Picked], *, sampled: bool) -> None:
    """Leased groups are ready again, each in a run of its own range (their deliveries counted where
    `sampled`)."""
    _mark(segments, picked, READY, NO_LEASE)
    if sampled:
        for p in picked:
            state = segments.state(p.seg)
            state.set_times(p.at, state.times(p.at) + 1)
    _moved(tt, READY, picked)
    segments.save()
    rows = [(_run_key(tt, seg, first), RunRow(seg, first, n).encode()) for seg, first, n in _lease_runs(picked)]
    put_rows(tt.txn, tt.db["runs"], sorted(rows))
    if picked and tt.ready.indexing():
        tt.ready.add_many(_placed(picked))
    if tt.extensions.hears("on_moved"):
        groups: Groups = [(p.gkey, _as(p, READY, times=p.group.times + sampled)) for p in picked]
        tt.extensions.on_moved(tt, Moved(LEASED, READY, groups))


def unleased(tt: TableState, segments: Segments, gkeys: Iterable[str], now: State) -> list[Picked]:
    """The groups of these keys the table holds in state `now` under no lease (ready ones, or cooling
    ones: row_requeue.py), in that order, the members of each segment's read together (`_picked`)."""
    places: list[tuple[int, int]] = []
    for gkey in gkeys:
        raw = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
        ref = None if raw is None else directory_entry(raw)
        if isinstance(ref, GroupRef):
            state = segments.state(ref.seg)
            if state.state(ref.group) == now and state.lease(ref.group) == NO_LEASE:
                places.append(ref)
    found: dict[tuple[int, int], Picked] = {}
    for seg, indexes in _by_segment(places).items():
        for p in _picked(segments.view(seg), segments.state(seg), seg, indexes, now, ""):
            found[seg, p.at] = p
    return [found[place] for place in places]


def complete_groups(tt: TableState, segments: Segments, gkeys: Iterable[str]) -> list[Picked]:
    """The complete groups of these keys the table holds, each read from its segment (a pending or
    absent one is not)."""
    picked: list[Picked] = []
    for gkey in gkeys:
        raw = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
        ref = None if raw is None else directory_entry(raw)
        if isinstance(ref, GroupRef):
            state = segments.state(ref.seg)
            tag = state.lease(ref.group)
            lease = tag.hex() if tag != NO_LEASE else ""
            picked += _picked(segments.view(ref.seg), state, ref.seg, [ref.group], state.state(ref.group), lease)
    return picked


def fail(tt: TableState, groups: Groups, damaged: Set[str]) -> None:
    """Groups found damaged fail together, never to be served, heard of in one `Retired` event as a
    records table's are: the `damaged` members' payloads gone, the others' kept (payloads.kept); the
    complete ones (ready, or leased: their lease goes on without them) out of their runs, the pending
    or computing ones as row_pending.leave has them."""
    tt.extensions.on_retired(tt, Retired(groups, FAILED))
    segments = Segments(tt)
    complete = [gkey for gkey, grp in groups if grp.state not in (PENDING, COMPUTING)]
    picked = [p for p in complete_groups(tt, segments, complete) if p.group.state in (READY, LEASED)]
    unready(tt, [p for p in picked if p.group.state == READY])
    _leave(tt, segments, [p._replace(group=p.group._replace(lease="")) for p in picked], FAILED, damaged)
    row_pending.leave(tt, [(gkey, grp) for gkey, grp in groups if grp.state in (PENDING, COMPUTING)], FAILED, damaged)


def retire_ready(tt: TableState, gkeys: Sequence[str], state: State) -> int:
    """The ready groups of these keys retire as `state`: replayed ones that reached the table's
    max_times_sampled (consumed), stale ones (dropped); returns how many (one not ready stays)."""
    segments = Segments(tt)
    picked = unleased(tt, segments, gkeys, READY)
    unready(tt, picked)
    retire(tt, segments, picked, state)
    return len(picked)


def replayed(
    segments: Segments, picked: Sequence[Picked], limit: int
) -> tuple[list[Picked], list[tuple[str, GroupView]]]:
    """Picked groups a take replays, still ready: their deliveries counted (saved), and their views
    once replayed, those that reach `limit` (0: none) as consumed, the others leased to no one where
    the table cools them (rules/reuse.py); returns the groups so counted."""
    counted_now = counted(segments, picked)
    segments.save()
    again = LEASED if segments.tt.config.reuse.cooldown_seconds > 0 else READY
    done: list[tuple[str, GroupView]] = [
        (p.gkey, _as(p, CONSUMED if limit and p.group.times >= limit else again)) for p in counted_now
    ]
    return counted_now, done


def consume(tt: TableState, gkeys: Sequence[str]) -> None:
    """Groups a trainer trained without a lease of this table (ready, or leased: their lease goes
    on without them) are consumed, as an ack consumes a lease's: a ready one, never taken, leaves the
    rate limiter's count as a delete does."""
    segments = Segments(tt)
    picked = complete_groups(tt, segments, gkeys)
    ready = [p for p in picked if p.group.state == READY]
    for p in ready:
        rate_counts.forget(tt, p.group, p.members.values())
    unready(tt, ready)
    retire(tt, segments, [p._replace(group=p.group._replace(lease="")) for p in picked], CONSUMED)


def evict(tt: TableState, over: Callable[[int, int], bool], live: int, held: int) -> int:
    """The oldest ready groups in the ready order (the order they completed in) evicted in one step
    (one Retired event), as many as it takes for `over` to pass on the counts (live experiences,
    bytes held) they leave; returns the experiences evicted."""
    segments = Segments(tt)
    picked: list[Picked] = []
    with contextlib.closing(_runs(tt, False)) as runs:
        for _, run in runs:
            view, state = segments.view(run.seg), segments.state(run.seg)
            for g in range(run.first, run.first + run.length):
                p = _picked(view, state, run.seg, [g], READY, "")[0]
                picked.append(p)
                live -= len(p.group.rows)
                held -= sum(member.size for member in p.group.rows)
                if not over(live, held):
                    break
            else:
                continue
            break
    if picked:
        unready(tt, picked)
        retire(tt, segments, picked, EVICTED)
    return sum(len(p.group.rows) for p in picked)


def taken(picked: Sequence[Picked]) -> list[Members]:
    """Picked groups as a take's verbs read them: key, view, members' views."""
    return [(p.gkey, p.group, p.members) for p in picked]


def newest_seq(snapshot: Snapshot, tt: TableState) -> int:
    """The insertion number of the newest experience a snapshot holds of a rows table (-1: none): the
    one before the next its counters name. Its newest segment's last member would not do: a group
    requeued by reuse (row_requeue.py) goes into the newest segment with members pushed long before."""
    return read_counters(snapshot, tt.db, tt.prefix).next_seq - 1
