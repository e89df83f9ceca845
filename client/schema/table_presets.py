"""Presets: the settings of the common tables, one definition each, for every way a table is made.

`create_table(name, preset="replay", **overrides)` on the clients, `preset = "replay"` in a TOML
`[[tables]]` block, `expbuf table create NAME --preset replay key=value` and
`TableConfig.preset("replay", name, **overrides)` all expand a preset here into flat settings
(the settings given win over the preset's), so the wire carries plain settings and the server
and the clients share this one copy. A preset may need settings it cannot choose (a capacity,
a job's group size): it refuses to expand without them, naming each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

from .table_settings import TableSettings

# Acme's rule for Reverb's SampleToInsertRatio: samples may drift from the ratio by a tenth of
# what the ratio asks of the first min_size_to_sample experiences.
_TOLERANCE = 0.1


def queue(given: TableSettings) -> TableSettings:
    """A FIFO queue, as Reverb's `Table.queue`: each group delivered once, pushers blocked while
    the table is full (`when_full = "block"`, up to their deadline).

    Needs `capacity_experiences`, the most experiences the queue holds. Sample it with
    `order="fifo"` and `delivery="consume"` (a group is gone once sent) or `delivery="lease"`
    (gone when acked, back at the head of the queue when its lease ends): each group then
    comes out once, in the order it became ready. `max_times_sampled = 1` keeps a replay
    delivery to one delivery per group too."""
    _needs("queue", given, capacity_experiences="the most experiences the queue holds")
    return {"when_full": "block", "max_times_sampled": 1, **given}


def replay(given: TableSettings) -> TableSettings:
    """A replay table, as Reverb's uniform replay: the oldest groups evicted to make room
    (`when_full = "evict"`), each group sampled up to `max_times_sampled` times (2), no sample
    before `min_size_to_sample` experiences were inserted, and a rate limiter keeping the
    experiences sampled near `samples_per_insert` (2.0) per experience inserted, within
    `samples_per_insert_error`: by default a tenth of what the ratio asks of the first
    `min_size_to_sample` experiences (Acme's rule), at least the ratio and 1. Samples beyond
    the band wait for inserts, and inserts beyond it for samples.

    Needs `capacity_experiences` and `min_size_to_sample`. Sample it with
    `delivery="replay"` (and `order="uniform"` for Reverb's uniform sampler)."""
    _needs(
        "replay",
        given,
        capacity_experiences="the most experiences the table holds",
        min_size_to_sample="the experiences inserted before the first sample",
    )
    settings: TableSettings = {"when_full": "evict", "max_times_sampled": 2, "samples_per_insert": 2.0, **given}
    if "samples_per_insert_error" not in settings:
        spi, size = settings["samples_per_insert"], given["min_size_to_sample"]
        settings["samples_per_insert_error"] = max(1.0, spi, _TOLERANCE * spi * size) if spi else 0.0
    return settings


def trinity(given: TableSettings) -> TableSettings:
    """The table of a Trinity-RFT job (docs/frameworks/trinity.md): experiences grouped by task,
    `group_size` the job's `algorithm.repeat_times` (the runs of a task make a group; 0 for a
    multi-step job, whose writes' groups are complete when stored), the groups a write leaves
    short (runs a pipeline filter dropped) released when the write ends, and grpo's advantages
    (set `estimator` to the job's algorithm, under Trinity's names).

    Needs `group_size`. Trinity's `replay_buffer` settings are the table's reuse settings
    (`priority_decay`, `reuse_cooldown_seconds`, `max_times_sampled`, `priority_noise`), and
    its `capacity` the table's `capacity_experiences`, given beside the preset."""
    _needs("trinity", given, group_size="the job's algorithm.repeat_times, or 0 for a multi-step job")
    return {"group_by": "task", "on_group_timeout": "release", "estimator": "grpo", **given}


PRESETS: dict[str, Callable[[TableSettings], TableSettings]] = {"queue": queue, "replay": replay, "trinity": trinity}


def preset_settings(preset: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """A preset's settings with the `given` ones over them; an unknown preset, or one whose
    needed settings are not given, is refused (ValueError) naming them."""
    make = PRESETS.get(preset) if isinstance(preset, str) else None
    if make is None:
        raise ValueError(f"unknown table preset {str(preset)[:40]!r}; known: {', '.join(PRESETS)}")
    return dict(make(cast(TableSettings, dict(given))))


def with_preset(preset: str | None, settings: Mapping[str, Any]) -> dict[str, Any]:
    """A table's flat settings: the preset's with `settings` over them, or `settings` without one."""
    return dict(settings) if preset is None else preset_settings(preset, settings)


def _needs(preset: str, given: TableSettings, **needed: str) -> None:
    missing = [f"{name} ({why})" for name, why in needed.items() if name not in given]
    if missing:
        raise ValueError(f"table preset {preset!r} needs {' and '.join(missing)}")
