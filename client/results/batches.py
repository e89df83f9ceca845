"""Batches of experiences: a sampled batch (`Batch`, `AsyncBatch` from the asyncio client), its
payload decoded on first use and its lease acknowledged, given back or renewed through the
client that sampled it (`Leases`); and the fields of named experiences read as columns
(`FieldBatch`), which shares a columnar batch's offer to a trainer (`Columnar`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from .. import trxp
from ..schema.experience import Experience

if TYPE_CHECKING:
    from tensordict import TensorDict

    from ..columns import Column, PrefixBranches
    from ..schema.balance import ModelShape


class Leases(Protocol):
    """What a batch acknowledges, gives back and renews its lease through: the client that sampled it."""

    def ack(self, lease_id: str, table: str = "default") -> Any: ...
    def nack(self, lease_id: str, table: str = "default") -> Any: ...
    def renew(self, lease_id: str, seconds: float, table: str = "default") -> Any: ...


class Columnar:
    """What a batch of columns (a columnar Batch, a FieldBatch) offers a trainer beyond its
    columns: its tokens as a tree, and its split over data-parallel ranks."""

    uids: list[str]
    group_ids: list[str]
    columns: dict[str, Column]

    @property
    def missing_fields(self) -> list[str]:
        """The fields asked for that no experience of the batch has, in the order asked: they have
        no column, and looking one up in `columns` raises a KeyError that says so (the reply's
        missing_fields; none from a server before this release, which left them out unsaid)."""
        from ..columns import missing_fields

        return missing_fields(self.columns)

    def prefix_branches(self) -> PrefixBranches:
        """The tokens as each distinct prompt once and each experience's branch after it, for
        tree packing (sampled or read with the fields prefix_tokens, branch_tokens and
        prefix_of; columns.prefix_branches)."""
        from ..columns import prefix_branches

        return prefix_branches(self.columns)

    def rank_parts(
        self, ranks: int, balance: str = "tokens", model: ModelShape | None = None, equal: bool = False
    ) -> list[list[str]]:
        """The uids of each of `ranks` data-parallel ranks: the groups split as read_part splits a
        leased step (the same split, for a batch of the lease), from the `length` (or `tokens`)
        column, for any delivery: ranks read theirs with read_fields (a replayed batch), or the
        process that holds the batch hands each its part (a consumed one)."""
        from ..columns import rank_parts

        return rank_parts(self, ranks, balance, model, equal)


@dataclass(repr=False)
class Batch(Columnar):
    """One sampled batch of whole groups. `experiences` decodes the payload on first use;
    `uids` and `group_ids` have one entry per experience, `groups` one per group.

    A leased batch's lease runs `lease_seconds` (the sample's) from when the client handed
    the batch to its caller; `lease_expires` is then, on this machine's clock. The server
    waits for that hand-over (the client's confirmation) at most `confirm_seconds` from the
    one before (its max_confirm_seconds, or more): a batch asked for later is not handed over
    (calls.handed)."""

    payload: bytes
    uids: list[str]
    group_ids: list[str]
    lease_id: str
    lease_expires: float
    partial: bool
    table: str = "default"
    times_sampled: list[int] = field(default_factory=list)  # one per uid: its deliveries, this one included
    _leases: Leases | None = field(default=None, repr=False)
    confirm_seconds: float = field(default=0.0, repr=False)  # the reply's; 0: the server sets no bound
    # A columnar batch's fields (sample(..., fields=[...])), by name; the payload is empty then.
    columns: dict[str, Column] = field(default_factory=dict, repr=False)
    # Each experience's one advantage, as the server sent it beside the payload (one per uid; empty
    # where it sent none so: a token-level estimator's, or none): an experience with no generated
    # token has its value here alone, its `advantages` tensor empty.
    advantage_values: list[float] = field(default_factory=list, repr=False)

    @property
    def columnar(self) -> bool:
        """Whether the batch came as columns (sample's `fields`) rather than a TRXP payload."""
        return not self.payload and bool(self.columns or self.uids)

    @property
    def groups(self) -> list[str]:
        """The batch's distinct groups, in the order they come."""
        return list(dict.fromkeys(self.group_ids))

    def __repr__(self) -> str:
        """A summary: the payload's bytes, and a uid per experience, would print at three times its size."""
        return (
            f"{type(self).__name__}(table={self.table!r}, experiences={len(self.uids)}, groups={len(self.groups)},"
            f" payload_bytes={len(self.payload)}, lease_id={self.lease_id!r}, partial={self.partial})"
        )

    @cached_property
    def experiences(self) -> list[Experience]:
        """Decoded on first use, with the checks a reader relies on (trxp.decode_reply): a
        malformed payload raises TrxpError. The tensors are writable views over buffers this
        batch owns, one per dtype, into which decode gathered their bytes: writing to one
        never changes `payload`. A columnar batch has none: it carries `columns`."""
        if self.columnar:
            raise ValueError(
                f"this batch of table '{self.table}' was sampled as columns (fields={sorted(self.columns)}): "
                "read batch.columns, or sample without fields for experiences"
            )
        return trxp.decode_reply(self.payload)

    def tensordict(self) -> TensorDict:
        """A columnar batch as a TensorDict of batch size [experiences]: per-token fields as
        jagged nested tensors, the rest one value per experience, none copied
        (columns.as_tensordict; needs the tensordict package)."""
        if not self.columnar:
            raise ValueError(
                f"this batch of table '{self.table}' was sampled as a TRXP payload: sample with fields=[...] "
                "for a TensorDict"
            )
        from ..columns import as_tensordict

        return as_tensordict(self.columns, len(self.uids))

    def ack(self) -> int:
        """Mark a leased batch done; without a lease there is nothing to acknowledge."""
        return self._leases.ack(self.lease_id, self.table) if self.lease_id and self._leases else 0

    def nack(self) -> int:
        """Return a leased batch to the buffer now."""
        return self._leases.nack(self.lease_id, self.table) if self.lease_id and self._leases else 0

    def renew(self, seconds: float) -> float:
        """Keep a leased batch for `seconds` more from now (a step that outlasts its lease);
        returns when the lease now ends (Unix time, the server's clock)."""
        if not (self.lease_id and self._leases):
            return 0.0
        self.lease_expires = self._leases.renew(self.lease_id, seconds, self.table)
        return self.lease_expires


class AsyncBatch(Batch):
    """A Batch from AsyncBufferClient: `ack`, `nack` and `renew` are coroutine functions, to be awaited.

    (A plain Batch's `ack` called without `await` would return a coroutine that never runs:
    the lease would expire and the batch be delivered again, with nothing said.)
    """

    async def ack(self) -> int:  # type: ignore[override]
        """Mark the leased batch done (await it); without a lease there is nothing to acknowledge."""
        return await self._leases.ack(self.lease_id, self.table) if self.lease_id and self._leases else 0

    async def nack(self) -> int:  # type: ignore[override]
        """Return the leased batch to the buffer now (await it)."""
        return await self._leases.nack(self.lease_id, self.table) if self.lease_id and self._leases else 0

    async def renew(self, seconds: float) -> float:  # type: ignore[override]
        """Keep the leased batch for `seconds` more from now (await it); returns when the lease now ends."""
        if not (self.lease_id and self._leases):
            return 0.0
        self.lease_expires = await self._leases.renew(self.lease_id, seconds, self.table)
        return self.lease_expires


@dataclass(repr=False)
class FieldBatch(Columnar):
    """Fields of named experiences as columns (`read_fields`), in the order asked, the ones not
    served in `missing_uids`; `columns` and `tensordict()` as a columnar Batch's. Nothing to
    acknowledge: the experiences stay as they were (the batch they were sampled in is acked)."""

    uids: list[str]
    group_ids: list[str]
    missing_uids: list[str]
    columns: dict[str, Column]
    table: str = "default"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(table={self.table!r}, experiences={len(self.uids)}, "
            f"fields={list(self.columns)}, missing_uids={len(self.missing_uids)})"
        )

    def tensordict(self) -> TensorDict:
        """The fields as a TensorDict of batch size [experiences], as Batch.tensordict()."""
        from ..columns import as_tensordict

        return as_tensordict(self.columns, len(self.uids))
