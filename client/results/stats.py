"""What `stats()` returns: each table's counters (`TableStats`) by table name (`BufferStats`),
and from a sharded client each table's merged over its shards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class TableStats:
    """One table's counters, as the Stats RPC reports them: experiences and groups by state,
    totals since the table was created, what shaping did, and the off-policy counts.

    A sharded client's stats hold each table merged over its shards (`merged`).
    """

    name: str
    # Live experiences by state, and their payload bytes.
    pending: int
    computing: int
    ready: int
    leased: int
    consumed: int
    bytes: int
    # Groups by live state; failed and dropped: totals since the table was created (failed groups'
    # advantages could not be computed or a member was damaged; dropped ones were filtered or timed out).
    groups_pending: int
    groups_computing: int
    groups_ready: int
    groups_leased: int
    groups_failed: int
    groups_dropped: int
    last_failure: str  # why the last failed group failed; empty when none did
    oldest_age_seconds: float
    # The least and most model versions pushed to the table (never narrowed as experiences leave);
    # -1 when none carried a version.
    min_model_version: int
    max_model_version: int
    # Totals since the table was created.
    evicted: int
    pushed: int
    duplicates: int
    sampled: int
    leases_expired: int
    damaged: int  # experiences found damaged on disk (by a read or the scrub) and quarantined, their groups failed;
    # and rollouts held in pieces with a piece found damaged, dropped
    quarantined: int  # quarantined experiences the table holds: never served (forgotten after tombstone_seconds)
    # Keyed values (put_values) the table holds, and their bytes (each key's and value's), which
    # count against capacity_bytes with the experiences' bytes.
    values: int
    value_bytes: int
    staged_bytes: int  # bytes pushes in chunks in progress staged on disk, not yet stored: within capacity_bytes
    # What reward shaping and the advantage clip did.
    overlong_penalised: int
    rewards_seen: int
    rewards_clipped: int
    advantages_seen: int
    advantages_clipped: int
    reward_running_mean: float
    reward_running_std: float
    # Off-policy control: the trainer's version (-1 before any was set), rollouts counted against
    # the admission bound, granted, returned by expired grants, and experiences dropped as stale.
    trainer_version: int
    submitted: int
    admitted: int
    grants_expired: int
    stale_dropped: int

    @property
    def live(self) -> int:
        """Experiences the table holds that are not yet consumed."""
        return self.pending + self.computing + self.ready + self.leased

    @classmethod
    def from_proto(cls, msg: Any) -> TableStats:
        """From a TableStats message, whose fields carry the same names."""
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})

    @classmethod
    def merged(cls, parts: Sequence[TableStats]) -> TableStats:
        """One table's stats over the shards that hold it: counts summed; the policy versions as the
        range over the shards that hold a versioned experience; the oldest age as the oldest; the
        trainer version as the lowest a shard holds (-1 while one has none); the running reward
        moments (each shard normalises by its own) averaged, weighted by the experiences pushed."""
        first = parts[0]
        versioned = [p for p in parts if p.max_model_version >= 0]
        weights = [p.pushed for p in parts] if any(p.pushed for p in parts) else [1] * len(parts)
        summed = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(cls) if f.name not in _NOT_SUMMED}
        return cls(
            **summed,
            name=first.name,
            last_failure=next((p.last_failure for p in parts if p.last_failure), ""),
            oldest_age_seconds=max(p.oldest_age_seconds for p in parts),
            min_model_version=min((p.min_model_version for p in versioned), default=-1),
            max_model_version=max((p.max_model_version for p in versioned), default=-1),
            trainer_version=min(p.trainer_version for p in parts),
            reward_running_mean=_weighted([p.reward_running_mean for p in parts], weights),
            reward_running_std=_weighted([p.reward_running_std for p in parts], weights),
        )


_NOT_SUMMED = frozenset(
    {
        "name",
        "last_failure",
        "oldest_age_seconds",
        "min_model_version",
        "max_model_version",
        "trainer_version",
        "reward_running_mean",
        "reward_running_std",
    }
)


def _weighted(values: Sequence[float], weights: Sequence[int]) -> float:
    return sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)


@dataclass(frozen=True)
class BufferStats(Mapping[str, TableStats]):
    """What `stats()` returns: each table's TableStats by table name (`stats["grpo8"].ready`).

    `missing` names the shards that did not answer a sharded client, with their error; the
    tables then count only the shards that did. It is empty for one server.
    """

    tables: Mapping[str, TableStats]
    missing: Mapping[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> TableStats:
        return self.tables[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)
