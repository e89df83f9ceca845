"""What `server_info()` returns: the server's version, limits and storage (`ServerInfo`), with
what its background scrub has done (`ScrubInfo`), and from a sharded client the shards' combined.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class ScrubInfo:
    """The server's background scrub: every stored payload checked against its digest, and every
    piece of a rollout held in pieces against its rollout's head, at a bounded rate, after the
    start and again every `interval_seconds`. Bytes count payloads and pieces."""

    mb_per_second: float = 0.0  # the bound; 0: no background scrub
    interval_seconds: float = 0.0
    running: bool = False  # a pass is under way
    pass_checked_bytes: int = 0  # of the pass under way, else of the last one
    pass_total_bytes: int = 0  # the payload and piece bytes stored when that pass began
    passes: int = 0  # complete passes since the server started
    checked_bytes: int = 0  # since the server started
    checked: int = 0  # experiences checked since the server started
    found: int = 0  # damaged experiences it quarantined (and rollouts in pieces dropped) since the server started
    last_pass_end_unix: float = 0.0  # when the last complete pass ended (kept across restarts); 0: never
    last_pass_seconds: float = 0.0
    last_pass_bytes: int = 0
    last_pass_found: int = 0

    @property
    def progress(self) -> float:
        """The part of the pass under way (or the last) done, 0 to 1."""
        return min(1.0, self.pass_checked_bytes / self.pass_total_bytes) if self.pass_total_bytes else 1.0

    @classmethod
    def from_proto(cls, msg: Any) -> ScrubInfo:
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})

    @classmethod
    def merged(cls, parts: Sequence[ScrubInfo]) -> ScrubInfo:
        """The shards' scrubs as one: counts summed, the lowest bound, running if any is, the
        fewest passes and the oldest last pass (the least any shard's data was checked)."""
        summed = ("pass_checked_bytes", "pass_total_bytes", "checked_bytes", "checked", "found")
        oldest = min(parts, key=lambda p: p.last_pass_end_unix)
        return cls(
            mb_per_second=min(p.mb_per_second for p in parts),
            interval_seconds=max(p.interval_seconds for p in parts),
            running=any(p.running for p in parts),
            passes=min(p.passes for p in parts),
            last_pass_end_unix=oldest.last_pass_end_unix,
            last_pass_seconds=max(p.last_pass_seconds for p in parts),
            last_pass_bytes=sum(p.last_pass_bytes for p in parts),
            last_pass_found=sum(p.last_pass_found for p in parts),
            **{name: sum(getattr(p, name) for p in parts) for name in summed},
        )


@dataclass(frozen=True)
class ServerInfo:
    """What `server_info()` returns: the server's version, its TRXP version, the device advantages
    run on, the largest message it takes, how long it has run, its storage and how full its map
    is, what its background scrub has done, the orders a sample may name (built in and
    registered; empty from a server that predates the list), and why advantages cannot be
    computed there (`advantage_worker_failure`: empty unless its advantage worker did not start
    or ended; then a push that needs them is refused, and the groups computing fail). What its
    advantage worker is doing is `advantage_worker_state`: "not_needed" (nothing has needed
    advantages computed since the start; torch loads when something does), "loading",
    "running" or "failed"; empty from a server that predates it. `repeats_answered`: the calls it
    answers, made again after their reply was lost, as it answered the first, which the clients
    retry only there (empty from a server that predates the list).

    From a sharded client, the shards that answered combined (each in `shards`, the others in
    `missing`): the versions and devices each shard reports, comma-joined where they differ; the
    smallest message limit (what every shard takes); the shortest uptime; the storage summed;
    the fullest map; the scrubs as `ScrubInfo.merged` says; the orders and the repeats answered
    that every shard has; each failing shard's advantage worker failure, after its name; the
    workers' states, comma-joined where they differ.
    """

    version: str
    trxp_version: str
    advantage_device: str
    max_message_bytes: int
    uptime_seconds: float
    storage_bytes: int
    lmdb_map_used_ratio: float
    scrub: ScrubInfo = field(default_factory=ScrubInfo)
    orders: tuple[str, ...] = ()
    advantage_worker_failure: str = ""
    advantage_worker_state: str = ""
    repeats_answered: tuple[str, ...] = ()
    shards: Mapping[str, ServerInfo] = field(default_factory=dict)
    missing: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, msg: Any) -> ServerInfo:
        """From a ServerInfoReply, whose fields carry the same names."""
        apart = ("scrub", "orders", "repeats_answered", "shards", "missing")
        plain = {f.name: getattr(msg, f.name) for f in fields(cls) if f.name not in apart}
        return cls(
            **plain,
            scrub=ScrubInfo.from_proto(msg.scrub),
            orders=tuple(msg.orders),
            repeats_answered=tuple(msg.repeats_answered),
        )

    @classmethod
    def merged(cls, shards: Mapping[str, ServerInfo], missing: Mapping[str, str]) -> ServerInfo:
        """The answering shards' infos combined, as the class says."""
        infos = list(shards.values())

        def joined(name: str) -> str:
            return ",".join(sorted({getattr(i, name) for i in infos}))

        return cls(
            version=joined("version"),
            trxp_version=joined("trxp_version"),
            advantage_device=joined("advantage_device"),
            max_message_bytes=min(i.max_message_bytes for i in infos),
            uptime_seconds=min(i.uptime_seconds for i in infos),
            storage_bytes=sum(i.storage_bytes for i in infos),
            lmdb_map_used_ratio=max(i.lmdb_map_used_ratio for i in infos),
            scrub=ScrubInfo.merged([i.scrub for i in infos]),
            orders=tuple(name for name in infos[0].orders if all(name in i.orders for i in infos)),
            advantage_worker_failure="; ".join(
                f"{name}: {i.advantage_worker_failure}" for name, i in shards.items() if i.advantage_worker_failure
            ),
            advantage_worker_state=joined("advantage_worker_state"),
            repeats_answered=tuple(n for n in infos[0].repeats_answered if all(n in i.repeats_answered for i in infos)),
            shards=dict(shards),
            missing=dict(missing),
        )
