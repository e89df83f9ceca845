"""How a sharded client gathers one batch: which shards to ask for how much, how long to wait, when to give up.

Pure logic, with no calls and no clock: `Poll` is told the time, the shards' ready counts, what
each fetch brought and what went back unused, and answers with the next thing to do (`Ask`,
`Wait`, `Done` or `GiveUp`). The sample plan (sampling.py) makes the calls it asks for, and the
blocking and asyncio drivers run that plan, so the poll algorithm exists once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc

from ..errors import ExpbufError
from ..rpc.sample_spec import SampleSpec
from .common import ShardError, allocate

# The pause between looks at the shards' ready counts when none can fill the batch yet: it
# starts short, doubles, and stops growing here.
POLL_SECONDS = (0.02, 0.5)


@dataclass(frozen=True)
class Ask:
    """Fetch these parts now (shard: groups or experiences); `late` lets a shard give less."""

    parts: dict[str, int]
    late: bool


@dataclass(frozen=True)
class Wait:
    """Look at the ready counts again after this many seconds (the plan yields it as its pause)."""

    seconds: float


@dataclass(frozen=True)
class Done:
    """The batch is gathered; `partial` when the wait ran out with less than asked."""

    partial: bool


@dataclass(frozen=True)
class GiveUp:
    """Nothing was gathered in time: raise `error`, or (None, with allow_partial) end the stream."""

    error: ExpbufError | None


Next = Ask | Wait | Done | GiveUp


class Poll:
    """One batch being gathered over the shards, for one SampleSpec, from the time `now`."""

    def __init__(self, spec: SampleSpec, shards: Iterable[str], now: float) -> None:
        self.spec = spec
        self.key = "groups_ready" if spec.by_groups else "ready"  # the stats field a shard's part is sized by
        self._shards = list(shards)
        self._deadline = now + spec.timeout
        self._pause = POLL_SECONDS[0]
        self._got = 0
        self._parts = 0
        self._late = False
        self._ready: Mapping[str, int] = {}

    def left(self, now: float) -> float:
        """The seconds left before the batch is given up on (its parts held no longer)."""
        return max(0.0, self._deadline - now)

    def look(self, ready: Mapping[str, int], now: float) -> Next:
        """What to do given each answering shard's ready count (shards that did not answer are absent)."""
        self._ready, self._late = ready, now >= self._deadline
        missing = self.spec.size - self._got
        want = allocate(ready, missing)
        if sum(want.values()) >= missing or (self._late and want):
            return Ask(want, self._late)
        return self._after(now)

    def took(self, sizes: Iterable[int], now: float) -> Next:
        """What to do after an Ask brought parts of these sizes (groups or experiences, as asked)."""
        return self._count(sizes, 1, now)

    def returned(self, sizes: Iterable[int], now: float) -> Next:
        """What to do after parts of these sizes went back to their shards unused (held too long
        to be confirmed in time): what they held is asked for again, as if never brought."""
        return self._count(sizes, -1, now)

    def _count(self, sizes: Iterable[int], sign: int, now: float) -> Next:
        for size in sizes:
            self._got += sign * size
            self._parts += sign
        return self._after(now)

    def _after(self, now: float) -> Next:
        if self._got >= self.spec.size or self._late:
            if self._parts:
                return Done(partial=self._got < self.spec.size)
            return GiveUp(self._why())
        pause = min(self._pause, max(0.0, self._deadline - now))
        self._pause = min(self._pause * 2, POLL_SECONDS[1])
        return Wait(pause)

    def _why(self) -> ExpbufError | None:
        if not self._ready:
            return ShardError(grpc.StatusCode.UNAVAILABLE, "no shard answered", self._shards)
        if self.spec.allow_partial:
            return None
        what = "groups" if self.spec.by_groups else "experiences"
        return ExpbufError(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"fewer than {self.spec.size} ready {what} after {self.spec.timeout}s"
        )
