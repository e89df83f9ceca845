"""SampleQueue: the `rollout_buffer` TRL's trainer drains, over the batches the worker leased.

It is a `queue.Queue` (TRL's trainer calls `get(timeout=...)` and `qsize()` on it, and its
protocol types the attribute as one), filled only by the worker with each leased batch's
samples at once; taking a sample tells the worker (for its lease book, leases.py), under the
queue's lock, which lease the sample the trainer took belongs to.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable, Sequence

from trl.experimental.async_grpo.async_rollout_worker import RolloutSample


class SampleQueue(queue.Queue[RolloutSample]):
    def __init__(self, taken: Callable[[str, RolloutSample], None]) -> None:
        super().__init__()
        self._taken = taken
        self._leases: deque[str] = deque()  # the lease of each queued sample, in the same order

    def add(self, lease_id: str, samples: Sequence[RolloutSample]) -> None:
        """Queue a leased batch's samples (what Queue.put does, for all of them under one lock)."""
        with self.not_empty:
            self.queue.extend(samples)
            self._leases.extend([lease_id] * len(samples))
            self.unfinished_tasks += len(samples)
            self.not_empty.notify(len(samples))

    def _put(self, item: RolloutSample) -> None:
        raise TypeError("the expbuf rollout worker fills this queue from its table; push experiences to the table")

    def _get(self) -> RolloutSample:
        sample = self.queue.popleft()
        self._taken(self._leases.popleft(), sample)
        return sample

    def clear(self) -> None:
        """Drop every queued sample (the worker stops; their leases go back)."""
        with self.mutex:
            self.queue.clear()
            self._leases.clear()
            self.unfinished_tasks = 0
