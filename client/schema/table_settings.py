"""A table's settings under their flat names, typed: the names of a TOML `[[tables]]` block, of
`create_table(**settings)`, of `expbuf table create NAME key=value` and of the wire's
TableConfig message.

`TableSettings` lets a type checker see a mistyped mode (`when_full="blok"`) or setting name in
`create_table`. It imports neither grpc nor torch: the server's table configuration
(server/store/schema/table_config.py) takes its modes from here, so both sides know one list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, TypedDict, get_args

GroupBy = Literal["task", "run", "step", "none"]
OnGroupTimeout = Literal["release", "drop"]
Device = Literal["auto", "cpu", "cuda"]
WhenFull = Literal["block", "evict"]
OnStale = Literal["drop", "refuse"]
OnTokenStale = Literal["mask", "drop"]
Compression = Literal["none", "zstd"]

GROUP_BY: tuple[GroupBy, ...] = get_args(GroupBy)
ON_GROUP_TIMEOUT: tuple[OnGroupTimeout, ...] = get_args(OnGroupTimeout)
DEVICES: tuple[Device, ...] = get_args(Device)
WHEN_FULL: tuple[WhenFull, ...] = get_args(WhenFull)
ON_STALE: tuple[OnStale, ...] = get_args(OnStale)
ON_TOKEN_STALE: tuple[OnTokenStale, ...] = get_args(OnTokenStale)
COMPRESSIONS: tuple[Compression, ...] = get_args(Compression)

# Estimator parameters that take a name; the wire's parameter map holds numbers, so a name
# travels as its position in the tuple (flags as 0 or 1).
PARAM_CHOICES = {
    "std_cal_level": ("group", "batch"),
    "opmd_baseline": ("mean", "logavgexp"),
    "enable_step_norm": ("false", "true"),
    "std_normalize": ("false", "true"),
}


class ShapingSettings(TypedDict, total=False):
    """A table's `shaping`: reward shaping before the estimator and advantage clipping after it,
    under LightRFT's names; 0 (or false) turns a step off."""

    reward_clip: float
    overlong_buffer: bool
    overlong_buffer_len: int
    overlong_buffer_penalty_factor: float
    max_new_tokens: int
    reward_running_norm: bool
    reward_running_norm_minus_mean: bool
    advantage_clip: float
    advantages_norm: bool


class TableSettings(TypedDict, total=False):
    """Every setting of a table but its name; each left out takes the server's default. The
    settings reference (docs: Reference, Settings) says what each does."""

    group_by: GroupBy
    group_size: int
    group_timeout_seconds: float
    on_group_timeout: OnGroupTimeout
    estimator: str  # a registered estimator's name: grpo, rloo, opmd, ... or none
    estimator_params: Mapping[str, float | str]
    device: Device
    capacity_experiences: int
    capacity_bytes: int
    when_full: WhenFull
    max_times_sampled: int
    drop_zero_variance: bool
    tombstone_seconds: float
    keep_failed: bool
    shaping: ShapingSettings
    max_staleness: int | None
    batch_size: int
    on_stale: OnStale
    min_size_to_sample: int
    samples_per_insert: float
    samples_per_insert_error: float
    evict_stale: bool
    priority_decay: float
    reuse_cooldown_seconds: float
    priority_noise: float
    extensions: Sequence[str]  # the table extensions it runs, by the names the server registered
    min_group_size: int  # with group_size: the fewest members a group completes with when others failed
    max_token_staleness: int | None  # how many versions a generated token may lag the trainer
    on_token_stale: OnTokenStale  # a token behind that bound: masked where delivered, or its experience stale
    compression: Compression  # tensor data over 256 KiB kept as it is, or as zstd frames of 4 MiB chunks
    compression_level: int  # zstd's level, 1-19: 1 is fastest


# The names, in the order of the wire's TableConfig message.
SETTING_NAMES: tuple[str, ...] = tuple(TableSettings.__annotations__)
SHAPING_NAMES: tuple[str, ...] = tuple(ShapingSettings.__annotations__)
