"""The life of a group: its states, and every move allowed between them, in one table.

A group is pending while it takes members, computing while its advantages are computed (by
the worker; a push that computes them itself goes straight to ready), ready to be sampled,
and leased while a trainer holds it. It leaves the live states for a tombstone, and a
tombstone never moves again (a push of it is a duplicate until the tombstone is forgotten):

    pending --> computing --> ready <--> leased
       |            |           |  \\       |
       +------------+-----------+---+------+--> consumed | evicted | dropped | failed

- consumed: trained (a consume, an ack, a retire, a lease's last replay);
- evicted: a full table made room (`when_full = "evict"`), ready groups only;
- dropped: zero variance, a group timeout, staleness, below an estimator's threshold;
- failed: its estimator failed, or a sample found a member it cannot serve.

Quarantined is an experience's state only, never a group's: a member whose stored payload was
found damaged (quarantine.py) leaves as a quarantined tombstone, and its group fails.

A ready group moves back to computing only when an upgrade of the data directory recomputes
its stored advantages (migrate.py). Experiences share their group's state (a leased group's
members say ready in their own records: a lease rewrites no member record).

`MOVES` is the one table of what may follow what; `TableState.move_group`, which every move
of a group goes through, checks it. A move outside it is a defect in expbuf, never the
caller's: it raises `IllegalMove`, and the request's transaction stores nothing.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """A group's or an experience's state; its value is what Stats, metrics and Get show."""

    PENDING = "pending"
    COMPUTING = "computing"
    READY = "ready"
    LEASED = "leased"
    CONSUMED = "consumed"
    EVICTED = "evicted"
    DROPPED = "dropped"
    FAILED = "failed"
    QUARANTINED = "quarantined"  # an experience's only (quarantine.py)


PENDING, COMPUTING, READY, LEASED = State.PENDING, State.COMPUTING, State.READY, State.LEASED
CONSUMED, EVICTED, DROPPED, FAILED = State.CONSUMED, State.EVICTED, State.DROPPED, State.FAILED
QUARANTINED = State.QUARANTINED
LIVE = (PENDING, COMPUTING, READY, LEASED)
RETIRED = (CONSUMED, EVICTED, DROPPED, FAILED, QUARANTINED)
# Records store a state as its place here: a new state goes at the end, never between.
STATES = (*LIVE, *RETIRED)

MOVES: dict[State, frozenset[State]] = {
    PENDING: frozenset({COMPUTING, READY, DROPPED, FAILED}),
    COMPUTING: frozenset({READY, DROPPED, FAILED}),
    READY: frozenset({LEASED, CONSUMED, EVICTED, DROPPED, FAILED, COMPUTING}),
    LEASED: frozenset({READY, CONSUMED, FAILED}),
    **{state: frozenset() for state in RETIRED},
}


class IllegalMove(RuntimeError):
    """A move of a group that MOVES does not allow: a defect in expbuf."""


def check_move(gkey: str, was: State, to: State) -> None:
    """Raise IllegalMove unless a group may move from `was` to `to`."""
    if to not in MOVES[was]:
        allowed = ", ".join(sorted(MOVES[was])) or "none: a tombstone never moves"
        raise IllegalMove(f"group {gkey!r} cannot move from {was} to {to} (from {was}: {allowed})")
