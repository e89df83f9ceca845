"""The records and rows behind the views the table core hands out (schema/views.py): a records
table's view is its record, and the core, the only code that changes records, takes the record
back from a view it made to change it; a rows table's group is a `RowGroup` and its experiences
`RowMember`s, read from its segment's columns (disk/rows/), which code outside the core reads as
it reads records.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from expbuf.client.schema.routing import uid_group_key

from ...disk.records import GroupRecord, ItemRecord
from ...disk.rows import Member, SegmentView, SegState
from ...schema.states import LEASED, QUARANTINED, READY, State
from ...schema.views import GroupView, MemberView


def group_record(view: GroupView) -> GroupRecord:
    """The record behind a group's view, for the core to change."""
    if not isinstance(view, GroupRecord):
        raise TypeError(f"a group view the table core did not make: {type(view).__name__}")
    return view


def member_record(view: MemberView) -> ItemRecord:
    """The record behind an experience's view, for the core to change."""
    if not isinstance(view, ItemRecord):
        raise TypeError(f"an experience's view the table core did not make: {type(view).__name__}")
    return view


# The `failed` of a group none of whose runs was reported failed: one mapping, read only, shared.
NONE_FAILED: Mapping[str, str] = MappingProxyType({})


class RowGroup(NamedTuple):
    """A rows table's group as a GroupView, with its members' rows (`rows`) as its segment holds them:
    a tuple, made per group a take reads."""

    key: str
    state: State
    rows: tuple[Member, ...]
    failed: Mapping[str, str] = NONE_FAILED
    lease: str = ""
    times: int = 0  # its members' deliveries (a group's members are delivered together)
    created: float = 0.0  # when a pending group opened (its timeout's); 0 once it is complete
    # a failed group's members found damaged (SegState.QUARANTINED); a pending or computing group's
    # whose rows damage lost, made from their payloads (TableState.pending_members)
    quarantined: frozenset[str] = frozenset()
    lost: int = 0  # a pending or computing group's members whose rows and payloads damage lost alike

    @property
    def under_lease(self) -> bool:
        return self.state == LEASED and bool(self.lease)

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(member.uid for member in self.rows)


_ROW_GROUP = functools.partial(tuple.__new__, RowGroup)  # RowGroup._make less its count: every field given


def row_groups(
    keys: Iterable[str], state: State, rows: Iterable[tuple[Member, ...]], created: float = 0.0
) -> list[RowGroup]:
    """RowGroups of these keys and members' rows, in `state`, none of their runs reported failed,
    leased or sampled (`created`: when a pending group opened): made in C, no step a group, as a push
    makes one for each group it completes."""
    fields = (NONE_FAILED, "", 0, created, frozenset[str](), 0)
    return list(map(_ROW_GROUP, map(operator.add, zip(keys, itertools.repeat(state), rows), itertools.repeat(fields))))


class RowMember:
    """A rows table's experience as a MemberView: its row (disk/rows/'s Member), its group's key
    and state."""

    __slots__ = ("_row", "group", "state", "times_sampled")

    def __init__(self, row: Member, group: str, state: State, times_sampled: int = 0) -> None:
        self._row, self.group, self.state, self.times_sampled = row, group, state, times_sampled

    @property
    def tid(self) -> str:
        return uid_group_key(self._row.uid, "task") or ""

    @property
    def rid(self) -> str:
        return uid_group_key(self._row.uid, "run") or ""

    @property
    def digest(self) -> bytes:
        return self._row.digest

    @property
    def size(self) -> int:
        return self._row.size

    @property
    def seq(self) -> int:
        return self._row.seq

    @property
    def step(self) -> int:
        return self._row.step

    @property
    def response_length(self) -> int:
        return self._row.response_length

    @property
    def generated(self) -> int:
        return self._row.generated

    @property
    def version(self) -> int | None:
        return self._row.version

    @property
    def reward(self) -> float | None:
        return self._row.reward

    @property
    def priority(self) -> float:
        return self._row.priority

    @property
    def advantage(self) -> float | None:
        return self._row.advantage

    @property
    def shaped_reward(self) -> float | None:
        return self._row.shaped_reward

    @property
    def segments(self) -> tuple[int, ...]:
        return self._row.segments


def kept_rows(state: SegState, rows: Sequence[Member], lo: int) -> tuple[Member, ...]:
    """Members of a segment as read (`rows`: its members lo on), those deleted left out."""
    kept = state.kept(lo, lo + len(rows))
    if len(kept) == len(rows):
        return tuple(rows)
    return tuple(rows[i - lo] for i in kept)


def group_rows(view: SegmentView, state: SegState, g: int) -> tuple[Member, ...]:
    """The members of a segment's group g, in push order, those deleted left out."""
    lo, hi = view.span(g)
    return kept_rows(state, view.members.members(lo, hi), lo)


def quarantined(view: SegmentView, state: SegState, g: int) -> frozenset[str]:
    """The uids of a segment's group g's quarantined members (only a failed group has any)."""
    lo, hi = view.span(g)
    return frozenset(view.members.uids(i, i + 1)[0] for i in state.quarantined(lo, hi))


def row_members(grp: RowGroup) -> dict[str, RowMember]:
    """A rows table's group's members' views (uid -> view), in push order; a leased group's members
    say ready, as a records table's member records do, and a quarantined one says so."""
    state = READY if grp.state == LEASED else grp.state
    return {
        row.uid: RowMember(row, grp.key, QUARANTINED if row.uid in grp.quarantined else state, grp.times)
        for row in grp.rows
    }
