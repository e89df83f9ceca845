"""A table's group records: a pending group opened and kept, its members added (their records,
payloads and places in the insertion order), its failed runs recorded, and its completion (its
lowest version, priority and place in the ready order, then ready or computing). What a push,
a report of failed runs, a seal or a timeout decides about its groups is rules/groups.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

import lmdb

from ...disk import layout
from ...disk.kinds import Entry
from ...disk.layout import put_rows, u64
from ...disk.records import GroupRecord
from ...schema.errors import clip
from ...schema.states import COMPUTING, PENDING, READY
from ...schema.views import GroupView, Members, MemberView
from ..ordering.ready import Row
from ..table_state import rate_counts
from ..table_state.state import TableState
from ..table_state.views import RowGroup, group_record
from . import payloads, pieces
from .record_damage import placed_by

# A pending group about to complete: its key, view, members' views (closing), and whether it is in
# the pending index.
Closed = tuple[str, GroupView, dict[str, MemberView], bool]


def new(tt: TableState) -> GroupView:
    """A new pending group, counted (neither indexed as pending nor written yet)."""
    tt.counters.groups_pending += 1
    return GroupRecord(state=PENDING, created=tt.now)


def pend(tt: TableState, gkey: str, grp: GroupView) -> None:
    """A new group's row in the pending index (its timeout's)."""
    tt.txn.put(tt.pending_key(gkey, group_record(grp)), b"", db=tt.db["pending"])


def open_pending(tt: TableState, gkey: str) -> GroupView:
    """A new pending group, indexed and written."""
    grp = new(tt)
    pend(tt, gkey, grp)
    keep(tt, gkey, grp)
    return grp


def keep(tt: TableState, gkey: str, grp: GroupView) -> None:
    """A pending group changed (members added, runs recorded failed), written by save."""
    tt.put_group(gkey, group_record(grp))


def record_failed(grp: GroupView, uid: str, reason: str) -> GroupView:
    """A run reported failed: one of the group's runs, not a member. Returns the group's view with
    it (a rows table's is a new view, for row_pending.keep to write)."""
    why = clip(reason or "failed", 200)
    if isinstance(grp, RowGroup):
        return grp._replace(failed={**grp.failed, uid: why})
    group_record(grp).failed[uid] = why
    return grp


def forget_failed(grp: GroupView, uids: Sequence[str]) -> None:
    """Runs reported failed, then pushed after all (a retry that worked): members, no more failed."""
    failed = group_record(grp).failed
    for uid in uids:
        failed.pop(uid, None)


def unlist_pending(tt: TableState, key: bytes) -> None:
    """A pending group leaves the pending index (its key there, from `expired`): one whose head does
    not decode, which its timeout cannot end, is met once, not at every pass."""
    tt.txn.delete(key, db=tt.db["pending"])


def expired(tt: TableState, created_before: float) -> list[tuple[str, bytes]]:
    """The pending groups created before the cutoff, oldest first, each with its key in the pending index."""
    found = []
    cutoff = layout.micros(created_before)
    with tt.txn.cursor(db=tt.db["pending"]) as cur:
        at = cur.set_range(tt.prefix)
        while at and cur.key().startswith(tt.prefix) and cur.key()[4:12] <= cutoff:
            found.append((cur.key()[12:].decode(), bytes(cur.key())))
            at = cur.next()
    return found


def oldest_pending(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> bytes | None:
    """When a table's oldest pending group was created (8 sortable bytes), None: it has none."""
    return layout.first_time(txn, dbs["pending"], prefix)


def add_members(tt: TableState, by_group: dict[str, list[Entry]], groups: dict[str, GroupView]) -> None:
    """New experiences as pending members of their groups, in push order: their records
    (written by save), payloads and places in the insertion order."""
    prefix, now, seq = tt.prefix, tt.now, tt.counters.next_seq
    order: list[tuple[bytes, bytes]] = []  # insertion order: T + seq -> uid
    for gkey, members in by_group.items():
        grp = group_record(groups[gkey])
        for entry in members:
            tt.put_item(entry.uid, entry.record(gkey, seq=seq, created=now))
            order.append((prefix + u64(seq), entry.uid.encode()))
            grp.members.append(entry.uid)
            seq += 1
    put_rows(tt.txn, tt.db["order"], order)
    payloads.store(tt, by_group)


def closing(tt: TableState, gkey: str, grp: GroupView, *, partial: bool) -> dict[str, MemberView]:
    """A pending group about to complete (or to be dropped as it does): flagged partial (sealed,
    timed out, runs reported failed); its runs still in pieces dropped, as they will not join it
    (complete, it takes no more pieces: even with all its runs, a run past them may hold some);
    its members' views."""
    recs = tt.members(grp)
    group_record(grp).partial = partial
    pieces.drop_group(tt, gkey)
    return recs


def complete(
    tt: TableState,
    groups: Sequence[Closed],
    *,
    ready: list[Row] | None = None,
    computing: list[Members] | None = None,
) -> None:
    """Pending groups (each with its members' views, and whether it is in the pending index:
    a group opened and filled by one push never is) become ready, or computing, together, in
    the ready order's next places, each with its members' lowest version (None unless every
    member has one) and highest priority. With `ready`, the ready groups' index entries are
    appended there for the caller to add with others (ReadyIndex.add_many) instead of added now.
    With `computing` (a push whose table has an advantage computation), the groups that need
    advantages are appended there, still pending, for the caller's compute_in_push."""
    now_ready: list[Members] = []
    placed: list[tuple[str, GroupRecord]] = []  # the ready ones' records
    queued: list[Members] = []
    estimated = tt.config.advantages.estimator != "none"
    for gkey, view, recs, indexed in groups:
        grp = group_record(view)
        if indexed:
            tt.txn.delete(tt.pending_key(gkey, grp), db=tt.db["pending"])
        grp.version, grp.priority = placed_by(recs)
        grp.rseq = tt.counters.next_rseq
        tt.counters.next_rseq += 1
        if not estimated:
            now_ready.append((gkey, grp, recs))
            placed.append((gkey, grp))
        elif computing is not None:
            computing.append((gkey, grp, recs))
        else:  # queued for its advantages (compute.py); sampled once they are stored (finish_compute)
            queued.append((gkey, grp, recs))
    if now_ready:
        tt.set_states(now_ready, READY)
        rate_counts.became_ready(tt, sum(len(recs) for _, _, recs in now_ready))
        rows = [(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp in placed]
        if ready is None:
            tt.ready.add_many(rows)
        else:
            ready.extend(rows)
    if queued:
        tt.set_states(queued, COMPUTING)
