"""The rate limiter's counts (rules/limiter.py sets its limits from them): only what can still be
sampled, in two durable counters of their own (rate_inserted, rate_sampled), changed in the
transaction of what changes them and only here:
- an experience counts as inserted when its group becomes ready (a pending or computing
  one may never be sampled);
- each experience taken counts as sampled; one held for a stream and never sent comes back;
- an experience that leaves while counted (ready or leased) other than by being consumed
  (evicted, dropped as stale, deleted) is forgotten: out of inserted, and its samples out
  of sampled. So a drop, an eviction, a failure or a timeout never leaves owed samples
  behind that nothing could take, and neither side can hold the other for good.
A table whose counters an older build wrote (which counted every push) is counted again
when the store opens (`recount`): its live ready and leased experiences as they are, the
ones gone as sampled in full.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import lmdb

from ...disk.records import ItemRecord
from ...schema.states import LEASED, READY
from ...schema.views import GroupView, MemberView
from .counters import stored_names
from .state import TableState

# The limiter's counters by their names in the stored counters.
INSERTED, SAMPLED = "rate_inserted", "rate_sampled"
COUNTED = (READY, LEASED)  # the states of experiences the limiter counts


def became_ready(tt: TableState, count: int) -> None:
    """`count` experiences of a group that just became ready (never a requeued one)."""
    tt.counters.rate_inserted += count


def taken(tt: TableState, count: int) -> None:
    tt.counters.rate_sampled += count


def given_back(tt: TableState, count: int) -> None:
    """Experiences held for a stream that never sent them: not sampled after all."""
    tt.counters.rate_sampled -= count


def forget(tt: TableState, group: GroupView, records: Iterable[MemberView]) -> None:
    """Experiences of `group` leaving other than by consumption, with their state before they
    leave: the counted ones (ready, leased) are out of the count, their samples with them, and
    the sample of a lease the group is under, which `taken` counted but their records do not yet
    (core/verbs/leases.py counts it when the lease ends, for the members it still finds)."""
    leased = group.under_lease
    for rec in records:
        if rec.state in COUNTED:
            tt.counters.rate_inserted -= 1
            tt.counters.rate_sampled -= rec.times_sampled + leased


def counted_before(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes) -> bool:
    """Whether a table's stored counters (at its `prefix`) are of an older build, which counted
    every push: `recount` is due."""
    stored = stored_names(txn, dbs, prefix)
    return stored is not None and INSERTED not in stored


def recount(tt: TableState) -> bool:
    """Count a table whose stored counters an older build wrote; False when they are this
    build's (or the table has none yet). Ready and leased experiences count as they are; the
    others pushed and gone (consumed, dropped, evicted...) count as inserted and sampled in
    full, so they hold neither side."""
    if not counted_before(tt.txn, tt.db, tt.prefix):
        return False
    live, samples = 0, 0
    with tt.txn.cursor(db=tt.db["items"]) as cur:
        found = cur.set_range(tt.prefix)
        while found and cur.key().startswith(tt.prefix):
            rec = ItemRecord.decode(cur.value())
            if rec.state in COUNTED:
                live += 1
                samples += rec.times_sampled
            found = cur.next()
    gone = max(0, tt.counters.pushed - tt.counters.pending - tt.counters.computing - live)
    tt.counters.rate_inserted = live + gone
    tt.counters.rate_sampled = samples + gone * tt.config.rate_limiter.samples_per_insert
    tt.save()
    return True
