"""A rows table's ready groups picked for a take (issue 64, 2.4), and the groups a verb names read
back: from the runs of the ready order, front first (fifo) or back first (lifo), each segment's rows
read once and its members' columns once a run; in any other order, or with a lowest model version,
from the index the order reads (core/ordering/), as a records table's take does, each group it names
found through its directory entry (2.7). A rows table keeps such an index from the first request
that read it (ready.ReadyIndex), so a table taken in fifo or lifo order alone writes none. Nothing
here writes: what the picked groups become is row_moves.py's and row_leases.py's.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import random
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, overload

from ...disk.layout import next_prefix, put_rows, u64
from ...disk.rows import GroupRef, Member, RunRow, SegmentView, SegState, directory_entry
from ...disk.snapshot import Snapshot
from ...schema.sample_spec import TakeSpec
from ...schema.states import READY, State
from ...schema.views import GroupView, Members
from ..ordering.ready import BUILD_CHUNK, IndexBuilding
from ..table_state.counters import read_counters
from ..table_state.state import TableState, missing
from ..table_state.views import RowGroup, RowMember, row_members

NO_LEASE = bytes(SegState.LEASE)


class Block:
    """Members lo to hi (excluded) of a segment, as the groups picked from them read them: each
    column read once, on first use (`column`), and the members as rows only where a view of one is
    asked for (`rows`)."""

    __slots__ = ("_columns", "_rows", "hi", "lo", "view")

    def __init__(self, view: SegmentView, lo: int, hi: int) -> None:
        self.view, self.lo, self.hi = view, lo, hi
        self._columns: dict[str, Sequence[Any]] = {}
        self._rows: list[Member] | None = None

    def column(self, name: str) -> Sequence[Any]:
        """A field of Member, of the block's members."""
        found = self._columns.get(name)
        if found is None:
            members, lo, hi = self.view.members, self.lo, self.hi
            if name == "uid":
                found = members.uids(lo, hi)
            elif name == "digest":
                found = members.digests(lo, hi)
            elif name == "segments":
                found = members.segments_of(lo, hi)
            else:
                found = members.column(name, lo, hi)
            self._columns[name] = found
        return found

    def rows(self, kept: range | list[int]) -> tuple[Member, ...]:
        """The members at `kept` (indexes in the segment), every field read."""
        if self._rows is None:
            self._rows = self.view.members.members(self.lo, self.hi)
        rows, lo = self._rows, self.lo
        if isinstance(kept, range):
            return tuple(rows[kept.start - lo : kept.stop - lo])
        return tuple(rows[i - lo] for i in kept)


class Picked:
    """A group a take picked, in state `state` (under `lease`; its deliveries `times`): its key, its
    place (segment, index), its members (`kept`: their indexes in the segment, those deleted left out)
    in a `Block` read with its neighbours', and its priority and lowest version, as the ready indexes
    hold it. Its view (`group`) and its members' (`members`) are made only where asked for: a take
    and a confirm read the members' columns a range at a time (`Spans`)."""

    __slots__ = (
        "_group", "_members", "at", "block", "gkey", "kept", "lease", "priority", "seg", "state", "times", "version",
    )  # fmt: skip

    def __init__(
        self,
        gkey: str,
        seg: int,
        at: int,
        state: State,
        block: Block,
        kept: range | list[int],
        lease: str = "",
        times: int = 0,
        priority: float = 0.0,
        version: int | None = None,
    ) -> None:
        self.gkey, self.seg, self.at, self.state, self.block, self.kept = gkey, seg, at, state, block, kept
        self.lease, self.times, self.priority, self.version = lease, times, priority, version
        self._group: RowGroup | None = None
        self._members: dict[str, RowMember] | None = None

    @property
    def rows(self) -> tuple[Member, ...]:
        return self.block.rows(self.kept)

    @property
    def group(self) -> RowGroup:
        """Its view."""
        if self._group is None:
            self._group = RowGroup(self.gkey, self.state, self.rows, lease=self.lease, times=self.times)
        return self._group

    @property
    def members(self) -> dict[str, RowMember]:
        """Its members' views (uid -> view), in push order."""
        if self._members is None:
            self._members = row_members(self.group)
        return self._members

    def moved(self, state: State | None = None, *, lease: str | None = None, times: int | None = None) -> Picked:
        """The same group once it moved to `state` (its own by default), under `lease`, delivered `times`."""
        return Picked(
            self.gkey, self.seg, self.at, self.state if state is None else state, self.block, self.kept,
            self.lease if lease is None else lease, self.times if times is None else times, self.priority,
            self.version,
        )  # fmt: skip


