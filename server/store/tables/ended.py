"""The latest leases and grants a server saw end, remembered by their ids in memory for its run
(the writer's alone): an ack, a nack or a grant's finish made again after its reply was lost
answers as the first did, and one made after another end (an expiry) says which. Kept ENDED_KEPT
of each kind, about 200 bytes each; forgotten at a restart, where a repeat is told the id is unknown.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

ENDED_KEPT = 16384
V = TypeVar("V")


class RecentEnds(Generic[V]):
    """The ends of one kind, the latest ENDED_KEPT by id. A caller reads one only where its record is
    gone from the disk: an end remembered by a transaction that was then undone is not an end."""

    def __init__(self, kept: int = ENDED_KEPT) -> None:
        self._kept = kept
        self._ended: OrderedDict[str, V] = OrderedDict()

    def add(self, key: str, how: V) -> None:
        self._ended[key] = how
        self._ended.move_to_end(key)
        if len(self._ended) > self._kept:
            self._ended.popitem(last=False)

    def get(self, key: str) -> V | None:
        return self._ended.get(key)
