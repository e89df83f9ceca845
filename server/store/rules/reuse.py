"""Reuse under replay delivery, as Trinity-RFT's priority queue (its AsyncPriorityQueue) does it.

A table with a `priority_decay` or a `reuse_cooldown_seconds` treats a replayed group as
Trinity treats an item it reads: its priority becomes its members' priority less
`priority_decay` per delivery (Trinity's linear_decay, `model_version - decay * use_count`,
the use count being the durable `times_sampled` of its members), it joins the back of the
groups of equal priority (Trinity appends a returned item), and it is out of reach for
`reuse_cooldown_seconds` (Trinity's `reuse_cooldown_time`), until `max_times_sampled`
retires it (Trinity's `use_count_limit`). With `priority_noise`, a Gaussian of that standard
deviation is added to each lowered priority (Trinity's `sigma`).

A cooling group is leased to no one (state leased, no lease) and has a row in the `cooling`
index, T + the time it is ready again + group key. The table's next take makes the groups
whose time has come ready again, in that order, so a reader waiting for them gets them at
its next attempt; until then the table's counts show them as leased.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..core.retire import retire
from ..core.state import TableState
from ..disk import layout
from ..disk.layout import put_rows
from ..disk.records import GroupRecord, ItemRecord
from ..schema.states import CONSUMED, LEASED, READY
from ..schema.table_config import TableConfig

Taken = tuple[str, GroupRecord, dict[str, ItemRecord]]


def reuses(config: TableConfig) -> bool:
    """Whether a replayed group is lowered and moved (else it stays where it is)."""
    return config.reuse.priority_decay > 0 or config.reuse.cooldown_seconds > 0


def requeue(tt: TableState, groups: Sequence[Taken], rng: random.Random) -> None:
    """Groups replayed just now (and not spent): lowered by their deliveries, then back in
    the ready order at once, or after the cooldown."""
    config = tt.config
    if not groups or not reuses(config):
        return
    before = [(gkey.encode(), grp.ready_seq, grp.priority, grp.version) for gkey, grp, _ in groups]
    for _, grp, recs in groups:
        uses = max(rec.times_sampled for rec in recs.values())
        grp.priority = max(rec.priority for rec in recs.values()) - config.reuse.priority_decay * uses
        if config.reuse.priority_noise:
            grp.priority += rng.gauss(0.0, config.reuse.priority_noise)
    cooldown = config.reuse.cooldown_seconds
    if cooldown <= 0:  # a priority change of ready groups, for every order's index
        tt.ready.move_many(before, _ready_again(tt, groups))
        return
    tt.ready.remove_many(before)
    tt.set_states(groups, LEASED)
    until = layout.micros(tt.now + cooldown)
    put_rows(tt.txn, tt.db["cooling"], sorted((tt.prefix + until + gkey.encode(), b"") for gkey, _, _ in groups))


def warm(tt: TableState) -> int:
    """Cooling groups whose cooldown has ended become ready again; returns how many. Rows of
    groups deleted or retired meanwhile are dropped."""
    if tt.config.reuse.cooldown_seconds <= 0:  # nothing of this table ever cools
        return 0
    due = []
    cutoff = layout.micros(tt.now)
    with tt.txn.cursor(db=tt.db["cooling"]) as cur:
        found = cur.set_range(tt.prefix)
        while found and cur.key().startswith(tt.prefix) and cur.key()[4:12] <= cutoff:
            due.append(bytes(cur.key()))
            found = cur.delete()
    back = []
    for key in due:
        gkey = key[12:].decode()
        grp = tt.group(gkey)
        if grp is not None and grp.state == LEASED and not grp.lease:
            back.append((gkey, grp, tt.members(grp)))
    if back:
        tt.set_states(back, READY)
        tt.ready.add_many(_ready_again(tt, back))
        tt.save()
    return len(back)


def _ready_again(tt: TableState, groups: Sequence[Taken]) -> list[tuple[bytes, int, float, int | None]]:
    """A new place in the ready order, behind every group there; returns the groups' rows for
    the ready indexes."""
    rows = []
    for gkey, grp, _ in groups:
        grp.rseq = tt.counters.next_rseq
        tt.counters.next_rseq += 1
        tt.put_group(gkey, grp)
        rows.append((gkey.encode(), grp.ready_seq, grp.priority, grp.version))
    return rows


def replayed(tt: TableState, taken: list[Taken], rng: random.Random) -> None:
    """Groups replayed just now, their members' deliveries counted: those that reached
    max_times_sampled retire, the others stay ready, lowered and cooled (`requeue`)."""
    limit = tt.config.reuse.max_times_sampled
    spent = {gkey for gkey, _, recs in taken if limit and max(r.times_sampled for r in recs.values()) >= limit}
    retire(tt, [(gkey, grp) for gkey, grp, _ in taken if gkey in spent], CONSUMED)
    requeue(tt, [group for group in taken if group[0] not in spent], rng)