class Spans:
    """The members of picked groups, in the order picked, as ranges of their blocks: a column of them
    all (`column`) is a slice of each block's column a range of consecutive members (a run's members
    are one), not a read per experience."""

    __slots__ = ("_columns", "_parts", "members", "picked")

    def __init__(self, picked: Sequence[Picked]) -> None:
        self.picked, self.members = picked, 0
        self._columns: dict[str, list[Any]] = {}
        parts: list[tuple[Block, range | list[int]]] = []
        for p in picked:
            kept = p.kept
            self.members += len(kept)
            if parts and isinstance(kept, range):
                block, last = parts[-1]
                if block is p.block and isinstance(last, range) and last.stop == kept.start:
                    parts[-1] = (block, range(last.start, kept.stop))
                    continue
            parts.append((p.block, kept))
        self._parts = parts

    def column(self, name: str) -> list[Any]:
        """A field of Member, of every member, in order (read once)."""
        found = self._columns.get(name)
        if found is not None:
            return found
        found = self._columns[name] = []
        for block, kept in self._parts:
            values, lo = block.column(name), block.lo
            if isinstance(kept, range):
                found += values[kept.start - lo : kept.stop - lo]
            else:
                found += [values[i - lo] for i in kept]
        return found

    def per_member(self, values: Sequence[Any]) -> list[Any]:
        """A value a picked group (`values`, one a group) as each of its members has it."""
        if len(values) == self.members:  # groups of one
            return list(values)
        found: list[Any] = []
        for p, value in zip(self.picked, values, strict=True):
            found += [value] * len(p.kept)
        return found


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
            view = self._views[seg] = SegmentView(self._read(seg, "segs", "segment"))
        return view

    def state(self, seg: int) -> SegState:
        state = self._states.get(seg)
        if state is None:
            state = self._states[seg] = SegState.decode(self._read(seg, "sstate", "segment state"))
        return state

    def _read(self, seg: int, db: str, what: str) -> bytes:
        """A segment's row in one of its databases, which whatever names the segment says is stored."""
        raw = self.tt.txn.get(self.tt.prefix + u64(seg), db=self.tt.db[db])
        if raw is None:
            raise missing(what, str(seg))
        return raw

    def changed(self, seg: int) -> SegState:
        """A segment's state, to change: written by `save`."""
        self._dirty.add(seg)
        return self.state(seg)

    def save(self) -> None:
        prefix = self.tt.prefix
        rows = [(prefix + u64(seg), self._states[seg].encode()) for seg in sorted(self._dirty)]
        put_rows(self.tt.txn, self.tt.db["sstate"], rows)
        self._dirty.clear()


def ready_runs(tt: TableState, newest: bool) -> Generator[tuple[bytes, RunRow]]:
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
    for seg, indexes in by_segment(places).items():  # each segment's members read once
        for p in picks(segments.view(seg), segments.state(seg), seg, indexes, READY, ""):
            found[seg, p.at] = p
    return [found[place] for place in places], total


def _from_runs(tt: TableState, spec: TakeSpec, segments: Segments) -> tuple[list[Picked], int]:
    """Ready groups from the runs, front first (fifo) or back first (lifo), until there are enough."""
    picked: list[Picked] = []
    total = 0
    newest = spec.order == "lifo"
    with contextlib.closing(ready_runs(tt, newest)) as runs:
        for _, run in runs:
            view, state = segments.view(run.seg), segments.state(run.seg)
            places = range(run.first, run.first + run.length)
            if newest:
                places = places[::-1]
            chosen = 0
            for count in kept_counts(view, state, places):
                chosen += 1
                total += count
                if spec.filled(len(picked) + chosen, total):
                    break
            picked += picks(view, state, run.seg, places[:chosen], READY, "")
            if spec.enough(len(picked), total):
                break
    return picked, total


def kept_counts(view: SegmentView, state: SegState, places: Iterable[int]) -> list[int]:
    """The members of a segment's groups at `places` (those deleted left out)."""
    if state.any_flags:
        return [len(state.kept(*view.span(g))) for g in places]
    ends = view.ends
    return [ends[g] - ends[g - 1] if g else ends[0] for g in places]


def picks(view: SegmentView, state: SegState, seg: int, places: Sequence[int], now: State, lease: str) -> list[Picked]:
    """Groups of one segment at `places` (in that order), in state `now` (under `lease`), with their
    members (those deleted left out): the members they span one block, read a column at a time when
    asked, or (groups far apart, as a uniform take's) each group's a block of its own."""
    if not places:
        return []
    first, last = min(places), max(places)
    ends = view.ends
    spans = [(ends[g - 1] if g else 0, ends[g]) for g in places]
    lo, hi = view.span(first)[0], ends[last]
    together = 4 * sum(b - a for a, b in spans) >= hi - lo
    shared = Block(view, lo, hi) if together else None
    keys = view.keys(first, last + 1) if together else []
    priorities, versions = view.priorities(first, last + 1), view.versions(first, last + 1)
    times = state.times_of(first, last + 1)
    kept = state.kept if state.any_flags else range  # a group's members, those deleted left out
    found = []
    for g, (a, b) in zip(places, spans, strict=True):
        at = g - first
        gkey = keys[at] if together else view.keys(g, g + 1)[0]
        block = shared if shared is not None else Block(view, a, b)
        found.append(Picked(gkey, seg, g, now, block, kept(a, b), lease, times[at], priorities[at], versions[at]))
    return found


