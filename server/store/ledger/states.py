"""The life of a prompt: its states, and every move allowed between them, in one table.

A prompt never handed out is pending (it has no record: it is at or beyond its dataset's
cursor). A claim makes it claimed by one attempt; the attempt's group complete makes it
generated, and the group trained (consumed, acked or retired) makes it trained. A claim that
ends before its group is complete, or a group dropped with `on_drop = "retry"`, sends it back
to pending with the next attempt, and it is dropped instead once `max_attempts` are spent, or at
once with `on_drop = "done"` (a pending prompt is dropped too when every attempt's group is
already taken in the table). Trained and dropped are the end of a prompt's life in its epoch:

    pending --> claimed --> generated --> trained
       |  ^        |  |          |  |
       |  +--------+  |          |  +--> pending (attempt + 1)
       +--------------+----------+-----> dropped

`PROMPT_MOVES` is the one table of what may follow what; `PromptRecord.move`, which every move of
a prompt goes through, checks it. A move outside it is a defect in expbuf, never the caller's: it
raises `IllegalPromptMove`, and the request's transaction stores nothing. The values are what the
wire, ListPrompts, the metrics and the command line show.
"""

from __future__ import annotations

from expbuf.client.schema.prompts import PromptState

PENDING, CLAIMED, GENERATED = PromptState.PENDING, PromptState.CLAIMED, PromptState.GENERATED
TRAINED, DROPPED = PromptState.TRAINED, PromptState.DROPPED
# Records store a state as its place here: a new state goes at the end, never between.
PROMPT_STATES = (PENDING, CLAIMED, GENERATED, TRAINED, DROPPED)
COUNTED = PROMPT_STATES[1:]  # the states a dataset counts; pending is the rest
DONE = (TRAINED, DROPPED)

PROMPT_MOVES: dict[PromptState, frozenset[PromptState]] = {
    PENDING: frozenset({CLAIMED, DROPPED}),
    CLAIMED: frozenset({GENERATED, PENDING, DROPPED}),
    GENERATED: frozenset({TRAINED, PENDING, DROPPED}),
    TRAINED: frozenset(),
    DROPPED: frozenset(),
}


class IllegalPromptMove(RuntimeError):
    """A move of a prompt that PROMPT_MOVES does not allow: a defect in expbuf."""


def check_prompt_move(prompt: str, was: PromptState, to: PromptState) -> None:
    """Raise IllegalPromptMove unless a prompt may move from `was` to `to`."""
    if to not in PROMPT_MOVES[was]:
        allowed = ", ".join(sorted(PROMPT_MOVES[was])) or "none: its life in this epoch is over"
        raise IllegalPromptMove(f"prompt {prompt} cannot move from {was} to {to} (from {was}: {allowed})")
