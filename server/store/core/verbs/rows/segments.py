"""A rows table's complete groups as rows (issue 64; disk/rows/): the groups one push completes go,
in completion order, into segments of at most SEGMENT_GROUPS groups and SEGMENT_MEMBERS members
(a larger group alone), each with its state (SegState), a directory entry per group (GroupRef)
and one run of ready groups (RunRow) keyed by the rseq of its first group. A pending group that
leaves without becoming ready (dropped) goes into a segment of its retired state, which keeps its
members' digests as a consumed group's does (ends.py).

A segment's id is the rseq its first group took: rseqs are the table's own, unique and
increasing, so no other counter is kept for segments.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import cast

from ....disk import layout
from ....disk.layout import put_rows, u64
from ....disk.rows import (
    SEGMENT_GROUPS,
    SEGMENT_MEMBERS,
    Group,
    GroupRef,
    Member,
    RunRow,
    SegmentView,
    SegState,
    append_groups,
    directory_entry,
    encode_segment,
    group_refs,
)
from ....schema.states import FAILED, PENDING, QUARANTINED, READY, RETIRED, State
from ....schema.views import Groups
from ...table_state import oldest_index, rate_counts
from ...table_state.events import Moved
from ...table_state.state import TableState
from ...table_state.views import NONE_FAILED, RowGroup, row_groups

# A request completing fewer ready groups than this puts them into the table's newest segment where it
# can (`_grow_tail`). One completing more makes a segment of its own, whose per-segment cost its take
# and confirm share among that many groups: growing costs such a push about what it saves the drain
# (pushes of groups of one side by side, growing or not, µs an experience: of 1, +23 the push, -54 the
# drain; of 8, +3.4 and -6.5; of 16, +3.0 and -3.3).
GROW_BELOW = 8
_CREATED, _KEY = operator.attrgetter("created"), operator.attrgetter("key")
_ROWS, _FAILED = operator.attrgetter("rows"), operator.attrgetter("failed")
# a group's members, and a member's priority, version and time, read as a tuple's items: a named
# field's attribute costs a look-up more, a step a group or member of every push
_MEMBERS = operator.itemgetter(Group._fields.index("members"))
_PRIORITY, _VERSION, _MEMBER_CREATED = (
    operator.itemgetter(Member._fields.index(name)) for name in ("priority", "version", "created")
)
_GROUP = functools.partial(tuple.__new__, Group)  # Group._make less its count: `whole` gives every field


def cut(groups: Sequence[Group]) -> list[list[Group]]:
    """Groups in completion order, cut into segments: at most SEGMENT_GROUPS groups and
    SEGMENT_MEMBERS members each, a larger group alone. Groups all of one size (a push's groups of
    one, or of its group size) are cut every as many as fit, without a look at each."""
    sizes = set(map(len, map(_MEMBERS, groups)))
    if len(sizes) == 1:
        (size,) = sizes
        step = max(1, min(SEGMENT_GROUPS, SEGMENT_MEMBERS // size)) if size else SEGMENT_GROUPS
        return [list(groups[at : at + step]) for at in range(0, len(groups), step)]
    segments: list[list[Group]] = []
    members = 0
    for group in groups:
        size = len(group.members)
        if not segments or len(segments[-1]) == SEGMENT_GROUPS or members + size > SEGMENT_MEMBERS:
            segments.append([])
            members = 0
        segments[-1].append(group)
        members += size
    return segments


def whole(
    gkey: str,
    created: float,
    members: Sequence[Member],
    partial: bool = False,
    failed: Mapping[str, str] = NONE_FAILED,
    placed: tuple[float, int | None] | None = None,
) -> Group:
    """A group as its segment keeps it once complete, with its priority and version as they were
    `placed` when it completed (a computing group's head keeps them), or else its members' (`placed_by`)."""
    runs = tuple(failed.items()) if failed else ()
    if placed is None and len(members) == 1:  # a group of one (one a pushed experience, where a table groups none)
        member = members[0]
        return _GROUP((gkey, created, members, member.priority, member.version, partial, runs))
    priority, version = placed_by(members) if placed is None else placed
    return _GROUP((gkey, created, members, priority, version, partial, runs))


def wholes(views: Sequence[RowGroup]) -> list[Group]:
    """`whole`'s of groups complete as their views are (not partial, not placed: opened and completed
    by one request): where each is one member and none has runs reported failed, made in C with its
    member's priority and version, no step a group."""
    rows = list(map(_ROWS, views))
    if any(map(_FAILED, views)):
        return [whole(grp.key, grp.created, grp.rows, False, grp.failed) for grp in views]
    return _of(map(_KEY, views), map(_CREATED, views), rows)