def ranges(indexes: Iterable[int]) -> list[tuple[int, int]]:
    """Distinct group indexes, sorted, as (first, length) ranges of consecutive ones."""
    values = sorted(indexes)
    if not values or values[-1] - values[0] + 1 == len(values):  # one range (a run's groups)
        return [(values[0], len(values))] if values else []
    found: list[tuple[int, int]] = []
    first, n = values[0], 1
    for g in values[1:]:
        if g == first + n:
            n += 1
        else:
            found.append((first, n))
            first, n = g, 1
    found.append((first, n))
    return found


def picked_by_segment(picked: Sequence[Picked]) -> dict[int, list[int]]:
    """Picked groups' indexes by segment, in the order picked (a run's groups read as one)."""
    found: dict[int, list[int]] = {}
    for seg, run in itertools.groupby(picked, key=_SEG):
        found.setdefault(seg, []).extend(map(_AT, run))
    return found


def members(picked: Iterable[Picked]) -> int:
    """Picked groups' members (those deleted left out)."""
    return sum(map(len, map(_KEPT, picked)))


_SEG, _AT, _KEPT = operator.attrgetter("seg"), operator.attrgetter("at"), operator.attrgetter("kept")


def by_segment(places: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for seg, g in places:
        found.setdefault(seg, []).append(g)
    return found


def run_key(tt: TableState, seg: int, first: int) -> bytes:
    """A run's key: the ready order's place of its first group (the segment's id is its first's)."""
    return tt.prefix + u64(seg + first)


def placed(picked: Sequence[Picked]) -> list[tuple[bytes, int, float, int | None]]:
    """Picked groups as the ready indexes hold them: key, place, priority, lowest version."""
    return [(p.gkey.encode(), p.seg + p.at, p.priority, p.version) for p in picked]


def moved_view(p: Picked, state: State, lease: str = "", times: int | None = None) -> RowGroup:
    """A picked group's view once it moved to `state` (under `lease`; its deliveries `times`)."""
    return RowGroup(p.gkey, state, p.rows, lease=lease, times=p.times if times is None else times)


class Views(Sequence[tuple[str, GroupView]]):
    """Picked groups' views as an event names them (key, view), each made as it is read: an event
    whose extensions read no group's view (the prompt ledger of a table holding no dataset) costs none."""

    def __init__(self, picked: Sequence[Picked], view: Callable[[Picked], GroupView]) -> None:
        self._picked, self._view = picked, view
        self._made: dict[int, GroupView] = {}

    def __len__(self) -> int:
        return len(self._picked)

    @overload
    def __getitem__(self, index: int) -> tuple[str, GroupView]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, GroupView]]: ...
    def __getitem__(self, index: int | slice) -> tuple[str, GroupView] | list[tuple[str, GroupView]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        p = self._picked[index]
        at = index % len(self._picked)
        view = self._made.get(at)
        if view is None:
            view = self._made[at] = self._view(p)
        return p.gkey, view


def views(picked: Sequence[Picked], state: State, lease: str = "") -> Views:
    """Picked groups' views once a take delivered them, as its `Taken` event names them."""
    return Views(picked, lambda p: moved_view(p, state, lease))


def as_they_are(picked: Sequence[Picked]) -> Views:
    """Picked groups' own views, as an event names them."""
    return Views(picked, lambda p: p.group)


def unleased(tt: TableState, segments: Segments, gkeys: Iterable[str], now: State) -> list[Picked]:
    """The groups of these keys the table holds in state `now` under no lease (ready ones, or cooling
    ones: row_requeue.py), in that order, the members of each segment's read together (`picks`)."""
    places: list[tuple[int, int]] = []
    for gkey in gkeys:
        raw = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
        ref = None if raw is None else directory_entry(raw)
        if isinstance(ref, GroupRef):
            state = segments.state(ref.seg)
            if state.state(ref.group) == now and state.lease(ref.group) == NO_LEASE:
                places.append(ref)
    found: dict[tuple[int, int], Picked] = {}
    for seg, indexes in by_segment(places).items():
        for p in picks(segments.view(seg), segments.state(seg), seg, indexes, now, ""):
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
            picked += picks(segments.view(ref.seg), state, ref.seg, [ref.group], state.state(ref.group), lease)
    return picked


def taken(picked: Sequence[Picked]) -> list[Members]:
    """Picked groups as a take's verbs read them: key, view, members' views."""
    return [(p.gkey, p.group, p.members) for p in picked]


def newest_seq(snapshot: Snapshot, tt: TableState) -> int:
    """The insertion number of the newest experience a snapshot holds of a rows table (-1: none): the
    one before the next its counters name. Its newest segment's last member would not do: a group
    requeued by reuse (row_requeue.py) goes into the newest segment with members pushed long before."""
    return read_counters(snapshot, tt.db, tt.prefix).next_seq - 1
