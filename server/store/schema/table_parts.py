"""The parts a table's configuration is composed of, as Reverb composes a `Table` (its rate
limiter, its size, its remover): how experiences make groups, how advantages are computed and
shaped, what the table holds, how long it remembers what left, how stale a rollout may be, when
samples may run ahead of inserts, how often a group is replayed, and how its large tensor data
is kept.

Each part is a small frozen dataclass that checks its own ranges when made, naming the setting
by its flat name (`group_size`, not `Grouping.size`): the name a user writes in the TOML file,
in `create_table` and on the command line. A field whose flat name is not its own carries it
in its metadata (`SETTING`); table_config.py maps the parts to the flat settings and back
with it, one mapping for both directions.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from expbuf.client.schema.table_settings import (
    COMPRESSIONS,
    DEVICES,
    GROUP_BY,
    ON_GROUP_TIMEOUT,
    ON_STALE,
    ON_TOKEN_STALE,
    WHEN_FULL,
    Compression,
    Device,
    GroupBy,
    OnGroupTimeout,
    OnStale,
    OnTokenStale,
    WhenFull,
)

from .errors import ConfigError, clip
from .estimator_registry import ESTIMATORS

# The metadata key of a field's flat setting name, where it is not the field's own.
SETTING = "setting"
# The metadata key of a hidden setting: one the store keeps for its own development (a table's
# storage layout while the rows of issue 64 land), set in Python and a TOML file's [[tables]],
# stored with its table, but not on the wire, in the flat settings or on the settings page.
HIDDEN = "hidden"
# The layouts a table's records may take (issue 64): an item and a group record per experience
# and group ("records"), or the rows of batches of groups (disk/rows/, "rows").
LAYOUTS = ("records", "rows")
# The layout a table created without one takes.
DEFAULT_LAYOUT = "rows"
# Where the test suite runs with another (`pytest --layout records`, tests/conftest.py): read from
# the environment, so a server started as a child takes it too. A table is stored naming its layout
# wherever it is not "records" (STORED_LAYOUT), so this never changes what an existing table is.
DEFAULT_LAYOUT_VARIABLE = "EXPBUF_DEFAULT_LAYOUT"
# The layout of a stored table that names none: every table written before rows existed.
STORED_LAYOUT = "records"
# Timeouts and retention beyond ten years are mistakes (1e10, inf), not plans.
MAX_SECONDS = 10 * 365 * 86400.0
# zstd's levels above 19 take far more memory and time for little: not offered.
MAX_ZSTD_LEVEL = 19


def default_layout() -> str:
    """The layout a table takes where its settings name none (DEFAULT_LAYOUT_VARIABLE)."""
    return os.environ.get(DEFAULT_LAYOUT_VARIABLE) or DEFAULT_LAYOUT


def flat(name: str) -> dict[str, str]:
    """A field's metadata naming its flat setting."""
    return {SETTING: name}


def is_hidden(f: dataclasses.Field[Any]) -> bool:
    """Whether a part's field is a hidden setting (HIDDEN)."""
    return bool(f.metadata.get(HIDDEN))


def hidden_fields(part: type[Any]) -> list[str]:
    """A part's fields that are hidden settings."""
    return [f.name for f in dataclasses.fields(part) if is_hidden(f)]


def flat_names(part: type[Any]) -> dict[str, str]:
    """A part's fields -> their flat setting names."""
    names = _FLAT_NAMES.get(part)
    if names is None:
        names = _FLAT_NAMES[part] = {f.name: str(f.metadata.get(SETTING, f.name)) for f in dataclasses.fields(part)}
    return names


_FLAT_NAMES: dict[type[Any], dict[str, str]] = {}