def opened(joined: Mapping[str, tuple[Member, ...]], created: float) -> list[Group]:
    """`whole`'s of groups a request opened at `created` and completes with these members (not partial,
    none of their runs reported failed), made without a view of each first (`wholes`)."""
    return _of(joined, itertools.repeat(created), list(joined.values()))


def _of(keys: Iterable[str], created: Iterable[float], rows: list[tuple[Member, ...]]) -> list[Group]:
    """Groups complete as pushed, of these keys, times and members: where each is one member, made in C
    with its member's priority and version, no step a group; else `whole` a group."""
    flat = list(itertools.chain.from_iterable(rows))
    if len(flat) != len(rows):
        return [whole(key, when, members) for key, when, members in zip(keys, created, rows, strict=False)]
    # every field zipped (none added to a tuple after) and tuple.__new__ mapped with Group repeated (no
    # partial's call around it): 0.7 k instructions a group of one less than either
    partial, runs = itertools.repeat(False), itertools.repeat(())
    made = zip(keys, created, rows, map(_PRIORITY, flat), map(_VERSION, flat), partial, runs, strict=False)
    return list(map(tuple.__new__, itertools.repeat(Group), made))


def placed_by(members: Sequence[Member]) -> tuple[float, int | None]:
    """A complete group's priority and version: its members' highest priority and lowest version (None
    unless every member has one), as core/verbs/groups.complete gives a records table's."""
    versions = list(map(_VERSION, members))
    version = min(versions) if versions and None not in versions else None
    return max(map(_PRIORITY, members), default=0.0), version


def write(
    tt: TableState,
    groups: Sequence[Group],
    state: State,
    places: Sequence[int] | None = None,
    times: Sequence[int] | None = None,
    quarantined: Set[str] = frozenset(),
    *,
    indexed: bool = True,
    keys: Sequence[bytes] | None = None,
) -> None:
    """Groups written as rows in `state`, in the order given: their segments (each a segment's id
    the rseq of its first group), states and directory entries; ready ones with a run a segment,
    retired ones in segments that say they retired now (their members' digests kept there: a
    retried push of one is a duplicate). With `places` (the rseq each group took when it completed:
    computing groups'), each group goes into a segment of its own there, in the ready order's place
    it took then. With `times`, each group's deliveries so far (a requeued group's: requeue.py);
    the members of `quarantined` (failed groups' damaged ones) flagged so. Without `indexed`, ready
    ones are not added to the indexes the table keeps: an upgrade's groups are there at their places
    already (whole_table/to_rows.py). Fewer than GROW_BELOW ready groups that take the next places
    go first into the table's newest segment where it is fresh (`_grow_tail`), so that pushes of a
    few experiences each do not leave a segment for every push. `keys`: the groups' directory keys
    where the caller has them encoded (`tt.keys`), else encoded here."""
    if keys is None:
        keys = tt.keys(map(_KEY, groups))
    if len(groups) < GROW_BELOW and state == READY and places is None and times is None and not quarantined and indexed:
        grown = _grow_tail(tt, groups, keys)
        groups, keys = groups[grown:], keys[grown:]
        if not groups:
            return
    counters = tt.counters
    prefix = tt.prefix
    segs: list[tuple[bytes, bytes]] = []
    states: list[tuple[bytes, bytes]] = []
    refs: list[tuple[bytes, bytes]] = []
    runs: list[tuple[bytes, bytes]] = []
    live: list[tuple[int, float]] = []  # the live segments, each with its oldest member's time (oldest_index)
    done = 0  # the groups of the segments before this one
    for at, part in enumerate(cut(groups) if places is None else [[group] for group in groups]):
        if places is None:
            seg = counters.next_rseq
            counters.next_rseq += len(part)
        else:
            seg = places[at]
        key = prefix + u64(seg)
        segs.append((key, encode_segment(part, seg, tt.now)))
        members = list(itertools.chain.from_iterable(map(_MEMBERS, part)))
        row = SegState.new([state] * len(part), len(members))
        for index, count in enumerate(() if times is None else times[done : done + len(part)]):
            row.set_times(index, count)
        refs.extend(zip(keys[done : done + len(part)], group_refs(seg, len(part)), strict=True))
        done += len(part)
        if quarantined:
            for i in (i for i, member in enumerate(members) if member.uid in quarantined):
                row.flag(i, SegState.QUARANTINED)
        if state in RETIRED:
            retired(tt, seg, row)
        elif members:  # every member live, none deleted
            live.append((seg, min(map(_MEMBER_CREATED, members))))
        states.append((key, row.encode()))
        if state == READY:
            runs.append((key, RunRow(seg, 0, len(part)).encode()))
            if indexed and tt.ready.indexing():  # the indexes a take in another order read (select.py)
                tt.ready.add_many([(g.key.encode(), seg + at, g.priority, g.version) for at, g in enumerate(part)])
    put_rows(tt.txn, tt.db["segs"], segs)
    put_rows(tt.txn, tt.db["sstate"], states)
    put_rows(tt.txn, tt.db["gdir"], refs)
    put_rows(tt.txn, tt.db["runs"], runs)
    oldest_index.segments_written(tt, live)


