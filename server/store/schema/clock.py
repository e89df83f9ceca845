"""The store's clock: the wall clock's time at the server's start, carried forward by a clock that
no one sets (CLOCK_BOOTTIME, which counts a suspended machine's time too; else the monotonic one).

Every deadline the store keeps is a wall-clock time, written to the disk so that it holds across a
restart: a lease's end, a claim's, a grant's, a pending group's timeout, a tombstone's, a cooldown.
Read from the wall clock itself, a step of it while the server runs moved all of them at once: an
NTP correction or a resumed VM 10 minutes forward expired every lease at the next upkeep pass (the
batches being trained served again, their acks refused) and timed out every young pending group;
one backward held a dead trainer's batch that much longer and stopped the tombstones' sweep. This
clock moves with elapsed time alone; a restart reads the wall clock again.
"""

from __future__ import annotations

import time

_STEADY = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


class SteadyClock:
    """Seconds since the epoch, as the wall clock said at this clock's making plus the time
    elapsed since: never stepped."""

    def __init__(self) -> None:
        self._origin = time.time() - time.clock_gettime(_STEADY)

    def __call__(self) -> float:
        return self._origin + time.clock_gettime(_STEADY)
