"""A rows table's complete groups as rows (issue 64; disk/rows/): the groups one push completes go,
in completion order, into segments of at most SEGMENT_GROUPS groups and SEGMENT_MEMBERS members
(a larger group alone), each with its state (SegState), a directory entry per group (GroupRef)
and one run of ready groups (RunRow) keyed by the rseq of its first group; and a uid's stored
digest found again through its group's entry, for a retried push's duplicate check.

A segment's id is the rseq its first group took: rseqs are the table's own, unique and
increasing, so no other counter is kept for segments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...disk.layout import put_rows, u64
from ...disk.rows import (
    SEGMENT_GROUPS,
    SEGMENT_MEMBERS,
    Group,
    GroupRef,
    RunRow,
    SegmentView,
    SegState,
    directory_entry,
    encode_segment,
)
from ...schema.states import PENDING, READY
from ...schema.views import Groups
from ..table_state import rate_counts
from ..table_state.events import Moved
from ..table_state.state import TableState, missing
from ..table_state.views import RowGroup


def stored(tt: TableState, gkeys: Iterable[str]) -> tuple[set[str], dict[str, bytes]]:
    """Of these groups, those the table has, and the digests of their members (uid -> digest),
    for a retried push's duplicates: one directory read a group, one segment read a segment."""
    found: set[str] = set()
    digests: dict[str, bytes] = {}
    views: dict[int, SegmentView] = {}
    for gkey in gkeys:
        raw = tt.txn.get(tt.key(gkey), db=tt.db["gdir"])
        if raw is None:
            continue
        found.add(gkey)
        ref = directory_entry(raw)
        if not isinstance(ref, GroupRef):
            continue  # a pending group's members are kept apart (its fragments, to come: 2.8)
        view = views.get(ref.seg)
        if view is None:
            seg = tt.txn.get(tt.prefix + u64(ref.seg), db=tt.db["segs"])
            if seg is None:
                raise missing("segment", f"{ref.seg} of group {gkey}")
            view = views[ref.seg] = SegmentView(seg)
        lo, hi = view.span(ref.group)
        digests.update(zip(view.members.uids(lo, hi), view.members.digests(lo, hi), strict=True))
    return found, digests


def cut(groups: Sequence[Group]) -> list[list[Group]]:
    """Groups in completion order, cut into segments: at most SEGMENT_GROUPS groups and
    SEGMENT_MEMBERS members each, a larger group alone."""
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


def complete_ready(tt: TableState, groups: Sequence[Group]) -> None:
    """Pending groups, counted as such, complete and become ready together as rows: their
    segments, states, directory entries and runs written, the counters moved as a records
    table's are (core/verbs/groups.complete)."""
    counters = tt.counters
    prefix, now = tt.prefix, tt.now
    segs: list[tuple[bytes, bytes]] = []
    states: list[tuple[bytes, bytes]] = []
    refs: list[tuple[bytes, bytes]] = []
    runs: list[tuple[bytes, bytes]] = []
    for part in cut(groups):
        seg = counters.next_rseq
        counters.next_rseq += len(part)
        key = prefix + u64(seg)
        segs.append((key, encode_segment(part, seg, now)))
        members = sum(len(group.members) for group in part)
        states.append((key, SegState.new([READY] * len(part), members).encode()))
        refs.extend((tt.key(group.key), GroupRef(seg, index).encode()) for index, group in enumerate(part))
        runs.append((key, RunRow(seg, 0, len(part)).encode()))
    put_rows(tt.txn, tt.db["segs"], segs)
    put_rows(tt.txn, tt.db["sstate"], states)
    put_rows(tt.txn, tt.db["gdir"], refs)
    put_rows(tt.txn, tt.db["runs"], runs)
    count = sum(len(group.members) for group in groups)
    counters.add(PENDING, -count)
    counters.add(READY, count)
    counters.add_groups(PENDING, -len(groups))
    counters.add_groups(READY, len(groups))
    rate_counts.became_ready(tt, count)
    ready: Groups = [(group.key, RowGroup(group.key, READY, tuple(group.members))) for group in groups]
    tt.extensions.on_moved(tt, Moved(PENDING, READY, ready))
