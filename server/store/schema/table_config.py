"""A table's configuration: its name and its parts (table_parts.py), and the flat settings they
are written as.

Outside Python objects a table's settings are flat, under one name each (`group_size`,
`when_full`): the TOML `[[tables]]` file, CreateTable's message, `create_table(**settings)`,
`expbuf table create NAME key=value`, and the table records the store keeps. `from_settings`
and `settings` turn them into parts and back through one mapping, each part's fields to their
flat names (table_parts.flat_names); the typed flat settings are the client's TableSettings
(client/schema/table_settings.py).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Unpack

from expbuf.client.schema.table_presets import preset_settings
from expbuf.client.schema.table_settings import SETTING_NAMES, TableSettings

from .errors import ConfigError, clip
from .estimator_registry import ESTIMATORS, Estimator
from .table_parts import (
    MAX_SECONDS,
    STORED_LAYOUT,
    Capacity,
    Estimation,
    Grouping,
    Part,
    RateLimiter,
    Retention,
    Reuse,
    Shaping,
    Staleness,
    Storage,
    flat_names,
    hidden_fields,
)

# The form of stored table records: 1 before the estimators took Trinity-RFT's names.
CONFIG_VERSION = 2
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

# The parts of a table, by the attribute that holds each.
PARTS: dict[str, type[Part]] = {
    "grouping": Grouping,
    "advantages": Estimation,
    "capacity": Capacity,
    "retention": Retention,
    "staleness": Staleness,
    "rate_limiter": RateLimiter,
    "reuse": Reuse,
    "storage": Storage,
}
# TableConfig's own fields that are flat settings, outside any part.
OWN = ("extensions",)
_OWNERS: dict[str, tuple[str | None, str]] = {
    setting: (part, name) for part, cls in PARTS.items() for name, setting in flat_names(cls).items()
} | {name: (None, name) for name in OWN}
# Each flat setting -> the part (None: the table itself) and field that hold it, in the order
# of the wire's message (a setting without a field fails here, at import).
WHERE: dict[str, tuple[str | None, str]] = {setting: _OWNERS[setting] for setting in SETTING_NAMES}
# The hidden settings (table_parts.HIDDEN) -> their part and field: taken from a TOML file's table
# and a stored record, written by `to_stored` where not at their defaults, never in `settings()`.
HIDDEN_WHERE: dict[str, tuple[str, str]] = {
    flat_names(cls)[name]: (part, name) for part, cls in PARTS.items() for name in hidden_fields(cls)
}
# A table extension's name, as a table names it and a Store registers it (extensions.py).
EXTENSION_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]{0,63}$")
MAX_EXTENSIONS = 32


def estimator_of(config: TableConfig) -> Estimator:
    """The table's estimator (estimator_registry.py)."""
    return ESTIMATORS[config.advantages.estimator]


def estimator_args(config: TableConfig) -> dict[str, float | str | None]:
    """The estimator's keyword arguments: the table's parameters over the defaults, choices by name."""
    return estimator_of(config).args(config.advantages.params)


def batch_stage(config: TableConfig) -> bool:
    """Whether the table's advantages are finished over each sampled batch (statistics over the batch)."""
    return config.advantages.shaping.advantages_norm or estimator_of(config).has_batch_stage(estimator_args(config))


def group_step_first(config: TableConfig) -> bool:
    """Whether the running normalisation and the reward clip take the estimator's values
    (its group step done), as LightRFT's group calculators do, rather than the rewards. An
    estimator whose batch stage completes its group step shapes the rewards instead."""
    estimator = estimator_of(config)
    if not estimator.group_step:
        return False
    return not (estimator.group_step_in_batch and estimator.has_batch_stage(estimator_args(config)))


def never_serves(config: TableConfig) -> str | None:
    """Why a table of these settings could never serve a trainer (a new one is refused: its
    pushers and samplers would wait for good); None when it may. A pending group is never evicted
    and a push past the capacity is refused, so a group larger than the capacity never completes;
    the rate limiter counts only what the table can still serve, so one that never holds
    min_size_to_sample experiences never lets a sample start."""
    most, size = config.capacity.experiences, config.grouping.size
    if most and size > most:
        return (
            f"table '{config.name}': capacity_experiences {most} is below group_size {size}: no group could "
            "complete (a pending group is never evicted, and a push past the capacity is refused)"
        )
    least = config.rate_limiter.min_size_to_sample
    if most and least > most:
        return (
            f"table '{config.name}': min_size_to_sample {least} is above capacity_experiences {most}: the table "
            "never holds that many, so no sample could start"
        )
    return None


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"table name {clip(name)!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return name


