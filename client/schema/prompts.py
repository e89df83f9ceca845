"""The prompt ledger as the clients return it: the prompts a claim hands out, a claim's
result, a dataset's settings and counts, a page of prompts.

A rollout worker claims prompts (`client.claim`), generates each one's group with the EID
the prompt names (`prompt.eid(run)`), pushes it, and renews its claims while it works
(`client.renew_claims`); a claim that ends before the group is complete goes back and out
again with the next attempt, and a push into the ended attempt is refused.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from .experience import EID


class PromptState(StrEnum):
    """A prompt's state in the ledger (the server's prompt ledger moves it, store/ledger/states.py);
    its value is what ListPrompts, the metrics and the CLI show, and a string compares equal to it."""

    PENDING = "pending"
    CLAIMED = "claimed"
    GENERATED = "generated"
    TRAINED = "trained"
    DROPPED = "dropped"


STATES = tuple(PromptState)  # in the ledger's order: pending first, then the states a dataset counts
# The most prompts one call hands out or names: a Claim's count, the prompts of a RenewClaims or
# a ReleaseClaims. The server's one writer works through them in one transaction, every other
# tenant's writes waiting (a claim of 65,536 held it for seconds); 4,096 hold it a fraction of
# a second (bench/bench_ledger_hold.py), and are more than a rollout step claims at once: a
# Trinity explorer's batch of tasks, a single controller's training batch of prompts. The
# clients renew and release any number of claims in calls of at most this many.
MAX_PROMPTS_PER_CALL = 4096
# A client's id for one claim (a uuid's 32 hex digits as the clients make it, or the caller's own).
MAX_CLAIM_ID_BYTES = 64


def new_claim_id() -> str:
    """An id for one claim: the same id on each try of it lets the server answer a repeat with
    what the first handed out (a reply lost), rather than claim more."""
    return uuid.uuid4().hex


# The prompts a page of list_prompts reads unless told (a request's limit of 0 means it).
DEFAULT_PAGE = 1000


@dataclass
class PromptStats:
    """How one prompt fared over its epochs (ListPrompts), durable on the server (its record
    extends this type): claims handed out, groups generated and their runs, the runs that passed
    (reward above the dataset's pass_threshold), the last generated group's runs and the mean and
    variance of their rewards, and how often it was trained, last in epoch `last_epoch` at trainer
    version `last_step` (-1: never, or no version set)."""

    attempts: int = 0
    generated: int = 0
    runs: int = 0
    passes: int = 0
    last_runs: int = 0
    last_mean: float = math.nan
    last_var: float = math.nan
    trained: int = 0
    last_epoch: int = -1
    last_step: int = -1

    @property
    def pass_rate(self) -> float:
        """The runs that passed, of all its runs generated (NaN before any)."""
        return self.passes / self.runs if self.runs else math.nan

    @classmethod
    def from_proto(cls, msg: Any) -> PromptStats:
        return cls(
            msg.attempts, msg.generated, msg.runs, msg.passes, msg.last_runs, msg.last_mean, msg.last_var,
            msg.trained, msg.last_epoch, msg.last_step,
        )  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    """One prompt of a dataset: index `index` of epoch `epoch`, at attempt `attempt`. Its
    experiences carry EID batch `batch` and task `task` (`eid(run)`), so that they make the
    prompt's group; its claim ends at `expires` (Unix time, the server's clock) unless renewed. Two
    are equal, and hash alike, where they name the same attempt of the same prompt: a prompt as
    ListPrompts gives it (its state, owner and stats) is the one claimed, renewed or reported."""

    dataset: str
    epoch: int
    index: int
    attempt: int
    batch: str
    task: str
    expires: float = field(compare=False)
    table: str = "default"
    state: PromptState = field(default=PromptState.CLAIMED, compare=False)  # as ListPrompts reports it
    owner: str = field(default="", compare=False)
    stats: PromptStats | None = field(default=None, compare=False)  # ListPrompts only

    def eid(self, run: int, step: int = 0, suffix: str = "") -> EID:
        """The EID of this attempt's experience of run `run` (and step `step`): its uid is the
        same every time, so a push retried after a lost reply is a duplicate, never a copy."""
        return EID(batch=self.batch, task=self.task, run=run, step=step, suffix=suffix)

    @property
    def group(self) -> str:
        """The group this attempt's experiences make in a table grouped by task."""
        return f"{self.batch}/{self.task}"

    @classmethod
    def from_proto(cls, msg: Any, table: str) -> Prompt:
        return cls(
            dataset=msg.dataset, epoch=msg.epoch, index=msg.index, attempt=msg.attempt, batch=msg.batch,
            task=msg.task, expires=msg.expires_unix, table=table, state=PromptState(msg.state or "claimed"),
            owner=msg.owner,
            stats=PromptStats.from_proto(msg.stats) if msg.HasField("stats") else None,
        )  # fmt: skip


@dataclass(frozen=True)
class Claim:
    """What a claim handed out: `prompts` (possibly none), and `done` once the dataset has
    nothing left to hand out or train: the rollout loop ends (Trinity's StopAsyncIteration)."""

    prompts: list[Prompt]
    done: bool


