"""A rows table's groups picked for a verb (issue 64, 2.4), as a take and a confirm work on them: by
the runs they were picked in, not a Python object an experience, nor a group.

`picks` reads groups of one segment into a `Run`: their places, state, lease, deliveries and their
members' indexes, the members' columns read a block at a time (`Block`) when something asks. A verb
takes `Picks`, the runs of a request in the order picked: what a take and a confirm do to them
(marked, counted, cut out of the ready runs, their payloads checked and read, dropped) reads the
runs whole (`by_segment`, `counts`, `spans`, `gkeys`, `times`), and a group as one object
(`Picked`, with its view and its members' views) is made only where a verb reads groups one by one
(a delete, a requeue, an event an extension reads, a batch stage).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import Any, overload

from ...disk.rows import Member, SegmentView, SegState
from ...schema.states import State
from ...schema.views import GroupView
from .views import RowGroup, RowMember, row_members


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
        """A field of Member (or "uid_bytes", the uids as stored), of the block's members."""
        found = self._columns.get(name)
        if found is None:
            members, lo, hi = self.view.members, self.lo, self.hi
            if name == "uid":
                found = members.uids(lo, hi)
            elif name == "uid_bytes":  # as stored: what a key is made of
                found = members.uid_bytes(lo, hi)
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
    """One picked group, in state `state` (under `lease`; its deliveries `times`): its key, its place
    (segment, index), its members (`kept`: their indexes in the segment, those deleted left out) in
    a `Block`, and its priority and lowest version, as the ready indexes hold them. Its view
    (`group`) and its members' (`members`) are made only where asked for."""

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


class Run:
    """Groups of one segment picked together, at `places` (in the order picked), all in state `now`
    under `lease`: each one's deliveries (`times`) and members (`kept`, their indexes in the
    segment; None where `whole`: each group's span, made once something reads one), whose columns
    are read from `block` (None: each group's from a block of its own, the groups lying far apart);
    `whole`: none of their members was deleted; `count`, their members, counted once. Its groups as
    `Picked` objects are made once something reads one."""

    __slots__ = ("_groups", "_kept", "block", "count", "lease", "now", "places", "seg", "times", "view", "whole")

    def __init__(
        self,
        view: SegmentView,
        seg: int,
        places: Sequence[int],
        now: State,
        lease: str,
        times: Sequence[int],
        kept: Sequence[range | list[int]] | None,
        block: Block | None,
        whole: bool,
        groups: list[Picked] | None = None,
        count: int | None = None,
    ) -> None:
        self.view, self.seg, self.places, self.now, self.lease = view, seg, places, now, lease
        self.times, self._kept, self.block, self.whole, self._groups = times, kept, block, whole, groups
        self.count = sum(self.sizes()) if count is None else count

    @property
    def kept(self) -> Sequence[range | list[int]]:
        """Each group's members, their indexes in the segment."""
        if self._kept is None:
            self._kept = list(map(range, *self.view.bounds(self.places)))
        return self._kept

    def sizes(self) -> list[int]:
        """Each group's members counted: a whole run's from its groups' bounds, no range made a group."""
        if self._kept is None:
            starts, stops = self.view.bounds(self.places)
            return list(map(operator.sub, stops, starts))
        return list(map(len, self._kept))

    @classmethod
    def of(cls, p: Picked) -> Run:
        """A group made alone (a verb's that chose among picked groups) as a run of its own."""
        whole = isinstance(p.kept, range)
        return cls(p.block.view, p.seg, [p.at], p.state, p.lease, [p.times], [p.kept], p.block, whole, [p])

    def groups(self) -> list[Picked]:
        """Its groups, each one object, in the order picked."""
        if self._groups is None:
            view, places = self.view, self.places
            first, last = extent(places)
            keys = self.gkeys()
            priorities, versions = view.priorities(first, last + 1), view.versions(first, last + 1)
            found = []
            for at, (g, kept) in enumerate(zip(places, self.kept, strict=True)):
                block = self.block or Block(view, *view.span(g))
                here = g - first
                found.append(
                    Picked(keys[at], self.seg, g, self.now, block, kept, self.lease, self.times[at], priorities[here],
                           versions[here])
                )  # fmt: skip
            self._groups = found
        return self._groups

    def gkeys(self) -> list[str]:
        """Its groups' keys, in the order picked."""
        if self._groups is not None:
            return [p.gkey for p in self._groups]
        places = self.places
        if self.block is None:  # groups far apart: each one's read alone
            return [self.view.keys(g, g + 1)[0] for g in places]
        first, last = extent(places)
        block = self.block
        if self.view.keys_are_uids and block.lo == first and block.hi == last + 1:
            keys = list(block.column("uid"))  # groups of one: their keys are their members' uids, cut once for both
        else:
            keys = self.view.keys(first, last + 1)
        return keys if ascending(places) else [keys[g - first] for g in places]

    def parts(self) -> list[tuple[Block, range | list[int]]]:
        """Its members as parts of blocks, in the order picked: one part where its groups are
        consecutive ones none of whose members was deleted."""
        view, places = self.view, self.places
        if self.block is not None and self.whole and ascending(places):
            return [(self.block, range(view.span(places[0])[0], view.ends[places[-1]]))]
        return [(self.block or Block(view, *view.span(g)), k) for g, k in zip(places, self.kept, strict=True)]

    def moved(self, now: State | None, lease: str | None, times: Sequence[int] | None) -> Run:
        """The same groups in state `now`, under `lease`, delivered `times` (None: as they are)."""
        return Run(
            self.view, self.seg, self.places, self.now if now is None else now, self.lease if lease is None else lease,
            self.times if times is None else times, self._kept, self.block, self.whole, count=self.count,
        )  # fmt: skip


