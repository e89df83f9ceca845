"""What a rollout worker's admission returns: the rollouts it may start now, under a grant
(`Grant`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Grant:
    """Rollouts a worker may start now (`count`, 0 when there was no room), under a grant
    that expires at `expires` (Unix time) unless finished with `finish_grant`."""

    count: int
    grant_id: str
    expires: float
    table: str
