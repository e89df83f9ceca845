"""Table configuration: how a table groups, completes, caps and replays experiences.

The same names are used in the TOML config file, in CreateTable and in the
client's create_table keyword arguments.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .errors import ConfigError, clip
from .estimator_registry import ESTIMATORS, Estimator

GROUP_BY = ("task", "run", "step", "none")
WHEN_FULL = ("block", "evict")
ON_GROUP_TIMEOUT = ("release", "drop")
ON_STALE = ("drop", "refuse")
# The form of stored table records: 1 before the estimators took Trinity-RFT's names.
CONFIG_VERSION = 2


def estimator_of(config: TableConfig) -> Estimator:
    """The table's estimator (estimator_registry.py)."""
    return ESTIMATORS[config.estimator]


def estimator_args(config: TableConfig) -> dict[str, float | str | None]:
    """The estimator's keyword arguments: the table's parameters over the defaults, choices by name."""
    return estimator_of(config).args(config.estimator_params)


def batch_stage(config: TableConfig) -> bool:
    """Whether the table's advantages are finished over each sampled batch (statistics over the batch)."""
    return config.shaping.advantages_norm or estimator_of(config).has_batch_stage(estimator_args(config))


def group_step_first(config: TableConfig) -> bool:
    """Whether the running normalisation and the reward clip take the estimator's values
    (its group step done), as LightRFT's group calculators do, rather than the rewards. An
    estimator whose batch stage completes its group step shapes the rewards instead."""
    estimator = estimator_of(config)
    if not estimator.group_step:
        return False
    return not (estimator.group_step_in_batch and estimator.has_batch_stage(estimator_args(config)))


DEVICES = ("auto", "cpu", "cuda")
# Timeouts and retention beyond ten years are mistakes (1e10, inf), not plans.
MAX_SECONDS = 10 * 365 * 86400.0
# Counts travel as uint32/uint64 on the wire; values at the top of those ranges are
# negative numbers sent unsigned.
_INT_LIMITS = {
    "group_size": 2**20,
    "capacity_experiences": 2**62,
    "capacity_bytes": 2**62,
    "max_times_sampled": 2**31 - 1,
    "batch_size": 2**31 - 1,
    "min_size_to_sample": 2**62,
}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


# The shaping settings that turn a step on (the others are its parameters).
_SWITCHES = ("reward_clip", "overlong_buffer", "reward_running_norm", "advantage_clip", "advantages_norm")


@dataclass(frozen=True)
class Shaping:
    """A table's reward shaping and advantage clipping (server/shaping.py), under LightRFT's
    setting names; 0 (or false) turns a step off."""

    reward_clip: float = 0.0
    overlong_buffer: bool = False
    overlong_buffer_len: int = 0
    overlong_buffer_penalty_factor: float = 1.0
    max_new_tokens: int = 0
    reward_running_norm: bool = False
    reward_running_norm_minus_mean: bool = False
    advantage_clip: float = 0.0
    advantages_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("reward_clip", "advantage_clip", "overlong_buffer_penalty_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
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
        return [f.name for f in fields(self) if f.name in _SWITCHES and getattr(self, f.name)]

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
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown shaping setting(s): {', '.join(clip(u, 40) for u in unknown)}; known: {', '.join(known)}"
            )
        return cls(**data)