class Part:
    """The checks a part runs over its own fields; each refusal names the flat setting."""

    def _setting(self, name: str) -> tuple[str, Any]:
        return flat_names(type(self))[name], getattr(self, name)

    def _one_of(self, name: str, allowed: tuple[str, ...]) -> None:
        setting, value = self._setting(name)
        if value not in allowed:
            raise ConfigError(f"{setting} is {clip(repr(value), 40)}; expected one of {', '.join(allowed)}")

    def _integer(self, name: str, high: int) -> None:
        setting, value = self._setting(name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
            raise ConfigError(f"{setting} must be an integer from 0 to {high}, got {clip(repr(value), 40)}")

    def _seconds(self, name: str) -> None:
        setting, value = self._setting(name)
        if not _number(value) or not 0 <= value <= MAX_SECONDS:
            raise ConfigError(
                f"{setting} must be from 0 to {MAX_SECONDS:g} seconds (10 years), got {clip(repr(value), 40)}"
            )

    def _amount(self, name: str) -> None:
        setting, value = self._setting(name)
        if not _number(value) or value < 0:
            raise ConfigError(f"{setting} must be a finite number >= 0, got {clip(repr(value), 40)}")

    def _boolean(self, name: str) -> None:
        setting, value = self._setting(name)
        if not isinstance(value, bool):
            raise ConfigError(f"{setting} must be true or false, got {clip(repr(value), 40)}")


def _number(value: object) -> bool:
    """A finite number a double holds: an int past it is not (math.isfinite raised OverflowError on
    one, a TOML file's 1 followed by 400 zeros: a traceback, not a refusal naming the setting)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return -sys.float_info.max <= value <= sys.float_info.max  # exact for an int of any size; False for NaN


@dataclass(frozen=True)
class Grouping(Part):
    """How a table makes groups of experiences, and when a group is complete."""

    # What makes a group: the runs of a task, each run, each step, or each experience alone.
    by: GroupBy = field(default="task", metadata=flat("group_by"))
    # Experiences that make a group complete; 0 = the push that carries a group completes it.
    size: int = field(default=0, metadata=flat("group_size"))
    # Release or drop incomplete groups after this many seconds; 0 = never.
    timeout_seconds: float = field(default=0.0, metadata=flat("group_timeout_seconds"))
    # What a group timeout does: release the group short (flagged partial) or drop it.
    on_timeout: OnGroupTimeout = field(default="release", metadata=flat("on_group_timeout"))
    # Drop groups whose rewards are all equal when they complete (dynamic sampling).
    drop_zero_variance: bool = False
    # With group_size: the fewest members a group may complete with when its other runs were
    # reported failed (FailRuns) or it timed out; 0 = every run (a group with a failed run is
    # dropped once all its runs are known, and a timed-out group is released as before).
    min_size: int = field(default=0, metadata=flat("min_group_size"))

    def __post_init__(self) -> None:
        self._one_of("by", GROUP_BY)
        self._integer("size", 2**20)
        self._integer("min_size", 2**20)
        if self.min_size and not 0 < self.min_size <= self.size:
            raise ConfigError(
                f"min_group_size must be from 1 to group_size ({self.size}), or 0 for every run; got {self.min_size}"
            )
        self._seconds("timeout_seconds")
        self._one_of("on_timeout", ON_GROUP_TIMEOUT)
        self._boolean("drop_zero_variance")
        if self.by == "none" and self.size > 1:
            raise ConfigError("group_size must be 0 or 1 when group_by is 'none'")


# The shaping settings that turn a step on (the others are its parameters).
_SWITCHES = ("reward_clip", "overlong_buffer", "reward_running_norm", "advantage_clip", "advantages_norm")


@dataclass(frozen=True)
class Shaping:
    """A table's reward shaping and advantage clipping (server/advantages/shaping.py), under LightRFT's
    setting names; 0 (or false) turns a step off."""

    # Clip rewards (or the group step's values) to [-reward_clip, reward_clip].
    reward_clip: float = 0.0
    # DAPO's overlong penalty on the rewards of responses that run into the last
    # overlong_buffer_len tokens before max_new_tokens.
    overlong_buffer: bool = False
    # The buffer's length in tokens: 0 < overlong_buffer_len < max_new_tokens.
    overlong_buffer_len: int = 0
    # The penalty at max_new_tokens; it grows linearly across the buffer.
    overlong_buffer_penalty_factor: float = 1.0
    # The generation limit the overlong buffer ends at.
    max_new_tokens: int = 0
    # Divide rewards (or the group step's values) by their running std, group by group in completion order.
    reward_running_norm: bool = False
    # ... and subtract their running mean first.
    reward_running_norm_minus_mean: bool = False
    # Clip advantages to [-advantage_clip, advantage_clip].
    advantage_clip: float = 0.0
    # Whiten the advantages over each sampled batch's generated tokens.
    advantages_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("reward_clip", "advantage_clip", "overlong_buffer_penalty_factor"):
            value = getattr(self, name)
            if not _number(value) or value < 0:
                raise ConfigError(f"shaping {name} is {clip(value, 40)}; allowed: a finite number >= 0")
        for name in ("overlong_buffer_len", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
                raise ConfigError(f"shaping {name} is {clip(value, 40)}; allowed: an integer >= 0 and < 2^31")
        for name in ("overlong_buffer", "reward_running_norm", "reward_running_norm_minus_mean", "advantages_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"shaping {name} is {clip(getattr(self, name), 40)}; allowed: true or false")
        if self.overlong_buffer and not 0 < self.overlong_buffer_len < self.max_new_tokens:
            raise ConfigError(
                f"shaping overlong_buffer needs 0 < overlong_buffer_len < max_new_tokens, "
                f"got {self.overlong_buffer_len} and {self.max_new_tokens}"
            )

    @property
    def active(self) -> list[str]:
        """The settings that turn a step on."""
        return [f.name for f in dataclasses.fields(self) if f.name in _SWITCHES and getattr(self, f.name)]

    @property
    def shapes_values(self) -> bool:
        """Whether the running normalisation or the reward clip is on (the steps that take
        the group step's values, where there is one)."""
        return self.reward_running_norm or self.reward_clip > 0

    @property
    def shapes_rewards(self) -> bool:
        """Whether any reward step (overlong penalty, running normalisation, clip) is on."""
        return self.overlong_buffer or self.reward_running_norm or self.reward_clip > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Shaping:
        """The settings of a TOML inline table, a create_table dict or a stored record."""
        if isinstance(data, Shaping):
            return data
        if not isinstance(data, dict):
            raise ConfigError(f"shaping is {clip(data, 40)}; expected a table of settings")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown shaping setting(s): {', '.join(clip(u, 40) for u in unknown)}; known: {', '.join(known)}"
            )
        return cls(**data)


@dataclass(frozen=True)
class Estimation(Part):
    """How a table computes advantages when a group completes: the estimator (a registered one,
    estimator_registry.py, or `none`), its parameters, where it runs, and the shaping around it."""

    # The estimator: a registered one's name (grpo, rloo, opmd, ...: see Concepts, Estimators), or none.
    estimator: str = "grpo"
    # The estimator's parameters by name (its own: see Concepts, Estimators); choices stored by position.
    params: dict[str, float] = field(default_factory=dict, metadata=flat("estimator_params"))
    # Where the advantage worker computes: cuda needs a CUDA device at startup; auto takes one if present.
    device: Device = "auto"
    # Reward shaping before the estimator and advantage clipping after it.
    shaping: Shaping = field(default_factory=Shaping)

    def __post_init__(self) -> None:
        self._one_of("estimator", tuple(ESTIMATORS))
        self._one_of("device", DEVICES)
        self._check_params()
        object.__setattr__(self, "shaping", Shaping.from_dict(self.shaping))
        self._check_shaping()

    def _check_params(self) -> None:
        """Every parameter known to the estimator and in its range; choices stored by position."""
        if not isinstance(self.params, dict) or not all(isinstance(k, str) for k in self.params):
            raise ConfigError("estimator_params must map parameter names to values")
        known = ESTIMATORS[self.estimator].params
        unknown = set(self.params) - set(known)
        if unknown:
            takes = ", ".join(known) or "none"
            raise ConfigError(
                f"estimator {self.estimator} has no parameter(s) {', '.join(sorted(unknown))} (it takes: {takes})"
            )
        checked = {}
        for name, value in self.params.items():
            stored = known[name].check(value)
            if stored is None:
                raise ConfigError(
                    f"estimator {self.estimator} parameter {name} is {str(value)[:40]!r}; "
                    f"allowed: {known[name].describe()}"
                )
            checked[name] = stored
        object.__setattr__(self, "params", checked)

    def _check_shaping(self) -> None:
        """Shaping where it can run: a `none` table computes nothing, so it would ignore every
        step; advantages_norm whitens one value per experience, and LightRFT skips it for
        grpo, whose values are normalised per group already."""
        active = self.shaping.active
        if self.estimator == "none" and active:
            raise ConfigError(
                f"shaping {', '.join(active)} needs an estimator; "
                "estimator 'none' computes no advantages, so nothing would be shaped or clipped"
            )
        if self.shaping.advantages_norm and (ESTIMATORS[self.estimator].token_valued or self.estimator == "grpo"):
            why = (
                "its values are normalised per group already (LightRFT skips advantages_norm for grpo)"
                if self.estimator == "grpo"
                else "it gives token-level values, which advantages_norm does not take"
            )
            raise ConfigError(f"shaping advantages_norm is not available with {self.estimator}: {why}")


@dataclass(frozen=True)
class Capacity(Part):
    """What a table may hold, and what a push into a full table gets."""

    # Live experiences the table may hold; 0 = unlimited.
    experiences: int = field(default=0, metadata=flat("capacity_experiences"))
    # Bytes the table may hold: live experiences' payloads, rollouts in pieces and keyed values (a put of
    # values past it is refused; none is evicted); 0 = unlimited.
    bytes: int = field(default=0, metadata=flat("capacity_bytes"))
    # A push into a full table waits for room (block) or evicts the oldest ready groups (evict).
    when_full: WhenFull = "block"

    def __post_init__(self) -> None:
        self._integer("experiences", 2**62)
        self._integer("bytes", 2**62)
        self._one_of("when_full", WHEN_FULL)


@dataclass(frozen=True)
class Retention(Part):
    """How long a table remembers experiences that left it."""

    # How long a consumed, evicted, dropped or failed experience keeps its record (so that
    # a retried push of it stays a duplicate); 0 = forever.
    tombstone_seconds: float = 86400.0
    # Whether a group whose advantages could not be computed keeps its payloads (for Get
    # and Delete) until its record is forgotten, or loses them at once.
    keep_failed: bool = True

    def __post_init__(self) -> None:
        self._seconds("tombstone_seconds")
        self._boolean("keep_failed")


@dataclass(frozen=True)
class Staleness(Part):
    """Off-policy control (admission.py, staleness.py): how far rollouts may lag the trainer."""

    # How many versions a rollout may lag the trainer; None = no bound.
    max_staleness: int | None = None
    # The trainer's rollouts per version, for admission (Admit); 0 = no bound.
    batch_size: int = 0
    # What a push of experiences staler than the bound gets: they are dropped, or it is refused.
    on_stale: OnStale = "drop"
    # Whether ready groups that fall below the bound as the trainer advances are evicted.
    evict_stale: bool = False
    # How many versions a generated token may lag the trainer (an experience's version segments,
    # client/trxp/codec/segments.py; its one version without them); None = no bound.
    max_token_staleness: int | None = None
    # What a token behind that bound gets: masked out of the action mask where a batch is
    # delivered ("mask"), or its experience is stale as max_staleness makes one ("drop").
    on_token_stale: OnTokenStale = "mask"

    def __post_init__(self) -> None:
        for name in ("max_staleness", "max_token_staleness"):
            bound = getattr(self, name)
            if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or not 0 <= bound < 2**31):
                raise ConfigError(f"{name} must be an integer from 0 to 2^31 - 1, got {clip(repr(bound), 40)}")
        self._integer("batch_size", 2**31 - 1)
        self._one_of("on_stale", ON_STALE)
        self._boolean("evict_stale")
        self._one_of("on_token_stale", ON_TOKEN_STALE)

    @property
    def experience_bound(self) -> int | None:
        """How many versions an experience (its oldest token) may lag the trainer before it is stale:
        max_staleness, or max_token_staleness where that is lower and drops ("drop"); None = no bound."""
        bounds = [self.max_staleness]
        if self.on_token_stale == "drop":
            bounds.append(self.max_token_staleness)
        known = [bound for bound in bounds if bound is not None]
        return min(known) if known else None

    @property
    def token_bound(self) -> int | None:
        """The lag past which delivered tokens are masked out; None when none are."""
        return self.max_token_staleness if self.on_token_stale == "mask" else None