def extent(places: Sequence[int]) -> tuple[int, int]:
    """The least and the greatest of (some) places: a range's ends (a fifo or lifo run's), not a walk."""
    if isinstance(places, range):
        return (places[0], places[-1]) if places.step > 0 else (places[-1], places[0])
    return min(places), max(places)


def ascending(places: Sequence[int]) -> bool:
    """Whether places are consecutive, in ascending order."""
    if isinstance(places, range):
        return places.step == 1
    return list(places) == list(range(places[0], places[0] + len(places))) if places else True


class Picks(Sequence[Picked]):
    """A request's picked groups, as the runs they were picked in (`runs`), in the order picked. As
    a sequence, its groups one object each (made at the first read)."""

    __slots__ = ("_groups", "_spans", "runs")

    def __init__(self, runs: Iterable[Run] = ()) -> None:
        self.runs = [run for run in runs if run.places]
        self._groups: list[Picked] | None = None
        self._spans: Spans | None = None

    @classmethod
    def of(cls, picked: Sequence[Picked]) -> Picks:
        """Picked groups as Picks: themselves, or (groups a verb chose) a run each."""
        return picked if isinstance(picked, Picks) else cls(Run.of(p) for p in picked)

    @classmethod
    def joined(cls, parts: Iterable[Picks]) -> Picks:
        return cls(run for part in parts for run in part.runs)

    def _all(self) -> list[Picked]:
        if self._groups is None:
            self._groups = [p for run in self.runs for p in run.groups()]
        return self._groups

    def __len__(self) -> int:
        return sum(len(run.places) for run in self.runs)

    def __iter__(self) -> Iterator[Picked]:
        return iter(self._all())

    @overload
    def __getitem__(self, index: int) -> Picked: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Picked]: ...
    def __getitem__(self, index: int | slice) -> Picked | Sequence[Picked]:
        return self._all()[index]

    def by_segment(self) -> dict[int, Sequence[int]]:
        """Its groups' indexes by segment, in the order picked: a segment's one run's places as they
        are (a fifo take's range), no list made of them."""
        found: dict[int, list[Sequence[int]]] = {}
        for run in self.runs:
            found.setdefault(run.seg, []).append(run.places)
        return {seg: parts[0] if len(parts) == 1 else list(chain.from_iterable(parts)) for seg, parts in found.items()}

    def segments(self) -> set[int]:
        return {run.seg for run in self.runs}

    def members(self) -> int:
        """Its groups' members (those deleted left out)."""
        return sum(run.count for run in self.runs)

    def counts(self) -> dict[State, tuple[int, int]]:
        """Its groups and their members, by the state each group is in."""
        found: dict[State, tuple[int, int]] = {}
        for run in self.runs:
            groups, members = found.get(run.now, (0, 0))
            found[run.now] = (groups + len(run.places), members + run.count)
        return found

    def gkeys(self) -> list[str]:
        """Its groups' keys, in the order picked."""
        found: list[str] = []
        for run in self.runs:
            found += run.gkeys()
        return found

    def times(self) -> list[int]:
        """Its groups' deliveries, in the order picked."""
        found: list[int] = []
        for run in self.runs:
            found += run.times
        return found

    def spans(self) -> Spans:
        """Its members, as ranges of blocks (read once)."""
        if self._spans is None:
            self._spans = Spans(self)
        return self._spans

    def moved(self, now: State | None = None, *, lease: str | None = None, sampled: bool = False) -> Picks:
        """The same groups once they moved to `now` (their own by default), under `lease`, each one's
        delivery counted where `sampled`."""
        return Picks(
            run.moved(now, lease, [times + 1 for times in run.times] if sampled else None) for run in self.runs
        )


