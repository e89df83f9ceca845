"""A rows table's leases of runs (issue 64, 2.4): a batch's groups held under a lease (`RowLease`:
the runs of the groups it holds), then consumed as it ends, or given back, each in a run of its own
range (the runs cover the ready groups exactly) and to the indexes the table keeps at its place (its
segment's id plus its index there).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ....disk.layout import put_rows
from ....disk.records import Counted
from ....disk.rows import RowLease, RunRow
from ....schema.states import CONSUMED, LEASED, READY
from ....schema.views import Members
from ...table_state import rate_counts
from ...table_state.events import Moved
from ...table_state.picks import Picked, Picks, Views, ascending, moved_view, picks, views
from ...table_state.state import TableState
from .moves import count_moved, mark, retire
from .select import NO_LEASE, Segments, placed, run_key, taken


def hold(tt: TableState, segments: Segments, picked: Sequence[Picked], lease_id: str) -> list[tuple[int, int, int]]:
    """Picked groups (ready, out of their runs) leased under `lease_id` (to no one where it is "": a
    cooling group, requeue.py): their state bytes and lease tags; returns the lease's runs
    (segment, first group, groups)."""
    mark(segments, picked, LEASED, bytes.fromhex(lease_id) if lease_id else NO_LEASE)
    count_moved(tt, LEASED, picked)
    segments.save()
    if tt.extensions.hears("on_moved"):
        tt.extensions.on_moved(tt, Moved(READY, LEASED, views(picked, LEASED, lease_id)))
    return _lease_runs(picked)


def _lease_runs(picked: Sequence[Picked]) -> list[tuple[int, int, int]]:
    """Picked groups as runs (segment, first group, groups) of consecutive ones, in the order picked,
    as a records table's lease names its groups: a lease's rank parts are read in the batch's order
    (reading.lease_groups; the client's batch.rank_parts splits the batch so), and a table that
    reuses requeues a held batch's replayed groups in the order they were taken (requeue.py). A
    lifo or priority take that reaches groups out of their places' order keeps a run for each."""
    runs: list[tuple[int, int, int]] = []
    for run in Picks.of(picked).runs:
        # consecutive places ascending (a fifo take's) are one stretch, others a stretch a group
        stretches = [(run.places[0], len(run.places))] if ascending(run.places) else [(g, 1) for g in run.places]
        for g, count in stretches:
            seg, first, n = runs[-1] if runs else (-1, 0, 0)
            if seg == run.seg and first + n == g:  # it goes on from the run before
                runs[-1] = (seg, first, n + count)
            else:
                runs.append((run.seg, g, count))
    return runs


def lease_row(
    table_id: int, runs: Sequence[tuple[int, int, int]], expires: float | None, owner: str, counted: Counted | None
) -> bytes:
    """The value of a lease of runs; one `counted` is held, its count deferred to its confirmation."""
    row_runs = [RunRow(*run) for run in runs]
    deferred = counted is not None
    return RowLease(
        table_id=table_id, runs=row_runs, expires=expires, owner=owner, counted=counted, deferred=deferred
    ).encode()


def leased(tt: TableState, segments: Segments, lease_id: str, lease: RowLease, *, ending: bool = False) -> Picks:
    """The groups still under a lease of runs (one consumed or given back meanwhile is not); with
    `ending`, their views say they left it (as an ack's consume hears them)."""
    tag, lease_tag = bytes.fromhex(lease_id), "" if ending else lease_id
    under: dict[int, range | list[int]] = {}  # by segment, each read once (a run whole: its range)
    for run in lease.runs:
        state = segments.found_readable(run.seg)
        if state is None:  # its groups left the lease and retired, and it was forgotten; or damage
            continue
        places, before = state.under(run.first, run.first + run.length, LEASED, tag), under.get(run.seg)
        under[run.seg] = places if before is None else [*before, *places]
    found = Picks.joined(
        picks(segments.view(seg), segments.state(seg), seg, places, LEASED, lease_tag) for seg, places in under.items()
    )
    if all(a < b for a, b in itertools.pairwise(lease.runs)):  # runs in the ready order: so are the groups found
        return found
    at = {(p.seg, p.at): p for p in found}  # in the runs' order (a reusing table's: the take's, _lease_runs)
    return Picks.of(
        [at[run.seg, g] for run in lease.runs for g in range(run.first, run.first + run.length) if (run.seg, g) in at]
    )


def held(tt: TableState, lease_id: str, lease: RowLease) -> int:
    """The experiences still under a lease of runs."""
    return leased(tt, Segments(tt), lease_id, lease).members()


def end(tt: TableState, lease_id: str, lease: RowLease, *, requeue: bool, unsent: bool) -> int:
    """A lease of runs ends: its groups consumed, or back to ready (`requeue`), counted as sampled
    unless `unsent` (a batch held for a stream that never sent it: it leaves the rate limiter's
    count, and the table's counters where its take counted it: `RowLease.deferred`); returns the
    experiences."""
    segments = Segments(tt)
    picked = leased(tt, segments, lease_id, lease, ending=not requeue)
    count = picked.members()
    if not requeue:  # the groups leave their lease, then the table
        retire(tt, segments, picked, CONSUMED)
        return count
    if unsent and not lease.deferred:  # a hold of a release that counted it at the take
        counted = lease.counted or Counted(count, sum(picked.spans().column("size")), 0)
        tt.counters.sampled -= counted.experiences
        tt.counters.bytes_sampled -= counted.nbytes
        tt.counters.tokens_masked -= counted.tokens_masked
    if unsent:
        rate_counts.given_back(tt, count)
    back(tt, segments, picked, sampled=not unsent)
    return count


def replayed_back(tt: TableState, lease_id: str, lease: RowLease) -> list[Members]:
    """A held replay batch its client confirmed: its groups still under the lease are ready again,
    their deliveries counted; returns them, counted, for reuse to retire the spent."""
    segments = Segments(tt)
    picked = leased(tt, segments, lease_id, lease)
    back(tt, segments, picked, sampled=True)
    return taken([p.moved(READY, lease="", times=p.times + 1) for p in picked])


def back(tt: TableState, segments: Segments, picked: Sequence[Picked], *, sampled: bool) -> None:
    """Leased groups are ready again, each in a run of its own range (their deliveries counted where
    `sampled`)."""
    picked = Picks.of(picked)
    mark(segments, picked, READY, NO_LEASE)
    if sampled:
        for run in picked.runs:
            row = segments.state(run.seg)
            for g, times in zip(run.places, run.times, strict=True):
                row.set_times(g, times + 1)
    count_moved(tt, READY, picked)
    segments.save()
    rows = [(run_key(tt, seg, first), RunRow(seg, first, n).encode()) for seg, first, n in _lease_runs(picked)]
    put_rows(tt.txn, tt.db["runs"], sorted(rows))
    if picked and tt.ready.indexing():
        tt.ready.add_many(placed(picked))
    if picked and tt.extensions.hears("on_moved"):  # a lease whose every group was deleted moves none
        groups = Views(picked, lambda p: moved_view(p, READY, times=p.times + sampled))
        tt.extensions.on_moved(tt, Moved(LEASED, READY, groups))
