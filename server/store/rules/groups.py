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

import itertools
import logging
from collections.abc import Mapping, Sequence

from expbuf.client.schema.routing import uid_group_key

from ..core.ordering.ready import Row
from ..core.table_state.events import Pushed
from ..core.table_state.state import TableState
from ..core.table_state.views import RowGroup
from ..core.verbs import groups as core_groups
from ..core.verbs import pieces
from ..core.verbs.compute import still_queued, store_advantages, store_row_advantages
from ..core.verbs.groups import Closed
from ..core.verbs.retire import retire
from ..core.verbs.rows import ends as row_ends
from ..core.verbs.rows import pending as row_pending
from ..disk.kinds import Ahead, Compute, FailResult, ShapingUpdate
from ..schema.errors import (
    DROP_DAMAGED_GROUP,
    Conflict,
    DamagedGroup,
    GroupClosed,
    GroupOverfilled,
    InvalidRequest,
    NotFound,
    clip,
)
from ..schema.states import COMPUTING, DROPPED, FAILED, PENDING, State
from ..schema.views import GroupView, Members
from .capacity import make_room
from .pushed_advantages import (
    add_shaping,
    compute_rows_in_push,
    drop_below_threshold,
    zero_variance,
)
from .quarantine import quarantine_lost

log = logging.getLogger("expbuf.store")


class Ending:
    """The groups one step of a request completes and drops, completed and retired together by
    `done`: the table's extensions hear one event for them all (one per state they leave as),
    never one per group."""

    def __init__(self, tt: TableState, heads: Mapping[bytes, bytes] | None = None) -> None:
        self.tt = tt
        self.heads = heads  # a rows table's: the directory entries the request read, unchanged since
        self.closed: list[Closed] = []
        self.rows: list[tuple[RowGroup, bool, bool]] = []  # a rows table's: (view, partial, written)
        # a rows table's, as complete_opened took them, each with its groups' directory keys
        self.opened: list[tuple[row_pending.Joined, Sequence[bytes]]] = []
        self.gone: dict[State, list[tuple[str, GroupView]]] = {}
        self.lost: list[tuple[str, GroupView]] = []  # to fail: a member's record is lost

    def complete(self, gkey: str, grp: GroupView, *, partial: bool, indexed: bool = True) -> bool:
        """A pending group is to become ready, or computing; False if the zero-variance filter
        drops it instead. `indexed`: the group is in the pending index (a group opened and
        filled by one push never is; of a rows table's: its head is written). One with a member
        whose record the directory lost is to fail instead (the quarantine rule), since it can never
        be served whole; so is a rows table's some of whose rows damage lost (TableState.pending_members)."""
        tt = self.tt
        if isinstance(grp, RowGroup) and (grp.quarantined or grp.lost):  # damage lost some of its rows
            self.lost.append((gkey, grp))
            return True
        if isinstance(grp, RowGroup):
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

    def complete_opened(self, joined: row_pending.Joined, keys: Sequence[bytes]) -> list[str]:
        """Groups of a rows table this request opened and completes with these members, none of their
        runs reported failed, as `complete` takes each (not partial, not indexed), at once; the keys of
        those the zero-variance filter drops instead. Where no filter or estimator reads them, they
        go to their segments as they are, no view made of each (row_ends.complete_opened, with
        their directory keys as the push encoded them: `keys`, in `joined`'s order)."""
        tt = self.tt
        if not tt.config.grouping.drop_zero_variance and tt.config.advantages.estimator == "none":
            if joined:  # a push of copies alone completes none: nothing moves, no one hears of it
                self.opened.append((joined, keys))
            return []
        views = row_pending.views_new(tt, joined)
        if tt.config.grouping.drop_zero_variance:
            return [view.key for view in views if not self.complete(view.key, view, partial=False, indexed=False)]
        self.rows.extend(zip(views, itertools.repeat(False), itertools.repeat(False)))
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
        # before `rows`: a push that opens and completes every group completes no other
        for joined, keys in self.opened:
            row_ends.complete_opened(self.tt, joined, keys)
        rows, estimated = self.rows, self.tt.config.advantages.estimator != "none"
        if rows and not estimated:
            row_ends.complete(self.tt, rows, heads=self.heads)
        elif rows and compute is None:  # queued, computing, as a records table's are in complete
            compute_rows_in_push(self.tt, rows, None, None)
        for state, groups in self.gone.items():
            retire(self.tt, groups, state)
        quarantine_lost(self.tt, self.lost)
        if rows and estimated and compute is not None:  # after the others leave, as put's compute_in_push
            compute_rows_in_push(self.tt, rows, compute, ahead)
        self.closed, self.rows, self.opened, self.gone, self.lost = [], [], [], {}, []
        self.heads = None  # read before what was just written: not for a later step's groups


