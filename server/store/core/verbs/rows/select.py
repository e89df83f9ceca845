"""A rows table's ready groups picked for a take (issue 64, 2.4), and the groups a verb names read
back: from the runs of the ready order, front first (fifo) or back first (lifo), each segment's rows
read once and its members' columns once a run; in any other order, or with a lowest model version,
from the index the order reads (core/ordering/), as a records table's take does, each group it names
found through its directory entry (2.7). A rows table keeps such an index from the first request
that read it (ready.ReadyIndex), so a table taken in fifo or lifo order alone writes none. Nothing
here writes: what the picked groups become is moves.py's and leases.py's; what a pick holds
is table_state/picks.py's.
"""

from __future__ import annotations

import contextlib
import operator
import random
from collections.abc import Generator, Iterable, Sequence

from ....disk.layout import next_prefix, put_rows, u64
from ....disk.rows import GroupRef, RunRow, SegmentView, SegState, agreeing, directory_entry
from ....disk.snapshot import Snapshot
from ....schema.errors import DAMAGE
from ....schema.sample_spec import TakeSpec
from ....schema.states import READY, State
from ....schema.views import Members
from ...ordering.ready import BUILD_CHUNK, IndexBuilding
from ...table_state import oldest_index
from ...table_state.counters import read_counters
from ...table_state.pending_reads import missing
from ...table_state.picks import Picked, Picks, picks
from ...table_state.state import TableState

NO_LEASE = bytes(SegState.LEASE)


class Segments:
    """The segments a request reads in one transaction, each read once (its rows as a view of the
    map, its state as a bytearray), and the states it changed, written once by `save`."""

    def __init__(self, tt: TableState) -> None:
        self.tt = tt
        self._views: dict[int, SegmentView] = {}
        self._states: dict[int, SegState] = {}
        self._stored: dict[int, bytes] = {}  # each state row as stored, before this request changed it
        self._dirty: set[int] = set()

    def view(self, seg: int) -> SegmentView:
        view = self._views.get(seg)
        if view is None:
            view = self._views[seg] = SegmentView(self._read(seg, "segs", "segment"))
        return view

    def readable(self, seg: int) -> bool:
        """Whether a segment's rows and state decode and agree: a take passes over the groups of one
        that does not (TableState.passed_over), and serves the others."""
        if seg in self._views and seg in self._states:
            return True
        try:
            agreeing(self.view(seg), self.state(seg))
        except DAMAGE as exc:
            self._views.pop(seg, None)
            self._states.pop(seg, None)
            self.tt.passed_over(seg, exc)
            return False
        return True

    def found(self, seg: int) -> SegState | None:
        """A segment's state, None where it is not there: one whose groups all retired is forgotten
        tombstone_seconds later (segments.prune), while a lease its groups left may name it still."""
        state = self._states.get(seg)
        if state is None:
            raw = self.tt.txn.get(self.tt.prefix + u64(seg), db=self.tt.db["sstate"])
            if raw is None:
                return None
            self._stored[seg] = raw
            state = self._states[seg] = SegState.decode(raw)
        return state

    def found_readable(self, seg: int) -> SegState | None:
        """`found`'s state where the segment's rows and state decode too: None also where they do not,
        its groups passed over as a take passes them (`readable`), so that a verb that names groups
        of it (a lease's end, an eviction) acts on the others."""
        if seg not in self._states and self.tt.txn.get(self.tt.prefix + u64(seg), db=self.tt.db["sstate"]) is None:
            return None
        return self._states[seg] if self.readable(seg) else None

    def state(self, seg: int) -> SegState:
        state = self.found(seg)
        if state is None:
            raise missing("segment state", str(seg))
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
        """The changed states written, each segment's key in the index of the oldest moved with them."""
        prefix, rows = self.tt.prefix, []
        for seg in sorted(self._dirty):
            state, raw = self._states[seg], self._stored[seg]
            oldest_index.segment_saved(self.tt, seg, SegState.decode(raw), state, self.view)
            self._stored[seg] = state.encode()
            rows.append((prefix + u64(seg), self._stored[seg]))
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


def select(tt: TableState, spec: TakeSpec, segments: Segments, rng: random.Random) -> tuple[Picks, int]:
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


