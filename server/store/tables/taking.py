"""Taking a batch of whole ready groups.

A batch is chosen in the request's order, whole groups only, optionally only groups
whose every member is at least `min_model_version` (found through the version index of
core/ordering/indexes.py, so stale groups in front cost nothing). It is delivered by consuming it
(payloads deleted in the same transaction), leasing it (invisible until acked; back on
nack or expiry), or replaying it (counted against max_times_sampled, lowered and cooled by
reuse.py). A Sample stream's batch is first held, whatever its delivery: leased without
expiry, invisible to others, until the client confirms it has the batch. A lease's life,
granted with the batch, is leases.py's.
"""

from __future__ import annotations

import functools
import logging
import random
import secrets
from collections.abc import Callable

from ..core.table_state import picks, rate_counts
from ..core.table_state.events import Taken
from ..core.table_state.read_check import Unservable
from ..core.table_state.state import TableState
from ..core.verbs import requeue
from ..core.verbs.retire import retire
from ..core.verbs.rows import leases as row_leases
from ..core.verbs.rows import moves as row_moves
from ..core.verbs.rows import requeue as row_requeue
from ..core.verbs.rows import select as row_select
from ..core.verbs.take import Payloads, lease, read_batch, read_rows, select
from ..core.whole_table.reading import batch_rows
from ..disk.kinds import Sampled
from ..disk.records import Counted
from ..disk.snapshot import Snapshot
from ..disk.stored_advantages import FinishBatch, StageCounts
from ..rules import reuse
from ..rules.capacity import inserts_wait_for_samples, samples_wait_for_nothing
from ..rules.limiter import sample_limit
from ..rules.quarantine import counted, fail_lost_groups, quarantine_groups, quarantine_lost
from ..rules.staleness import evict_stale, masked_tokens, report, token_bound
from ..schema.errors import SampleLimited
from ..schema.sample_spec import TakeSpec
from ..schema.states import CONSUMED, FAILED, LEASED
from ..schema.views import Groups, GroupView

log = logging.getLogger("expbuf.store")


def could_fill(tt: TableState, spec: TakeSpec, allow_partial: bool) -> bool:
    """Whether the table holds enough ready data for the request at all (whatever its
    versions): when not, no batch can be taken and nothing needs to be tried."""
    groups, experiences = tt.counters.groups_ready, tt.counters.ready
    if allow_partial:
        return groups > 0
    return spec.enough(groups, experiences)


def warm(tt: TableState) -> int:
    """Replayed groups whose cooldown has ended become ready again (core/verbs/requeue.py; a rows
    table's, which loses no records, row_requeue.py); returns how many. One with a member whose
    record is lost fails first, as a lease putting it back fails it (the quarantine rule), since it
    can never be served whole again."""
    if tt.config.storage.layout == "rows":
        back = row_requeue.warm(tt)
        if not back:
            return 0
    else:
        cooled = requeue.cooled(tt)
        if not cooled:
            return 0
        quarantine_lost(tt, cooled)
        back = requeue.warm(tt, cooled)
    tt.save()
    return back


