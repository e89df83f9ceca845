"""The prompt ledger: datasets of prompts on a table, and the life of each prompt, every change
made in the transaction of the event that makes it.

A prompt (dataset, epoch, index) is pending until a rollout worker claims it; then claimed,
by one claimant at a time, under a claim that ends unless renewed; generated once the group
of its attempt (records.group_key) is complete in the table; trained once that group
is consumed (a consumed batch confirmed, a lease acked, a replay spent, a group retired as
trained). A claim that ends before its group is complete (it expired, or was released) sends
the prompt back with attempt + 1, to be handed out before any new prompt; the incomplete group
of the ended attempt is dropped, and a later push into it is refused (StaleAttempt, naming the
attempt), so no group mixes attempts. A group the table drops (zero variance, a group timeout,
eviction, a failed computation, a delete) counts its prompt as done, dropped, or sends it back,
as the dataset's `on_drop` says; a prompt sent back `max_attempts` times is dropped.
`max_in_flight` bounds the prompts claimed, or generated and not yet trained.

The rules run as one table extension (extensions.py), `Ledger`, composed of one class a job:
the table's datasets and their counts (datasets.py), a claim's life (claim_life.py), what became
of a claimed prompt (outcomes.py), and the refusal of writes and reads into a prompt's groups by
all but its claimant (claimants.py). The table's groups say when a prompt was generated or
trained, with no change to the group rules.
"""

from __future__ import annotations

from .claim_life import ClaimRules
from .claimants import ClaimantRules
from .outcomes import OutcomeRules


class Ledger(ClaimRules, OutcomeRules, ClaimantRules):
    """The ledger's rules over one table's state, and the table events that move prompts."""
