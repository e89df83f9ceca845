"""Quarantine: an experience whose stored payload is not the one pushed (damage on disk, found
by a read's check of its digest or by the scrub) leaves the buffer in a state of its own,
`quarantined`, and is never served.

Its group fails: a batch holds whole groups, and the group's advantages were computed with the
damaged member. The group's other members keep their payloads, as failed experiences, for Get
and export until their tombstones are forgotten (`tombstone_seconds`), so nothing good is lost
with it. A member of a group that had failed already, whose payload was kept, is quarantined
alone. Each experience is logged once, with its uid, when it is quarantined, and counted: by
state (`quarantined`, a tombstone forgotten in time like the others) and in the total `damaged`.

A member its group names whose record the directory lost is quarantined alike: found by a
sample, by a lease that would put its group back in the buffer, by a replayed group's cooldown
ending, or by its group's completion or advantages (`quarantine_lost`), its group fails; found
where its group leaves anyway (evicted, consumed, dropped), the retirement buries it
(core/verbs/retire.py). Its tombstone is made from what is left (its payload's digest where the
payload is, so that a retried push of it is still a duplicate), its payload and place in the
insertion order, found by its uid, go, and the table's bytes are recounted from its records (the
lost record's size, counted in them, is known nowhere else). A ready group whose own record is
lost fails when a sample passes it over or an index build reads past it (`fail_lost_groups`), its
record remade from its members' (core/verbs/groups.remade), their payloads kept for Get; a computing
group whose own record is lost fails alike when the advantage worker's read of its backlog passes it
over (`fail_lost_computing`). A record
that does not decode (a damaged page) is read as lost (TableState.item, .group) and met alike.

A rows table's (issue 64) group with a damaged member fails as a records table's does, the damaged
member's payload gone and the others' kept, the damaged member flagged quarantined in its segment's
state (disk/rows/segments.SegState) and counted so until its segment is forgotten. Its pending or
computing group some of whose rows damage lost fails where a records table's with a lost record
does (`quarantine_lost`), the members whose rows are lost quarantined.

A ready group that cannot be served for another cause than damage (its table's batch stage raises
on it) fails as any failed group, its payloads kept only with keep_failed (`fail_ready`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from ..core.table_state.read_check import payload_problem
from ..core.table_state.state import TableState
from ..core.table_state.views import RowGroup
from ..core.verbs import retire
from ..core.verbs.groups import remade, remade_computing
from ..core.verbs.rows import moves as row_moves
from ..core.verbs.rows.ends import LOST_ROW
from ..disk import chunk_reads
from ..schema.states import COMPUTING, FAILED, LIVE, PENDING, READY
from ..schema.views import GroupView, MemberView

log = logging.getLogger("expbuf.store")


def quarantine_groups(tt: TableState, groups: Sequence[tuple[str, GroupView, dict[str, str]]]) -> int:
    """Live groups with damaged members (uid -> why) fail; those members are quarantined.
    Returns how many were."""
    quarantined = counted(tt, groups)
    if tt.config.storage.layout == "rows":
        row_moves.fail(tt, [(gkey, grp) for gkey, grp, _ in groups], quarantined)
    else:
        retire.retire(tt, [(gkey, grp) for gkey, grp, _ in groups], FAILED, quarantined)  # and buries the lost
    return len(quarantined)


def counted(tt: TableState, groups: Sequence[tuple[str, GroupView, dict[str, str]]]) -> set[str]:
    """Groups with damaged members (uid -> why) about to fail, logged and counted (each damaged
    member once, by uid); returns the members to quarantine. `quarantine_groups` moves them, and a
    rows table's sample, which holds their segments' states, moves them itself."""
    quarantined: set[str] = set()
    for gkey, _, damaged in groups:
        for uid, why in damaged.items():
            log.error(
                "table %s: experience %s quarantined (%s): never served; its group %s failed",
                tt.config.name, uid, why, gkey,
            )  # fmt: skip
        quarantined |= damaged.keys()
        tt.counters.groups_failed += 1
        if damaged:  # none: a rows table's group whose members' rows and payloads are lost alike
            uid, why = next(iter(damaged.items()))
            tt.counters.last_failure = f"group {gkey}: experience {uid} quarantined: {why}"
    tt.counters.damaged += len(quarantined)
    return quarantined


def quarantine_lost(tt: TableState, groups: Sequence[tuple[str, GroupView]]) -> None:
    """The live `groups` with a member whose record the directory lost fail, as a sample fails
    them (quarantine_groups): a lease that puts its groups back in the buffer, a cooldown that
    ends, a pending group's completion and its advantages ask first, since such a group can
    never be served whole again. A rows table's group some of whose rows damage lost (its members
    made from their payloads named quarantined in its view: TableState.pending_members) fails alike."""
    if tt.config.storage.layout == "rows":
        _quarantine_damaged_rows(tt, groups)
        return
    damaged = []
    for gkey, grp in groups:
        lost = {uid: tt.lost_why(uid) for uid in grp.members if tt.member(uid) is None}
        if lost:
            damaged.append((gkey, grp, lost))
    if damaged:
        quarantine_groups(tt, damaged)


def _quarantine_damaged_rows(tt: TableState, groups: Sequence[tuple[str, GroupView]]) -> None:
    """A rows table's pending or computing `groups` some of whose rows damage lost fail, the members
    made from their payloads quarantined (row_ends.leave counts and logs those whose payloads are
    lost too)."""
    failing = [
        (gkey, grp)
        for gkey, grp in groups
        if isinstance(grp, RowGroup) and grp.state in (PENDING, COMPUTING) and (grp.quarantined or grp.lost)
    ]
    if failing:
        named = [(gkey, grp, {uid: LOST_ROW for uid in grp.members if uid in grp.quarantined}) for gkey, grp in failing]
        row_moves.fail(tt, failing, counted(tt, named))


def fail_lost_groups(tt: TableState, gkeys: Sequence[str]) -> None:
    """Ready groups whose records are lost (a sample or an index build passed them over) fail,
    their members, whose records and payloads are stored, kept for Get as a group failed for
    damage keeps them; each logged once. A group the ready order does not name cannot be
    remade, and is left to `expbuf check`, logged."""
    found = []
    for gkey in gkeys:
        grp = remade(tt, gkey)
        if grp is None:
            log.error(
                "table %s: ready group %s has no record, and the ready order does not name it: run `expbuf check`",
                tt.config.name, gkey,
            )  # fmt: skip
            continue
        found.append((gkey, grp))
    _fail_remade(tt, found)


def fail_lost_computing(tt: TableState, gkeys: Sequence[str]) -> int:
    """A records table's computing groups whose own records are lost or do not decode (the advantage
    worker's read of its backlog passed them over) fail as `fail_lost_groups` fails a ready one, their
    records remade from their members' at the place the compute queue holds them
    (TableState.queued_place): left computing, they would never be computed nor served. A group
    found again meanwhile (its record stored, or out of the queue) is left as it is. Returns how many
    failed."""
    found = [(gkey, grp) for gkey in gkeys if (grp := remade_computing(tt, gkey)) is not None]
    _fail_remade(tt, found)
    return len(found)


def _fail_remade(tt: TableState, groups: Sequence[tuple[str, GroupView]]) -> None:
    """Live groups whose records were lost, remade from their members', fail: their members, whose
    records and payloads are stored, kept for Get as a group failed for damage keeps them, each
    group logged once with why its record was lost, counted and named in `last_failure`."""
    for gkey, grp in groups:
        why = tt.lost_why(gkey)
        log.error(
            "table %s: %s group %s failed (%s): never served; its %d experience(s) kept for Get",
            tt.config.name, grp.state, gkey, why, len(grp.members),
        )  # fmt: skip
        tt.counters.groups_failed += 1
        tt.counters.last_failure = f"group {gkey}: {why}"
    retire.retire(tt, groups, FAILED, keep_payloads=True)


def fail_ready(tt: TableState, failed: Mapping[str, str]) -> int:
    """Ready groups that cannot be served (their table's batch stage raises on them: `failed`, group ->
    why) fail, never to be served, as any failed group: their payloads kept where the table keeps
    failed groups' (keep_failed), counted and named in `last_failure`. A group no longer ready
    (deleted, or taken again meanwhile) is left. Returns the experiences failed."""
    groups = [(gkey, grp) for gkey in failed if (grp := tt.view(gkey)) is not None and grp.state == READY]
    for gkey, _ in groups:
        tt.counters.groups_failed += 1
        tt.counters.last_failure = f"group {gkey}: {failed[gkey]}"
    if groups and tt.config.storage.layout == "rows":
        row_moves.fail(tt, groups, frozenset())
    elif groups:
        retire.retire(tt, groups, FAILED)
    return sum(len(grp.members) for _, grp in groups)


def quarantine_kept(tt: TableState, uid: str, rec: MemberView, why: str) -> None:
    """A failed experience whose kept payload is damaged: quarantined alone, its payload gone."""
    log.error("table %s: experience %s quarantined (%s): never served", tt.config.name, uid, why)
    retire.quarantine_kept(tt, uid, rec)


def quarantine_found(tt: TableState, uids: Iterable[str]) -> int:
    """Quarantine those of `uids` whose stored payload, read again here in the write
    transaction, is damaged; those changed or gone since they were found are left alone.
    Returns how many were quarantined."""
    groups: dict[str, tuple[GroupView, dict[str, str]]] = {}
    count = 0
    for uid in dict.fromkeys(uids):
        rec = tt.member(uid)
        if rec is None or rec.state not in (*LIVE, FAILED):
            continue
        blob = chunk_reads.read_payload(tt.txn, tt.db, tt.key(uid))
        why = None if blob is None else payload_problem(uid, rec, blob)
        if why is None:
            continue
        if rec.state == FAILED:
            quarantine_kept(tt, uid, rec, why)
            count += 1
            continue
        grp = tt.existing_view(rec.group)
        groups.setdefault(rec.group, (grp, {}))[1][uid] = why
    count += quarantine_groups(tt, [(gkey, grp, damaged) for gkey, (grp, damaged) in groups.items()])
    return count