def _grow_tail(tt: TableState, groups: Sequence[Group], keys: Sequence[bytes]) -> int:
    """Of ready groups about to take the table's next places (`keys`: their directory keys), how many
    went into its newest segment:
    one whose groups took the places just before them and are all as they were written (ready, never
    sampled or leased, no member flagged: its state row a new one's), with room for them (at most
    SEGMENT_GROUPS groups and SEGMENT_MEMBERS members). Its groups keep their places and indexes and
    its run grows over the new ones, so a take reads them as if one push had brought them all: a
    stream of pushes of one experience each fills segments of 64, where each made one of its own,
    which a take and a confirm then read, change and write one at a time."""
    prefix, counters, txn = tt.prefix, tt.counters, tt.txn
    with txn.cursor(db=tt.db["segs"]) as cur:
        found = cur.prev() if cur.set_range(prefix + u64(counters.next_rseq)) else cur.last()
        if not found or cur.key()[: len(prefix)] != prefix:
            return 0
        key, raw = cur.key(), cur.value()
    view = SegmentView(raw)
    seg, held, members = view.rseq0, view.groups, view.members.count
    if seg + held != counters.next_rseq:
        return 0
    fit = 0
    for group in groups:
        if held + fit + 1 > SEGMENT_GROUPS or members + len(group.members) > SEGMENT_MEMBERS:
            break
        fit, members = fit + 1, members + len(group.members)
    if not fit:
        return 0
    run = txn.get(key, db=tt.db["runs"])
    if txn.get(key, db=tt.db["sstate"]) != _fresh(held, view.members.count) or run != RunRow(seg, 0, held).encode():
        return 0
    added = groups[:fit]
    counters.next_rseq += fit
    txn.put(key, append_groups(view, added), db=tt.db["segs"])
    txn.put(key, _fresh(held + fit, members), db=tt.db["sstate"])
    txn.put(key, RunRow(seg, 0, held + fit).encode(), db=tt.db["runs"])
    refs = zip(keys[:fit], group_refs(seg, fit, held), strict=True)
    put_rows(txn, tt.db["gdir"], list(refs))
    if tt.ready.indexing():
        tt.ready.add_many([(g.key.encode(), seg + held + at, g.priority, g.version) for at, g in enumerate(added)])
    before = min(cast("Sequence[float]", view.members.column("created", 0, view.members.count)))  # all live
    oldest_index.segment_grown(tt, seg, before, min(before, *(m.created for g in added for m in g.members)))
    return fit


