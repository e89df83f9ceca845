"""Which leased batches TRL's trainer has taken samples of, and when each may be acked.

TRL's trainer takes samples before it trains them: transformers fetches all of a step's
micro-batches before the first forward, accelerate's loader fetches one micro-batch more
ahead, and TRL's token-budget batcher takes the first sample of the next micro-batch to find
that it does not fit. So what was taken by the next `get` is not yet trained, and a lease is
acked at a step's end instead, `lag` steps after the one in which its last sample was taken:
with one micro-batch per step, what is taken during step t (a micro-batch ahead, and one
sample more) is trained by the end of step t + 2; with two or more, by the end of step t + 1.
When training ends after its last step, the lag no longer stands for steps to come: what TRL
fetched ahead then is its loader's next micro-batch (and, with the token budget, the first
sample of the one after), all of it taken during the last step's fetch. So at the end a lease
is acked as soon as every sample of it went into a micro-batch a finished step trained: the
book keeps the samples of the last fetch (from the first sample of a micro-batch on) and has
TRL's own micro-batcher say where the micro-batches the last step trained end among them.
Every other lease goes back (nack), so its untrained samples are trained by a later run and
no acked sample was left untrained.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from ..results import Batch

log = logging.getLogger("expbuf.trl")


def ack_lag(gradient_accumulation_steps: int) -> int:
    """Step ends between the one before a lease's last sample was taken and its ack."""
    return 3 if gradient_accumulation_steps <= 1 else 2


class Planner(Protocol):
    """How the trainer makes micro-batches of the samples it takes (TRL's planner, as set up)."""

    accumulation: int  # micro-batches a step trains
    reads_ahead: bool  # it takes the first sample of the next micro-batch to end one

    def planned(self, samples: list[Any], count: int) -> int | None:
        """How many of `samples` (from the first of a micro-batch on) come up to the last one the
        first `count` micro-batches hold; None when they do not fill `count` micro-batches."""
        ...


@dataclass
class _Held:
    batch: Batch
    size: int
    taken: int = 0
    taken_by: int | None = None  # the step ends counted when its last sample was taken


class LeaseBook:
    """The leases the worker holds, in the order their samples go to the trainer."""

    def __init__(self, lag: int = ack_lag(1)) -> None:
        self.lag = lag
        self._changed = threading.Condition()
        self._held: dict[str, _Held] = {}
        self._steps = 0
        self._planner: Planner | None = None
        # The samples of the last fetch, as (lease, sample; None if TRL's queue dropped it), from
        # the first sample of a micro-batch on; taken when `_tail_steps` step ends were counted.
        self._tail: list[tuple[str, Any]] = []
        self._tail_steps = 0

    def begin(self, planner: Planner) -> None:
        """Training begins: its steps are counted from here, their micro-batches `planner`'s."""
        with self._changed:
            self.lag = ack_lag(planner.accumulation)
            self._planner, self._steps, self._tail, self._tail_steps = planner, 0, [], 0

    def hold(self, batch: Batch, size: int) -> None:
        """A batch whose `size` samples are queued for the trainer."""
        with self._changed:
            self._held[batch.lease_id] = _Held(batch, size, taken_by=None if size else self._steps)

    def taken(self, lease_id: str, sample: Any | None) -> None:
        """The trainer took one more sample of this lease (None: one TRL's queue drops as stale)."""
        with self._changed:
            if self._planner is not None:
                if self._tail_steps != self._steps:  # a step's fetch begins: a micro-batch begins with it
                    self._tail = self._tail[-1:] if self._planner.reads_ahead else []
                    self._tail_steps = self._steps
                self._tail.append((lease_id, sample))
            held = self._held[lease_id]
            held.taken += 1
            if held.taken == held.size:
                held.taken_by = self._steps
                self._changed.notify_all()

    def wait_for_room(self, ahead: int, timeout: float) -> bool:
        """Wait until fewer than `ahead` batches have samples not yet taken; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._untaken() < ahead, timeout)

    def _untaken(self) -> int:
        return sum(1 for held in self._held.values() if held.taken_by is None)

    def step_ended(self) -> list[Batch]:
        """A trainer step ended: the batches now trained, which leave the book to be acked."""
        with self._changed:
            self._steps += 1
            due = [
                lease
                for lease, held in self._held.items()
                if held.taken_by is not None and self._steps >= held.taken_by + self.lag
            ]
            return [self._held.pop(lease).batch for lease in due]

    def trained(self) -> list[Batch]:
        """Training ended after its last step: the batches every sample of which a finished step
        trained, which leave the book to be acked (what is left goes back with `release`)."""
        with self._changed:
            planner = self._planner
            if planner is None or not self._steps:
                return []
            # the tail begins training's first fetch, or the micro-batch after the first one a fetch made
            before = self._tail_steps * planner.accumulation + 1 if self._tail_steps else 0
            count = self._steps * planner.accumulation - before  # micro-batches of the tail trained
            kept = [(at, sample) for at, (_, sample) in enumerate(self._tail) if sample is not None]
            end = planner.planned([sample for _, sample in kept], count) if count > 0 else 0
            if end is None:
                log.warning(
                    "the trainer's last fetch does not fill the %d micro-batches its last step trained: "
                    "every batch of that fetch goes back",
                    count,
                )
                end = 0
            cut = kept[end - 1][0] + 1 if end else 0
            untrained = {lease for lease, _ in self._tail[cut:]}
            done = [lease for lease, held in self._held.items() if held.taken_by is not None and lease not in untrained]
            return [self._held.pop(lease).batch for lease in done]

    def held(self) -> list[Batch]:
        """Every batch still held (its lease to be kept)."""
        with self._changed:
            return [held.batch for held in self._held.values()]

    def release(self) -> list[Batch]:
        """Every batch still held, which leaves the book (to be given back)."""
        with self._changed:
            batches = [held.batch for held in self._held.values()]
            self._held.clear()
            self._changed.notify_all()
            return batches
