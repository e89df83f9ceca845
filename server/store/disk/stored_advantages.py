"""How computed advantages are stored, and how they reach a sampled batch, without torch.

Stored form, per experience: one value in its item record when every generated token
carries the same value (every estimator but the token-level ones), or a token-level record
(`token_record`: response length u32 + float32 advantages + float32 returns) in the `adv`
database. `expand` turns either into the `advantages` and `returns` tensors of a sampled
batch (value * action_mask, client/trxp/codec/advantages.py), and `batch_payload` splices them
into the batch. For a client that asks for compact advantages, `send_apart` keeps one value
per experience out of the payload: the reply carries the values and the client expands them
with the same code.

An estimator with a batch stage stores pending values instead (see server/advantages/estimators.py),
and the batch stage turns the pending values of a sampled batch into its advantages, in the
stored forms, before `expand`. That stage computes with torch, so it lives above the storage
engine (server/advantages/batch_stage.py): the server gives it to the Store (`FinishBatch`), which binds
it to a taken batch and hands the batch on with it (`Stage`), to run where the reply is built,
on the RPC's thread: never inside the write transaction, so no push waits behind a whitening
pass.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from expbuf.client.trxp.codec import segments
from expbuf.client.trxp.codec.advantages import ADDED, scaled
from expbuf.client.trxp.codec.common import RawTensor
from expbuf.client.trxp.stored.columns import ColumnParts, Shares, column_parts
from expbuf.client.trxp.stored.pieces import Run, Stored, concatenated
from expbuf.client.trxp.stored.splice import join_parts

from ..schema.table_config import TableConfig
from ..schema.views import MemberView


class SentApart:
    """An experience's advantage sent beside the payload (a compact sample reply), not in it."""


SENT_APART = SentApart()

# An experience's computed advantage: (value, response length) when every generated token
# carries the same value, the stored token-level record otherwise, or None; SENT_APART in a
# compact reply's batch, where the value goes beside the payload.
Advantage = tuple[float, int] | bytes | None | SentApart

_LENGTH = struct.Struct("<I")


class StageCounts:
    """What the batch stage's advantage clip did in one table's samples since the server
    started. The stage runs as replies are built, outside any write transaction, so these
    counts are kept in memory; Stats adds them to the table's durable counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.advantages_seen = 0
        self.advantages_clipped = 0

    def add(self, seen: int, clipped: int) -> None:
        with self._lock:
            self.advantages_seen += seen
            self.advantages_clipped += clipped


# The batch stage the server gives the Store (server/batch_stage.finish_batch): a batch's
# advantages from the table's configuration, the batch's item records and stored values in
# batch order, and the counts its clip adds to (None for a Get, which is not a sample).
FinishBatch = Callable[[TableConfig, Sequence[MemberView], Sequence[Advantage], StageCounts | None], list[Advantage]]


class Stage(Protocol):
    """A taken batch's batch stage, bound to its rows (batch_rows.BoundStage): its advantages from
    its stored ones; and, once that raised, what it raises over some of the rows alone, to find
    which groups the failure is down to (kinds.Sampled.finish)."""

    def __call__(self, stored: Sequence[Advantage]) -> list[Advantage]: ...

    def raised_over(self, stored: Sequence[Advantage], rows: Sequence[int]) -> Exception | None: ...


def token_record(length: int, advantages: bytes | memoryview, returns: bytes | memoryview) -> bytes:
    """The stored token-level record of one experience: its float32 advantages and returns."""
    return _LENGTH.pack(length) + advantages + returns


def token_parts(record: bytes) -> tuple[int, bytes, bytes]:
    """A token-level record's response length, float32 advantages and float32 returns."""
    (length,) = _LENGTH.unpack_from(record)
    middle = _LENGTH.size + 4 * length
    return length, record[_LENGTH.size : middle], record[middle:]


def advantage_of(advantage: float | None, length: int, token_level: bytes | None) -> Advantage:
    """An experience's stored advantage: the value in its record (`advantage`, of a response of
    `length` tokens), or its token-level record."""
    if advantage is not None:
        return (advantage, length)
    return token_level


