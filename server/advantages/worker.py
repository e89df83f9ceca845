"""Advantages on ingest: the worker that computes them for completed groups.

A table whose estimator gives one value per experience from the item records alone (no
tokens read or valued, no batch stage) on the CPU has its advantages computed by the push
that completes a group, and stored in the push's own transaction (`computed_in_push`; the
storage engine calls the worker's `in_push`, on the pushing thread before the transaction for
the groups the push fills whole): each record is written once, ready with its value.
For the others, and for groups a push leaves (store/rules/pushed_advantages.py says
when), the store marks a completed group `computing` and queues it; this worker takes
every queued group (all tables, oldest first), computes each table's estimator in one
batched call on the table's device, and hands the results back to the store, which
makes the groups ready in the same transaction that stores their advantages. The Push
ack does not wait for it, and no experience is sampled before it is done. A computation
that fails is retried group by group, so only a group that fails on its own fails, with
the reason in Stats, and the worker goes on; one that yields a non-finite value fails
the groups it belongs to: no NaN or infinity is stored or served. How the results are
stored is `encode_results` here and store/disk/stored_advantages.py; how they reach a sampled
batch, advantages/batch_stage.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from expbuf.client import trxp
from expbuf.client.trxp.codec.convert import flat_tensor

from ..store import SHAPING_COUNTERS, Compute, Computed, ComputeJob, MemberView, ShapingUpdate, Store, token_record
from ..store.schema.errors import NotFound, clip
from ..store.schema.table_config import TableConfig, batch_stage, estimator_args, estimator_of, group_step_first
from . import estimators, shaping
from .moments import RunningMoments

log = logging.getLogger("expbuf.advantages")


def encode_results(result: estimators.Advantages, batch: estimators.FlatBatch) -> list[float | bytes]:
    """What the store keeps for each experience: its one value, or its token-level record."""
    if result.scalar is not None:
        return [float(v) for v in result.scalar.double().cpu().tolist()]
    lengths = batch.lengths.tolist()
    token_advantages, token_returns = result.token_values()
    advantages = token_advantages.float().cpu().split(lengths)
    returns = token_returns.float().cpu().split(lengths)
    return [
        token_record(n, trxp.raw_of(a).data, trxp.raw_of(r).data)
        for a, r, n in zip(advantages, returns, lengths, strict=True)
    ]


def build_batch(
    records: Sequence[MemberView],
    items: Sequence[trxp.RawItem] | None = None,
    shape: Callable[[estimators.FlatBatch], torch.Tensor] | None = None,
) -> tuple[estimators.FlatBatch, list[str]]:
    """Flat estimator inputs from the item records of the completed groups of one table
    (and their payloads, for token-level estimators), with the group keys in the order of
    their numbers. `shape` turns the batch into the rewards the estimator sees, before
    they are put on the tokens."""
    index: dict[str, dict[str, int]] = {"group": {}, "task": {}, "run": {}}

    def numbers(kind: str, field: str) -> torch.Tensor:
        seen = index[kind]
        return torch.tensor([seen.setdefault(getattr(rec, field), len(seen)) for rec in records], dtype=torch.int64)

    f64 = torch.float64
    batch = estimators.FlatBatch(
        rewards=torch.tensor([float(rec.reward or 0.0) for rec in records], dtype=f64),
        group=numbers("group", "group"),
        lengths=torch.tensor([rec.response_length for rec in records], dtype=torch.int64),
        generated=torch.tensor([rec.generated for rec in records], dtype=f64),
        task=numbers("task", "tid"),
        run=numbers("run", "rid"),
        step=torch.tensor([rec.step for rec in records], dtype=torch.int64),
    )
    if shape is not None:
        batch.rewards = shape(batch)
    if items is not None:
        masks = [flat_tensor(item.tensors.get("action_mask"), rec.response_length, 1, f64) for item, rec in zip(
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


def compute(job: ComputeJob, device: torch.device | None = None) -> Computed:
    """Advantages of one job: (what to store by uid, ready groups, dropped groups, failed
    groups with the reason, what reward shaping did), computed on `device` (the table's
    unless given), where the estimator's every input is moved. Shaping runs in LightRFT's order
    (advantages/shaping.py): the overlong penalty on the rewards; the running normalisation and the
    reward clip, group by group in the job's order (the groups' completion order), on the
    values of an estimator's group step or else on the rewards; the advantage clip last,
    unless the batch stage finishes the values."""
    config, settings = job.config, job.config.advantages.shaping
    uids = [uid for members in job.members for uid in members]
    items = None
    if estimator_of(config).token_level:
        items = [item for uid in uids for item in trxp.parse(job.blobs[uid], trusted=True)]
    moments = RunningMoments.of(job.moments)
    report = shaping.ShapingReport()
    sizes = [len(members) for members in job.members]
    first = group_step_first(config)
    unshapeable: set[int] = set()  # groups whose shaped values came out non-finite

    def shape(batch: estimators.FlatBatch) -> torch.Tensor:
        nonlocal moments, unshapeable
        rewards = shaping.penalise_overlong(settings, batch.rewards, batch.generated, report)
        if not first:
            rewards, moments, unshapeable = shaping.shape(
                settings, rewards, sizes, [True] * len(sizes), moments, report
            )
        return rewards

    records = [job.records[uid] for uid in uids]
    batch, group_keys = build_batch(records, items, shape)
    device = device or estimators.resolve_device(config.advantages.device)
    result = estimators.estimate(config.advantages.estimator, batch.to(device), estimator_args(config))
    dropped = []
    if result.drop_groups is not None:
        dropped = [group_keys[i] for i in result.drop_groups.nonzero().squeeze(1).cpu().tolist()]
    if first and settings.shapes_values:  # groups dropped or already non-finite take no part
        finite = result.finite(batch).cpu().split(sizes)
        keep = [gkey not in dropped and bool(f.all()) for gkey, f in zip(job.groups, finite, strict=True)]
        result.scalar, moments, unshapeable = shaping.shape(
            settings, result.scalar_values(), sizes, keep, moments, report
        )
    finite = dict(zip(uids, result.finite(batch).cpu().tolist(), strict=True))
    if not batch_stage(config):  # after the non-finite check: clipping would hide an infinity
        if result.scalar is not None:
            result.scalar = shaping.clip_advantages(settings, result.scalar, report)
        else:
            result.advantages = shaping.clip_advantages(settings, result.token_values()[0], report)
    values = dict(zip(uids, encode_results(result, batch), strict=True))
    failed = {}
    for index, (gkey, members) in enumerate(zip(job.groups, job.members, strict=True)):
        if gkey in dropped:
            continue
        if index in unshapeable:
            failed[gkey] = "the running reward normalisation gave a non-finite value (NaN or infinity)"
        elif not all(finite[uid] for uid in members):
            failed[gkey] = (
                f"{config.advantages.estimator} gave a non-finite advantage (NaN, infinity, or beyond float32's range, "
                "in which advantages are served)"
            )
    ready = [gkey for gkey in job.groups if gkey not in set(dropped) and gkey not in failed]
    update = ShapingUpdate(
        counts={name: getattr(report, name) for name in SHAPING_COUNTERS},
        moments=moments.stored() if settings.reward_running_norm else job.moments,
    )
    if batch_stage(config) and settings.shapes_rewards:  # the batch stage's statistics use them
        update.rewards = dict(zip(uids, batch.rewards.tolist(), strict=True))
    return values, ready, dropped, failed, update


def computed_in_push(config: TableConfig, cuda: bool) -> bool:
    """Whether a push computes the table's advantages itself: its estimator gives one value
    per experience from the item records (rewards, lengths, ids), with no batch stage, on
    the CPU (`cuda`: whether the server has a CUDA device, which device "auto" takes)."""
    estimator = estimator_of(config)
    return (
        estimator.ingest is not None
        and not (estimator.token_level or estimator.token_valued or batch_stage(config))
        and (config.advantages.device == "cpu" or (config.advantages.device == "auto" and not cuda))
    )


def use_threads(threads: int) -> None:
    """torch's intra-op threads in this process (0 leaves torch's own default): the server's
    computations are a push's groups or a worker's batch, too small to gain from more threads
    on a few cores, where a second one costs every table CPU (bench/RESULTS.md)."""
    if threads > 0:
        torch.set_num_threads(threads)


class AdvantageWorker:
    """Computes advantages for completed groups as they arrive, in a background thread.

    A batched computation that fails is tried group by group. A group that fails while
    others succeed is the cause: it fails at once. When every group fails (one group
    alone, or a GPU out of memory for all), the cause may be passing: the table's groups
    stay computing and are tried again after `retry_delays`, and fail only after the
    last try. What a pass raises is retried; what is not an Exception ends the thread,
    and `on_ended` hears it.
    """

    def __init__(
        self,
        store: Store,
        *,
        batch_limit: int = 8192,
        on_computed: Callable[[ComputeJob, float], None] | None = None,
        on_failed: Callable[[ComputeJob, str, int], None] | None = None,
        on_ended: Callable[[BaseException], None] | None = None,
        retry_delays: Sequence[float] = (1.0, 4.0),
    ) -> None:
        self.store = store
        self.batch_limit = batch_limit
        self.on_computed = on_computed  # (job, seconds), for the metrics
        self.on_failed = on_failed  # (job, "retried" or "failed", groups), for the metrics
        self.on_ended = on_ended  # what ended its thread before a stop, on that thread
        self.retry_delays = tuple(retry_delays)
        # by the table's id, not its name: a table made again under the name starts afresh
        self._tries: dict[tuple[int | None, str], int] = {}  # (table id, group) -> failed tries so far
        self._not_before: dict[int | None, float] = {}  # table id -> monotonic time of its next try
        self._cuda = torch.cuda.is_available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="expbuf-advantages", daemon=True)

    def in_push(self, config: TableConfig) -> Compute | None:
        """The computation a push runs for the table's completed groups in its own transaction
        (the store's `in_push`), timed for the metrics as the worker's are; None where the
        worker computes them."""
        return self._timed if computed_in_push(config, self._cuda) else None

    def _timed(self, job: ComputeJob) -> Computed:
        started = time.perf_counter()
        result = compute(job)
        if self.on_computed is not None:
            self.on_computed(job, time.perf_counter() - started)
        return result

    def start(self) -> AdvantageWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.store.wake()  # a wait for new groups ends now, not at its timeout
        self._thread.join()

    def run_once(self) -> int:
        """Compute every queued group once (tables waiting to retry excepted); returns the
        groups handled."""
        handled = 0
        now = time.monotonic()
        for job in self.store.compute_backlog(self.batch_limit):
            if self._not_before.get(job.table_id, 0.0) > now:
                continue
            started = time.perf_counter()
            computed = self._compute(job)
            handled += len(job.groups)
            if computed and self.on_computed is not None:  # a try that computed nothing is no timing
                self.on_computed(job, time.perf_counter() - started)
        return handled

    def _compute(self, job: ComputeJob) -> bool:
        """One batched computation; if it fails, each group on its own (the running reward
        moments chain through those tries, and a failed try leaves them as they were). Whether a
        group of it was computed."""
        try:
            self._finish(job, compute(job))
            return True
        except NotFound:
            self._gone(job)
            return False
        except Exception as exc:
            errors = {job.groups[0]: exc} if len(job.groups) == 1 else {}
            if not errors:
                log.warning(
                    "advantages failed for %d groups of table %s together (%s); trying each on its own",
                    len(job.groups), job.table, said(exc),
                )  # fmt: skip
        moments = job.moments
        for single in job.split() if len(job.groups) > 1 else []:
            single.moments = moments
            try:
                moments = self._finish(single, compute(single))
            except NotFound:
                self._gone(job)
                return False
            except Exception as exc:
                errors[single.groups[0]] = exc
        if len(errors) < len(job.groups):  # the others went through: these groups are the cause
            self._fail(job, errors)
            return True
        tries = max(self._tries.get((job.table_id, gkey), 0) for gkey in errors) + 1
        if tries > len(self.retry_delays):
            self._fail(job, errors)
            return False
        for gkey in errors:
            self._tries[(job.table_id, gkey)] = tries
        delay = self.retry_delays[tries - 1]
        self._not_before[job.table_id] = time.monotonic() + delay
        log.warning(
            "advantages failed for every group of table %s tried (%s); trying again in %gs (try %d of %d)",
            job.table, said(next(iter(errors.values()))), delay, tries, len(self.retry_delays) + 1,
        )  # fmt: skip
        self._failed(job, "retried", len(errors))
        return False

    def _finish(self, job: ComputeJob, result: tuple) -> list[float] | None:
        """Store a computation; returns the running moments it leaves (the job's own where the
        store did not take it: a group of it was pushed again meanwhile)."""
        values, ready, dropped, failed, update = result
        if not self.store.finish_compute(
            job.table, values, ready, dropped, failed, update, places=job.queued(), table_id=job.table_id
        ):
            return job.moments
        for gkey in job.groups:
            self._tries.pop((job.table_id, gkey), None)
        for gkey, reason in failed.items():
            log.warning("group failed: table %s, group %s: %s", job.table, gkey, reason)
        for gkey in dropped:
            log.info("group dropped: table %s, group %s, reason std_threshold", job.table, gkey)
        return update.moments

    def _fail(self, job: ComputeJob, errors: dict[str, Exception]) -> None:
        advantages = job.config.advantages
        device = estimators.resolve_device(advantages.device).type
        reasons = {
            gkey: f"{advantages.estimator} on {device}: {type(exc).__name__}: {said(exc)}"
            for gkey, exc in errors.items()
        }
        for gkey, reason in reasons.items():
            self._tries.pop((job.table_id, gkey), None)
            log.error("advantages failed for group %s of table %s: %s", clip(gkey), job.table, reason)
        try:
            self.store.finish_compute(job.table, {}, [], failed=reasons, places=job.queued(), table_id=job.table_id)
        except NotFound:
            self._gone(job)
            return
        self._failed(job, "failed", len(errors))

    def _gone(self, job: ComputeJob) -> None:
        """The job's table was dropped while its groups were computed (a table made again under its
        name since is another): what was computed goes nowhere, and its tries and its wait go too."""
        self._not_before.pop(job.table_id, None)
        for key in [key for key in self._tries if key[0] == job.table_id]:
            del self._tries[key]
        log.info("table %s was dropped while advantages were computed for %d of its groups", job.table, len(job.groups))

    def _failed(self, job: ComputeJob, outcome: str, groups: int) -> None:
        if self.on_failed is not None:
            self.on_failed(job, outcome, groups)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                generation = self.store.generation
                try:
                    if self.run_once():
                        continue
                except Exception:
                    log.exception("advantage worker error; retrying")
                self.store.wait_for_change(generation, 0.5)
        except BaseException as exc:  # a pass's retry lets it through (a SystemExit, which a thread ends by unsaid)
            if self.on_ended is None:
                raise
            self.on_ended(exc)


def said(exc: Exception) -> str:
    """An estimator's error on one line, clipped: a message of several lines (a traceback's text,
    a tensor printed) made log entries of several, which a log's reader takes for others."""
    return clip(str(exc).replace("\r", "\\r").replace("\n", "\\n"), 300)