def _indexed(tt: TableState, spec: TakeSpec, segments: Segments, rng: random.Random) -> tuple[Picks, int]:
    """Ready groups in the order of the request's index (core/ordering/), each found through its
    directory entry, until there are enough (core/verbs/take.select's way on records). Reading an
    index the table does not keep yet raises IndexBuilding before anything is changed."""
    places: list[tuple[int, int]] = []  # (segment, group) in the order's
    total = 0
    with contextlib.closing(tt.ready.candidates(spec.order, rng, spec.min_model_version)) as candidates:
        for raw in candidates:
            entry = tt.txn.get(tt.prefix + raw, db=tt.db["gdir"])
            ref = None if entry is None else directory_entry(entry)
            if isinstance(ref, GroupRef) and not segments.readable(ref.seg):
                continue
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
    return Picks.of([found[place] for place in places]), total


def _from_runs(tt: TableState, spec: TakeSpec, segments: Segments) -> tuple[Picks, int]:
    """Ready groups from the runs, front first (fifo) or back first (lifo), until there are enough:
    the groups a run gives, one `Run`."""
    picked: list[Picks] = []
    groups = total = 0
    newest = spec.order == "lifo"
    with contextlib.closing(ready_runs(tt, newest)) as runs:
        for _, run in runs:
            if not segments.readable(run.seg):
                continue
            view, state = segments.view(run.seg), segments.state(run.seg)
            places = range(run.first, run.first + run.length)
            if newest:
                places = places[::-1]
            counts = kept_counts(view, state, places)
            chosen = spec.taking(groups, total, counts)
            total += sum(counts[:chosen])
            picked.append(picks(view, state, run.seg, places[:chosen], READY, ""))
            groups += chosen
            if spec.enough(groups, total):
                break
    return Picks.joined(picked), total


def kept_counts(view: SegmentView, state: SegState, places: Sequence[int]) -> list[int]:
    """The members of a segment's groups at `places` (those deleted left out)."""
    if state.any_flags:
        return [len(state.kept(*view.span(g))) for g in places]
    starts, stops = view.bounds(places)
    return list(map(operator.sub, stops, starts))


def ranges(indexes: Iterable[int]) -> list[tuple[int, int]]:
    """Distinct group indexes, sorted, as (first, length) ranges of consecutive ones: a run's range
    of places (a fifo or lifo take's) one, its ends read, not sorted."""
    if isinstance(indexes, range) and indexes.step in (1, -1):
        return [(min(indexes[0], indexes[-1]), len(indexes))] if indexes else []
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


def unleased(tt: TableState, segments: Segments, gkeys: Iterable[str], now: State) -> Picks:
    """The groups of these keys the table holds in state `now` under no lease (ready ones, or cooling
    ones: requeue.py), in that order, the members of each segment's read together (`picks`)."""
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
    return Picks.of([found[place] for place in places])


def complete_groups(tt: TableState, segments: Segments, gkeys: Iterable[str]) -> Picks:
    """The complete groups of these keys the table holds, each read from its segment (a pending or
    absent one is not)."""
    picked: list[Picks] = []
    for gkey in gkeys:
        raw = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
        ref = None if raw is None else directory_entry(raw)
        if isinstance(ref, GroupRef):
            state = segments.state(ref.seg)
            tag = state.lease(ref.group)
            lease = tag.hex() if tag != NO_LEASE else ""
            picked.append(picks(segments.view(ref.seg), state, ref.seg, [ref.group], state.state(ref.group), lease))
    return Picks.joined(picked)


def taken(picked: Sequence[Picked]) -> list[Members]:
    """Picked groups as a take's verbs read them: key, view, members' views."""
    return [(p.gkey, p.group, p.members) for p in picked]


def newest_seq(snapshot: Snapshot, tt: TableState) -> int:
    """The insertion number of the newest experience a snapshot holds of a rows table (-1: none): the
    one before the next its counters name. Its newest segment's last member would not do: a group
    requeued by reuse (requeue.py) goes into the newest segment with members pushed long before."""
    return read_counters(snapshot, tt.db, tt.prefix).next_seq - 1