def take(
    tt: TableState,
    spec: TakeSpec,
    allow_partial: bool,
    rng: random.Random,
    *,
    hold: bool,
    snapshot: Callable[[], Snapshot] | None = None,
    finish: FinishBatch | None = None,
    counts: StageCounts | None = None,
) -> Sampled | SampleLimited | None:
    """Select and deliver one batch; None if there is not enough (and no partial batch),
    the rate limit (limiter.py) if it holds the batch back. The request's trainer version
    is stored first (staleness.py); the caller undoes it when no batch is taken. With
    `snapshot` (a way to open one), the payloads are views read from it, not copies (see
    core/verbs/take.Payloads). The batch carries its stored advantages; a table's batch stage is left to
    run where the reply is built (`Sampled.stage`: `finish`, the server's, its clip counted in
    `counts`)."""
    # groups ready again below the bound since it moved (a lease nacked or expired, a group that a
    # late member completed) go before the upkeep's next pass would take them: none is served
    evict_stale(tt)
    report(tt, spec.trainer_version)  # before selection: a stale group is not taken in the same step
    payloads = Payloads(tt, snapshot, defer=hold)
    segments = row_select.Segments(tt) if tt.config.storage.layout == "rows" else None
    picked = picks.Picks()
    while True:
        chosen: Groups
        if segments is not None:  # a rows table's runs: it loses no records
            picked, total = row_select.select(tt, spec, segments, rng)
            chosen = picks.as_they_are(picked)
            lost: list[str] = []
        else:
            chosen, total, lost = select(tt, spec, rng)
        if lost:  # passed over: failed now, whether or not the groups chosen make a batch
            fail_lost_groups(tt, lost)
            tt.save()
        enough = spec.enough(len(chosen), total)
        if not chosen or not (enough or allow_partial):
            return None
        held = sample_limit(tt, total, samples_wait_for_nothing(tt))
        if held is not None and not inserts_wait_for_samples(tt):
            return held
        if segments is not None:  # its members' columns read a range at a time
            spans = picked.spans()
            gkeys = spans.per_member(picked.gkeys())  # each member's group
            keys = spans.keys(tt.prefix)  # their payloads'
            unservable = _unservable_rows(payloads, picked, keys, gkeys)
        else:
            taken = [(gkey, grp, tt.stored_members(grp)) for gkey, grp in chosen]
            unservable = [(gkey, grp, problems) for gkey, grp, recs in taken if (problems := payloads.check(grp, recs))]
        if not unservable:
            break
        _fail_unservable(tt, unservable, None if segments is None else (segments, picked))  # then choose again
        tt.save()  # the failure stands whether or not the groups left make a batch
    batch = Sampled(uids=[], group_ids=[], blobs=[], partial=not enough)
    delivery = "lease" if hold else spec.delivery
    if delivery == "lease":  # its record is the lease's life's to write (leases.py: TableLeases.grant)
        batch.lease_id = secrets.token_hex(8)
        batch.lease_expires = tt.now + spec.lease_seconds  # a held one's, were it confirmed as it is sent
    rows = batch_rows(tt.txn, tt.db, tt.config, finish)
    bound = token_bound(tt.config, tt.counters.trainer_version)
    masked = None if bound is None else functools.partial(masked_tokens, bound=bound)
    # a leased one's delivery is counted in its record when the lease ends (leases.py); a rows
    # table's consumed group keeps no count
    if segments is not None:
        read_rows(picked, keys, gkeys, payloads, rows, batch, masked=masked)
    else:
        read_batch(tt, taken, payloads, rows, batch, counted=delivery != "lease", masked=masked)
    batch.blobs, batch.advantages, batch.stage = rows.blobs, rows.advantages, rows.stage(counts)
    batch.counted = Counted(len(batch.uids), rows.nbytes, sum(batch.masked))
    if segments is not None and delivery == "replay":  # the groups stay ready, in their runs
        picked, chosen = row_moves.replayed(segments, picked, tt.config.reuse.max_times_sampled)
        reuse.replayed(tt, row_select.taken(picked), rng)
    elif segments is not None:
        row_moves.unready(tt, picked)
        if delivery == "consume":
            picked = row_moves.counted(segments, picked)
            row_moves.retire(tt, segments, picked, CONSUMED)
            chosen = picks.views(picked, CONSUMED)
        else:
            batch.lease_runs = row_leases.hold(tt, segments, picked, batch.lease_id)
            chosen = picks.views(picked, LEASED, batch.lease_id)
    elif delivery == "consume":
        retire(tt, chosen, CONSUMED)
    elif delivery == "replay":
        reuse.replayed(tt, taken, rng)
    elif delivery == "lease":
        lease(tt, chosen, taken, batch.lease_id)
    if not hold:  # a batch held for a stream counts once its client has it (leases.delivered)
        tt.counters.sampled += batch.counted.experiences
        tt.counters.bytes_sampled += batch.counted.nbytes
        tt.counters.tokens_masked += batch.counted.tokens_masked
    rate_counts.taken(tt, batch.counted.experiences)
    batch.newest_version = tt.counters.max_version
    batch.trainer_version = tt.counters.trainer_version
    tt.extensions.on_taken(tt, Taken(chosen, delivery))
    tt.save()
    if payloads.snapshot is not None:
        batch.snapshot = payloads.snapshot
        payloads.snapshot.hold(batch.blobs)
        payloads.snapshot.unpin()
    return batch


def _unservable_rows(
    payloads: Payloads, picked: picks.Picks, keys: list[bytes], gkeys: list[str]
) -> list[tuple[str, GroupView, list[Unservable]]]:
    """A rows table's picked groups a member of which cannot be served, with why (Payloads.check),
    their members' payloads (at `keys`) read and checked from their columns."""
    spans = picked.spans()
    seqs, digests, sizes, advantages = (spans.column(name) for name in ("seq", "digest", "size", "advantage"))
    found = payloads.check_columns(spans.column("uid"), keys, seqs, digests, sizes, advantages)
    if not found:
        return []
    problems: dict[str, list[Unservable]] = {}
    for at, problem in found:
        problems.setdefault(gkeys[at], []).append(problem)
    return [(p.gkey, p.group, problems[p.gkey]) for p in picked if p.gkey in problems]


def _fail_unservable(
    tt: TableState,
    groups: list[tuple[str, GroupView, list[Unservable]]],
    rows: tuple[row_select.Segments, picks.Picks] | None,
) -> None:
    """Groups a sample found a member of unservable fail whole, never served: one with a
    damaged payload by the quarantine rule (quarantine.py: the damaged members quarantined, the
    others' payloads kept for Get); one whose stored advantage is beyond float32 as any failed
    group (its payloads kept where the table keeps failed groups). A rows table's (`rows`: the
    sample's segments and picked groups) move in one step, through the segments the sample holds."""
    damaged, beyond = [], []
    for gkey, grp, problems in groups:
        found = {problem.uid: problem.why for problem in problems if problem.damaged}
        for problem in problems:
            if not problem.damaged:
                log.error(
                    "table %s: group %s failed when sampled, never to be served: %s", tt.config.name, gkey, problem
                )
        if found:
            damaged.append((gkey, grp, found))
        else:
            beyond.append((gkey, grp))
            tt.counters.groups_failed += 1
            tt.counters.last_failure = f"group {gkey}: {problems[0]}"
    if rows is not None:
        segments, picked = rows
        quarantined = counted(tt, damaged)
        failing = {gkey for gkey, _, _ in groups}
        failed = [p for p in picked if p.gkey in failing]
        row_moves.unready(tt, failed)
        row_moves.retire(tt, segments, failed, FAILED, quarantined)
        return
    if damaged:
        quarantine_groups(tt, damaged)
    if beyond:
        retire(tt, beyond, FAILED)