@functools.lru_cache(maxsize=1024)
def _fresh(groups: int, members: int) -> bytes:
    """The state row of a segment as it is written: its groups ready, none sampled or leased, no
    member flagged."""
    return SegState.new([READY] * groups, members).encode()


def retired(tt: TableState, seg: int, row: SegState) -> None:
    """A segment's last group retired now: its state says when, and the retired index names it (its
    tombstones are forgotten tombstone_seconds later: `prune`)."""
    row.retired = tt.now
    tt.txn.put(tt.prefix + layout.micros(tt.now) + u64(seg), b"", db=tt.db["retired"])


def prune(tt: TableState, retired_before: float, limit: int = 10_000) -> int:
    """Forget the segments whose last group retired before the cutoff (at most `limit` a call), and
    their groups' directory entries: their members' tombstones, which a retried push meets no more
    (it may push them again), uncounted from their states as a records table's forgotten tombstones
    are, a failed group's kept payloads deleted; returns how many members were forgotten. A segment
    goes whole, once its last group retired: a group that retired before the others of its segment
    keeps its tombstones longer than a records table's group would."""
    prefix, forgotten = tt.prefix, 0
    for key in layout.stamped_before(tt.txn, tt.db["retired"], prefix, retired_before, limit):
        seg = int.from_bytes(key[12:], "big")
        raw, raw_state = (tt.txn.get(prefix + u64(seg), db=tt.db[name]) for name in ("segs", "sstate"))
        if raw is not None and raw_state is not None:
            view, state = SegmentView(raw), SegState.decode(raw_state)
            for g, gkey in enumerate(view.keys(0, view.groups)):
                lo, hi = view.span(g)
                members = state.kept(lo, hi)  # a deleted member was uncounted as it went
                flagged = len(state.quarantined(lo, hi))
                tt.counters.add(state.state(g), flagged - len(members))
                tt.counters.add(QUARANTINED, -flagged)
                forgotten += len(members)
                if state.state(g) == FAILED:  # its payloads, kept for Get (payloads.kept), go with it
                    uids = view.members.uids(lo, hi)  # but a deleted member's, gone (its uid maybe pushed again)
                    sizes = view.members.column("size", lo, hi)
                    kept = [i - lo for i in members]
                    tt.delete_payloads([tt.key(uids[i]) for i in kept], [int(sizes[i] or 0) for i in kept])
                entry = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
                if entry is not None and directory_entry(entry) == GroupRef(seg, g):
                    tt.txn.delete(tt.key(gkey), db=tt.db["gdir"])
            for name in ("segs", "sstate"):
                tt.txn.delete(prefix + u64(seg), db=tt.db[name])
        tt.txn.delete(key, db=tt.db["retired"])  # gone with its segment, or left by damage
    return forgotten


def complete_ready(
    tt: TableState,
    groups: Sequence[Group],
    was: State = PENDING,
    places: Sequence[int] | None = None,
    *,
    keys: Sequence[bytes] | None = None,
) -> None:
    """Pending (or computing: `was`, each at its place: `write`) groups, counted as such, become ready
    together as rows, the counters moved as a records table's are (core/verbs/groups.complete);
    `keys`: their directory keys, where the caller has them (`write`)."""
    counters = tt.counters
    write(tt, groups, READY, places, keys=keys)
    count = sum(map(len, map(_MEMBERS, groups)))
    counters.add(was, -count)
    counters.add(READY, count)
    counters.add_groups(was, -len(groups))
    counters.add_groups(READY, len(groups))
    rate_counts.became_ready(tt, count)
    if tt.extensions.hears("on_moved"):  # the groups' views made only for an extension that reads them
        names = list(map(_KEY, groups))
        ready: Groups = list(zip(names, row_groups(names, READY, map(tuple, map(_MEMBERS, groups))), strict=True))
        tt.extensions.on_moved(tt, Moved(was, READY, ready))
