"""Advantages on ingest: the worker that computes them for completed groups, and their
storage form.

When a group completes, the store marks it `computing` and queues it; this worker takes
every queued group (all tables, oldest first), computes each table's estimator in one
batched call on the table's device, and hands the results back to the store, which
makes the groups ready in the same transaction that stores their advantages. The Push
ack does not wait for it, and no experience is sampled before it is done. A failed
computation fails its groups, with the reason in Stats, and the worker goes on.

Stored form, per experience: one value in its item record when every generated token
carries the same value (every estimator but the token-level ones), or a record of (response
length u32) + float32 advantages + float32 returns. `expand` turns either into the
`advantages` and `returns` tensors of a sampled batch (value * action_mask).

An estimator with a batch stage stores pending values instead (see estimators.py), and
`finish_batch` turns the pending values of a sampled batch into its advantages, in the
stored forms, before `expand`. A computation that yields a non-finite value fails the groups
it belongs to: no NaN or infinity is stored or served.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from expbuf.client import trxp

from . import estimators
from .errors import clip
from .store import Advantage, ComputeJob, Store
from .tables import TOKEN_LEVEL, TableConfig, batch_stage, estimator_args

log = logging.getLogger("expbuf.advantages")
_LENGTH = struct.Struct("<I")
_F32 = struct.Struct("<f")
_MASK_LETTERS = bytes.maketrans(
    b"\x00\x01", b"ab"
)  # zero bytes carry no "b": the second replace sees only mask letters


def _flat_bytes(raw: trxp.RawTensor | None, length: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
    if raw is None:
        return torch.full((length,), fill, dtype=dtype)
    return trxp.tensor_of(raw).reshape(-1).to(dtype)


def build_batch(
    records: Sequence[dict[str, Any]], items: Sequence[trxp.RawItem] | None = None
) -> tuple[estimators.FlatBatch, list[str]]:
    """Flat estimator inputs from the item records of the completed groups of one table
    (and their payloads, for token-level estimators), with the group keys in the order of
    their numbers."""
    index: dict[str, dict[str, int]] = {"group": {}, "task": {}, "run": {}}

    def numbers(kind: str, field: str) -> torch.Tensor:
        seen = index[kind]
        return torch.tensor([seen.setdefault(rec[field], len(seen)) for rec in records], dtype=torch.int64)

    f64 = torch.float64
    batch = estimators.FlatBatch(
        rewards=torch.tensor([float(rec["r"] or 0.0) for rec in records], dtype=f64),
        group=numbers("group", "g"),
        lengths=torch.tensor([rec["L"] for rec in records], dtype=torch.int64),
        generated=torch.tensor([rec["G"] for rec in records], dtype=f64),
        task=numbers("task", "tid"),
        run=numbers("run", "rid"),
        step=torch.tensor([rec["k"] for rec in records], dtype=torch.int64),
    )
    if items is not None:
        masks = [_flat_bytes(item.tensors.get("action_mask"), rec["L"], 1, f64) for item, rec in zip(
            items, records, strict=True)]  # fmt: skip
        batch.mask = torch.cat(masks) if masks else torch.zeros(0, dtype=f64)
        rewards = batch.rewards.tolist()
        batch.token_rewards = torch.cat(
            [_token_rewards(item, m, r) for item, m, r in zip(items, masks, rewards, strict=True)]
            or [torch.zeros(0, dtype=f64)]
        )
    return batch, list(index["group"])


def _token_rewards(item: trxp.RawItem, mask: torch.Tensor, reward: float) -> torch.Tensor:
    """Pushed token-level rewards, or the scalar reward on the last response token (where
    Trinity-RFT's trainer puts it)."""
    raw = item.tensors.get("token_level_reward")
    if raw is not None:
        return trxp.tensor_of(raw).reshape(-1).to(torch.float64)
    out = torch.zeros_like(mask)
    if out.numel():
        out[-1] = reward
    return out


def encode_results(result: estimators.Advantages, batch: estimators.FlatBatch) -> list[float | bytes]:
    """What the store keeps for each experience: its one value, or its token-level record."""
    if result.scalar is not None:
        return [float(v) for v in result.scalar.double().cpu().tolist()]
    lengths = batch.lengths.tolist()
    advantages = result.advantages.float().cpu().split(lengths)
    returns = result.returns.float().cpu().split(lengths)
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
        if raw is not None and raw.dtype == "BOOL":  # bytes 0/1 -> float32 0 / value, by two byte-string replaces
            data = bytes(raw.data).translate(_MASK_LETTERS).replace(b"a", bytes(4)).replace(b"b", _F32.pack(value))
        if data is not None and len(data) == 4 * length:
            values = trxp.RawTensor("F32", (length,), data)
        else:
            values = trxp.raw_of(_flat_bytes(raw, length, 1, torch.float32) * value)
        return {"advantages": values, "returns": values}
    record = bytes(advantage)
    (length,) = _LENGTH.unpack_from(record)
    middle = _LENGTH.size + 4 * length
    return {
        "advantages": trxp.RawTensor("F32", (length,), record[_LENGTH.size : middle]),
        "returns": trxp.RawTensor("F32", (length,), record[middle:]),
    }


def compute(job: ComputeJob) -> tuple[dict[str, float | bytes], list[str], list[str], dict[str, str]]:
    """Advantages of one job: (what to store by uid, ready groups, dropped groups, failed
    groups with the reason)."""
    config = job.config
    uids = [uid for members in job.members for uid in members]
    items = None
    if config.estimator in TOKEN_LEVEL:
        items = [item for uid in uids for item in trxp.parse(job.blobs[uid], trusted=True)]
    batch, group_keys = build_batch([job.records[uid] for uid in uids], items)
    device = estimators.resolve_device(config.device)
    result = estimators.estimate(config.estimator, batch.to(device), estimator_args(config))
    finite = dict(zip(uids, result.finite(batch).cpu().tolist(), strict=True))
    values = dict(zip(uids, encode_results(result, batch), strict=True))
    dropped = []
    if result.drop_groups is not None:
        dropped = [group_keys[i] for i in result.drop_groups.nonzero().squeeze(1).cpu().tolist()]
    failed = {}
    for gkey, members in zip(job.groups, job.members, strict=True):
        if gkey not in dropped and not all(finite[uid] for uid in members):
            failed[gkey] = f"{config.estimator} gave a non-finite advantage (NaN or infinity)"
    ready = [gkey for gkey in job.groups if gkey not in set(dropped) and gkey not in failed]
    return values, ready, dropped, failed


def finish_batch(
    config: TableConfig, records: Sequence[dict[str, Any]], stored: Sequence[Advantage]
) -> list[Advantage]:
    """The batch stage: the advantages of a sampled batch (its item records and stored
    values, in batch order) from the pending values its estimator stored on ingest. Tables
    without a batch stage get their stored values back unchanged."""
    if not batch_stage(config) or not records:
        return list(stored)
    if any(a is None for a in stored):  # experiences not computed yet (Get): finish the others
        done = [i for i, a in enumerate(stored) if a is not None]
        out = list(stored)
        for i, value in zip(
            done, finish_batch(config, [records[i] for i in done], [stored[i] for i in done]), strict=True
        ):
            out[i] = value
        return out
    f64 = torch.float64
    runs: dict[str, int] = {}
    rows = estimators.SampledRows(
        pending=torch.tensor([a[0] if isinstance(a, tuple) else 0.0 for a in stored], dtype=f64),
        rewards=torch.tensor([float(rec["r"] or 0.0) for rec in records], dtype=f64),
        generated=torch.tensor([rec["G"] for rec in records], dtype=f64),
        run=torch.tensor([runs.setdefault(rec["rid"], len(runs)) for rec in records], dtype=torch.int64),
        step=torch.tensor([rec["k"] for rec in records], dtype=torch.int64),
    )
    args = estimator_args(config)
    if config.estimator != "reinforceplusplus":
        values = estimators.FINISH[config.estimator](rows, **args)
        return [(float(v), rec["L"]) for v, rec in zip(values.tolist(), records, strict=True)]
    lengths, masks, returns = [], [], []
    for record in stored:
        (length,) = _LENGTH.unpack_from(record)
        middle = _LENGTH.size + 4 * length
        lengths.append(length)
        masks.append(torch.frombuffer(bytearray(record[_LENGTH.size : middle]), dtype=torch.float32))
        returns.append(torch.frombuffer(bytearray(record[middle:]), dtype=torch.float32))
    rows.mask, rows.returns = torch.cat(masks).double(), torch.cat(returns).double()
    advantages = estimators.FINISH["reinforceplusplus"](rows, **args)
    return [
        _LENGTH.pack(n) + trxp.raw_of(a.float()).data + trxp.raw_of(r).data
        for a, r, n in zip(advantages.split(lengths), returns, lengths, strict=True)
    ]


class AdvantageWorker:
    """Computes advantages for completed groups as they arrive, in a background thread."""

    def __init__(
        self,
        store: Store,
        *,
        batch_limit: int = 8192,
        on_computed: Callable[[str, str, float], None] | None = None,
    ) -> None:
        self.store = store
        self.batch_limit = batch_limit
        self.on_computed = on_computed  # (table, estimator, seconds), for the metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expbuf-advantages", daemon=True)

    def start(self) -> AdvantageWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def run_once(self) -> int:
        """Compute every queued group once; returns the groups handled."""
        handled = 0
        for job in self.store.compute_backlog(self.batch_limit):
            started = time.perf_counter()
            self._compute(job)
            handled += len(job.groups)
            if self.on_computed is not None:
                self.on_computed(job.table, job.config.estimator, time.perf_counter() - started)
        return handled

    def _compute(self, job: ComputeJob) -> None:
        """One batched computation. If it fails, each group is tried on its own, so that
        only a group that fails by itself fails (and keeps its payloads, see keep_failed)."""
        try:
            values, ready, dropped, failed = compute(job)
        except Exception as exc:
            if len(job.groups) > 1:
                log.warning(
                    "advantages failed for %d groups of table %s together (%s); trying each on its own",
                    len(job.groups), job.table, clip(str(exc), 300),
                )  # fmt: skip
                for single in job.split():
                    self._compute(single)
                return
            log.exception("advantages failed for group %s of table %s", clip(job.groups[0]), job.table)
            reason = f"{job.config.estimator} on {job.config.device}: {type(exc).__name__}: {clip(str(exc), 300)}"
            self.store.finish_compute(job.table, {}, [], failed=dict.fromkeys(job.groups, reason))
            return
        self.store.finish_compute(job.table, values, ready, dropped, failed)
        for gkey, reason in failed.items():
            log.warning("group failed: table %s, group %s: %s", job.table, gkey, reason)
        for gkey in dropped:
            log.info("group dropped: table %s, group %s, reason std_threshold", job.table, gkey)

    def _run(self) -> None:
        while not self._stop.is_set():
            generation = self.store.generation
            try:
                if self.run_once():
                    continue
            except Exception:
                log.exception("advantage worker error; retrying")
            self.store.wait_for_change(generation, 0.5)
