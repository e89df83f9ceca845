"""What the clients return: the result types of pushes, samples, reads and admissions.

Plain data, built from the service's replies by the clients (client.py); a sampled batch
decodes its payload on first use and acknowledges through the client that made it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from . import trxp
from .experience import Experience


@dataclass
class PushResult:
    """What a push stored: uids stored now, uids already stored (a retry), groups it completed,
    and uids dropped as staler than the table's max_staleness. Durable when returned."""

    stored: list[str]
    duplicates: list[str]
    completed_groups: list[str]
    stale: list[str] = field(default_factory=list)  # dropped as staler than the table's max_staleness


@dataclass
class Batch:
    """One sampled batch of whole groups. `experiences` decodes the payload on first use;
    `uids` and `group_ids` have one entry per experience, `groups` one per group."""

    payload: bytes
    uids: list[str]
    group_ids: list[str]
    lease_id: str
    lease_expires: float
    partial: bool
    table: str = "default"
    times_sampled: list[int] = field(default_factory=list)  # one per uid: its deliveries, this one included
    _ack: Callable[[str, str], Any] | None = field(default=None, repr=False)
    _nack: Callable[[str, str], Any] | None = field(default=None, repr=False)

    @property
    def groups(self) -> list[str]:
        """The batch's distinct groups, in the order they come."""
        return list(dict.fromkeys(self.group_ids))

    @cached_property
    def experiences(self) -> list[Experience]:
        """Decoded on first use. The tensors are writable views over one buffer this batch
        owns, into which decode gathered their bytes, aligned: writing to one never changes
        `payload`."""
        return trxp.decode(self.payload)

    def ack(self) -> int:
        """Mark a leased batch done; without a lease there is nothing to acknowledge."""
        return self._ack(self.lease_id, self.table) if self.lease_id and self._ack else 0

    def nack(self) -> int:
        """Return a leased batch to the buffer now."""
        return self._nack(self.lease_id, self.table) if self.lease_id and self._nack else 0


class AsyncBatch(Batch):
    """A Batch from AsyncBufferClient: `ack` and `nack` are coroutine functions, to be awaited.

    (A plain Batch's `ack` called without `await` would return a coroutine that never runs:
    the lease would expire and the batch be delivered again, with nothing said.)
    """

    async def ack(self) -> int:  # type: ignore[override]
        """Mark the leased batch done (await it); without a lease there is nothing to acknowledge."""
        return await self._ack(self.lease_id, self.table) if self.lease_id and self._ack else 0

    async def nack(self) -> int:  # type: ignore[override]
        """Return the leased batch to the buffer now (await it)."""
        return await self._nack(self.lease_id, self.table) if self.lease_id and self._nack else 0


@dataclass
class Grant:
    """Rollouts a worker may start now (`count`, 0 when there was no room), under a grant
    that expires at `expires` (Unix time) unless finished with `finish_grant`."""

    count: int
    grant_id: str
    expires: float
    table: str


class GetResult(list[Experience]):
    """The experiences found (a list, as before) and `missing_uids`, the requested uids not stored."""

    def __init__(self, experiences: Iterable[Experience], missing_uids: Iterable[str]) -> None:
        super().__init__(experiences)
        self.missing_uids = list(missing_uids)


@dataclass(frozen=True)
class ListedExperience:
    """A live experience as `list_experiences` lists it; its payload comes from `get`."""

    uid: str
    group_id: str
    state: str  # pending | computing | ready | leased
    model_version: int | None
    reward: float | None
    times_sampled: int


@dataclass(frozen=True)
class ExperiencePage:
    """One page of a table's live experiences in insertion order; pass `next` as `after` for the next."""

    experiences: list[ListedExperience]
    next: int
    done: bool
