"""How a rows table's pending group ends (issue 64, 2.8; what a push does to one while it is
pending is pending.py's). It completes into a segment as a group pushed whole does (segments.py),
ready (`complete`) or computing its advantages first (`queue`, then `complete` from computing),
its fragments read once and deleted then; dropped (timed out, too few runs, all rewards equal, its
claim ended) or failed, it goes into a segment of its own retired state (`retire`, `leave`), which
keeps its members' digests as a consumed group's does, its payloads gone; a Delete that takes some
of its members writes the rest again (`left`). The groups a push completes have their rows in the
indexes found from their heads' bytes where those keep every member themselves (`_forget_all`),
the heads as the push read them (rules/groups.Ending's `heads`), not read again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence, Set

from ....disk.rows import (
    Member,
    PendingHead,
    fragment_key,
    group_entry,
)
from ....schema.states import COMPUTING, PENDING, QUARANTINED, State
from ....schema.views import Groups
from ...table_state import oldest_index
from ...table_state.events import Moved, Retired
from ...table_state.state import TableState
from ...table_state.views import RowGroup
from .. import payloads, pieces
from . import segments
from .pending import Joined, add, head, held

LOST_ROW = "its row is damaged"  # why a member whose row damage lost is quarantined
log = logging.getLogger("expbuf.store")


def complete_opened(tt: TableState, joined: Joined, keys: Sequence[bytes]) -> None:
    """Groups this request opened (`opening`) and completes with these members, none of their runs
    reported failed, ready in the ready order's next places: `complete`'s of their views, made as
    their segment keeps them without a view of each first; `keys`: their directory keys."""
    pieces.drop_groups(tt, lambda: list(joined))  # their runs still in pieces will not join them
    segments.complete_ready(tt, segments.opened(joined, tt.now), keys=keys)


def left(tt: TableState, gkey: str, head: PendingHead, rows: Sequence[Member], lost: Sequence[int] = ()) -> None:
    """Members left a pending group (a Delete): those still in it (`rows`, in push order) written again
    in its head, as a group's first members are (PendingHead.add: in its first fragment where they
    spill), and the hashes of those whose rows damage lost (`lost`) after them, so that its end still
    fails it with them (TableState.pending_members); with neither, its fragments and pending index row
    go (its directory entry is the caller's)."""
    if not rows and not lost:
        _forget(tt, gkey, head)
        return
    now = rows[0].created if rows else None
    if lost:  # its first member's row may be one damage lost: its key found by the group's
        oldest_index.head_gone(tt, gkey, head)
        oldest_index.head_changed(tt, gkey, None, now)
    else:
        oldest_index.head_changed(tt, gkey, oldest_index.head_first(tt, gkey, head), now)
    for number in range(head.fragments):
        tt.txn.delete(fragment_key(tt.prefix, gkey, number), db=tt.db["frags"])
    head.fragments, head.hashes, head.inline = 0, [], b""
    if (spilled := head.add(rows)) is not None:
        tt.txn.put(fragment_key(tt.prefix, gkey, 0), spilled, db=tt.db["frags"])
    head.hashes.extend(lost)
    tt.txn.put(tt.key(gkey), head.encode(), db=tt.db["gdir"])


def _forget_all(
    tt: TableState, gkeys: Sequence[str], read: Mapping[bytes, bytes] | None = None
) -> dict[str, PendingHead]:
    """Pending or computing groups complete or leave together: their heads read in one call (or as
    the request read them: `read`, by directory key, where it holds every one), each `_forget`; a
    plain head that keeps every member itself (PendingHead.outline: what a push completes most) is
    not decoded, its rows in the pending index and the index of the oldest found from its bytes.
    Returns the heads it decoded, by group (a computing group's names its place in the compute
    queue); a group opened and closed by one request was never written and has none."""
    keys = tt.keys(gkeys)
    entries = read if read is not None and all(key in read for key in keys) else held(tt, keys)
    heads: dict[str, PendingHead] = {}
    plain: list[tuple[str, float]] = []
    txn, pending = tt.txn, tt.db["pending"]
    for gkey, key in zip(gkeys, keys, strict=True):
        raw = entries.get(key)
        outline = None if raw is None else PendingHead.outline(raw)
        if outline is not None:
            created, first = outline
            txn.delete(tt.pending_key(gkey, created), db=pending)
            plain.append((gkey, first))
        elif raw is not None and isinstance(entry := group_entry(gkey, raw), PendingHead):
            _forget(tt, gkey, entry)
            heads[gkey] = entry
    oldest_index.heads_gone(tt, plain)
    return heads


def _forget(tt: TableState, gkey: str, entry: PendingHead) -> None:
    """A pending or computing group's fragments and its rows in the index of the oldest and in the
    pending index or the compute queue go (it completes or leaves); its directory entry is
    overwritten by its segment's, or deleted, by the caller."""
    oldest_index.head_gone(tt, gkey, entry)
    for number in range(entry.fragments):
        tt.txn.delete(fragment_key(tt.prefix, gkey, number), db=tt.db["frags"])
    if entry.queued is None:
        tt.txn.delete(tt.pending_key(gkey, entry), db=tt.db["pending"])
    else:
        tt.txn.delete(tt.queued_key(entry), db=tt.db["compute"])


def complete(
    tt: TableState,
    groups: Sequence[tuple[RowGroup, bool, bool]],
    was: State = PENDING,
    heads: Mapping[bytes, bytes] | None = None,
) -> None:
    """Pending (or computing: `was`) groups become ready together, in the ready order's next places,
    as groups pushed whole do: each with whether it completes partial (sealed, timed out, runs
    reported failed) and whether it was written (`keep`; a group opened and filled by one push never
    is). A computing group's head says whether it completed partial, and its place in the ready
    order: the rseq it took when it completed, a records table's group's. No groups (those a push
    completed all dropped by its computation): nothing moves, and an extension hears of nothing.
    `heads`: their directory entries as the request read them (pending.held), unchanged since, by
    directory key (a push that completes them read them first): not read again."""
    if not groups:
        return
    views, partials, writes = zip(*groups, strict=True)
    if was == PENDING:  # their runs still in pieces will not join them
        pieces.drop_groups(tt, lambda: [grp.key for grp in views])
    if was == PENDING and not any(partials) and not any(writes):  # opened and completed by this request
        segments.complete_ready(tt, segments.wholes(views), was)
        return
    whole, places = [], []
    decoded = _forget_all(tt, [grp.key for grp, _, written in groups if written], heads)
    for grp, partial, _ in groups:
        entry = decoded.get(grp.key)
        placed = None
        if entry is not None and entry.queued is not None:
            partial, placed = entry.partial, entry.placed
            places.append(entry.queued)
        whole.append(segments.whole(grp.key, grp.created, grp.rows, partial, grp.failed, placed))
    segments.complete_ready(tt, whole, was, places if was == COMPUTING else None)


def queue(tt: TableState, groups: Sequence[tuple[RowGroup, bool, bool]]) -> None:
    """Pending groups complete and wait for their advantages (computing), in the compute queue's next
    places: each keeps its head, now naming its place there (its key in the compute queue, out of the
    pending index: it times out no more), whether it completed partial and its priority and version
    (which a member deleted while it computes leaves as they are), and its members' rows
    (with the ones this request brought). `complete` (from computing) writes it into
    a segment with its advantages."""
    counters = tt.counters
    moved: list[tuple[str, RowGroup]] = []
    for grp, partial, written in groups:
        entry = head(tt, grp.key) if written else None
        if entry is None:
            entry = PendingHead(created=grp.created)
        else:
            tt.txn.delete(tt.pending_key(grp.key, entry), db=tt.db["pending"])
        if (new := grp.rows[len(entry.hashes) :]) and (spilled := add(tt, grp.key, entry, new)) is not None:
            tt.txn.put(*spilled, db=tt.db["frags"])
        pieces.drop_group(tt, grp.key)  # its runs still in pieces will not join it
        entry.failed, entry.partial, entry.queued = dict(grp.failed), partial, counters.next_rseq
        entry.placed = segments.placed_by(grp.rows)
        counters.next_rseq += 1
        tt.txn.put(tt.queued_key(entry), grp.key.encode(), db=tt.db["compute"])
        tt.txn.put(tt.key(grp.key), entry.encode(), db=tt.db["gdir"])
        counters.add(PENDING, -len(grp.rows))
        counters.add(COMPUTING, len(grp.rows))
        moved.append((grp.key, grp._replace(state=COMPUTING)))
    counters.add_groups(PENDING, -len(moved))
    counters.add_groups(COMPUTING, len(moved))
    tt.extensions.on_moved(tt, Moved(PENDING, COMPUTING, moved))


def retire(tt: TableState, groups: Groups, state: State, damaged: Set[str] = frozenset()) -> None:
    """Pending or computing groups leave the table as `state` (dropped, failed): the extensions hear
    of it first (`Retired`), then they `leave`."""
    tt.extensions.on_retired(tt, Retired(groups, state))
    leave(tt, groups, state, damaged)


def leave(tt: TableState, groups: Groups, state: State, damaged: Set[str] = frozenset()) -> None:
    """Pending or computing groups leave the table as `state`, the extensions told by the caller
    (`retire`): their rows go into segments of that state, which keep their members' digests (a
    retried push of one is a duplicate), their fragments and rows in the pending index or the
    compute queue go, and their payloads (a failed group's stay, as payloads.kept says: all but the
    `damaged` members'). Their members whose rows damage lost (TableState.pending_members) are
    quarantined too, counted damaged and logged where the caller did not name them (as a records
    table's retirement buries a member whose record is lost)."""
    views = [_pending(gkey, grp) for gkey, grp in groups]
    damaged = _found_damaged(tt, views, damaged, state)
    for grp in views:
        pieces.drop_group(tt, grp.key)
    _forget_all(tt, [grp.key for grp in views])
    whole = [segments.whole(g.key, g.created, g.rows, failed=g.failed) for g in views]
    segments.write(tt, whole, state, quarantined=damaged)
    counters = tt.counters
    for grp in views:
        counters.add(grp.state, -len(grp.rows) - grp.lost)
        counters.add_groups(grp.state, -1)
    members = [member for grp in views for member in grp.rows]
    flagged = sum(member.uid in damaged for member in members)
    counters.add(state, len(members) - flagged)
    counters.add(QUARANTINED, flagged)
    keys = [tt.key(member.uid) for member in members]
    payloads.drop(tt, keys, [member.size for member in members], keep=payloads.kept(tt, state, damaged))


def _found_damaged(tt: TableState, views: Sequence[RowGroup], damaged: Set[str], state: State) -> Set[str]:
    """`damaged` with the members of `views` whose rows damage lost, those not among them counted
    damaged and logged once each, as are the members neither a row nor a payload holds."""
    found = [(grp.key, uid) for grp in views for uid in grp.members if uid in grp.quarantined and uid not in damaged]
    for gkey, uid in found:
        log.error(
            "table %s: experience %s quarantined (%s): never served; its group %s left as %s",
            tt.config.name, uid, LOST_ROW, gkey, state,
        )  # fmt: skip
        tt.counters.last_failure = f"group {gkey}: experience {uid} quarantined: {LOST_ROW}"
    for grp in views:
        if grp.lost:
            log.error(
                "table %s: %d experience(s) of group %s lost with their rows and payloads; the group left as %s",
                tt.config.name, grp.lost, grp.key, state,
            )  # fmt: skip
            tt.counters.last_failure = f"group {grp.key}: {grp.lost} experience(s) lost with their rows and payloads"
    tt.counters.damaged += len(found) + sum(grp.lost for grp in views)
    return {*damaged, *(uid for _, uid in found)} if found else damaged


def _pending(gkey: str, grp: object) -> RowGroup:
    if not isinstance(grp, RowGroup) or grp.state not in (PENDING, COMPUTING):
        raise TypeError(f"group {gkey} is no pending or computing group of a rows table")
    return grp
