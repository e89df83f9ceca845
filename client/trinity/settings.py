"""Trinity-RFT's buffer settings against the expbuf table they name: honoured, or refused by name.

A writer or reader is made once per job, so every mismatch is found there, with what to
set, instead of as a stalled trainer hours later. What each Trinity setting becomes:
- `capacity` (Trinity's queue blocks the writer when full): the table's
  `capacity_experiences` with `when_full = "block"`; a capacity other than Trinity's default
  that the table does not hold is refused.
- `replay_buffer` (Trinity's priority queue): without reuse (`reuse_cooldown_time` unset, its
  default) every experience is read once, highest priority first, its priority being its
  `model_version` (`linear_decay` of a use count of 0): the writer stamps `info["priority"]`
  and the reader takes the table's `priority` order, and a full table (`when_full = "evict"`)
  makes room by evicting its oldest groups. Reuse after a cooldown, whose priority decays with
  each use, and a random `sigma` are refused; expbuf's replay is the path option
  `delivery=replay` with the table's `max_times_sampled` (see the README).
- `batch_size` of the reader: whole groups of a table with a fixed `group_size` make it
  only when it is a multiple of that size; another size is refused.
- an `expbuf://` path in a taskset: refused (expbuf holds experiences, not tasks).
"""

from __future__ import annotations

import logging
from typing import Any

from expbuf.client.client import BufferClient, BufferError
from expbuf.client.results import TableInfo

from .location import Location

log = logging.getLogger(__name__)
TRINITY_DEFAULT_CAPACITY = 10000


def table_settings(client: BufferClient, location: Location) -> TableInfo | None:
    """The table's settings; None where the token may not read them (push-only)."""
    try:
        tables = {t.name: t for t in client.list_tables()}
    except BufferError as exc:
        log.warning("expbuf: cannot read the settings of table '%s' (%s); they are not checked", location.table, exc)
        return None
    if location.table not in tables:
        raise ValueError(
            f"expbuf table '{location.table}' does not exist at {location.target}: create it first "
            "(the server's TOML [[tables]] or create_table), with group_size = 0 for Trinity jobs"
        )
    return tables[location.table]


def refuse_taskset(config: Any) -> None:
    """A taskset (or a storage config made from one) never reads from expbuf."""
    from trinity.common.config import TasksetConfig

    tasks = getattr(config, "schema_type", None) == "task" or getattr(config, "default_workflow_type", None)
    if isinstance(config, TasksetConfig) or tasks or getattr(config, "repeat_times", None) is not None:
        raise ValueError(
            f"buffer '{getattr(config, 'name', '')}': an expbuf:// path holds experiences, not tasks; "
            "a taskset's path must be a dataset (file or database)"
        )


def check_capacity(config: Any, table: TableInfo | None) -> None:
    """Trinity's queue blocks a writer when full, its priority queue evicts the lowest priority:
    the table's capacity, with the matching `when_full`."""
    capacity = getattr(config, "capacity", TRINITY_DEFAULT_CAPACITY)
    if capacity == TRINITY_DEFAULT_CAPACITY or table is None:
        return
    when_full = "evict" if priority_replay(config) else "block"
    if table.capacity_experiences != capacity or table.when_full != when_full:
        raise ValueError(
            f"experience buffer capacity={capacity}: the expbuf table '{table.name}' holds "
            f"capacity_experiences={table.capacity_experiences} (when_full={table.when_full}); create it with "
            f"capacity_experiences = {capacity} and when_full = '{when_full}' (it counts experiences, where "
            "Trinity's queue counts writes), or leave capacity unset"
        )


def priority_replay(config: Any) -> bool:
    """Whether Trinity's priority queue is asked for, in the form a table runs; any other form is refused."""
    replay = getattr(config, "replay_buffer", None)
    if replay is None or not getattr(replay, "enable", False):
        return False
    name = f"experience buffer replay_buffer (priority_fn={replay.priority_fn})"
    if replay.priority_fn not in ("linear_decay", "decay_limit_randomization"):
        raise ValueError(f"{name}: expbuf runs linear_decay and decay_limit_randomization without reuse")
    if replay.reuse_cooldown_time is not None:
        raise ValueError(
            f"{name}: reuse_cooldown_time={replay.reuse_cooldown_time} puts a read experience back with a priority "
            "lowered by each use, which an expbuf table does not do: leave it unset (each experience read once, "
            "the newest model_version first), or replay with the path option delivery=replay and the table's "
            "max_times_sampled"
        )
    if (replay.priority_fn_args or {}).get("sigma", 0.0):
        raise ValueError(f"{name}: priority_fn_args.sigma (random priorities) is not run by an expbuf table; set 0")
    return True


def fixed_group_size(table: TableInfo | None) -> int | None:
    """The size every complete group of the table has; None where it varies (group_size 0)."""
    if table is None:
        return None
    if table.group_by == "none":
        return 1
    return table.group_size or None


def check_batch_size(batch_size: int, group: int | None, table: str) -> None:
    """Whole groups of `group` experiences make `batch_size` only when it is a multiple."""
    if group and batch_size % group:
        raise ValueError(
            f"batch_size {batch_size} is not a multiple of the group_size {group} of expbuf table '{table}': "
            f"whole groups never make it; set buffer.train_batch_size to a multiple of {group}"
        )