@dataclass(frozen=True, init=False)
class TableConfig:
    """A table: its name and its parts, each checked when made. `TableConfig.of(name, **settings)`
    makes one from flat settings (`group_size=8`), `settings()` gives them back."""

    # 1-64 letters, digits, '_', '.' or '-'.
    name: str
    # How experiences make groups, and when a group is complete.
    grouping: Grouping = field(default_factory=Grouping)
    # The estimator, its parameters and device, and the shaping around it.
    advantages: Estimation = field(default_factory=Estimation)
    # What the table holds, and what a push into a full table gets.
    capacity: Capacity = field(default_factory=Capacity)
    # How long experiences that left keep their records.
    retention: Retention = field(default_factory=Retention)
    # How far rollouts may lag the trainer.
    staleness: Staleness = field(default_factory=Staleness)
    # When samples may start, and how far they may run ahead of inserts.
    rate_limiter: RateLimiter = field(default_factory=RateLimiter)
    # How often, and how, a replayed group is delivered again.
    reuse: Reuse = field(default_factory=Reuse)
    # How the chunks of large tensor data are kept: as they are, or zstd frames.
    storage: Storage = field(default_factory=Storage)
    # The table extensions it runs, by the names the Store registered them under (each an
    # instance of its own for this table); the store's own rules follow from the other settings.
    extensions: tuple[str, ...] = ()

    def __init__(
        self,
        name: str,
        grouping: Grouping | None = None,
        advantages: Estimation | None = None,
        capacity: Capacity | None = None,
        retention: Retention | None = None,
        staleness: Staleness | None = None,
        rate_limiter: RateLimiter | None = None,
        reuse: Reuse | None = None,
        storage: Storage | None = None,
        extensions: Sequence[str] = (),
        **flat: Any,
    ) -> None:
        given = {
            "grouping": grouping,
            "advantages": advantages,
            "capacity": capacity,
            "retention": retention,
            "staleness": staleness,
            "rate_limiter": rate_limiter,
            "reuse": reuse,
            "storage": storage,
        }
        if flat:  # the flat keywords of earlier releases
            warnings.warn(
                "TableConfig(name, group_size=..., ...) with flat settings is deprecated and is refused from the "
                "next release: use TableConfig.of(name, **settings), or the parts "
                "(TableConfig(name, grouping=Grouping(size=8)))",
                DeprecationWarning,
                stacklevel=2,
            )
            mixed = [part for part, value in given.items() if value is not None]
            if mixed:
                raise TypeError(f"TableConfig takes parts or flat settings, not both (got {', '.join(mixed)})")
            given = dict(_fields(name, flat))
        object.__setattr__(self, "name", _check_name(name))
        object.__setattr__(self, "extensions", _check_extensions(name, extensions))
        for part, cls in PARTS.items():
            value = given.get(part)
            if value is not None and not isinstance(value, cls):
                raise ConfigError(f"table '{name}': {part} is {clip(repr(value), 60)}; expected a {cls.__name__}")
            object.__setattr__(self, part, cls() if value is None else value)

    @classmethod
    def of(cls, name: str, **settings: Unpack[TableSettings]) -> TableConfig:
        """A table from flat settings under their TOML names: `TableConfig.of("t", group_size=8)`."""
        return cls.from_settings({"name": name, **settings})

    @classmethod
    def from_settings(cls, data: Mapping[str, Any]) -> TableConfig:
        """A table from its flat settings (a TOML block, a create_table's, a stored record's), a
        `preset` among them expanded first (client/schema/table_presets.py); an unknown setting, or
        one out of range, is refused naming it."""
        settings = {k: v for k, v in data.items() if k not in ("name", "preset")}
        if "preset" in data:
            try:
                settings = preset_settings(data["preset"], settings)
            except ValueError as exc:
                raise ConfigError(f"table '{clip(data.get('name'))}': {exc}") from None
        unknown = set(settings) - set(WHERE) - set(HIDDEN_WHERE)
        if unknown:
            raise ConfigError(f"unknown table setting(s): {', '.join(clip(u, 40) for u in sorted(unknown))}")
        name = _check_name(data.get("name"))
        return cls(name, **_fields(name, settings))

    @classmethod
    def preset(cls, preset: str, name: str, **overrides: Unpack[TableSettings]) -> TableConfig:
        """A preset's table (client/schema/table_presets.py: queue, replay, trinity), the settings given
        over the preset's: `TableConfig.preset("trinity", "grpo8", group_size=8)`."""
        return cls.from_settings({"name": name, "preset": preset, **overrides})

    def settings(self) -> dict[str, Any]:
        """The flat settings, every one of them, in the wire's order: `TableConfig.from_settings`
        takes them back."""
        flat: dict[str, Any] = {"name": self.name}
        for setting, (part, name) in WHERE.items():
            value = getattr(self if part is None else getattr(self, part), name)
            flat[setting] = _plain(value)
        return flat

    def described(self) -> str:
        """The name and the settings not left at their defaults (a setting of parts, shaping's,
        only its parts that are not), in one short line: `grpo8 (group_size=8)`."""
        default = TableConfig(self.name).settings()
        changed = []
        for setting, value in self.settings().items():
            was = default[setting]
            if isinstance(value, dict) and isinstance(was, dict) and was:
                value = {part: v for part, v in value.items() if v != was.get(part)}
                was = {}
            if value != was:
                changed.append(f"{setting}={value}")
        return f"{self.name} ({', '.join(changed) or 'defaults'})"

    def to_dict(self) -> dict[str, Any]:
        """The flat settings (deprecated: `settings()`)."""
        warnings.warn("TableConfig.to_dict() is deprecated: use settings()", DeprecationWarning, stacklevel=2)
        return self.settings()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableConfig:
        """A table from flat settings (deprecated: `from_settings`)."""
        warnings.warn("TableConfig.from_dict() is deprecated: use from_settings()", DeprecationWarning, stacklevel=2)
        return cls.from_settings(data)

    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            """A flat setting read as an attribute (`config.group_size`), as earlier releases had
            them: deprecated, for one release."""
            where = WHERE.get(name)
            if where is None:
                raise AttributeError(f"'TableConfig' object has no attribute {name!r}")
            warnings.warn(
                f"TableConfig.{name} is deprecated: read config.{where[0]}.{where[1]}", DeprecationWarning, stacklevel=2
            )
            return getattr(getattr(self, where[0]), where[1])

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
        for setting, (part, name) in HIDDEN_WHERE.items():
            data.setdefault(setting, _stored_default(part, name))
        return cls.from_settings(data)

    def to_stored(self) -> dict[str, Any]:
        """The settings a table record keeps (read back by `from_stored`): a table without
        extensions, or without compression, is stored as an earlier release stored it, so that
        release still opens it (and refuses, naming the setting, one whose chunks it cannot read)."""
        stored = self.settings()
        if not stored["extensions"]:
            del stored["extensions"]
        if self.storage.zstd_level is None:
            del stored["compression"], stored["compression_level"]
        for setting, (part, name) in HIDDEN_WHERE.items():
            value = getattr(getattr(self, part), name)
            if value != _stored_default(part, name):  # so a release without the setting opens the table
                stored[setting] = value
        return stored


