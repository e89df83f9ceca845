"""How computed advantages are stored, and how they reach a sampled batch.

Stored form, per experience: one value in its item record when every generated token
carries the same value (every estimator but the token-level ones), or a record of
(response length u32) + float32 advantages + float32 returns in the `adv` database.
`expand` turns either into the `advantages` and `returns` tensors of a sampled batch
(value * action_mask), and `batch_payload` splices them into the batch.

An estimator with a batch stage stores pending values instead (see estimators.py), and
`finish_batch` turns the pending values of a sampled batch into its advantages, in the
stored forms, before `expand`. The storage engine takes a batch with its stored values and
hands it on with its `BatchStage`, which runs where the reply is built, on the RPC's
thread: never inside the write transaction, so no push waits behind a whitening pass.
torch is imported only where values are computed, so the storage engine that reads and
splices them does not load it.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from expbuf.client import trxp

from .tables import TableConfig, batch_stage, estimator_args, estimator_of

if TYPE_CHECKING:
    import torch

    from . import estimators
    from .shaping import ShapingReport
    from .store.records import ItemRecord

# An experience's computed advantage: (value, response length) when every generated token
# carries the same value, the stored token-level record otherwise, or None.
Advantage = tuple[float, int] | bytes | None
_LENGTH = struct.Struct("<I")
_F32 = struct.Struct("<f")


def stored_advantage(record: ItemRecord, token_level: bytes | None) -> Advantage:
    """An experience's stored advantage: the value in its record, or its token-level record."""
    if record.advantage is not None:
        return (record.advantage, record.response_length)
    return token_level


def batch_payload(blobs: Sequence[bytes | memoryview], advantages: Sequence[Advantage]) -> bytes:
    """One TRXP batch of stored experiences, with their computed advantages and returns."""
    return b"".join(batch_parts(blobs, advantages))


def batch_parts(blobs: Sequence[bytes | memoryview], advantages: Sequence[Advantage]) -> list[bytes | memoryview]:
    """batch_payload() as the runs of bytes it is made of, for a reply that copies them once."""
    if all(a is None for a in advantages):
        return trxp.join_parts(blobs)
    return trxp.join_parts(blobs, lambda index, tensors: expand(advantages[index], tensors))


