"""Rate limits between inserts and samples, as Reverb's rate limiters set them.

A table may hold samples back until `min_size_to_sample` experiences were inserted, and
keep the experiences sampled per experience inserted near `samples_per_insert`: with
diff = inserts * samples_per_insert - samples, an insert waits while it would push diff
above spi * min_size + error, a sample while it would pull diff below spi * min_size -
error (error = `samples_per_insert_error`). Inserts and samples are the table's `pushed`
and `sampled` counters, so the limiter's state is durable and survives a restart.

Batches move diff by more than one: a batch that cannot fit inside the band passes when
diff is on its side of the band's centre (the other side is then free to move), so
neither side can hold the other for good, and the band is left by at most one batch.
A request held by a limit waits on the store's change condition up to its deadline,
then fails with a message that names the limit.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import StoreError
from .groups import TableTxn
from .types import Entry


class InsertLimited(StoreError):
    """An insert held by the rate limit until its deadline."""

    code = "resource_exhausted"


class SampleLimited(StoreError):
    """A sample held by the rate limit until its deadline."""

    code = "deadline_exceeded"


def _diff(tt: TableTxn) -> tuple[float, float]:
    """diff and the band's centre."""
    cfg = tt.config
    spi = cfg.samples_per_insert
    return tt.counters["pushed"] * spi - tt.counters["sampled"], spi * cfg.min_size_to_sample


def insert_limit(tt: TableTxn, entries: Sequence[Entry]) -> InsertLimited | None:
    """Why inserting the entries not stored yet (a retried push's are) must wait now; None
    when they may go."""
    cfg = tt.config
    if not cfg.samples_per_insert:
        return None
    count = len({e.uid for e in entries if tt.item(e.uid) is None})
    if not count:
        return None
    diff, centre = _diff(tt)
    if diff + count * cfg.samples_per_insert <= centre + cfg.samples_per_insert_error or diff <= centre:
        return None
    return InsertLimited(
        f"table '{cfg.name}': samples_per_insert {cfg.samples_per_insert:g} (error "
        f"{cfg.samples_per_insert_error:g}) holds inserts until more is sampled: {tt.counters['pushed']} "
        f"inserted, {tt.counters['sampled']} sampled"
    )


def sample_limit(tt: TableTxn, count: int) -> SampleLimited | None:
    """Why sampling `count` experiences must wait now; None when it may go."""
    cfg = tt.config
    inserted = tt.counters["pushed"]
    if inserted < cfg.min_size_to_sample:
        return SampleLimited(
            f"table '{cfg.name}': min_size_to_sample {cfg.min_size_to_sample} holds samples; "
            f"{inserted} experiences were inserted"
        )
    if not cfg.samples_per_insert:
        return None
    diff, centre = _diff(tt)
    if diff - count >= centre - cfg.samples_per_insert_error or diff >= centre:
        return None
    return SampleLimited(
        f"table '{cfg.name}': samples_per_insert {cfg.samples_per_insert:g} (error "
        f"{cfg.samples_per_insert_error:g}) holds samples until more is inserted: {inserted} inserted, "
        f"{tt.counters['sampled']} sampled"
    )
