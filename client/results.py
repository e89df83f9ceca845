"""What the clients return: the result types of pushes, samples, reads, admissions, stats,
tables and server info.

Plain data, built from the service's replies by the clients (client.py); a sampled batch
decodes its payload on first use and acknowledges through the client that made it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from . import trxp
from .schema.experience import Experience

if TYPE_CHECKING:
    from tensordict import TensorDict

    from .columns import Column, PrefixBranches
    from .schema.balance import ModelShape


@dataclass
class PushResult:
    """What a push stored: uids stored now, uids already stored (a retry), groups it completed,
    and uids dropped as staler than the table's max_staleness. Durable when returned."""

    stored: list[str]
    duplicates: list[str]
    completed_groups: list[str]
    stale: list[str] = field(default_factory=list)  # dropped as staler than the table's max_staleness
    partial: list[str] = field(default_factory=list)  # pieces of partial rollouts stored (rollouts not finished)


@dataclass
class FailedRuns:
    """What a report of failed runs did (fail_runs): the runs recorded now (one reported again is
    not), the groups it completed short, and those it dropped as too short. Durable when returned."""

    recorded: list[str]
    completed_groups: list[str]
    dropped_groups: list[str]


class Leases(Protocol):
    """What a batch acknowledges, gives back and renews its lease through: the client that sampled it."""

    def ack(self, lease_id: str, table: str = "default") -> Any: ...
    def nack(self, lease_id: str, table: str = "default") -> Any: ...
    def renew(self, lease_id: str, seconds: float, table: str = "default") -> Any: ...


class Columnar:
    """What a batch of columns (a columnar Batch, a FieldBatch) offers a trainer beyond its
    columns: its tokens as a tree, and its split over data-parallel ranks."""

    uids: list[str]
    group_ids: list[str]
    columns: dict[str, Column]

    @property
    def missing_fields(self) -> list[str]:
        """The fields asked for that no experience of the batch has, in the order asked: they have
        no column, and looking one up in `columns` raises a KeyError that says so (the reply's
        missing_fields; none from a server before this release, which left them out unsaid)."""
        from .columns import missing_fields

        return missing_fields(self.columns)

    def prefix_branches(self) -> PrefixBranches:
        """The tokens as each distinct prompt once and each experience's branch after it, for
        tree packing (sampled or read with the fields prefix_tokens, branch_tokens and
        prefix_of; columns.prefix_branches)."""
        from .columns import prefix_branches

        return prefix_branches(self.columns)

    def rank_parts(
        self, ranks: int, balance: str = "tokens", model: ModelShape | None = None, equal: bool = False
    ) -> list[list[str]]:
        """The uids of each of `ranks` data-parallel ranks: the groups split as read_part splits a
        leased step (the same split, for a batch of the lease), from the `length` (or `tokens`)
        column, for any delivery: ranks read theirs with read_fields (a replayed batch), or the
        process that holds the batch hands each its part (a consumed one)."""
        from .columns import rank_parts

        return rank_parts(self, ranks, balance, model, equal)


@dataclass(repr=False)
class Batch(Columnar):
    """One sampled batch of whole groups. `experiences` decodes the payload on first use;
    `uids` and `group_ids` have one entry per experience, `groups` one per group.

    A leased batch's lease runs `lease_seconds` (the sample's) from when the client handed
    the batch to its caller; `lease_expires` is then, on this machine's clock. The server
    waits for that hand-over (the client's confirmation) at most `confirm_seconds` from the
    one before (its max_confirm_seconds, or more): a batch asked for later is not handed over
    (calls.handed)."""

    payload: bytes
    uids: list[str]
    group_ids: list[str]
    lease_id: str
    lease_expires: float
    partial: bool
    table: str = "default"
    times_sampled: list[int] = field(default_factory=list)  # one per uid: its deliveries, this one included
    _leases: Leases | None = field(default=None, repr=False)
    confirm_seconds: float = field(default=0.0, repr=False)  # the reply's; 0: the server sets no bound
    # A columnar batch's fields (sample(..., fields=[...])), by name; the payload is empty then.
    columns: dict[str, Column] = field(default_factory=dict, repr=False)

    @property
    def columnar(self) -> bool:
        """Whether the batch came as columns (sample's `fields`) rather than a TRXP payload."""
        return not self.payload and bool(self.columns or self.uids)

    @property
    def groups(self) -> list[str]:
        """The batch's distinct groups, in the order they come."""
        return list(dict.fromkeys(self.group_ids))

    def __repr__(self) -> str:
        """A summary: the payload's bytes, and a uid per experience, would print at three times its size."""
        return (
            f"{type(self).__name__}(table={self.table!r}, experiences={len(self.uids)}, groups={len(self.groups)},"
            f" payload_bytes={len(self.payload)}, lease_id={self.lease_id!r}, partial={self.partial})"
        )

    @cached_property
    def experiences(self) -> list[Experience]:
        """Decoded on first use, with the checks a reader relies on (trxp.decode_reply): a
        malformed payload raises TrxpError. The tensors are writable views over buffers this
        batch owns, one per dtype, into which decode gathered their bytes: writing to one
        never changes `payload`. A columnar batch has none: it carries `columns`."""
        if self.columnar:
            raise ValueError(
                f"this batch of table '{self.table}' was sampled as columns (fields={sorted(self.columns)}): "
                "read batch.columns, or sample without fields for experiences"
            )
        return trxp.decode_reply(self.payload)

    def tensordict(self) -> TensorDict:
        """A columnar batch as a TensorDict of batch size [experiences]: per-token fields as
        jagged nested tensors, the rest one value per experience, none copied
        (columns.as_tensordict; needs the tensordict package)."""
        if not self.columnar:
            raise ValueError(
                f"this batch of table '{self.table}' was sampled as a TRXP payload: sample with fields=[...] "
                "for a TensorDict"
            )
        from .columns import as_tensordict

        return as_tensordict(self.columns, len(self.uids))

    def ack(self) -> int:
        """Mark a leased batch done; without a lease there is nothing to acknowledge."""
        return self._leases.ack(self.lease_id, self.table) if self.lease_id and self._leases else 0

    def nack(self) -> int:
        """Return a leased batch to the buffer now."""
        return self._leases.nack(self.lease_id, self.table) if self.lease_id and self._leases else 0

    def renew(self, seconds: float) -> float:
        """Keep a leased batch for `seconds` more from now (a step that outlasts its lease);
        returns when the lease now ends (Unix time, the server's clock)."""
        if not (self.lease_id and self._leases):
            return 0.0
        self.lease_expires = self._leases.renew(self.lease_id, seconds, self.table)
        return self.lease_expires


