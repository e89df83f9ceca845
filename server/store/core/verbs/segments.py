"""A rows table's complete groups as rows (issue 64; disk/rows/): the groups one push completes go,
in completion order, into segments of at most SEGMENT_GROUPS groups and SEGMENT_MEMBERS members
(a larger group alone), each with its state (SegState), a directory entry per group (GroupRef)
and one run of ready groups (RunRow) keyed by the rseq of its first group. A pending group that
leaves without becoming ready (dropped) goes into a segment of its retired state, which keeps its
members' digests as a consumed group's does (row_pending.py).

A segment's id is the rseq its first group took: rseqs are the table's own, unique and
increasing, so no other counter is kept for segments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from ...disk.layout import put_rows, u64
from ...disk.rows import SEGMENT_GROUPS, SEGMENT_MEMBERS, Group, GroupRef, Member, RunRow, SegState, encode_segment
from ...schema.states import PENDING, READY, RETIRED, State
from ...schema.views import Groups
from ..table_state import rate_counts
from ..table_state.events import Moved
from ..table_state.state import TableState
from ..table_state.views import RowGroup

_NONE_FAILED: Mapping[str, str] = MappingProxyType({})


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


def whole(
    gkey: str,
    created: float,
    members: Sequence[Member],
    *,
    partial: bool = False,
    failed: Mapping[str, str] = _NONE_FAILED,
) -> Group:
    """A group as its segment keeps it once complete, with its members' lowest version (None unless
    every member has one) and highest priority, as core/verbs/groups.complete gives a records
    table's."""
    versions = [m.version for m in members if m.version is not None]
    version = min(versions) if versions and len(versions) == len(members) else None
    priority = max((m.priority for m in members), default=0.0)
    return Group(gkey, created, members, priority, version, partial, tuple(failed.items()))


def write(tt: TableState, groups: Sequence[Group], state: State) -> None:
    """Groups written as rows in `state`, in the order given: their segments (each a segment's id
    the rseq of its first group), states and directory entries; ready ones with a run a segment,
    retired ones in segments that say they retired now (their members' digests kept there: a
    retried push of one is a duplicate)."""
    counters = tt.counters
    prefix = tt.prefix
    segs: list[tuple[bytes, bytes]] = []
    states: list[tuple[bytes, bytes]] = []
    refs: list[tuple[bytes, bytes]] = []
    runs: list[tuple[bytes, bytes]] = []
    for part in cut(groups):
        seg = counters.next_rseq
        counters.next_rseq += len(part)
        key = prefix + u64(seg)
        segs.append((key, encode_segment(part, seg, tt.now)))
        row = SegState.new([state] * len(part), sum(len(group.members) for group in part))
        if state in RETIRED:
            row.retired = tt.now
        states.append((key, row.encode()))
        refs.extend((tt.key(group.key), GroupRef(seg, index).encode()) for index, group in enumerate(part))
        if state == READY:
            runs.append((key, RunRow(seg, 0, len(part)).encode()))
    put_rows(tt.txn, tt.db["segs"], segs)
    put_rows(tt.txn, tt.db["sstate"], states)
    put_rows(tt.txn, tt.db["gdir"], refs)
    put_rows(tt.txn, tt.db["runs"], runs)


def complete_ready(tt: TableState, groups: Sequence[Group]) -> None:
    """Pending groups, counted as such, complete and become ready together as rows (`write`), the
    counters moved as a records table's are (core/verbs/groups.complete)."""
    counters = tt.counters
    write(tt, groups, READY)
    count = sum(len(group.members) for group in groups)
    counters.add(PENDING, -count)
    counters.add(READY, count)
    counters.add_groups(PENDING, -len(groups))
    counters.add_groups(READY, len(groups))
    rate_counts.became_ready(tt, count)
    ready: Groups = [(group.key, RowGroup(group.key, READY, tuple(group.members))) for group in groups]
    tt.extensions.on_moved(tt, Moved(PENDING, READY, ready))
