"""Which leased batches TRL's trainer has taken samples of, and when each may be acked.

TRL's trainer takes samples before it trains them: transformers fetches all of a step's
micro-batches before the first forward, accelerate's loader fetches one micro-batch more
ahead, and TRL's token-budget batcher takes the first sample of the next micro-batch to find
that it does not fit. So what was taken by the next `get` is not yet trained, and a lease is
acked at a step's end instead, `lag` steps after the one in which its last sample was taken:
with one micro-batch per step, what is taken during step t (a micro-batch ahead, and one
sample more) is trained by the end of step t + 2; with two or more, by the end of step t + 1.
A lease not yet due when the trainer stops goes back (nack), so its untrained samples are
trained by a later run and no acked sample was left untrained.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..results import Batch


def ack_lag(gradient_accumulation_steps: int) -> int:
    """Step ends between the one before a lease's last sample was taken and its ack."""
    return 3 if gradient_accumulation_steps <= 1 else 2


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

    def hold(self, batch: Batch, size: int) -> None:
        """A batch whose `size` samples are queued for the trainer."""
        with self._changed:
            self._held[batch.lease_id] = _Held(batch, size, taken_by=None if size else self._steps)

    def taken(self, lease_id: str) -> None:
        """The trainer took one more sample of this lease."""
        with self._changed:
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