class AsyncBatch(Batch):
    """A Batch from AsyncBufferClient: `ack`, `nack` and `renew` are coroutine functions, to be awaited.

    (A plain Batch's `ack` called without `await` would return a coroutine that never runs:
    the lease would expire and the batch be delivered again, with nothing said.)
    """

    async def ack(self) -> int:  # type: ignore[override]
        """Mark the leased batch done (await it); without a lease there is nothing to acknowledge."""
        return await self._leases.ack(self.lease_id, self.table) if self.lease_id and self._leases else 0

    async def nack(self) -> int:  # type: ignore[override]
        """Return the leased batch to the buffer now (await it)."""
        return await self._leases.nack(self.lease_id, self.table) if self.lease_id and self._leases else 0

    async def renew(self, seconds: float) -> float:  # type: ignore[override]
        """Keep the leased batch for `seconds` more from now (await it); returns when the lease now ends."""
        if not (self.lease_id and self._leases):
            return 0.0
        self.lease_expires = await self._leases.renew(self.lease_id, seconds, self.table)
        return self.lease_expires


@dataclass(repr=False)
class FieldBatch(Columnar):
    """Fields of named experiences as columns (`read_fields`), in the order asked, the ones not
    served in `missing_uids`; `columns` and `tensordict()` as a columnar Batch's. Nothing to
    acknowledge: the experiences stay as they were (the batch they were sampled in is acked)."""

    uids: list[str]
    group_ids: list[str]
    missing_uids: list[str]
    columns: dict[str, Column]
    table: str = "default"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(table={self.table!r}, experiences={len(self.uids)}, "
            f"fields={list(self.columns)}, missing_uids={len(self.missing_uids)})"
        )

    def tensordict(self) -> TensorDict:
        """The fields as a TensorDict of batch size [experiences], as Batch.tensordict()."""
        from .columns import as_tensordict

        return as_tensordict(self.columns, len(self.uids))


@dataclass
class Grant:
    """Rollouts a worker may start now (`count`, 0 when there was no room), under a grant
    that expires at `expires` (Unix time) unless finished with `finish_grant`."""

    count: int
    grant_id: str
    expires: float
    table: str


class GetResult(list[Experience]):
    """The experiences found (a list, as before) and `missing_uids`, the requested uids not stored."""

    def __init__(self, experiences: Iterable[Experience], missing_uids: Iterable[str]) -> None:
        super().__init__(experiences)
        self.missing_uids = list(missing_uids)

    def __repr__(self) -> str:
        """A summary: the experiences' tensors would print in full."""
        return f"GetResult(experiences={len(self)}, missing_uids={len(self.missing_uids)})"


@dataclass(frozen=True)
class ListedExperience:
    """A live experience as `list_experiences` lists it; its payload comes from `get`."""

    uid: str
    group_id: str
    state: str  # pending | computing | ready | leased
    model_version: int | None
    reward: float | None
    times_sampled: int


@dataclass(frozen=True)
class ExperiencePage:
    """One page of a table's live experiences in insertion order; pass `next` as `after` for the next."""

    experiences: list[ListedExperience]
    next: int
    done: bool


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
    # Groups by state; failed groups' advantages could not be computed, dropped ones were filtered or timed out.
    groups_pending: int
    groups_computing: int
    groups_ready: int
    groups_leased: int
    groups_failed: int
    groups_dropped: int
    last_failure: str  # why the last failed group failed; empty when none did
    oldest_age_seconds: float
    min_model_version: int  # -1 when no live experience carries a version
    max_model_version: int
    # Totals since the table was created.
    evicted: int
    pushed: int
    duplicates: int
    sampled: int
    leases_expired: int
    damaged: int  # experiences found damaged on disk (by a read or the scrub) and quarantined; their groups failed
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


