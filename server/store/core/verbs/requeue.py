"""A replayed group requeued, as records (rules/reuse.py says when, and its new priority): back in
the ready order at once, behind every group there, or cooling until a time. A cooling group is
leased to no one (state leased, no lease) and has a row in the `cooling` index, T + the time it
is ready again + group key; the table's next take makes the groups whose time has come ready
again (`cooled`, then `warm`), in that order.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...disk import layout
from ...disk.layout import put_rows
from ...disk.records import GroupRecord
from ...schema.states import LEASED, READY
from ...schema.views import Members
from ..table_state.state import TableState
from ..table_state.views import group_record


def place(tt: TableState, groups: Sequence[Members], priorities: Sequence[float], until: float | None) -> None:
    """Ready groups replayed just now get their new priorities, then go back in the ready order
    at once (`until` None), or cool until `until`."""
    records = [(gkey, group_record(grp)) for gkey, grp, _ in groups]
    before = [(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in records]
    for (_, grp), priority in zip(records, priorities, strict=True):
        grp.priority = priority
    if until is None:  # a priority change of ready groups, for every order's index
        tt.ready.move_many(before, _ready_again(tt, groups))
        return
    tt.ready.remove_many(before)
    tt.set_states(groups, LEASED)
    at = layout.micros(until)
    put_rows(tt.txn, tt.db["cooling"], sorted((tt.prefix + at + gkey.encode(), b"") for gkey, _, _ in groups))


def cooled(tt: TableState) -> list[tuple[str, GroupRecord]]:
    """Cooling groups whose cooldown has ended, their rows in the cooling index gone, to be made
    ready again (`warm`). Rows of groups deleted or retired meanwhile are dropped."""
    if tt.config.reuse.cooldown_seconds <= 0:  # nothing of this table ever cools
        return []
    due = []
    cutoff = layout.micros(tt.now)
    with tt.txn.cursor(db=tt.db["cooling"]) as cur:
        found = cur.set_range(tt.prefix)
        while found and cur.key().startswith(tt.prefix) and cur.key()[4:12] <= cutoff:
            due.append(bytes(cur.key()))
            found = cur.delete()
    groups = []
    for key in due:
        gkey = key[12:].decode()
        grp = tt.group(gkey)
        if grp is not None and grp.state == LEASED and not grp.lease:
            groups.append((gkey, grp))
    return groups


def warm(tt: TableState, groups: Sequence[tuple[str, GroupRecord]]) -> int:
    """Groups `cooled` become ready again, in that order (written by the caller's save); returns
    how many. Those that left meanwhile (failed for a member whose record is lost:
    rules/quarantine.py) are passed over."""
    back: list[Members] = [
        (gkey, grp, tt.members(grp)) for gkey, grp in groups if grp.state == LEASED and not grp.lease
    ]
    if back:
        tt.set_states(back, READY)
        tt.ready.add_many(_ready_again(tt, back))
    return len(back)


def _ready_again(tt: TableState, groups: Sequence[Members]) -> list[tuple[bytes, int, float, int | None]]:
    """A new place in the ready order, behind every group there; returns the groups' rows for
    the ready indexes."""
    rows = []
    for gkey, view, _ in groups:
        grp = group_record(view)
        grp.rseq = tt.counters.next_rseq
        tt.counters.next_rseq += 1
        tt.put_group(gkey, grp)
        rows.append((gkey.encode(), grp.ready_seq, grp.priority, grp.version))
    return rows