def finish_compute(
    tt: TableState,
    advantages: dict[str, float | bytes],
    ready: Sequence[str],
    dropped: Sequence[str],
    failed: dict[str, str],
    shaping: ShapingUpdate | None = None,
    places: Mapping[str, int] | None = None,
) -> bool:
    """One value per experience goes into its record (rewritten anyway to become ready),
    with its shaped reward where the batch stage needs it; token-level advantages, being
    larger, into the adv database. What reward shaping did (its counts and running
    moments) is saved with them. Groups deleted or evicted meanwhile are left alone; one with a
    member whose record the directory lost fails instead (the quarantine rule). Given each group's
    place in the compute queue as the computation read it (`places`), a group that is no longer
    there (deleted and pushed again, it completed again elsewhere) is left alone too, computing.
    Where shaping counted or took in such a group, nothing is stored (returns False): its counts
    and moments hold a group whose values are not kept, which the one pushed again would add a
    second time; the groups stay computing, for the worker's next pass."""
    if shaping is not None:
        if places is not None and _shaped(tt, shaping) and not all(still_queued(tt, *at) for at in places.items()):
            return False
        add_shaping(tt, shaping)
    ending = Ending(tt)
    below: list[tuple[str, GroupView]] = []
    computed: list[Members] = []
    rows: list[tuple[RowGroup, bool, bool]] = []  # a rows table's: completing as row_ends.complete has it
    for gkey in dict.fromkeys([*ready, *dropped, *failed]):
        grp = tt.view(gkey)
        if grp is None or grp.state != COMPUTING or not (places is None or still_queued(tt, gkey, places.get(gkey))):
            continue
        if gkey in failed:
            ending.fail(gkey, grp, failed[gkey])
        elif gkey in dropped:
            below.append((gkey, grp))
        elif isinstance(grp, RowGroup) and not (grp.quarantined or grp.lost):
            rows.append((grp, False, True))
        elif isinstance(grp, RowGroup) or any(tt.member(uid) is None for uid in grp.members):  # never served whole
            ending.lost.append((gkey, grp))
        else:
            computed.append((gkey, grp, tt.members(grp)))
    tt.ready.add_many(store_advantages(tt, computed, advantages, shaping))
    if rows:
        store_row_advantages(tt, rows, advantages, shaping, COMPUTING)
    drop_below_threshold(tt, below)
    ending.done()
    tt.save()
    return True


def _shaped(tt: TableState, shaping: ShapingUpdate) -> bool:
    """Whether a computation's shaping update changes the table's counts or running moments."""
    return any(shaping.counts.values()) or shaping.moments != tt.counters.reward_moments


def expire_groups(tt: TableState, created_before: float) -> int:
    """Release (flagged partial) or drop incomplete groups created before the cutoff; returns how many.
    A rows table's whose head does not decode, or is lost, cannot be ended from what is stored: it
    leaves the pending index, so that the upkeep meets it once and times out the others, logged, and is left to
    `expbuf check` and a Delete naming it (core/verbs/rows/deletes.py)."""
    ending = Ending(tt)
    timed_out = 0
    for gkey, key in core_groups.expired(tt, created_before):
        try:
            grp = tt.existing_view(gkey)
        except DamagedGroup as exc:
            core_groups.unlist_pending(tt, key)
            log.error(
                "table %s: pending group %s passed over by its timeout (%s): %s",
                tt.config.name, gkey, exc.why, DROP_DAMAGED_GROUP,
            )  # fmt: skip
            continue
        timed_out += 1
        tt.counters.groups_timed_out += 1
        if tt.config.grouping.on_timeout == "drop":
            ending.drop(gkey, grp)
            tt.counters.dropped_timeout += 1
        elif not grp.members or (tt.config.grouping.min_size and too_short(tt, grp)):
            ending.drop_short(gkey, grp)
        elif ending.complete(gkey, grp, partial=True):
            tt.counters.groups_short += len(grp.members) < tt.config.grouping.size
    ending.done()
    return timed_out


def fail_runs(tt: TableState, failures: Sequence[tuple[str, str]], holder: str) -> FailResult:
    """Runs their workers report failed (uid, reason): each is recorded in its pending group
    (opened if none of its runs arrived), where it counts as one of the group's runs but not a
    member. A group whose runs are then all known completes with the members present, short
    (flagged partial), when they are at least `min_group_size`; it is dropped (reason short)
    when fewer succeeded, or when any failed and the table wants every run. A run reported
    twice counts once; a run pushed later rejoins its group as a member. `holder` is who
    reports (as a push's)."""
    grouping = tt.config.grouping
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
    opened: set[str] = set()  # groups the reports open: those left open take their places (capacity.py)
    for (uid, reason), gkey in zip(failures, keys, strict=True):
        assert gkey is not None
        grp = touched.get(gkey) or tt.view(gkey)
        if uid in grp.members if rows and grp is not None else tt.member(uid) is not None:
            raise Conflict(f"uid {clip(uid)} was pushed: a run pushed cannot be reported failed")
        if grp is None and rows:
            grp = row_pending.opened(tt, gkey)
            opened.add(gkey)
        elif grp is None:
            grp = core_groups.new(tt)
            opened.add(gkey)
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
    left_open = sum(len(touched[gkey].members) + len(touched[gkey].failed) < grouping.size for gkey in opened)
    make_room(tt, 0, 0, set(), left_open, len(opened) - left_open)  # one every run of which failed takes none
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
