"""ExpbufRolloutWorker: TRL's AsyncGRPOTrainer takes its rollouts from an expbuf table.

It satisfies TRL 1.16's `RolloutWorkerProtocol`. Rollouts are made elsewhere, by any expbuf
client (convert.py turns TRL-style ids, masks, log-probs and rewards into a group's
experiences), and the table computes their advantages. A thread leases whole groups, at most
`batches_ahead` batches ahead of the trainer, turns each experience into TRL's RolloutSample
and queues them on `rollout_buffer`, which the trainer drains. Only groups at least as recent
as the trainer's version minus `max_staleness` are taken (the table's version index finds
them), and TRL's queue still drops those that grew stale while queued.

Acks. A batch is acked by the TRL callback `worker.callback` at the end of a step, once every
sample of it was trained (leases.py says when; the next `get` comes before that, since TRL
fetches ahead), or at the end of training if its last step trained it, and renewed while it
waits; a batch is handed to the trainer only once the server has stored its delivery. So a
trainer that crashes gets its untrained samples again when their leases end, and a server
killed and restarted keeps every lease it had: nothing acked is lost, and no sample goes to
the trainer twice.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import queue
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from transformers import TrainerCallback
from trl.experimental.async_grpo.async_grpo_trainer import FixedCountBatcher, TokenBudgetBatcher
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ..client import BufferClient
from ..errors import ExpbufError
from ..kit.batches import take_one
from ..kit.lease_keeper import RENEWALS_PER_LEASE, LeaseKeeper
from ..kit.retry import Retry
from ..kit.tables import connect, table_info
from ..results import Batch
from .convert import rollout_samples
from .leases import LeaseBook
from .reporter import TRANSIENT, Reporter
from .sample_queue import SampleQueue

log = logging.getLogger("expbuf.trl")

# Estimators whose advantages differ from token to token: a RolloutSample has one per sequence.
TOKEN_LEVEL = frozenset({"reinforceplusplus", "discounted_return"})


class TrainerPlanner:
    """The micro-batches of TRL's trainer as `args` sets them up (AsyncGRPOTrainer's
    get_train_dataloader): TRL's own planner, the token budget's or the fixed count's, made
    again over the samples of a fetch to find where its micro-batches end."""

    def __init__(self, args: Any) -> None:
        self.accumulation = int(args.gradient_accumulation_steps)
        self.processes = int(args.world_size)
        self.token_budget = int(args.token_budget or 0)
        self.samples = int(args.per_device_train_batch_size) * self.processes
        self.reads_ahead = self.token_budget > 0  # the token budget's ends a micro-batch on a sample that does not fit

    def planned(self, samples: list[RolloutSample], count: int) -> int | None:
        """leases.Planner's: the samples as TRL's queue dataset yields them, through its planner."""
        items = [
            {"input_ids": s.input_ids, "completion_mask": s.completion_mask, "group_id": s.group_id, "at": at}
            for at, s in enumerate(samples)
        ]
        planner: Iterable[list[Any]]
        if self.reads_ahead:
            planner = TokenBudgetBatcher(items, self.processes, self.token_budget, defaultdict(list))
        else:
            planner = FixedCountBatcher(items, self.processes, self.samples)
        made = list(itertools.islice(planner, count))
        if len(made) < count:
            return None
        return 1 + max(item["at"] for rows in made for row in rows for item in row.samples)


class AckAfterStep(TrainerCallback):
    """The worker's TRL callback: it learns the trainer's settings when training begins, acks at
    each step's end the batches that are trained by then, and at the end of training those
    its last step trained."""

    def __init__(self, worker: ExpbufRolloutWorker) -> None:
        self.worker = worker
        self.began = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.worker.book.begin(TrainerPlanner(args))
        self.worker.trainer_settings(args.max_staleness)
        self.began = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.worker.reporter.ack(self.worker.book.step_ended())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.worker.reporter.ack(self.worker.book.trained())


class ExpbufRolloutWorker:
    """TRL's rollout worker over an expbuf table (pass `callbacks=[worker.callback]` with it).

    `num_groups` whole groups are leased at a time (fewer when no more are ready within
    `wait_seconds`), each for `lease_seconds`, renewed while the trainer lives. `max_staleness`
    defaults to the trainer's (`AsyncGRPOConfig.max_staleness`)."""

    def __init__(
        self,
        client: BufferClient | str,
        table: str,
        *,
        num_groups: int = 4,
        lease_seconds: float = 300.0,
        max_staleness: int | None = None,
        batches_ahead: int = 2,
        wait_seconds: float = 5.0,
        token: str | None = None,
    ) -> None:
        if num_groups < 1 or batches_ahead < 1:
            raise ValueError(f"num_groups ({num_groups}) and batches_ahead ({batches_ahead}) must be at least 1")
        if not (math.isfinite(lease_seconds) and lease_seconds > 0):
            raise ValueError(f"lease_seconds is {lease_seconds!r}; it must be a finite number of seconds > 0")
        self.client = connect(client, token)
        self.table = table
        self.config = table_info(self.client, table)
        if self.config.estimator in TOKEN_LEVEL:
            raise ValueError(
                f"expbuf table {table!r} has the estimator {self.config.estimator}, whose advantages differ from "
                "token to token; TRL's RolloutSample takes one advantage per sequence: use a group estimator"
            )
        self.num_groups = num_groups
        self.lease_seconds = lease_seconds
        self.max_staleness = max_staleness
        self.batches_ahead = batches_ahead
        self.wait_seconds = wait_seconds
        self.book = LeaseBook()
        self.rollout_buffer = SampleQueue(self._taken)
        self.metrics_queue: queue.Queue[dict[str, float]] = queue.Queue(maxsize=4096)
        self.callback = AckAfterStep(self)
        renewals = self.client.clone(timeout=lease_seconds / RENEWALS_PER_LEASE)
        lost = functools.partial(_put, self.metrics_queue, "expbuf/leases_lost_total", 1.0)  # holds no worker
        self.leases = LeaseKeeper(self.client, table, lease_seconds, renewals=renewals, lost=lambda _: lost())
        weakref.finalize(self, self.leases.close)  # a worker dropped renews nothing more
        self.reporter = Reporter(
            self.client, table, self.leases, answered=self._answered, failed=self._fail, metric=self._metric
        )
        self._version = 0
        self._queue_staleness = math.inf  # the trainer's max_staleness, by which TRL's queue drops a sample
        self._failure: Exception | None = None
        self._last_answer = time.monotonic()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    # ---- RolloutWorkerProtocol ------------------------------------------------------------

    def start(self) -> None:
        """Begin leasing (TRL calls this when training begins, after its first weight sync)."""
        if not self.callback.began:
            raise RuntimeError(
                "ExpbufRolloutWorker acks each batch from its TRL callback: pass callbacks=[worker.callback] to "
                "AsyncGRPOTrainer along with rollout_worker=worker"
            )
        if self._sampler is not None:
            return
        self._stop.clear()
        self._failure = None
        self._last_answer = time.monotonic()
        self.reporter.start()
        self._sampler = threading.Thread(target=self._sample_loop, name="expbuf-trl-sampler", daemon=True)
        self._sampler.start()

    def stop(self) -> None:
        """Stop leasing; ack what is due and give back every other batch held (TRL calls this
        when training ends, also when it fails)."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
            self._sampler = None
        self.rollout_buffer.clear()
        self.reporter.give_back(self.book.release())
        self.reporter.stop()

    def update_model_version(self, model_version: int) -> None:
        """The trainer's policy version (after each weight sync): the staleness floor of the next
        lease at once, and the table's trainer version from the reporter's thread."""
        self._version = model_version
        self.reporter.set_version(model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise when the worker stopped on an error, or the server has not answered for more
        than `stale_after_s` seconds (a restart within that is waited out)."""
        if self._failure is not None:
            raise RuntimeError(f"the expbuf rollout worker stopped: {self._failure}") from self._failure
        try:
            self.client.server_info()
        except ExpbufError as exc:
            silent = time.monotonic() - self._last_answer
            if silent > stale_after_s:
                raise RuntimeError(
                    f"expbuf at {self.client.target} has not answered for {silent:.0f}s (more than {stale_after_s:g}s):"
                    f" {exc}"
                ) from exc
        else:
            self._answered()

    # ---- the trainer's settings, from the callback ----------------------------------------

    def trainer_settings(self, max_staleness: int) -> None:
        """The trainer's staleness bound (its queue's), and the worker's unless it was given one."""
        self._queue_staleness = max_staleness
        if self.max_staleness is None:
            self.max_staleness = max_staleness
        table_bound = self.config.max_staleness
        if table_bound is not None and table_bound != self.max_staleness:
            log.warning(
                "expbuf table %s keeps max_staleness %d and the trainer %d: the stricter one decides what is trained",
                self.table,
                table_bound,
                self.max_staleness,
            )

    def _taken(self, lease_id: str, sample: RolloutSample) -> None:
        """The trainer took a sample: TRL's queue dataset drops it if it is more than the trainer's
        max_staleness versions behind the trainer's, and its planner never sees it."""
        stale = self._version - sample.model_version > self._queue_staleness
        self.book.taken(lease_id, None if stale else sample)

    # ---- the sampler thread ---------------------------------------------------------------

    def _sample_loop(self) -> None:
        retry = Retry()
        while not self._stop.is_set():
            if not self.book.wait_for_room(self.batches_ahead, 0.5):
                continue
            try:
                batches = self._take()
            except ExpbufError as exc:
                if exc.code not in TRANSIENT or self.client.closed:  # a closed client's refusal is for good
                    self._fail(exc)
                    return
                pause = retry.pause() or 0.0  # no bound: it samples again until it is stopped
                log.info("expbuf table %s: %s; sampling again in %.2fs", self.table, exc, pause)
                self._stop.wait(pause)
                continue
            retry.reset()
            self._answered()
            for batch in batches:
                try:
                    samples = rollout_samples(batch.experiences, batch.group_ids)
                except ValueError as exc:
                    self.reporter.give_back([batch])
                    self._fail(exc)
                    return
                self.book.hold(batch, len(samples))
                self.leases.hold(batch.lease_id, batch.lease_expires)
                self.rollout_buffer.add(batch.lease_id, samples)
                self._metric("expbuf/groups_sampled_total", float(len(batch.groups)))

    def _take(self) -> list[Batch]:
        """At most one batch, delivered durably (kit.batches.take_one): one whose stream broke
        after it arrived is given back instead."""
        floor = None if self.max_staleness is None else self._version - self.max_staleness
        batch = take_one(
            self.client,
            self.table,
            lambda broken: self.reporter.give_back([broken]),
            num_groups=self.num_groups,
            delivery="lease",
            lease_seconds=self.lease_seconds,
            timeout=self.wait_seconds,
            allow_partial=True,
            min_model_version=floor,
        )
        return [] if batch is None else [batch]

    # ---- what both threads report -------------------------------------------------------

    def _answered(self) -> None:
        self._last_answer = time.monotonic()

    def _fail(self, exc: Exception) -> None:
        log.error("expbuf table %s: the rollout worker stops: %s", self.table, exc)
        self._failure = exc
        self._stop.set()

    def _metric(self, key: str, value: float) -> None:
        _put(self.metrics_queue, key, value)


def _put(metrics: queue.Queue[dict[str, float]], key: str, value: float) -> None:
    with contextlib.suppress(queue.Full):  # metrics the trainer does not drain are dropped
        metrics.put_nowait({key: value})