@dataclass(frozen=True, slots=True)
class Masks:
    """What a batch's delivery masks out of each experience's action mask: its first `stale[i]`
    response tokens (those too stale: rules/staleness.masked_tokens), of `lengths[i]`."""

    stale: Sequence[int]
    lengths: Sequence[int]

    def apply(self, index: int, tensors: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """Experience `index`'s action mask with its stale tokens masked out; none where it has none."""
        stale = self.stale[index]
        if not stale:
            return {}
        return {"action_mask": segments.masked(tensors.get("action_mask"), self.lengths[index], stale)}


def _delivered(
    advantages: Sequence[Advantage], masks: Masks | None
) -> Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]]:
    """The tensors a delivery gives experience i on top of its stored ones: its masked action mask,
    and its advantages and returns over that mask."""

    def stored(index: int, tensors: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        return expand(advantages[index], tensors)

    def masked(index: int, tensors: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        assert masks is not None
        given = masks.apply(index, tensors)
        if not given:
            return expand(advantages[index], tensors)
        return given | expand(advantages[index], given)  # expand reads the action mask alone

    return stored if masks is None else masked


def batch_payload(blobs: Sequence[Stored], advantages: Sequence[Advantage], masks: Masks | None = None) -> bytes:
    """One TRXP batch of stored experiences, with their computed advantages and returns."""
    return concatenated(batch_parts(blobs, advantages, masks))


def batch_parts(blobs: Sequence[Stored], advantages: Sequence[Advantage], masks: Masks | None = None) -> list[Run]:
    """batch_payload() as the runs of bytes it is made of, for a reply that copies them once.
    A batch whose advantages are all SENT_APART gets none (and loses any pushed with it)."""
    apart = all(a is SENT_APART for a in advantages)
    if masks is None and all(a is None for a in advantages):
        return join_parts(blobs)
    if masks is None and apart:
        return join_parts(blobs, drop=ADDED)
    return join_parts(blobs, _delivered(advantages, masks), drop=ADDED if apart else ())


def batch_columns(
    blobs: Sequence[Stored],
    advantages: Sequence[Advantage],
    fields: Sequence[str],
    shares: Shares | None = None,
    responses: Sequence[int] = (),
    masks: Masks | None = None,
) -> list[ColumnParts]:
    """A batch of stored experiences as the columns of `fields`, computed advantages and returns
    included (in place of any pushed with an experience that has computed ones), and action masks
    as delivered (`masks`), cut to `shares` of their tokens where given (columns.column_parts)."""
    if masks is None and all(a is None for a in advantages):
        return column_parts(blobs, fields, shares=shares, responses=responses)
    added = ADDED if masks is None else (*ADDED, "action_mask")
    return column_parts(blobs, fields, _delivered(advantages, masks), added, shares, responses)


def expand(advantage: Advantage, tensors: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
    """The advantages and returns tensors of one sampled experience (none when sent apart). Asked
    `type() is tuple` first, the most common, as `isinstance` of an object that is not one looks up
    its `__class__`."""
    if type(advantage) is tuple or isinstance(advantage, tuple):
        value, length = advantage
        values = scaled(value, length, tensors.get("action_mask"))
        return {"advantages": values, "returns": values}
    if advantage is None or isinstance(advantage, SentApart):
        return {}
    length, advantages, returns = token_parts(bytes(advantage))
    return {"advantages": RawTensor("F32", (length,), advantages), "returns": RawTensor("F32", (length,), returns)}


def send_apart(advantages: Sequence[Advantage]) -> tuple[list[Advantage], list[float], list[int]] | None:
    """A batch's advantages for a client that asked for them compact: what the payload
    splices (SENT_APART for each), and the values and response lengths sent beside it;
    None where an experience has token-level advantages (or none), which only the payload
    can carry."""
    if not advantages or not all(isinstance(a, tuple) for a in advantages):
        return None
    values = [a[0] for a in advantages]  # type: ignore[index]
    lengths = [a[1] for a in advantages]  # type: ignore[index]
    return [SENT_APART] * len(advantages), values, lengths
