"""The trainer's policy version of a table, and eviction of the ready groups it leaves stale.

The version only moves forward. A report lower than the stored version keeps the stored
one (the reply says which is stored): a trainer restarted from a checkpoint goes on, its
rollouts judged against the newest weights the job reached. Only an admin's reset
(`reset`: the ResetOffPolicy RPC, `expbuf table reset-offpolicy`) sets it back. With
`evict_stale`, a report may move the version at most to the newest model version pushed
(or the stored version, if higher) + max_staleness + 1: a trainer can have trained only on
groups at most max_staleness behind it, and it reports one more after its step. A larger
jump, which would evict groups no trainer could yet have passed (a token sending 2**63-1
would evict them all), is refused, naming the reset that sets any version.

With `evict_stale`, a ready group whose lowest model version fell below trainer version -
max_staleness leaves the buffer (max_token_staleness where it is lower and on_token_stale is
"drop": an experience's version is its oldest token's) as dropped (reason `stale`): the trainer would never take
it. The version index (`byver`, core/ordering/indexes.py) orders ready groups by their lowest version,
so the stale ones are the front of the table's part of it, read up to the bound and never
past it: the cost is that of the stale groups found, whatever fresh data the table holds.
Each pass takes at most `limit` groups, so one write never grows without bound; the store's
upkeep takes the rest on its next passes. The eviction is a table extension (`StaleEviction`,
extensions.py): it runs when the version moves and at each upkeep.
"""

from __future__ import annotations

from typing import overload

from expbuf.client.trxp.codec import segments

from ..core.table_state.events import TableExtension
from ..core.table_state.state import TableState
from ..core.verbs.retire import retire
from ..core.verbs.rows import moves as row_moves
from ..schema.errors import VersionJump
from ..schema.states import DROPPED, READY
from ..schema.table_config import TableConfig
from ..schema.views import MemberView

# Stale groups evicted per table in one pass (one write transaction).
EVICT_LIMIT = 10_000


def ceiling(tt: TableState) -> int | None:
    """The highest version a report may set; None when any may be set (no evict_stale, or a
    table that has neither a version nor versioned data yet, so nothing to evict)."""
    cfg, counters = tt.config, tt.counters
    lag = cfg.staleness.experience_bound
    if not cfg.staleness.evict_stale or lag is None:
        return None
    known = [v for v in (counters.trainer_version, counters.max_version) if v is not None]
    return max(known) + lag + 1 if known else None


def next_version(tt: TableState, reported: int | None) -> int | None:
    """The version a trainer's report stores; None when it stores nothing (no report, or
    not above the stored version). Refuses a jump past the ceiling."""
    stored = tt.counters.trainer_version
    if reported is None or (stored is not None and reported <= stored):
        return None
    top = ceiling(tt)
    if top is not None and reported > top:
        cfg = tt.config
        raise VersionJump(
            f"table '{cfg.name}': trainer version {reported} jumps past {top}, the newest model version pushed "
            f"({tt.counters.max_version}) or the stored trainer version ({stored}), whichever is higher, + "
            f"max_staleness {cfg.staleness.experience_bound} + 1; with evict_stale it would evict groups no trainer "
            f"could have passed. An admin sets any version with "
            f"`expbuf table reset-offpolicy {cfg.name} --version {reported}`"
        )
    return reported


@overload
def report(tt: TableState, reported: int) -> int: ...  # a version was reported: one is stored
@overload
def report(tt: TableState, reported: int | None) -> int | None: ...
def report(tt: TableState, reported: int | None) -> int | None:
    """Store a trainer's report (see next_version); the table's extensions hear of a move
    (with evict_stale, a first bounded batch of the groups that fell stale is dropped).
    Returns the stored version."""
    version = next_version(tt, reported)
    if version is not None:
        tt.counters.trainer_version = version
        tt.save()
        tt.extensions.on_version(tt)
    return tt.counters.trainer_version


def reset(tt: TableState, version: int | None) -> None:
    """An admin sets the version to any value, or to none (None), backwards too."""
    tt.counters.trainer_version = version
    tt.save()
    tt.extensions.on_version(tt)


def stale_bound(tt: TableState) -> int | None:
    """The lowest version a ready group may have; None when the table evicts nothing."""
    cfg, version = tt.config, tt.counters.trainer_version
    lag = cfg.staleness.experience_bound
    if not cfg.staleness.evict_stale or lag is None or version is None:
        return None
    return version - lag


def evict_stale(tt: TableState, limit: int = EVICT_LIMIT) -> int:
    """Drop up to `limit` ready groups below the table's staleness bound; returns how many."""
    bound = stale_bound(tt)
    if bound is None:
        return 0
    stale = list(dict.fromkeys(tt.ready.below_version(bound, limit)))
    if tt.config.storage.layout == "rows":  # its groups leave their segments' runs (core/verbs/rows/moves.py)
        gone = row_moves.retire_ready(tt, stale, DROPPED) if stale else 0
    else:
        groups = [(gkey, grp) for gkey in stale if (grp := tt.view(gkey)) is not None and grp.state == READY]
        if groups:
            retire(tt, groups, DROPPED)
        gone = len(groups)
    tt.counters.groups_dropped += gone
    tt.counters.dropped_stale += gone
    if stale:
        tt.save()
    return len(stale)


class StaleEviction(TableExtension):
    """Drops the ready groups that fell below the staleness bound of a table with evict_stale:
    a first bounded batch when the trainer version moves, the rest at the upkeep's passes."""

    def on_version(self, tt: TableState) -> None:
        evict_stale(tt)

    def on_upkeep(self, tt: TableState) -> int:
        return evict_stale(tt)


def token_bound(config: TableConfig, trainer_version: int | None) -> int | None:
    """The oldest policy version whose tokens a delivery leaves in the action mask: the trainer's
    version less max_token_staleness, where on_token_stale is "mask"; None when none is masked."""
    lag = config.staleness.token_bound
    return None if lag is None or trainer_version is None else trainer_version - lag


def masked_tokens(rec: MemberView, bound: int) -> int:
    """How many of an experience's response tokens (a prefix: versions never decrease) its delivery
    masks out of the action mask: those of a policy older than `bound` (token_bound). Its version
    segments say each token's policy; an experience without them has its one version for all."""
    if rec.version is None:
        return 0
    return segments.stale_tokens(rec.segments or (rec.version, 0), rec.response_length, bound)