@dataclass(frozen=True)
class EpochCounts:
    """An epoch's prompts by state."""

    pending: int
    claimed: int
    generated: int
    trained: int
    dropped: int


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset's settings, its cursor (the next new prompt's epoch and position), its counts
    over every epoch (`totals`, `total(state)`) and by epoch started (`counts`: epochs 0 through
    the cursor's; an epoch after those has had no prompt handed out, all its prompts pending),
    the claims handed out again, the incomplete groups of ended claims dropped, and whether it
    is done. `owned` is the prompts of every epoch the server hands out: `size` times `epochs`,
    or for one shard of a sharded table its part (`shard`, one of `shards`) of the epochs it
    started, each epoch's part counted as it starts, so that a shard's totals are over those
    epochs. A sharded client merges the shards' (`merged`), over every epoch; `missing` names
    the shards that did not answer it, with their error."""

    table: str
    name: str
    size: int
    epochs: int
    seed: int | None
    max_in_flight: int
    on_drop: str
    max_attempts: int
    created: float
    cursor_epoch: int
    cursor_position: int
    counts: list[EpochCounts]
    reissued: int
    attempts_dropped: int
    done: bool
    owned: int
    totals: EpochCounts
    shards: list[str] = field(default_factory=list)
    shard: str = ""
    pass_threshold: float = 0.0  # a run passes when its reward is above it (PromptStats.passes)
    order: str = "permutation"  # the claim order of each epoch's prompts
    order_options: dict[str, float] = field(default_factory=dict)  # its options, its defaults filled in
    zero_variance: str = "keep"  # a prompt whose group's rewards are all equal: keep, retry or skip
    skip_epochs: int = 1  # with zero_variance "skip": the epochs it sits out
    skipped: int = 0  # prompts an epoch skipped (dropped at the cursor)
    missing: Mapping[str, str] = field(default_factory=dict)

    def total(self, state: str) -> int:
        """Prompts in `state` over every epoch."""
        return int(getattr(self.totals, state))

    @classmethod
    def merged(cls, parts: Sequence[DatasetInfo], missing: Mapping[str, str]) -> DatasetInfo:
        """One dataset over the shards that answered: counts, claims re-issued, attempts dropped
        and the max_in_flight bounds summed; the earliest creation and the least advanced
        cursor; done once every shard is done and none is missing. An epoch is in `counts` once
        a shard started it; of its `size` prompts, and in `totals` of every epoch's, those no
        shard that answered counts in another state are pending (a shard's part of an epoch it
        has not started is all pending, and not counted until it starts). `owned`: every
        prompt, the shards' parts making up each epoch."""
        first = parts[0]
        cursor = min((p.cursor_epoch, p.cursor_position) for p in parts)
        counts = []
        for epoch in range(max(len(p.counts) for p in parts)):
            held = [
                sum(getattr(p.counts[epoch], state) for p in parts if epoch < len(p.counts)) for state in STATES[1:]
            ]
            counts.append(EpochCounts(first.size - sum(held), *held))
        everywhere = [sum(p.total(state) for p in parts) for state in STATES[1:]]
        return replace(
            first,
            max_in_flight=sum(p.max_in_flight for p in parts),
            created=min(p.created for p in parts),
            cursor_epoch=cursor[0],
            cursor_position=cursor[1],
            counts=counts,
            totals=EpochCounts(first.size * first.epochs - sum(everywhere), *everywhere),
            reissued=sum(p.reissued for p in parts),
            attempts_dropped=sum(p.attempts_dropped for p in parts),
            skipped=sum(p.skipped for p in parts),
            done=all(p.done for p in parts) and not missing,
            owned=first.size * first.epochs,
            shard="",
            missing=dict(missing),
        )

    @classmethod
    def from_proto(cls, msg: Any, table: str) -> DatasetInfo:
        """A DatasetInfo as the server sent it; a server older than its `totals` sent a row for
        every epoch, which add up to them."""
        config = msg.config
        counts = [EpochCounts(c.pending, c.claimed, c.generated, c.trained, c.dropped) for c in msg.counts]
        rows = [msg.totals] if msg.HasField("totals") else counts
        totals = EpochCounts(*(sum(getattr(row, state) for row in rows) for state in STATES))
        return cls(
            table=table, name=config.name, size=config.size, epochs=config.epochs,
            seed=config.seed if config.HasField("seed") else None, max_in_flight=config.max_in_flight,
            on_drop=config.on_drop, max_attempts=config.max_attempts, created=msg.created_unix,
            cursor_epoch=msg.cursor_epoch, cursor_position=msg.cursor_position,
            counts=counts, reissued=msg.reissued, attempts_dropped=msg.attempts_dropped, done=msg.done,
            owned=msg.owned, totals=totals, shards=list(config.shards), shard=config.shard,
            pass_threshold=config.pass_threshold, order=config.order or "permutation",
            order_options=dict(sorted(config.order_options.items())), zero_variance=config.zero_variance or "keep",
            skip_epochs=config.skip_epochs or 1, skipped=msg.skipped,
        )  # fmt: skip


@dataclass(frozen=True)
class PromptPage:
    """A page of a dataset's prompts handed out at least once, in (epoch, index) order; pass
    `after` for the next page. A prompt never handed out has no record here: the dataset's
    counts hold it as pending."""

    prompts: list[Prompt]
    after: tuple[int, int] | None
    done: bool
