"""What `list_tables()` and `create_table()` return: a table's settings (`TableInfo`), with its
reward shaping and advantage clip (`ShapingInfo`), under the names `create_table` takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


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
    estimator_params: Mapping[str, float | str]
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
