"""Rate limits between inserts and samples, as Reverb's rate limiters set them.

A table may hold samples back until `min_size_to_sample` experiences were inserted, and
keep the experiences sampled per experience inserted near `samples_per_insert`: with
diff = inserted * samples_per_insert - sampled, an insert waits while it would push diff
above spi * min_size + error, a sample while it would pull diff below spi * min_size -
error (error = `samples_per_insert_error`).

The limiter counts only what can still be sampled, in two durable counters of its own
(rate_inserted, rate_sampled), changed in the transaction of what changes them and only here:
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

Batches move diff by more than one: a batch that cannot fit inside the band passes when
diff is on its side of the band's centre (the other side is then free to move), so the
band is left by at most one batch. A request held by a limit waits on the store's change
condition up to its deadline, then fails with a message that names the limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import lmdb

from ..core.counters import stored_names
from ..core.state import TableState
from ..disk.kinds import Entry
from ..disk.records import GroupRecord, ItemRecord
from ..schema.errors import InsertLimited, SampleLimited
from ..schema.states import LEASED, READY

# The limiter's counters by their names in the stored counters.
INSERTED, SAMPLED = "rate_inserted", "rate_sampled"
COUNTED = (READY, LEASED)  # the states of experiences the limiter counts


# ---- what moves the counters ------------------------------------------------------------


def became_ready(tt: TableState, count: int) -> None:
    """`count` experiences of a group that just became ready (never a requeued one)."""
    tt.counters.rate_inserted += count


def taken(tt: TableState, count: int) -> None:
    tt.counters.rate_sampled += count


def given_back(tt: TableState, count: int) -> None:
    """Experiences held for a stream that never sent them: not sampled after all."""
    tt.counters.rate_sampled -= count


def forget(tt: TableState, group: GroupRecord, records: Iterable[ItemRecord]) -> None:
    """Experiences of `group` leaving other than by consumption, with their state before they
    leave: the counted ones (ready, leased) are out of the count, their samples with them, and
    the sample of a lease the group is under, which `taken` counted but their records do not yet
    (leases.py counts it when the lease ends, for the members it still finds)."""
    leased = group.under_lease
    for rec in records:
        if rec.state in COUNTED:
            tt.counters.rate_inserted -= 1
            tt.counters.rate_sampled -= rec.times_sampled + leased


def counted_before(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes) -> bool:
    """Whether a table's stored counters (in `db`, at its `prefix`) are of an older build,
    which counted every push: `recount` is due."""
    stored = stored_names(txn, db, prefix)
    return stored is not None and INSERTED not in stored


def recount(tt: TableState) -> bool:
    """Count a table whose stored counters an older build wrote; False when they are this
    build's (or the table has none yet). Ready and leased experiences count as they are; the
    others pushed and gone (consumed, dropped, evicted...) count as inserted and sampled in
    full, so they hold neither side."""
    if not counted_before(tt.txn, tt.db["counters"], tt.prefix):
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


# ---- the limits ---------------------------------------------------------------------------


def _diff(tt: TableState) -> tuple[float, float]:
    """diff and the band's centre."""
    cfg = tt.config
    spi = cfg.rate_limiter.samples_per_insert
    return tt.counters.rate_inserted * spi - tt.counters.rate_sampled, spi * cfg.rate_limiter.min_size_to_sample


def insert_limit(tt: TableState, entries: Sequence[Entry]) -> InsertLimited | None:
    """Why inserting the entries not stored yet (a retried push's are) must wait now; None
    when they may go."""
    cfg = tt.config
    if not cfg.rate_limiter.samples_per_insert:
        return None
    count = len({e.uid for e in entries if tt.item(e.uid) is None})
    if not count:
        return None
    diff, centre = _diff(tt)
    if diff + count * cfg.rate_limiter.samples_per_insert <= centre + cfg.rate_limiter.error_buffer or diff <= centre:
        return None
    return InsertLimited(
        f"table '{cfg.name}': samples_per_insert {cfg.rate_limiter.samples_per_insert:g} (error "
        f"{cfg.rate_limiter.error_buffer:g}) holds inserts until more is sampled: {_counts(tt)}"
    )


def sample_limit(tt: TableState, count: int) -> SampleLimited | None:
    """Why sampling `count` experiences must wait now; None when it may go."""
    cfg = tt.config
    inserted = tt.counters.rate_inserted
    if inserted < cfg.rate_limiter.min_size_to_sample:
        return SampleLimited(
            f"table '{cfg.name}': min_size_to_sample {cfg.rate_limiter.min_size_to_sample} holds samples; "
            f"{inserted} experiences were inserted"
        )
    if not cfg.rate_limiter.samples_per_insert:
        return None
    diff, centre = _diff(tt)
    if diff - count >= centre - cfg.rate_limiter.error_buffer or diff >= centre:
        return None
    return SampleLimited(
        f"table '{cfg.name}': samples_per_insert {cfg.rate_limiter.samples_per_insert:g} (error "
        f"{cfg.rate_limiter.error_buffer:g}) holds samples until more is inserted: {_counts(tt)}"
    )


def _counts(tt: TableState) -> str:
    return (
        f"{tt.counters.rate_inserted:g} inserted, {tt.counters.rate_sampled:g} sampled (of what can still be sampled)"
    )
