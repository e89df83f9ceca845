"""Reuse under replay delivery, as Trinity-RFT's priority queue (its AsyncPriorityQueue) does it.

A table with a `priority_decay` or a `reuse_cooldown_seconds` treats a replayed group as
Trinity treats an item it reads: its priority becomes its members' priority less
`priority_decay` per delivery (Trinity's linear_decay, `model_version - decay * use_count`,
the use count being the durable `times_sampled` of its members), it joins the back of the
groups of equal priority (Trinity appends a returned item), and it is out of reach for
`reuse_cooldown_seconds` (Trinity's `reuse_cooldown_time`), until `max_times_sampled`
retires it (Trinity's `use_count_limit`). With `priority_noise`, a Gaussian of that standard
deviation is added to each lowered priority (Trinity's `sigma`).

A cooling group is leased to no one (state leased, no lease) until its time comes
(core/verbs/requeue.py keeps it; a rows table's group, core/verbs/rows/requeue.py): the table's next
take makes the groups whose time has come ready again, in that order, so a reader waiting for them
gets them at its next attempt; until then the table's counts show them as leased.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..core.table_state.state import TableState
from ..core.verbs import requeue as records
from ..core.verbs.retire import retire
from ..core.verbs.rows import moves as row_moves
from ..core.verbs.rows import requeue as row_requeue
from ..schema.states import CONSUMED
from ..schema.table_config import TableConfig
from ..schema.views import Members


def reuses(config: TableConfig) -> bool:
    """Whether a replayed group is lowered and moved (else it stays where it is)."""
    return config.reuse.priority_decay > 0 or config.reuse.cooldown_seconds > 0


def requeue(tt: TableState, groups: Sequence[Members], rng: random.Random) -> None:
    """Groups replayed just now (and not spent): lowered by their deliveries, then back in
    the ready order at once, or after the cooldown (core/verbs/requeue.py)."""
    config = tt.config
    if not groups or not reuses(config):
        return
    priorities = []
    for _, _, recs in groups:
        uses = max(rec.times_sampled for rec in recs.values())
        priority = max(rec.priority for rec in recs.values()) - config.reuse.priority_decay * uses
        if config.reuse.priority_noise:
            priority += rng.gauss(0.0, config.reuse.priority_noise)
        priorities.append(priority)
    cooldown = config.reuse.cooldown_seconds
    place = row_requeue.place if config.storage.layout == "rows" else records.place
    place(tt, groups, priorities, None if cooldown <= 0 else tt.now + cooldown)


def replayed(tt: TableState, taken: Sequence[Members], rng: random.Random) -> None:
    """Groups replayed just now, their members' deliveries counted: those that reached
    max_times_sampled retire, the others stay ready, lowered and cooled (`requeue`)."""
    limit = tt.config.reuse.max_times_sampled
    spent = {gkey for gkey, _, recs in taken if limit and max(r.times_sampled for r in recs.values()) >= limit}
    if tt.config.storage.layout == "rows":
        row_moves.retire_ready(tt, [gkey for gkey, _, _ in taken if gkey in spent], CONSUMED)
    else:
        retire(tt, [(gkey, grp) for gkey, grp, _ in taken if gkey in spent], CONSUMED)
    requeue(tt, [group for group in taken if group[0] not in spent], rng)