def _stored_default(part: str, name: str) -> Any:
    """What a stored table record that leaves out a hidden setting means: for the layout, the one
    every table had before rows (STORED_LAYOUT), whatever a table created today takes."""
    return STORED_LAYOUT if (part, name) == ("storage", "layout") else getattr(PARTS[part](), name)


def _fields(name: str, flat: Mapping[str, Any]) -> dict[str, Any]:
    """TableConfig's keywords for these flat settings: the parts they set (the others left out,
    to take their defaults) and its own fields; a refusal names the table."""
    parts: dict[str, dict[str, Any]] = {}
    own: dict[str, Any] = {}
    for setting, value in flat.items():
        where = WHERE.get(setting) or HIDDEN_WHERE.get(setting)
        if where is None:
            raise ConfigError(f"table '{name}': unknown table setting {clip(setting, 40)}")
        part, field_name = where
        if part is None:
            own[field_name] = value
        else:
            parts.setdefault(part, {})[field_name] = value
    try:
        if "shaping" in flat:
            parts["advantages"]["shaping"] = Shaping.from_dict(flat["shaping"])
        return own | {part: PARTS[part](**values) for part, values in parts.items()}
    except ConfigError as exc:
        raise ConfigError(f"table '{name}': {exc}") from None


def _plain(value: Any) -> Any:
    """A setting as the flat settings hold it (TOML's and JSON's kinds): shaping as a dict, a
    list for a tuple, a dict copied."""
    if isinstance(value, Shaping):
        return value.to_dict()
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _check_extensions(table: str, names: object) -> tuple[str, ...]:
    """The extension names a table runs: a list of distinct names (a lone string would be its letters)."""
    if isinstance(names, str) or not isinstance(names, list | tuple) or len(names) > MAX_EXTENSIONS:
        raise ConfigError(
            f"table '{table}': extensions is {clip(repr(names), 60)}; expected a list of at most "
            f"{MAX_EXTENSIONS} extension names"
        )
    for extension in names:
        if not isinstance(extension, str) or not EXTENSION_NAME.match(extension):
            raise ConfigError(
                f"table '{table}': extension name {clip(repr(extension), 60)} must start with a letter and hold "
                "1-64 letters, digits, '_', '.' or '-'"
            )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"table '{table}': extensions names {twice[0]!r} twice")
    return tuple(names)


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
    """Each setting in which `want` differs from `have`, with both values, under the flat
    names; shaping's by their own (`shaping.reward_clip`)."""

    def flat(config: TableConfig) -> dict[str, Any]:
        settings = config.settings()
        estimator = ESTIMATORS.get(config.advantages.estimator)
        if estimator is not None:  # a parameter given its default is the parameter left out
            settings["estimator_params"] = estimator.args(config.advantages.params)
        return settings | {f"shaping.{name}": value for name, value in settings.pop("shaping").items()}

    theirs, ours = flat(have), flat(want)
    return [
        f"{name}: the table has {clip(repr(theirs[name]), 60)}, the request {clip(repr(ours[name]), 60)}"
        for name in theirs
        if theirs[name] != ours[name]
    ]


def default_table() -> TableConfig:
    """The table every server has: group by task, complete on push, grpo."""
    return TableConfig("default")
