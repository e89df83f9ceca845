"""Table configuration: how a table groups, completes, caps and replays experiences.

The same names are used in the TOML config file, in CreateTable and in the
client's create_table keyword arguments.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .errors import clip

GROUP_BY = ("task", "run", "step", "none")
WHEN_FULL = ("block", "evict")
ON_GROUP_TIMEOUT = ("release", "drop")
# Each estimator's parameters and their defaults (see server/estimators.py).
ESTIMATOR_PARAMS: dict[str, dict[str, float]] = {
    "grpo": {"epsilon": 1e-6, "std_over_batch": 0.0, "std_threshold": 0.0, "drop_below_threshold": 0.0},
    "drgrpo": {},
    "rloo": {},
    "reinforce++": {"epsilon": 1e-8},
    "reinforce": {"gamma": 1.0},
    "opmd": {"tau": 1.0, "logavgexp_baseline": 0.0},
    "step_wise_grpo": {"epsilon": 1e-6},
    "multi_turn_discount": {"turn_level_discount": 1.0},
    "none": {},
}
ESTIMATORS = tuple(ESTIMATOR_PARAMS)
# Estimators that need a reward on every experience ("reinforce" takes token-level rewards instead).
NEEDS_REWARD = frozenset(ESTIMATORS) - {"none", "reinforce"}
# Estimators that read the tokens (masks and token-level rewards), not just one reward each.
TOKEN_LEVEL = frozenset({"reinforce"})
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
}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class ConfigError(ValueError):
    """A table configuration is invalid; the message names the setting."""


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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(f"table name {clip(self.name)!r} must be 1-64 letters, digits, '_', '.' or '-'")
        for name, allowed in (
            ("group_by", GROUP_BY),
            ("when_full", WHEN_FULL),
            ("on_group_timeout", ON_GROUP_TIMEOUT),
            ("estimator", ESTIMATORS),
            ("device", DEVICES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} is {getattr(self, name)!r}; expected one of {', '.join(allowed)}")
        for name, high in _INT_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
                raise ConfigError(f"table '{self.name}': {name} must be an integer from 0 to {high}, got {value!r}")
        for name in ("group_timeout_seconds", "tombstone_seconds"):
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
        if self.group_by == "none" and self.group_size > 1:
            raise ConfigError("group_size must be 0 or 1 when group_by is 'none'")
        if not all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in self.estimator_params.items()):
            raise ConfigError("estimator_params must map names to numbers")
        unknown = set(self.estimator_params) - set(ESTIMATOR_PARAMS[self.estimator])
        if unknown:
            known = ", ".join(ESTIMATOR_PARAMS[self.estimator]) or "none"
            raise ConfigError(
                f"estimator {self.estimator} has no parameter(s) {', '.join(sorted(unknown))} (it takes: {known})"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> TableConfig:
        """A table as an earlier release stored it: durations it accepted beyond today's
        range are read as the longest allowed, so the server still starts."""
        data = dict(data)
        for name in ("group_timeout_seconds", "tombstone_seconds"):
            value = data.get(name)
            if isinstance(value, (int, float)) and not value <= MAX_SECONDS:
                data[name] = MAX_SECONDS
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown table setting(s): {', '.join(clip(u, 40) for u in sorted(unknown))}")
        return cls(**data)


def default_table() -> TableConfig:
    """The table every server has: group by task, complete on push, grpo."""
    return TableConfig(name="default")
