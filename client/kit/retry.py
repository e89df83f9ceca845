"""The one policy every adapter follows while the server cannot be reached: the pauses of the
client's own retries (`rpc.connection.BACKOFF`: from 0.125 s, doubling to 2 s, jittered), for at
most a bound from the first failure. A server that restarts is tried again within a fraction of
a second, and one that stays away is not asked more than twice a second by any adapter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import UnavailableError
from ..rpc.connection import BACKOFF, Backoff

T = TypeVar("T")


class Retry:
    """The pauses between the tries of one step (an ack, a draw, a sampler's take) while the
    server is unavailable. `within`: seconds from the first failure after which the step gives
    up (None: it goes on until its caller stops it)."""

    def __init__(self, within: float | None = None, backoff: Backoff = BACKOFF) -> None:
        self.within, self.backoff = within, backoff
        self._failures = 0
        self._deadline: float | None = None

    def pause(self) -> float | None:
        """After a failure: the seconds to wait before the next try, or None where waiting them
        would pass `within` (the caller raises what failed)."""
        now = time.monotonic()
        if self._deadline is None and self.within is not None:
            self._deadline = now + self.within
        pause = self.backoff.pause(self._failures)
        self._failures += 1
        if self._deadline is not None and now + pause >= self._deadline:
            return None
        return pause

    def reset(self) -> None:
        """The step succeeded: the next failure starts again from the shortest pause and a new bound."""
        self._failures, self._deadline = 0, None


def retried(step: Callable[[], T], within: float) -> T:
    """`step`, made again after Retry's pauses while the server is unavailable (a restart), for at
    most `within` seconds from the first failure; then what failed is raised. For a step that is
    safe to make twice (a push of the same uids, an ack as one tried before)."""
    retry = Retry(within)
    while True:
        try:
            return step()
        except UnavailableError:
            pause = retry.pause()
            if pause is None:
                raise
            time.sleep(pause)
