"""Advantages a push computes and stores itself: for the groups it completes, where the
server gives the table a computation (the estimators with one value per experience from the
item records, no batch stage, on the CPU; advantages/worker.py decides), the values are computed
before the push's transaction on the pushing thread (`compute_ahead`) or in it, and stored in
it (`compute_in_push`), each member's record written once, ready with its value. Groups it
leaves are queued for the advantage worker (core/verbs/compute.py), whose values are stored with
the same functions (groups.finish_compute). Rules over a table's state (core/table_state/state.py); the
computation itself is a callable the server injects: nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.ordering.ready import Row
from ..core.table_state.state import TableState
from ..core.table_state.views import RowGroup, row_members
from ..core.verbs.compute import queue, queued, store_advantages, store_row_advantages
from ..core.verbs.retire import retire
from ..core.verbs.rows import ends as row_ends
from ..disk.kinds import Ahead, Compute, ComputeJob, Entry, ShapingUpdate
from ..schema.states import DROPPED, PENDING
from ..schema.table_config import TableConfig
from ..schema.views import Groups, Members

# The most experiences whose advantages a push computes itself: about 1 to 4 ms for grpo
# (bench/RESULTS.md); a push completing more leaves them to the worker.
IN_PUSH_LIMIT = 1024


def zero_variance(rewards: list[float | None]) -> bool:
    """Whether a group's rewards are all known and all equal (it teaches nothing): the filter
    of drop_zero_variance, which compute_ahead foresees."""
    return None not in rewards and len(set(rewards)) <= 1


def compute_in_push(
    tt: TableState, computing: list[Members], ready: list[Row], compute: Compute | None, ahead: Ahead | None
) -> None:
    """The advantages of the groups a push completed, computed in the push's own transaction:
    each member's record is written once, ready with its value (the ready groups' index entries
    are appended to `ready`). The groups are queued for the worker instead, computing, where
    `computed` gives no values."""
    if not computing:
        return
    outcome = _computed(tt, computing, compute, ahead)
    if outcome is None:
        queue(tt, computing)
        return
    values, dropped, shaping = outcome
    add_shaping(tt, shaping)
    ready.extend(store_advantages(tt, [group for group in computing if group[0] not in dropped], values, shaping))
    drop_below_threshold(tt, [(gkey, grp) for gkey, grp, _ in computing if gkey in dropped])


def compute_rows_in_push(
    tt: TableState, groups: Sequence[tuple[RowGroup, bool, bool]], compute: Compute | None, ahead: Ahead | None
) -> None:
    """A rows table's groups a request completed (as row_ends.complete takes them), with their
    advantages computed in its transaction, go into their segments ready with their values, written
    once; queued for the worker instead (row_ends.queue), computing, where `computed` gives no
    values (a request without `compute`: a seal, a timeout, runs reported failed, a push before the
    server's computation is at hand)."""
    if not groups:
        return
    computing = [(grp.key, grp, row_members(grp)) for grp, _, _ in groups]
    outcome = _computed(tt, computing, compute, ahead)
    if outcome is None:
        row_ends.queue(tt, groups)
        return
    values, dropped, shaping = outcome
    add_shaping(tt, shaping)
    store_row_advantages(tt, [group for group in groups if group[0].key not in dropped], values, shaping, PENDING)
    drop_below_threshold(tt, [(grp.key, grp) for grp, _, _ in groups if grp.key in dropped])


def _computed(
    tt: TableState, computing: Sequence[Members], compute: Compute | None, ahead: Ahead | None
) -> tuple[dict[str, float | bytes], set[str], ShapingUpdate] | None:
    """The values of the groups a request completed (uid -> value), the groups the estimator drops
    and what reward shaping did; None where they are left to the worker: when there is no
    computation, when the groups hold more than IN_PUSH_LIMIT experiences, when a running reward
    normalisation must take them after older queued groups, or when the computation fails or gives
    any of them a non-finite value (a push never fails for its estimator, and a group fails alone,
    as the worker decides)."""
    count = sum(len(recs) for _, _, recs in computing)
    if compute is None or count > IN_PUSH_LIMIT or (tt.config.advantages.shaping.reward_running_norm and queued(tt)):
        return None
    job = ComputeJob(
        table=tt.config.name,
        config=tt.config,
        groups=[gkey for gkey, _, _ in computing],
        members=[list(recs) for _, _, recs in computing],
        records={uid: rec for _, _, recs in computing for uid, rec in recs.items()},
        blobs={},
        moments=tt.counters.reward_moments,
    )
    try:
        if ahead is not None and _same_job(ahead[0], job):
            values, _, dropped, failed, shaping = ahead[1]
        else:
            values, _, dropped, failed, shaping = compute(job)
    except Exception:  # the worker tries again, and fails only a group that fails on its own
        return None
    if failed:
        return None
    return values, set(dropped), shaping


def compute_ahead(config: TableConfig, entries: Sequence[Entry], compute: Compute) -> Ahead | None:
    """The advantages of the groups a push of `entries` is expected to complete, computed
    before its transaction, on the caller's thread, so that the writer only stores them: the
    groups of the push that fill their size (every group of it where the size is 0), less
    those the zero-variance filter would drop. compute_in_push uses the result only where the
    push completes exactly these groups with exactly these members (no duplicates, no members
    pushed before) and computes in the transaction otherwise. None where nothing is expected,
    or where a running reward normalisation needs the table's moments as the transaction
    finds them."""
    if config.advantages.shaping.reward_running_norm:
        return None
    members: dict[str, dict[str, Entry]] = {}
    for entry in entries:
        members.setdefault(entry.group_key(config.grouping.by), {}).setdefault(entry.uid, entry)
    size = config.grouping.size
    complete = {
        gkey: group
        for gkey, group in members.items()
        if (size == 0 or len(group) == size)
        and not (config.grouping.drop_zero_variance and zero_variance([e.reward for e in group.values()]))
    }
    if not complete or sum(map(len, complete.values())) > IN_PUSH_LIMIT:
        return None
    job = ComputeJob(
        table=config.name,
        config=config,
        groups=list(complete),
        members=[list(group) for group in complete.values()],
        # what an estimator reads of each record, before the record exists
        records={
            uid: e.record(gkey, seq=0, created=0.0) for gkey, group in complete.items() for uid, e in group.items()
        },
        blobs={},
    )
    try:
        return job, compute(job)
    except Exception:  # computed again in the transaction, and left to the worker if it fails there
        return None


def _same_job(ahead: ComputeJob, job: ComputeJob) -> bool:
    """Whether a job computed ahead is this one: the same table settings, groups and members
    (the members' records come from the same entries: a uid pushed before is no member)."""
    return ahead.groups == job.groups and ahead.members == job.members and ahead.config == job.config


def add_shaping(tt: TableState, shaping: ShapingUpdate) -> None:
    tt.counters.add_counts(shaping.counts)
    tt.counters.reward_moments = shaping.moments


def drop_below_threshold(tt: TableState, groups: Groups) -> None:
    """Drop the groups whose rewards' spread is below the estimator's threshold, together."""
    if groups:
        retire(tt, groups, DROPPED)
        tt.counters.groups_dropped += len(groups)
        tt.counters.dropped_std_threshold += len(groups)