def flat_tensor(raw: trxp.RawTensor | None, length: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of a stored tensor (an action mask, say), or `fill` where it is absent."""
    import torch

    if raw is None:
        return torch.full((length,), fill, dtype=dtype)
    return trxp.tensor_of(raw).reshape(-1).to(dtype)


def encode_results(result: estimators.Advantages, batch: estimators.FlatBatch) -> list[float | bytes]:
    """What the store keeps for each experience: its one value, or its token-level record."""
    if result.scalar is not None:
        return [float(v) for v in result.scalar.double().cpu().tolist()]
    lengths = batch.lengths.tolist()
    token_advantages, token_returns = result.token_values()
    advantages = token_advantages.float().cpu().split(lengths)
    returns = token_returns.float().cpu().split(lengths)
    return [
        _LENGTH.pack(n) + trxp.raw_of(a).data + trxp.raw_of(r).data
        for a, r, n in zip(advantages, returns, lengths, strict=True)
    ]


def expand(advantage: Advantage, tensors: dict[str, trxp.RawTensor]) -> dict[str, trxp.RawTensor]:
    """The advantages and returns tensors of one sampled experience."""
    if advantage is None:
        return {}
    if isinstance(advantage, tuple):
        value, length = advantage
        raw = tensors.get("action_mask")
        data = _F32.pack(value) * length if raw is None else None
        if raw is not None and raw.dtype == "BOOL":
            data = _scaled_mask(bytes(raw.data), value)
        if data is not None and len(data) == 4 * length:
            values = trxp.RawTensor("F32", (length,), data)
        else:
            import torch

            values = trxp.raw_of(flat_tensor(raw, length, 1, torch.float32) * value)
        return {"advantages": values, "returns": values}
    record = bytes(advantage)
    (length,) = _LENGTH.unpack_from(record)
    middle = _LENGTH.size + 4 * length
    return {
        "advantages": trxp.RawTensor("F32", (length,), record[_LENGTH.size : middle]),
        "returns": trxp.RawTensor("F32", (length,), record[middle:]),
    }


def _scaled_mask(mask: bytes, value: float) -> bytes | None:
    """A BOOL mask's bytes 0/1 as float32 0 / value; None if it holds other bytes. A mask
    without zeros is one repeat of the value's 4 bytes; any other is written as the k-th
    byte of every float at once, k = 0..3 (a translate and a strided copy each)."""
    if mask.translate(None, b"\x00\x01"):
        return None
    one = _F32.pack(value)
    if not mask.count(0):
        return one * len(mask)
    out = bytearray(4 * len(mask))
    for k in range(4):
        out[k::4] = mask.translate(bytes.maketrans(b"\x01", one[k : k + 1]))
    return bytes(out)


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


@dataclass
class BatchStage:
    """A taken batch's batch stage, to run once where its reply is built: the table's
    configuration, the batch's item records in batch order, and the counts its clip adds
    to (None for a Get, which is not a sample)."""

    config: TableConfig
    records: list[ItemRecord]
    counts: StageCounts | None = None

    @classmethod
    def of(cls, config: TableConfig, records: list[ItemRecord], counts: StageCounts | None) -> BatchStage | None:
        """The stage of a batch of this table, or None where the table has none."""
        return cls(config, records, counts) if records and batch_stage(config) else None

    def run(self, stored: Sequence[Advantage]) -> list[Advantage]:
        return finish_batch(self.config, self.records, stored, self.counts)


def finish_batch(
    config: TableConfig,
    records: Sequence[ItemRecord],
    stored: Sequence[Advantage],
    counts: StageCounts | None = None,
) -> list[Advantage]:
    """The batch stage: the advantages of a sampled batch (its item records and stored
    values, in batch order) from the pending values its estimator stored on ingest,
    whitened by advantages_norm and clipped, or for the estimators that whiten over the
    batch clipped and then whitened (LightRFT's order); what the clipping did is added to
    `counts` (a sample's, not a Get's). Tables without a batch stage get their stored
    values back unchanged (clipped on ingest)."""
    if not batch_stage(config) or not records:
        return list(stored)
    from .shaping import ShapingReport

    report = ShapingReport()
    finished = _finish(config, records, stored, report)
    if counts is not None:
        counts.add(report.advantages_seen, report.advantages_clipped)
    return finished


def _finish(
    config: TableConfig, records: Sequence[ItemRecord], stored: Sequence[Advantage], report: ShapingReport
) -> list[Advantage]:
    import torch

    from . import estimators, shaping

    if any(a is None for a in stored):  # experiences not computed yet (Get): finish the others
        done = [i for i, a in enumerate(stored) if a is not None]
        out = list(stored)
        finished = _finish(config, [records[i] for i in done], [stored[i] for i in done], report)
        for i, value in zip(done, finished, strict=True):
            out[i] = value
        return out
    f64 = torch.float64
    runs: dict[str, int] = {}
    rows = estimators.SampledRows(
        pending=torch.tensor([a[0] if isinstance(a, tuple) else 0.0 for a in stored], dtype=f64),
        rewards=torch.tensor([float(_batch_reward(rec)) for rec in records], dtype=f64),
        generated=torch.tensor([rec.generated for rec in records], dtype=f64),
        run=torch.tensor([runs.setdefault(rec.rid, len(runs)) for rec in records], dtype=torch.int64),
        step=torch.tensor([rec.step for rec in records], dtype=torch.int64),
    )
    estimator, args, settings = estimator_of(config), estimator_args(config), config.shaping
    batched = estimator.has_batch_stage(args)
    if not estimator.token_valued:
        values = rows.pending
        if batched and estimator.group_step_in_batch:  # the group step's std over the batch
            values = estimator.batch_stage()(rows, **args)
        if settings.advantages_norm:
            values = shaping.advantages_norm(values, rows.generated)
        values = shaping.clip_advantages(settings, values, report)
        if batched and not estimator.group_step_in_batch:  # LightRFT clips, then whitens across the batch
            rows.pending = values
            values = estimator.batch_stage()(rows, **args)
        return [(float(v), rec.response_length) for v, rec in zip(values.tolist(), records, strict=True)]
    lengths, masks, returns = [], [], []
    for record in stored:
        if record is None or isinstance(record, tuple):
            raise ValueError("a token-level table's experience holds one stored value, not its token-level record")
        (length,) = _LENGTH.unpack_from(record)
        middle = _LENGTH.size + 4 * length
        lengths.append(length)
        masks.append(torch.frombuffer(bytearray(record[_LENGTH.size : middle]), dtype=torch.float32))
        returns.append(torch.frombuffer(bytearray(record[middle:]), dtype=torch.float32))
    rows.mask, rows.returns = torch.cat(masks).double(), torch.cat(returns).double()
    rows.returns = shaping.clip_advantages(settings, rows.returns, report)  # the returns as advantages, clipped
    advantages = estimator.batch_stage()(rows, **args)
    return [
        _LENGTH.pack(n) + trxp.raw_of(a.float()).data + trxp.raw_of(r).data
        for a, r, n in zip(advantages.split(lengths), returns, lengths, strict=True)
    ]


def _batch_reward(rec: ItemRecord) -> float:
    """The reward the batch stage's statistics see: shaped where shaping ran on ingest."""
    reward = rec.shaped_reward if rec.shaped_reward is not None else rec.reward
    return reward or 0.0