@dataclass(frozen=True)
class ScrubInfo:
    """The server's background scrub: every stored payload checked against its digest at a
    bounded rate, after the start and again every `interval_seconds`. Bytes count payloads and
    their records."""

    mb_per_second: float = 0.0  # the bound; 0: no background scrub
    interval_seconds: float = 0.0
    running: bool = False  # a pass is under way
    pass_checked_bytes: int = 0  # of the pass under way, else of the last one
    pass_total_bytes: int = 0  # the payload bytes stored when that pass began
    passes: int = 0  # complete passes since the server started
    checked_bytes: int = 0  # since the server started
    checked: int = 0  # experiences checked since the server started
    found: int = 0  # damaged experiences it quarantined since the server started
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
    is, what its background scrub has done, and the orders a sample may name (built in and
    registered; empty from a server that predates the list).

    From a sharded client, the shards that answered combined (each in `shards`, the others in
    `missing`): the versions and devices each shard reports, comma-joined where they differ; the
    smallest message limit (what every shard takes); the shortest uptime; the storage summed;
    the fullest map; the scrubs as `ScrubInfo.merged` says; the orders every shard has.
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
    shards: Mapping[str, ServerInfo] = field(default_factory=dict)
    missing: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, msg: Any) -> ServerInfo:
        """From a ServerInfoReply, whose fields carry the same names."""
        apart = ("scrub", "orders", "shards", "missing")
        plain = {f.name: getattr(msg, f.name) for f in fields(cls) if f.name not in apart}
        return cls(**plain, scrub=ScrubInfo.from_proto(msg.scrub), orders=tuple(msg.orders))

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
            shards=dict(shards),
            missing=dict(missing),
        )


@dataclass(frozen=True)
class ShapingInfo:
    """A table's reward shaping and advantage clip (LightRFT's names); 0 or False turns a step off."""

    reward_clip: float = 0.0
    overlong_buffer: bool = False
    overlong_buffer_len: int = 0
    overlong_buffer_penalty_factor: float | None = None  # None: the server's default, 1.0
    max_new_tokens: int = 0
    reward_running_norm: bool = False
    reward_running_norm_minus_mean: bool = False
    advantage_clip: float = 0.0
    advantages_norm: bool = False


@dataclass(frozen=True)
class TableInfo:
    """A table's settings, as `list_tables()` and `create_table()` return them, under the names of
    a TOML `[[tables]]` block and of `create_table`; `settings()` gives them back as keywords for
    `create_table`. From a sharded client's `create_table`, `missing` names the shards that did
    not answer (owed the table, created when they answer again)."""

    name: str
    group_by: str  # task | run | step | none
    group_size: int  # 0: the push that carries a group completes it
    group_timeout_seconds: float
    on_group_timeout: str  # release | drop
    estimator: str
    estimator_params: Mapping[str, float]
    device: str  # auto | cpu | cuda
    capacity_experiences: int  # 0: unlimited
    capacity_bytes: int
    when_full: str  # block | evict
    max_times_sampled: int
    drop_zero_variance: bool
    shaping: ShapingInfo
    max_staleness: int | None  # None: no bound
    batch_size: int
    on_stale: str  # drop | refuse
    min_size_to_sample: int
    samples_per_insert: float
    samples_per_insert_error: float
    evict_stale: bool
    priority_decay: float  # under replay: a delivered group's priority lowered this much per delivery
    reuse_cooldown_seconds: float  # ... and out of reach this long (0: at once)
    priority_noise: float  # ... plus a Gaussian of this standard deviation
    tombstone_seconds: float | None = None  # None: the server's default, one day
    keep_failed: bool | None = None  # None: the server's default, True
    extensions: tuple[str, ...] = ()  # the table extensions it runs, by their registered names
    min_group_size: int = 0  # 0: a group completes with all its runs
    max_token_staleness: int | None = None  # None: no bound on a token's lag
    on_token_stale: str = "mask"  # mask | drop
    compression: str = "none"  # none | zstd: how tensor data over 256 KiB is kept
    compression_level: int | None = None  # None: a server that predates the setting
    missing: Mapping[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> TableInfo:
        """From settings under their TOML names (wire.table_from_proto)."""
        shaping = ShapingInfo(**settings.get("shaping") or {})
        return cls(**{**settings, "shaping": shaping, "extensions": tuple(settings.get("extensions", ()))})

    def settings(self) -> dict[str, Any]:
        """The settings under their TOML names, unset ones left out: `create_table(**info.settings())`."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "missing"}
        values["estimator_params"] = dict(self.estimator_params)
        values["extensions"] = list(self.extensions)
        values["shaping"] = {k: v for k, v in asdict(self.shaping).items() if v is not None}
        return {k: v for k, v in values.items() if v is not None}
