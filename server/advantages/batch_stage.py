"""The batch stage: a sampled batch's advantages finished over the batch, with torch.

An estimator with a batch stage stores pending values on ingest (see advantages/estimators.py); the
batch stage turns the pending values of a sampled batch into its advantages, in the stored
forms (store/disk/stored_advantages.py), whitened by advantages_norm and clipped. The storage
engine imports no torch: the server gives it `finish_batch` (Store(batch_stage=...)), which it
binds to a taken batch and hands on with it, to run where the reply is built, on the RPC's
thread, never inside the write transaction. torch is imported when a stage first runs, so
importing this module loads none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from expbuf.client import trxp

from ..store import Advantage, SentApart, StageCounts, token_parts, token_record
from ..store.schema.table_config import TableConfig, batch_stage, estimator_args, estimator_of

if TYPE_CHECKING:
    from ..store import MemberView
    from .shaping import ShapingReport


def finish_batch(
    config: TableConfig,
    records: Sequence[MemberView],
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
    config: TableConfig, records: Sequence[MemberView], stored: Sequence[Advantage], report: ShapingReport
) -> list[Advantage]:
    import torch

    from . import estimators, shaping

    if any(a is None for a in stored):  # experiences not computed yet (Get): finish the others
        done = [i for i, a in enumerate(stored) if a is not None]
        out = list(stored)
        if not done:  # none computed: nothing to finish (a token-valued stage cannot run on no tokens)
            return out
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
    estimator, args, settings = estimator_of(config), estimator_args(config), config.advantages.shaping
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
        values = _in_float32(torch, values)
        return [(float(v), rec.response_length) for v, rec in zip(values.tolist(), records, strict=True)]
    lengths, masks, returns = [], [], []
    for record in stored:
        if record is None or isinstance(record, (tuple, SentApart)):
            raise ValueError("a token-level table's experience holds one stored value, not its token-level record")
        length, mask, returned = token_parts(record)
        lengths.append(length)
        masks.append(_floats(torch, mask))
        returns.append(_floats(torch, returned))
    rows.mask, rows.returns = torch.cat(masks).double(), torch.cat(returns).double()
    rows.returns = shaping.clip_advantages(settings, rows.returns, report)  # the returns as advantages, clipped
    advantages = _in_float32(torch, estimator.batch_stage()(rows, **args))
    return [
        token_record(n, trxp.raw_of(a.float()).data, trxp.raw_of(r).data)
        for a, r, n in zip(advantages.split(lengths), returns, lengths, strict=True)
    ]


def _in_float32(torch: Any, values: Any) -> Any:
    """Finished values within float32's range, in which a batch carries them: a batch's std of 0
    divides by its epsilon alone (1e-6), so rewards past 3.4e32 would finish past it, fail to pack
    and fail every Sample of the batch again. Those are served at float32's largest instead (Trinity-
    RFT's would be infinite; no infinity is served). What ingest stored is finite already."""
    largest = torch.finfo(torch.float32).max
    return values.clamp(-largest, largest)


def _floats(torch: Any, data: bytes) -> Any:
    """A stored token-level part as float32s: none for an empty response, which frombuffer refuses."""
    if not data:
        return torch.zeros(0, dtype=torch.float32)
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


def _batch_reward(rec: MemberView) -> float:
    """The reward the batch stage's statistics see: shaped where shaping ran on ingest."""
    reward = rec.shaped_reward if rec.shaped_reward is not None else rec.reward
    return reward or 0.0
