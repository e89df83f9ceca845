"""Rate limits between inserts and samples, as Reverb's rate limiters set them.

A table may hold samples back until `min_size_to_sample` experiences were inserted (or it holds
all it can hold at once: capacity_bytes may hold fewer, evicting as more come, and the band below
is then centred on what it holds), and
keep the experiences sampled per experience inserted near `samples_per_insert`: with
diff = inserted * samples_per_insert - sampled, an insert waits while it would push diff
above spi * min_size + error, a sample while it would pull diff below spi * min_size -
error (error = `samples_per_insert_error`).

The limiter counts only what can still be sampled, in two durable counters of its own
(rate_inserted, rate_sampled), which the table core keeps as what they count changes
(core/table_state/rate_counts.py).

Batches move diff by more than one: a batch that cannot fit inside the band passes when
diff is on its side of the band's centre (the other side is then free to move), so the
band is left by at most one batch. A request held by a limit waits on the store's change
condition up to its deadline, then fails with a message that names the limit.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.table_state.state import TableState
from ..disk.kinds import Entry
from ..schema.errors import InsertLimited, SampleLimited

# ---- the limits ---------------------------------------------------------------------------


def _diff(tt: TableState, full: bool = False) -> tuple[float, float]:
    """diff and the band's centre; where the table holds all it can (`full`) and that is fewer than
    min_size_to_sample, the centre is on what it holds: on min_size_to_sample, diff could never
    come near it (samples held for good, in evict mode)."""
    cfg = tt.config
    spi, least = cfg.rate_limiter.samples_per_insert, cfg.rate_limiter.min_size_to_sample
    centre = spi * (min(least, tt.counters.live()) if full else least)
    return tt.counters.rate_inserted * spi - tt.counters.rate_sampled, centre


def insert_limit(tt: TableState, entries: Sequence[Entry]) -> InsertLimited | None:
    """Why inserting the entries not stored yet (a retried push's are) must wait now; None
    when they may go."""
    cfg = tt.config
    if not cfg.rate_limiter.samples_per_insert:
        return None
    count = len({e.uid for e in entries if tt.member(e.uid) is None})
    if not count:
        return None
    diff, centre = _diff(tt)
    if diff + count * cfg.rate_limiter.samples_per_insert <= centre + cfg.rate_limiter.error_buffer or diff <= centre:
        return None
    return InsertLimited(
        f"table '{cfg.name}': samples_per_insert {cfg.rate_limiter.samples_per_insert:g} (error "
        f"{cfg.rate_limiter.error_buffer:g}) holds inserts until more is sampled: {_counts(tt)}"
    )


def inserts_fit(tt: TableState, count: int) -> bool:
    """Whether `count` inserts keep diff inside the band, where `insert_limit` lets a batch pass that
    does not fit while diff is on its side of the centre."""
    spi = tt.config.rate_limiter.samples_per_insert
    if not spi:
        return True
    diff, centre = _diff(tt)
    return diff + count * spi <= centre + tt.config.rate_limiter.error_buffer


def sample_limit(tt: TableState, count: int, full: bool = False) -> SampleLimited | None:
    """Why sampling `count` experiences must wait now; None when it may go. `full`: the table holds
    all it can hold at once (capacity.samples_wait_for_nothing), which min_size_to_sample then holds no
    more."""
    cfg = tt.config
    inserted = tt.counters.rate_inserted
    if inserted < cfg.rate_limiter.min_size_to_sample and not full:
        return SampleLimited(
            f"table '{cfg.name}': min_size_to_sample {cfg.rate_limiter.min_size_to_sample} holds samples; "
            f"{inserted} experiences that can still be sampled were inserted"
        )
    if not cfg.rate_limiter.samples_per_insert:
        return None
    diff, centre = _diff(tt, full)
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