class Spans:
    """The members of picked groups, in the order picked, as ranges of their blocks: a column of them
    all (`column`) is a slice of each block's column a range of consecutive members (a run's members
    are one), not a read per experience."""

    __slots__ = ("_columns", "_parts", "_runs", "members")

    def __init__(self, picked: Picks) -> None:
        self._runs = picked.runs
        self._parts = [part for run in picked.runs for part in run.parts()]
        self.members = sum(run.count for run in picked.runs)
        self._columns: dict[str, list[Any]] = {}

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

    def keys(self, prefix: bytes) -> list[bytes]:
        """Its members' payloads' keys in a table of `prefix`: their uids as stored, no encode each; a
        range of a block's members' cut from their bytes at once."""
        found: list[bytes] = []
        for block, kept in self._parts:
            if isinstance(kept, range):
                found += block.view.members.keys(prefix, kept.start, kept.stop)
            else:
                uids, lo = block.column("uid_bytes"), block.lo
                found += [prefix + uids[i - lo] for i in kept]
        return found

    def per_member(self, values: Sequence[Any]) -> list[Any]:
        """A value a picked group (`values`, one a group) as each of its members has it."""
        if len(values) == self.members:  # groups of one
            return list(values)
        sizes: list[int] = []  # each group's members
        for run in self._runs:
            sizes += run.sizes()
        found: list[Any] = []
        for value, size in zip(values, sizes, strict=True):
            found += [value] * size
        return found


def picks(view: SegmentView, state: SegState, seg: int, places: Sequence[int], now: State, lease: str) -> Picks:
    """Groups of one segment at `places` (in that order), in state `now` (under `lease`), with their
    members (those deleted left out): the members they span one block, read a column at a time when
    asked, or (groups far apart, as a uniform take's) each group's a block of its own."""
    if not places:
        return Picks()
    first, last = extent(places)
    ends = view.ends
    lo, hi = view.span(first)[0], ends[last]
    whole = not state.any_flags
    kept: list[range | list[int]] | None = None  # a whole group's members: its span, made where asked for
    if whole:
        starts, stops = view.bounds(places)
        count = sum(stops) - sum(starts)
    else:
        kept = [state.kept(*view.span(g)) for g in places]
        count = sum(map(len, kept))
    together = 4 * count >= hi - lo
    times = state.times_of(first, last + 1)
    if not ascending(places):
        times = tuple(times[g - first] for g in places)
    block = Block(view, lo, hi) if together else None
    return Picks([Run(view, seg, places, now, lease, times, kept, block, whole, count=count)])


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
