"""A rows table's replayed group requeued (issue 64, 2.6), as core/verbs/requeue.py requeues a records
table's (rules/reuse.py says when, and its new priority): back in the ready order at once, behind every
group there, or cooling until a time.

A rows group's place is its segment's (the segment's id plus its index there) and its priority a
column of that segment, so a group requeued at once is moved (`move`): its members' rows written into
a new segment at the table's next rseq (the groups one request requeues together, in that order) with
its new priority and its deliveries, its directory entry naming it there; its old place is left as a
Delete leaves a group deleted whole (its members flagged deleted, its state byte retired, counting
nothing, its segment retired with its last live group and its tombstones forgotten in time). Its
payloads, kept by uid, stay where they are. Nothing else is heard of it, as of a records table's.

A cooling group stays at its place, leased to no one (state leased, no lease tag), out of its run and
the indexes, with a row in the `cooling` index, T + the time it is ready again + group key, whose
value is its new priority; the table's next take after that time (`warm`) makes it ready again and
moves it so, where a records table gives it its new place in the ready order.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ....disk import layout
from ....disk.layout import put_rows
from ....disk.rows import Group, SegState
from ....schema.states import LEASED, READY, RETIRED
from ....schema.views import Groups, Members
from ...table_state.events import Moved
from ...table_state.picks import Picked
from ...table_state.state import TableState
from . import segments as rows
from .deletes import EMPTIED
from .leases import hold
from .moves import count_moved, unready
from .select import NO_LEASE, Segments, unleased

COOLING_PRIORITY = struct.Struct("<d")  # a cooling row's value: the priority its group is ready again with


def place(tt: TableState, groups: Sequence[Members], priorities: Sequence[float], until: float | None) -> None:
    """Ready groups replayed just now, with their new priorities: out of their runs and the indexes,
    then moved behind every ready group at once (`until` None), or cooling until `until`."""
    segments = Segments(tt)
    picked = unleased(tt, segments, [gkey for gkey, _, _ in groups], READY)
    unready(tt, picked)
    if until is None:
        move(tt, segments, picked, priorities)
        return
    hold(tt, segments, picked, "")  # leased to no one: counted leased, heard of as a records table's
    at = layout.micros(until)
    cooling = [
        (tt.prefix + at + p.gkey.encode(), COOLING_PRIORITY.pack(q)) for p, q in zip(picked, priorities, strict=True)
    ]
    put_rows(tt.txn, tt.db["cooling"], sorted(cooling))


def warm(tt: TableState) -> int:
    """Cooling groups whose cooldown has ended are ready again, in the order of their times, each
    moved behind every ready group with the priority its cooling row holds; returns how many. Rows of
    groups that left meanwhile (deleted, retired, failed) are dropped."""
    if tt.config.reuse.cooldown_seconds <= 0:  # nothing of this table ever cools
        return 0
    due: list[tuple[str, float]] = []
    cutoff = layout.micros(tt.now)
    with tt.txn.cursor(db=tt.db["cooling"]) as cur:
        found = cur.set_range(tt.prefix)
        while found and cur.key().startswith(tt.prefix) and cur.key()[4:12] <= cutoff:
            due.append((bytes(cur.key()[12:]).decode(), COOLING_PRIORITY.unpack(cur.value())[0]))
            found = cur.delete()
    segments = Segments(tt)
    priority = dict(due)  # a group due twice (deleted, pushed again and cooled anew) warms once
    back = unleased(tt, segments, priority, LEASED)
    if not back:
        return 0
    count_moved(tt, READY, back)
    if tt.extensions.hears("on_moved"):
        groups: Groups = [(p.gkey, p.group._replace(state=READY)) for p in back]
        tt.extensions.on_moved(tt, Moved(LEASED, READY, groups))
    move(tt, segments, back, [priority[p.gkey] for p in back])
    return len(back)


def move(tt: TableState, segments: Segments, picked: Sequence[Picked], priorities: Sequence[float]) -> None:
    """Groups out of their runs and the indexes (ready, or cooling) moved into new segments at the back
    of the ready order, ready, with their new priorities and their deliveries; their old places left as
    groups deleted whole."""
    moved: list[Group] = []
    for p, priority in zip(picked, priorities, strict=True):
        view, row = segments.view(p.seg), segments.changed(p.seg)
        for i in row.kept(*view.span(p.at)):
            row.flag(i, SegState.DELETED)
        row.set_state(p.at, EMPTIED)
        row.set_lease(p.at, NO_LEASE)
        created, version = view.created(p.at, p.at + 1)[0], view.versions(p.at, p.at + 1)[0]
        failed = tuple(view.failed(p.at).items())  # its members as read (`rows`), not decoded again
        moved.append(Group(p.gkey, created, p.rows, priority, version, view.partial(p.at), failed))
    for seg in sorted({p.seg for p in picked}):
        row = segments.state(seg)
        if row.all_in(RETIRED):
            rows.retired(tt, seg, row)
    segments.save()
    rows.write(tt, moved, READY, times=[p.times for p in picked])