@dataclass(frozen=True)
class RateLimiter(Part):
    """Reverb's rate limits (limiter.py): when samples may start, and how far they may run
    ahead of inserts or fall behind them."""

    # No sample before the table has held this many experiences.
    min_size_to_sample: int = 0
    # Experiences sampled per experience inserted; 0 = no limit.
    samples_per_insert: float = 0.0
    # How far samples may drift from samples_per_insert, either way (Reverb's error_buffer).
    error_buffer: float = field(default=0.0, metadata=flat("samples_per_insert_error"))

    def __post_init__(self) -> None:
        self._integer("min_size_to_sample", 2**62)
        self._amount("samples_per_insert")
        self._amount("error_buffer")
        spi, error = self.samples_per_insert, self.error_buffer
        if spi and error < max(1.0, spi):  # a narrower band would block both sides for good
            raise ConfigError(
                f"samples_per_insert_error is {error:g}; with samples_per_insert {spi:g} "
                f"it must be >= {max(1.0, spi):g}"
            )
        if error and not spi:
            raise ConfigError("samples_per_insert_error needs samples_per_insert > 0")


@dataclass(frozen=True)
class Reuse(Part):
    """Replay delivery (reuse.py), as Trinity-RFT's priority queue: how often a group is delivered,
    and how each delivery lowers it and keeps it out of reach."""

    # How often an experience may be sampled under replay delivery; 0 = unlimited.
    max_times_sampled: int = 0
    # Each delivery lowers a group's priority by this much.
    priority_decay: float = 0.0
    # ... and keeps it out of reach this long; decay and cooldown 0: a replayed group stays where it is.
    cooldown_seconds: float = field(default=0.0, metadata=flat("reuse_cooldown_seconds"))
    # The standard deviation of a Gaussian added to a lowered priority.
    priority_noise: float = 0.0

    def __post_init__(self) -> None:
        self._integer("max_times_sampled", 2**31 - 1)
        self._amount("priority_decay")
        self._seconds("cooldown_seconds")
        self._amount("priority_noise")
        if self.priority_noise and not (self.priority_decay or self.cooldown_seconds):
            raise ConfigError(
                "priority_noise is added to a replayed group's lowered priority; "
                "it needs priority_decay or reuse_cooldown_seconds > 0"
            )