@dataclass(frozen=True)
class TableConfig:
    name: str
    group_by: str = "task"
    group_size: int = 0
    group_timeout_seconds: float = 0.0
    on_group_timeout: str = "release"
    estimator: str = "grpo"
    estimator_params: dict[str, float] = field(default_factory=dict)
    device: str = "auto"
    capacity_experiences: int = 0
    capacity_bytes: int = 0
    when_full: str = "block"
    max_times_sampled: int = 0
    drop_zero_variance: bool = False
    # How long a consumed, evicted, dropped or failed experience keeps its record (so that
    # a retried push of it stays a duplicate); 0 = forever.
    tombstone_seconds: float = 86400.0
    # Whether a group whose advantages could not be computed keeps its payloads (for Get
    # and Delete) until its record is forgotten, or loses them at once.
    keep_failed: bool = True
    # Reward shaping before the estimator and advantage clipping after it.
    shaping: Shaping = field(default_factory=Shaping)
    # Off-policy control: how many versions a rollout may lag the trainer (None: no bound),
    # the trainer's rollouts per version (admission; 0: no bound), what a push of
    # experiences staler than the bound gets (admission.py), and whether ready groups that
    # fall below it as the trainer advances are evicted (staleness.py).
    max_staleness: int | None = None
    batch_size: int = 0
    on_stale: str = "drop"
    evict_stale: bool = False
    # Rate limits (limiter.py): no sample before the table has held min_size_to_sample
    # experiences; samples per insert (0: no limit) within +- the error buffer.
    min_size_to_sample: int = 0
    samples_per_insert: float = 0.0
    samples_per_insert_error: float = 0.0
    # Reuse under replay delivery (reuse.py), as Trinity-RFT's priority queue: each delivery
    # lowers a group's priority by priority_decay and keeps it out of reach for
    # reuse_cooldown_seconds, with a Gaussian of standard deviation priority_noise added to
    # the lowered priority; decay and cooldown 0: a replayed group stays where it is.
    priority_decay: float = 0.0
    reuse_cooldown_seconds: float = 0.0
    priority_noise: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(f"table name {clip(self.name)!r} must be 1-64 letters, digits, '_', '.' or '-'")
        for name, allowed in (
            ("group_by", GROUP_BY),
            ("when_full", WHEN_FULL),
            ("on_group_timeout", ON_GROUP_TIMEOUT),
            ("on_stale", ON_STALE),
            ("estimator", tuple(ESTIMATORS)),
            ("device", DEVICES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} is {getattr(self, name)!r}; expected one of {', '.join(allowed)}")
        for name, high in _INT_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
                raise ConfigError(f"table '{self.name}': {name} must be an integer from 0 to {high}, got {value!r}")
        for name in ("group_timeout_seconds", "tombstone_seconds", "reuse_cooldown_seconds"):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or not 0 <= value <= MAX_SECONDS
            ):
                raise ConfigError(
                    f"table '{self.name}': {name} must be from 0 to {MAX_SECONDS:g} seconds (10 years), got {value!r}"
                )
        if not isinstance(self.drop_zero_variance, bool) or not isinstance(self.keep_failed, bool):
            raise ConfigError(f"table '{self.name}': drop_zero_variance and keep_failed must be true or false")
        self._check_off_policy()
        self._check_reuse()
        if self.group_by == "none" and self.group_size > 1:
            raise ConfigError("group_size must be 0 or 1 when group_by is 'none'")
        self._check_estimator_params()
        try:
            object.__setattr__(self, "shaping", Shaping.from_dict(self.shaping))
        except ConfigError as exc:
            raise ConfigError(f"table '{self.name}': {exc}") from None
        self._check_shaping()

    def _check_shaping(self) -> None:
        """Shaping where it can run: a `none` table computes nothing, so it would ignore every
        step; advantages_norm whitens one value per experience, and LightRFT skips it for
        grpo, whose values are normalised per group already."""
        active = self.shaping.active
        if self.estimator == "none" and active:
            raise ConfigError(
                f"table '{self.name}': shaping {', '.join(active)} needs an estimator; "
                "estimator 'none' computes no advantages, so nothing would be shaped or clipped"
            )
        if self.shaping.advantages_norm and (ESTIMATORS[self.estimator].token_valued or self.estimator == "grpo"):
            why = (
                "its values are normalised per group already (LightRFT skips advantages_norm for grpo)"
                if self.estimator == "grpo"
                else "it gives token-level values, which advantages_norm does not take"
            )
            raise ConfigError(
                f"table '{self.name}': shaping advantages_norm is not available with {self.estimator}: {why}"
            )

    def _check_off_policy(self) -> None:
        staleness = self.max_staleness
        if staleness is not None and (not isinstance(staleness, int) or isinstance(staleness, bool) or
                                      not 0 <= staleness < 2**31):  # fmt: skip
            raise ConfigError(
                f"table '{self.name}': max_staleness must be an integer from 0 to 2^31 - 1, got {clip(staleness, 40)}"
            )
        if not isinstance(self.evict_stale, bool):
            got = clip(self.evict_stale, 40)
            raise ConfigError(f"table '{self.name}': evict_stale must be true or false, got {got}")
        for name in ("samples_per_insert", "samples_per_insert_error"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"table '{self.name}': {name} must be a finite number >= 0, got {clip(value, 40)}")
        spi, error = self.samples_per_insert, self.samples_per_insert_error
        if spi and error < max(1.0, spi):  # a narrower band would block both sides for good
            raise ConfigError(
                f"table '{self.name}': samples_per_insert_error is {error:g}; with samples_per_insert {spi:g} "
                f"it must be >= {max(1.0, spi):g}"
            )
        if error and not spi:
            raise ConfigError(f"table '{self.name}': samples_per_insert_error needs samples_per_insert > 0")

    def _check_reuse(self) -> None:
        """Decay and noise are finite priority points; noise perturbs only a lowered priority."""
        for name in ("priority_decay", "priority_noise"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"table '{self.name}': {name} must be a finite number >= 0, got {clip(value, 40)}")
        if self.priority_noise and not (self.priority_decay or self.reuse_cooldown_seconds):
            raise ConfigError(
                f"table '{self.name}': priority_noise is added to a replayed group's lowered priority; "
                "it needs priority_decay or reuse_cooldown_seconds > 0"
            )

    def _check_estimator_params(self) -> None:
        """Every parameter known to the estimator and in its range; choices stored by position."""
        if not isinstance(self.estimator_params, dict) or not all(isinstance(k, str) for k in self.estimator_params):
            raise ConfigError("estimator_params must map parameter names to values")
        known = ESTIMATORS[self.estimator].params
        unknown = set(self.estimator_params) - set(known)
        if unknown:
            takes = ", ".join(known) or "none"
            raise ConfigError(
                f"estimator {self.estimator} has no parameter(s) {', '.join(sorted(unknown))} (it takes: {takes})"
            )
        checked = {}
        for name, value in self.estimator_params.items():
            stored = known[name].check(value)
            if stored is None:
                raise ConfigError(
                    f"table '{self.name}': estimator {self.estimator} parameter {name} is {str(value)[:40]!r}; "
                    f"allowed: {known[name].describe()}"
                )
            checked[name] = stored
        object.__setattr__(self, "estimator_params", checked)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_stored(cls, data: dict[str, Any], version: int = CONFIG_VERSION) -> TableConfig:
        """A table as this or an earlier release stored it. Durations an earlier release
        accepted beyond today's range are read as the longest allowed, the shaping a `none`
        table took (and ignored) is dropped, and the estimators of version 1 (before expbuf
        took Trinity-RFT's names) become their namesakes, so a data directory written by an
        earlier release still opens."""
        data = dict(data)
        for name in ("group_timeout_seconds", "tombstone_seconds"):
            value = data.get(name)
            if isinstance(value, (int, float)) and not value <= MAX_SECONDS:
                data[name] = MAX_SECONDS
        if data.get("estimator") == "none" and data.get("shaping"):
            data["shaping"] = {}  # taken and ignored before a `none` table refused it
        if version < 2:
            data["estimator"], data["estimator_params"] = _estimator_of_v1(
                data.get("estimator", "grpo"), dict(data.get("estimator_params") or {})
            )
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown table setting(s): {', '.join(clip(u, 40) for u in sorted(unknown))}")
        return cls(**data)


