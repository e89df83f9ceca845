"""The rules of a table's groups: experiences join groups, groups move through their states,
and the table keeps within its capacity. Functions over a table's state (core/table_state/state.py), whose
group records core/verbs/groups.py writes.

States: pending (the group is incomplete) → computing (its advantages) → ready → leased →
consumed; a group may also be evicted, dropped (zero variance, timeout, std threshold) or
failed (core/verbs/retire.py: retired experiences keep their record as a tombstone with their
digest, so a retried push is still a duplicate, until `tombstone_seconds`). Counts by state,
bytes and totals are counters written in the same transaction as the records.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from expbuf.client.schema.routing import uid_group_key

from ..core.ordering.ready import Row
from ..core.table_state.events import Inserted, Pushed, Resent
from ..core.table_state.state import TableState
from ..core.table_state.views import RowGroup
from ..core.verbs import groups as core_groups
from ..core.verbs import pieces, row_pending
from ..core.verbs.compute import store_advantages, store_row_advantages
from ..core.verbs.groups import Closed
from ..core.verbs.retire import retire
from ..disk import digests
from ..disk.kinds import Ahead, Compute, Entry, FailResult, PutResult, ShapingUpdate, group_keys
from ..schema.errors import (
    Conflict,
    GroupClosed,
    GroupOverfilled,
    InvalidPayload,
    InvalidRequest,
    NotFound,
    clip,
)
from ..schema.states import COMPUTING, DROPPED, FAILED, PENDING, RETIRED, State
from ..schema.table_config import estimator_of
from ..schema.views import GroupView, Members
from .capacity import make_room
from .pushed_advantages import (
    add_shaping,
    compute_in_push,
    compute_rows_in_push,
    drop_below_threshold,
    zero_variance,
)
from .quarantine import quarantine_lost


class Ending:
    """The groups one step of a request completes and drops, completed and retired together by
    `done`: the table's extensions hear one event for them all (one per state they leave as),
    never one per group."""

    def __init__(self, tt: TableState) -> None:
        self.tt = tt
        self.closed: list[Closed] = []
        self.rows: list[tuple[RowGroup, bool, bool]] = []  # a rows table's: (view, partial, written)
        self.gone: dict[State, list[tuple[str, GroupView]]] = {}
        self.lost: list[tuple[str, GroupView]] = []  # to fail: a member's record is lost

    def complete(self, gkey: str, grp: GroupView, *, partial: bool, indexed: bool = True) -> bool:
        """A pending group is to become ready, or computing; False if the zero-variance filter
        drops it instead. `indexed`: the group is in the pending index (a group opened and
        filled by one push never is; of a rows table's: its head is written). One with a member
        whose record the directory lost is to fail instead (the quarantine rule), since it can never
        be served whole."""
        tt = self.tt
        if isinstance(grp, RowGroup):  # its members are its rows, which it cannot lose apart
            if tt.config.grouping.drop_zero_variance and zero_variance([member.reward for member in grp.rows]):
                return self._zero_variance(gkey, grp)
            self.rows.append((grp, partial, indexed))
            return True
        if any(tt.member(uid) is None for uid in grp.members):
            self.lost.append((gkey, grp))
            return True
        recs = core_groups.closing(tt, gkey, grp, partial=partial)
        if tt.config.grouping.drop_zero_variance and zero_variance([rec.reward for rec in recs.values()]):
            return self._zero_variance(gkey, grp)
        self.closed.append((gkey, grp, recs, indexed))
        return True

    def complete_opened(self, views: Sequence[RowGroup]) -> list[str]:
        """Groups of a rows table this request opened and completes, none of their runs reported
        failed, as `complete` takes each (not partial, not indexed), at once; the keys of those the
        zero-variance filter drops instead."""
        if self.tt.config.grouping.drop_zero_variance:
            return [view.key for view in views if not self.complete(view.key, view, partial=False, indexed=False)]
        self.rows.extend([(view, False, False) for view in views])
        return []

    def _zero_variance(self, gkey: str, grp: GroupView) -> bool:
        """A group the zero-variance filter drops instead of completing it (False, as `complete`)."""
        self.drop(gkey, grp)
        self.tt.counters.dropped_zero_variance += 1
        return False

    def drop(self, gkey: str, grp: GroupView) -> None:
        """A group is to be dropped (the caller counts why)."""
        self.tt.counters.groups_dropped += 1
        self.gone.setdefault(DROPPED, []).append((gkey, grp))

    def drop_short(self, gkey: str, grp: GroupView) -> None:
        """A group too few of whose runs succeeded is to be dropped (reason short)."""
        self.drop(gkey, grp)
        self.tt.counters.dropped_short += 1

    def fail(self, gkey: str, grp: GroupView, why: str) -> None:
        """A group is to fail, `why` its table's last failure."""
        self.tt.counters.groups_failed += 1
        self.tt.counters.last_failure = f"group {gkey}: {why}"
        self.gone.setdefault(FAILED, []).append((gkey, grp))

    def done(
        self,
        *,
        ready: list[Row] | None = None,
        computing: list[Members] | None = None,
        compute: Compute | None = None,
        ahead: Ahead | None = None,
    ) -> None:
        """The groups complete (`ready`, `computing`: as core/verbs/groups.complete's; a rows table's
        with their advantages from `compute`, computed `ahead` or in the transaction, where its
        estimator needs any: compute_rows_in_push), then the others leave."""
        core_groups.complete(self.tt, self.closed, ready=ready, computing=computing)
        rows, estimated = self.rows, self.tt.config.advantages.estimator != "none"
        if rows and not estimated:
            row_pending.complete(self.tt, rows)
        elif rows and compute is None:  # queued, computing, as a records table's are in complete
            compute_rows_in_push(self.tt, rows, None, None)
        for state, groups in self.gone.items():
            retire(self.tt, groups, state)
        quarantine_lost(self.tt, self.lost)
        if rows and estimated and compute is not None:  # after the others leave, as put's compute_in_push
            compute_rows_in_push(self.tt, rows, compute, ahead)
        self.closed, self.rows, self.gone, self.lost = [], [], {}, []


def put(
    tt: TableState,
    entries: Sequence[Entry],
    *,
    holder: str,
    compute: Compute | None = None,
    ahead: Ahead | None = None,
) -> PutResult:
    """Store a push: each new experience joins its group, and each group it fills becomes
    ready (or computing). Per-item work is done in passes over the whole push: payloads,
    insertion order and ready indexes are written one database at a time. `holder` is who
    pushes (kinds.Push.holder: the prompt ledger lets only a prompt's claimant push its group).
    With `compute` (the table's advantage computation, where the server gives one), the groups
    it completes get their advantages in its transaction (`ahead`: computed before it;
    compute_in_push)."""
    if tt.txn.get(tt.config.name.encode(), db=tt.db["tables"]) is None:
        raise NotFound(f"table '{tt.config.name}' does not exist")
    result = PutResult()
    rows = tt.config.storage.layout == "rows"
    keys = group_keys(entries, tt.config.grouping.by)
    existing: dict[str, row_pending.PendingGroup | None] = {}
    if rows:
        by_group = _by_group(entries, keys)
        # the directory entries of this push's groups, and the digests of their members stored
        existing, stored = row_pending.stored(tt, by_group)
        fresh = {entry.uid: entry for entry in entries}
        if stored or len(fresh) < len(entries):  # some may be stored already, or pushed twice
            fresh, by_group = _screen(tt, entries, keys, stored, result, holder)
    else:
        fresh, by_group = _screen(tt, entries, keys, None, result, holder)
    _check_rewards(tt, fresh.values())
    _check_eids(tt, fresh.values())
    if by_group:  # a push of pieces alone, or of copies alone, was heard of as such
        tt.extensions.on_pushed(tt, Pushed(list(by_group), holder))
    if rows:
        _put_rows(tt, by_group, existing, compute, ahead, result)
        return _stored(tt, result, list(fresh))
    groups: dict[str, GroupView] = {}
    opened: set[str] = set()  # groups this push starts: not in the pending index yet
    size = tt.config.grouping.size
    for gkey, members in by_group.items():
        grp = tt.view(gkey)
        if grp is None:
            grp = core_groups.new(tt)
            opened.add(gkey)
        elif grp.state != PENDING:
            raise GroupClosed(f"group {gkey} is already complete ({grp.state}); it takes no more experiences")
        if grp.failed:  # a run reported failed, then pushed after all (a retry that worked)
            core_groups.forget_failed(grp, [entry.uid for entry in members])
        _no_overfill(tt, gkey, len(grp.members), grp.failed, len(members))
        groups[gkey] = grp
    make_room(tt, len(fresh), sum(e.size for e in fresh.values()), set(groups))
    core_groups.add_members(tt, by_group, groups)
    ending = Ending(tt)
    for gkey, grp in groups.items():
        if size == 0 or len(grp.members) + len(grp.failed) >= size:
            if grp.failed and too_short(tt, grp):
                ending.drop_short(gkey, grp)
                result.dropped_groups.append(gkey)
                continue
            result.completed_groups.append(gkey)
            if not ending.complete(gkey, grp, partial=bool(grp.failed), indexed=gkey not in opened):
                result.dropped_groups.append(gkey)
            else:
                tt.counters.groups_short += bool(grp.failed)
        else:
            if gkey in opened:
                core_groups.pend(tt, gkey, grp)
            core_groups.keep(tt, gkey, grp)
    ready: list[Row] = []
    computing: list[Members] | None = [] if compute is not None else None
    ending.done(ready=ready, computing=computing)
    if computing:
        compute_in_push(tt, computing, ready, compute, ahead)
    tt.ready.add_many(ready)
    return _stored(tt, result, list(fresh))


def _stored(tt: TableState, result: PutResult, stored: list[str]) -> PutResult:
    """A push's end: what it stored counted and heard of, the counters saved."""
    result.stored = stored
    tt.counters.pushed += len(stored)
    tt.counters.duplicates += len(result.duplicates)
    if stored:
        tt.extensions.on_inserted(tt, Inserted(stored))
    tt.save()
    return result


def _by_group(entries: Iterable[Entry], keys: Iterable[str]) -> dict[str, list[Entry]]:
    """The entries by group, in push order, each entry's group key in `keys`."""
    found: dict[str, list[Entry]] = defaultdict(list)
    for entry, gkey in zip(entries, keys, strict=True):
        found[gkey].append(entry)
    return found


def _screen(
    tt: TableState,
    entries: Sequence[Entry],
    keys: Sequence[str],
    stored: Mapping[str, bytes] | None,
    result: PutResult,
    holder: str,
) -> tuple[dict[str, Entry], dict[str, list[Entry]]]:
    """A push's new experiences (uid -> entry), and by group, its copies (the same uid and payload
    again, or stored already) its duplicates; a uid pushed or stored with another payload refused
    (Conflict). `stored`: a rows table's stored digests of the push's uids (row_pending.stored); a
    records table's (None) are read from their records."""
    fresh: dict[str, Entry] = {}
    by_group: dict[str, list[Entry]] = defaultdict(list)
    copies: dict[str, None] = {}  # the groups of the duplicates
    for entry, gkey in zip(entries, keys, strict=True):
        known = fresh.get(entry.uid)
        if known is not None:
            same = known.digest == entry.digest
        elif stored is not None:
            digest = stored.get(entry.uid)
            if digest is None:
                fresh[entry.uid] = entry
                by_group[gkey].append(entry)
                continue
            # a tombstone a format-3 directory left keeps the digest of that format through its upgrades
            same = digest == entry.digest or digest == digests.format_3(entry.blob)
        else:
            rec = tt.member(entry.uid)
            if rec is None:
                fresh[entry.uid] = entry
                by_group[gkey].append(entry)
                continue
            # A tombstone left by format 3 keeps the digest of that format (its payload is gone).
            same = rec.digest == entry.digest or (rec.state in RETIRED and rec.digest == digests.format_3(entry.blob))
        if not same:
            raise Conflict(f"uid {entry.uid} already exists with different content")
        result.duplicates.append(entry.uid)
        copies[gkey] = None
    if copies:  # a copy is answered as stored only to whoever may push its group
        tt.extensions.on_resent(tt, Resent(list(copies), holder))
    return fresh, by_group


def _put_rows(
    tt: TableState,
    by_group: dict[str, list[Entry]],
    existing: dict[str, row_pending.PendingGroup | None],
    compute: Compute | None,
    ahead: Ahead | None,
    result: PutResult,
) -> None:
    """A push into a table of layout "rows" (issue 64, whose rows land a step at a time): its groups
    joined, completed (with their advantages, or computing), kept pending or dropped as a records
    table's (`put`), the oldest ready groups evicted where it needs room (make_room). A group the push
    opens is not made a `PendingGroup` unless the push leaves it pending: most complete in their push."""
    size = tt.config.grouping.size
    groups = _joining(tt, by_group, existing)
    row_pending.opened_by_push(tt, len(by_group) - len(groups))
    make_room(tt, sum(map(len, by_group.values())), sum(e.size for es in by_group.values() for e in es), set())
    ending = Ending(tt)
    joined = row_pending.joined(tt, by_group)
    if not groups and min(map(len, joined.values()), default=size) >= size:  # it opens every group and fills each
        result.completed_groups.extend(joined)
        result.dropped_groups.extend(ending.complete_opened(row_pending.views_new(tt, joined)))
        joined = {}
    for gkey, new in joined.items():
        pending = groups.get(gkey)
        if pending is None:  # opened by this push, none of its runs reported failed
            if size and len(new) < size:
                row_pending.keep(tt, gkey, row_pending.opening(tt, gkey), new)
                continue
            result.completed_groups.append(gkey)
            if not ending.complete(gkey, row_pending.view_new(tt, gkey, new), partial=False, indexed=False):
                result.dropped_groups.append(gkey)
            continue
        if size and pending.size + len(new) + len(pending.failed) < size:
            row_pending.keep(tt, gkey, pending, new)
            continue
        view = row_pending.view(tt, pending, new)
        if pending.failed and too_short(tt, view):
            ending.drop_short(gkey, view)
            result.dropped_groups.append(gkey)
            continue
        result.completed_groups.append(gkey)
        if not ending.complete(gkey, view, partial=bool(pending.failed), indexed=pending.head is not None):
            result.dropped_groups.append(gkey)
        else:
            tt.counters.groups_short += bool(pending.failed)
    ending.done(compute=compute, ahead=ahead)


def _joining(
    tt: TableState, by_group: dict[str, list[Entry]], existing: Mapping[str, row_pending.PendingGroup | None]
) -> dict[str, row_pending.PendingGroup]:
    """Of the groups a push joins, in push order, the pending ones the table has (`existing`), their
    runs pushed now no longer failed; one complete refused (GroupClosed), one the push would overfill
    refused (GroupOverfilled), a group it opens too. Where it opens every group and the table's
    groups take any number, none is looked at."""
    size = tt.config.grouping.size
    groups: dict[str, row_pending.PendingGroup] = {}
    if not existing and not size:
        return groups
    for gkey, members in by_group.items():
        if gkey not in existing:
            _no_overfill(tt, gkey, 0, {}, len(members))
            continue
        if (found := existing[gkey]) is None:
            state = tt.existing_view(gkey).state
            raise GroupClosed(f"group {gkey} is already complete ({state}); it takes no more experiences")
        grp = found
        if grp.failed:  # a run reported failed, then pushed after all (a retry that worked)
            pushed = {entry.uid for entry in members}
            grp = grp._replace(failed={uid: why for uid, why in grp.failed.items() if uid not in pushed})
        _no_overfill(tt, gkey, grp.size, grp.failed, len(members))
        groups[gkey] = grp
    return groups


def _no_overfill(tt: TableState, gkey: str, members: int, failed: Mapping[str, str], adding: int) -> None:
    """Refuse `adding` more experiences to a group of `members` and `failed` runs that they would
    overfill (GroupOverfilled)."""
    size = tt.config.grouping.size
    if size and members + len(failed) + adding > size:
        raise GroupOverfilled(
            f"group {gkey} has {members} of {size} experiences"
            + (f" and {len(failed)} runs reported failed" if failed else "")
            + f"; {adding} more would overfill it"
        )


def _check_rewards(tt: TableState, entries: Iterable[Entry]) -> None:
    estimator = tt.config.advantages.estimator
    if estimator == "none":  # no reward is needed
        return
    needs_reward = estimator_of(tt.config).needs_reward
    for entry in entries:
        if entry.reward is not None:
            continue
        if needs_reward or not entry.has_token_rewards:
            raise InvalidRequest(
                f"uid {entry.uid} has no reward; table '{tt.config.name}' computes advantages "
                f"with {estimator}, which needs one" + (" (or token_level_reward)" if not needs_reward else "")
            )


# The group key of an eid whose batch and task are both empty (Trinity-RFT's and expbuf's defaults).
NO_EID = "/"


def _check_eids(tt: TableState, entries: Iterable[Entry]) -> None:
    """A table that groups refuses an experience without an eid: every such experience would
    join one group, which the first group_size of them complete and the next finds closed."""
    by = tt.config.grouping.by
    if by == "none":
        return
    for entry in entries:
        if entry.tid == NO_EID:
            raise InvalidPayload(
                f"uid {clip(entry.uid)} has no eid (its batch and task are empty), and table '{tt.config.name}' groups"
                f" by {by}: give each experience EID(batch=..., task=..., run=...), its group's task and its own run"
                ' (a table of group_by = "none" takes experiences without one)'
            )


def finish_compute(
    tt: TableState,
    advantages: dict[str, float | bytes],
    ready: Sequence[str],
    dropped: Sequence[str],
    failed: dict[str, str],
    shaping: ShapingUpdate | None = None,
) -> None:
    """One value per experience goes into its record (rewritten anyway to become ready),
    with its shaped reward where the batch stage needs it; token-level advantages, being
    larger, into the adv database. What reward shaping did (its counts and running
    moments) is saved with them. Groups deleted or evicted meanwhile are left alone; one with a
    member whose record the directory lost fails instead (the quarantine rule)."""
    if shaping is not None:
        add_shaping(tt, shaping)
    ending = Ending(tt)
    below: list[tuple[str, GroupView]] = []
    computed: list[Members] = []
    rows: list[tuple[RowGroup, bool, bool]] = []  # a rows table's: completing as row_pending.complete has it
    for gkey in dict.fromkeys([*ready, *dropped, *failed]):
        grp = tt.view(gkey)
        if grp is None or grp.state != COMPUTING:
            continue
        if gkey in failed:
            ending.fail(gkey, grp, failed[gkey])
        elif gkey in dropped:
            below.append((gkey, grp))
        elif isinstance(grp, RowGroup):  # its members are its rows, which it cannot lose apart
            rows.append((grp, False, True))
        elif any(tt.member(uid) is None for uid in grp.members):  # never to be served whole
            ending.lost.append((gkey, grp))
        else:
            computed.append((gkey, grp, tt.members(grp)))
    tt.ready.add_many(store_advantages(tt, computed, advantages, shaping))
    if rows:
        store_row_advantages(tt, rows, advantages, shaping, COMPUTING)
    drop_below_threshold(tt, below)
    ending.done()
    tt.save()


def expire_groups(tt: TableState, created_before: float) -> int:
    """Release (flagged partial) or drop incomplete groups created before the cutoff."""
    expired = core_groups.expired(tt, created_before)
    ending = Ending(tt)
    for gkey in expired:
        grp = tt.existing_view(gkey)
        if tt.config.grouping.on_timeout == "drop":
            ending.drop(gkey, grp)
            tt.counters.dropped_timeout += 1
        elif not grp.members or (tt.config.grouping.min_size and too_short(tt, grp)):
            ending.drop_short(gkey, grp)
        elif ending.complete(gkey, grp, partial=True):
            tt.counters.groups_short += len(grp.members) < tt.config.grouping.size
    ending.done()
    return len(expired)


def fail_runs(tt: TableState, failures: Sequence[tuple[str, str]], holder: str) -> FailResult:
    """Runs their workers report failed (uid, reason): each is recorded in its pending group
    (opened if none of its runs arrived), where it counts as one of the group's runs but not a
    member. A group whose runs are then all known completes with the members present, short
    (flagged partial), when they are at least `min_group_size`; it is dropped (reason short)
    when fewer succeeded, or when any failed and the table wants every run. A run reported
    twice counts once; a run pushed later rejoins its group as a member. `holder` is who
    reports (as a push's)."""
    grouping = tt.config.grouping
    if tt.txn.get(tt.config.name.encode(), db=tt.db["tables"]) is None:
        raise NotFound(f"table '{tt.config.name}' does not exist")
    if not grouping.size:
        raise InvalidRequest(
            f"table '{tt.config.name}' completes a group with the push that carries it (group_size = 0): "
            "it has no runs to wait for, so none to report failed"
        )
    rows = tt.config.storage.layout == "rows"
    result = FailResult()
    touched: dict[str, GroupView] = {}
    keys = [uid_group_key(uid, grouping.by) for uid, _ in failures]
    for (uid, _), gkey in zip(failures, keys, strict=True):
        if gkey is None:
            raise InvalidRequest(f"{clip(uid)!r} is not an experience uid (batch/task/run/step/suffix)")
    gkeys = list(dict.fromkeys(key for key in keys if key is not None))
    tt.extensions.on_pushed(tt, Pushed(gkeys, holder, "FailRuns"))  # a claim's checks
    for (uid, reason), gkey in zip(failures, keys, strict=True):
        assert gkey is not None
        grp = touched.get(gkey) or tt.view(gkey)
        if uid in grp.members if rows and grp is not None else tt.member(uid) is not None:
            raise Conflict(f"uid {clip(uid)} was pushed: a run pushed cannot be reported failed")
        if grp is None and rows:
            grp = row_pending.opened(tt, gkey)
        elif grp is None:
            grp = core_groups.new(tt)
            core_groups.pend(tt, gkey, grp)
        elif grp.state != PENDING:
            raise GroupClosed(f"group {clip(gkey)} is already complete ({grp.state}): its runs are all known")
        if uid not in grp.failed:
            if len(grp.members) + len(grp.failed) >= grouping.size:
                raise GroupOverfilled(f"group {clip(gkey)} has all its {grouping.size} runs; {clip(uid)} is not one")
            grp = core_groups.record_failed(grp, uid, reason)
            tt.counters.runs_failed += 1
            pieces.drop(tt, uid)
            result.recorded.append(uid)
        touched[gkey] = grp
    ending = Ending(tt)
    for gkey, grp in touched.items():
        if len(grp.members) + len(grp.failed) < grouping.size:
            _keep(tt, gkey, grp)
        elif too_short(tt, grp):
            ending.drop_short(gkey, grp)
            result.dropped_groups.append(gkey)
        elif ending.complete(gkey, grp, partial=True):
            tt.counters.groups_short += 1
            result.completed_groups.append(gkey)
        else:  # the zero-variance filter dropped it
            result.dropped_groups.append(gkey)
    ending.done()
    tt.save()
    return result


def _keep(tt: TableState, gkey: str, grp: GroupView) -> None:
    """A pending group changed, written: a records table's record, or a rows table's head."""
    if isinstance(grp, RowGroup):
        row_pending.keep(tt, gkey, grp)
    else:
        core_groups.keep(tt, gkey, grp)


def too_short(tt: TableState, grp: GroupView) -> bool:
    """Whether a group has fewer members than it may complete with (min_group_size; every run
    where that is 0)."""
    return len(grp.members) < (tt.config.grouping.min_size or tt.config.grouping.size)


def seal(tt: TableState, gkey: str, holder: str) -> int:
    """Complete a pending group now; returns its size. A group with no members (its runs so far
    all reported failed) is dropped instead (reason short), its size 0. `holder` is who seals
    (as a push's: only a prompt's claimant completes its group)."""
    grp = tt.view(gkey)
    if grp is None:
        raise NotFound(f"group {clip(gkey)} does not exist in table '{tt.config.name}'")
    if grp.state != PENDING:
        raise GroupClosed(f"group {clip(gkey)} is already complete ({grp.state})")
    tt.extensions.on_pushed(tt, Pushed([gkey], holder, "Seal"))  # a claim's checks
    pieces.drop_group(tt, gkey)  # its runs still in pieces will not join it
    ending = Ending(tt)
    if grp.members:
        ending.complete(gkey, grp, partial=bool(grp.failed))
    else:
        ending.drop_short(gkey, grp)
    ending.done()
    tt.save()
    return len(grp.members)