@dataclass(frozen=True)
class Storage(Part):
    """How a table keeps an experience's tensor data larger than 256 KiB (chunked.py): as it is,
    or in chunks each a zstd frame, compressed before the writer takes it. Rollouts with routing
    ids kept as int32 and int64 token ids keep about 0.3 of their bytes; float data and random
    uint8 ids hardly shrink (docs/internals/storage.md, "Compression")."""

    # none, or zstd: each chunk a zstd frame.
    compression: Compression = "none"
    # zstd's level, 1-19: 1 is fastest, and within a few percent of 3's size on tensor data.
    compression_level: int = 1
    # A hidden setting (HIDDEN): how the table's records are kept, one of LAYOUTS.
    layout: str = field(default_factory=default_layout, metadata={HIDDEN: True})

    def __post_init__(self) -> None:
        self._one_of("compression", COMPRESSIONS)
        self._one_of("layout", LAYOUTS)
        setting, value = self._setting("compression_level")
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_ZSTD_LEVEL:
            raise ConfigError(f"{setting} must be an integer from 1 to {MAX_ZSTD_LEVEL}, got {clip(repr(value), 40)}")
        if self.compression == "none" and value != 1:  # a table that does not compress is stored without it
            raise ConfigError(f"compression_level {value} needs compression = 'zstd'")

    @property
    def zstd_level(self) -> int | None:
        """The level each chunk is compressed at; None where chunks are kept as they are."""
        return self.compression_level if self.compression == "zstd" else None