def _estimator_of_v1(name: str, params: dict[str, float]) -> tuple[str, dict[str, Any]]:
    """An estimator and its parameters as version 1 stored them, under today's names."""
    if name == "reinforce++":  # verl's group-baseline variant
        return "reinforce++_baseline", params
    if name == "reinforce":  # the discounted return-to-go, now without restarts under the mask
        return "discounted_return", params
    if name == "grpo":
        out: dict[str, Any] = {"epsilon": params["epsilon"]} if "epsilon" in params else {}
        if params.get("std_over_batch"):
            out["std_cal_level"] = "batch"
        if params.get("std_threshold"):  # 0 was off; groups below it are now dropped, as Trinity does
            out["std_threshold"] = params["std_threshold"]
        return name, out
    if name == "opmd":
        out = {"tau": params["tau"]} if "tau" in params else {}
        if params.get("logavgexp_baseline"):
            out["opmd_baseline"] = "logavgexp"
        return name, out
    return name, params


def differences(have: TableConfig, want: TableConfig) -> list[str]:
    """Each setting in which `want` differs from `have`, with both values; shaping's by their
    own names (`shaping.reward_clip`)."""

    def flat(config: TableConfig) -> dict[str, Any]:
        settings = config.to_dict()
        return settings | {f"shaping.{name}": value for name, value in settings.pop("shaping").items()}

    theirs, ours = flat(have), flat(want)
    return [
        f"{name}: the table has {clip(repr(theirs[name]), 60)}, the request {clip(repr(ours[name]), 60)}"
        for name in theirs
        if theirs[name] != ours[name]
    ]


def default_table() -> TableConfig:
    """The table every server has: group by task, complete on push, grpo."""
    return TableConfig(name="default")
