"""Trinity-RFT's buffer settings against the expbuf table they name: honoured, or refused by name.

A writer or reader is made once per job, so every mismatch is found there, with what to
set, instead of as a stalled trainer hours later. What each Trinity setting becomes:
- `capacity` (Trinity's queue blocks the writer when full): the table's
  `capacity_experiences` with `when_full = "block"`; a capacity other than Trinity's default
  that the table does not hold is refused.
- `replay_buffer` of an SQL buffer (`storage_type: sql`), which re-reads rows without bound,
  the least read first: refused, naming the queue's replay to use instead.
- `replay_buffer` (Trinity's priority queue, `linear_decay` or `decay_limit_randomization`):
  an experience's priority is its `model_version` less `decay` per use. The writer stamps
  `info["priority"] = model_version` and the reader takes the table's `priority` order and
  sets `info["use_count"]` to the times its group was delivered. Without reuse
  (`reuse_cooldown_time` unset) each experience is read once, and a full table
  (`when_full = "evict"`) makes room by evicting its oldest groups. With reuse the reader
  replays (`delivery=replay`) and the table lowers, cools and retires each delivered group
  (server/store/rules/reuse.py): the table's `priority_decay`, `reuse_cooldown_seconds`,
  `max_times_sampled` and `priority_noise` must be Trinity's `decay`, `reuse_cooldown_time`,
  `use_count_limit` and `sigma`, or the reader is refused, saying what to set.
- `batch_size` of the reader: whole groups of a table with a fixed `group_size` make it
  only when it is a multiple of that size, and a read waits for a whole batch, which a table
  holding fewer experiences (`capacity_experiences`) never has; another size is refused.
- a taskset with an `expbuf://` path reads a dataset of prompts (`dataset=` and `source=`,
  taskset.py); written to, or without them, it is refused, and an experience buffer's path
  names neither.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from expbuf.client.client import BufferClient
from expbuf.client.errors import PermissionDeniedError
from expbuf.client.kit.location import Location
from expbuf.client.kit.retry import retried
from expbuf.client.kit.tables import table_info
from expbuf.client.results import TableInfo

log = logging.getLogger(__name__)
TRINITY_DEFAULT_CAPACITY = 10000


def table_settings(client: BufferClient, location: Location) -> TableInfo | None:
    """The table's settings; None where the token may not read them (push-only). A server that
    cannot be reached (a job started before it, a restart) is waited for, for the client's timeout
    (kit.retry), and then its error raised: a writer made without the settings sealed no short
    group (its trainer then waited for good), a reader checked no batch size."""
    try:
        return retried(
            lambda: table_info(client, location.table, make_it="with group_size = 0 for Trinity jobs"), client.timeout
        )
    except PermissionDeniedError as exc:
        log.warning("expbuf: cannot read the settings of table '%s' (%s); they are not checked", location.table, exc)
        return None


def is_taskset(config: Any) -> bool:
    """Whether a buffer config is a taskset's (or a storage config made from one)."""
    from trinity.common.config import TasksetConfig

    tasks = getattr(config, "schema_type", None) == "task" or getattr(config, "default_workflow_type", None)
    return isinstance(config, TasksetConfig) or bool(tasks) or getattr(config, "repeat_times", None) is not None


def refuse_taskset(config: Any) -> None:
    """An experience buffer's reader or writer is not a taskset's: a taskset is read from a
    dataset of prompts (taskset.py) and never written."""
    if is_taskset(config):
        raise ValueError(
            f"buffer '{getattr(config, 'name', '')}': a taskset on expbuf is read from a dataset of prompts "
            "(expbuf://HOST:PORT/TABLE?dataset=NAME&source=PATH), never written; write its source instead"
        )


def refuse_dataset(location: Location, name: str) -> None:
    """An experience buffer's path names no dataset of prompts: that is a taskset's."""
    if location.dataset or location.source:
        raise ValueError(
            f"buffer '{name}': dataset= and source= name a taskset's prompts; an experience buffer's path takes neither"
        )


def check_capacity(config: Any, table: TableInfo | None) -> None:
    """Trinity's queue blocks a writer when full, its priority queue drops the lowest priority:
    the table's capacity, with `when_full` block or evict (which evicts the oldest ready groups:
    the same where priorities rise with time, docs/frameworks/trinity.md)."""
    capacity = getattr(config, "capacity", TRINITY_DEFAULT_CAPACITY)
    if capacity == TRINITY_DEFAULT_CAPACITY:
        return
    replay = priority_replay(config)
    if replay is not None and replay.reuse:
        raise ValueError(
            f"experience buffer capacity={capacity} with replay_buffer reuse_cooldown_time={replay.cooldown}: "
            "Trinity's full priority queue drops a returning experience of lower priority, which an expbuf table "
            "does not do; leave capacity unset (the table's capacity_experiences, with when_full = 'block', "
            "still bounds it)"
        )
    if table is None:
        return
    when_full = "evict" if replay is not None else "block"
    if table.capacity_experiences != capacity or table.when_full != when_full:
        raise ValueError(
            f"experience buffer capacity={capacity}: the expbuf table '{table.name}' holds "
            f"capacity_experiences={table.capacity_experiences} (when_full={table.when_full}); create it with "
            f"capacity_experiences = {capacity} and when_full = '{when_full}' (it counts experiences, where "
            "Trinity's queue counts writes), or leave capacity unset"
        )


@dataclass(frozen=True)
class PriorityReplay:
    """Trinity's priority queue as a table runs it: the decay per use, and with reuse the
    cooldown, the use limit (0: none) and the noise."""

    priority_fn: str
    decay: float
    cooldown: float | None
    limit: int
    sigma: float

    @property
    def reuse(self) -> bool:
        return self.cooldown is not None

    def table_settings(self) -> dict[str, float]:
        """The table settings that run this reuse."""
        return {
            "priority_decay": self.decay,
            "reuse_cooldown_seconds": self.cooldown or 0.0,
            "max_times_sampled": self.limit,
            "priority_noise": self.sigma,
        }


def priority_replay(config: Any) -> PriorityReplay | None:
    """Trinity's priority queue, if asked for, in the form a table runs; any other form is refused."""
    replay = getattr(config, "replay_buffer", None)
    if replay is None or not getattr(replay, "enable", False):
        return None
    if getattr(config, "storage_type", None) == "sql":
        raise ValueError(
            f"experience buffer '{getattr(config, 'name', '')}': storage_type 'sql' with replay_buffer.enable reads "
            "its rows again without bound, the least read first, which an expbuf table does not run; an expbuf path "
            "runs Trinity's queue priority replay: set storage_type: queue (with reuse_cooldown_time to read "
            "experiences again, up to use_count_limit), or disable replay_buffer to read each once"
        )
    from trinity.buffer.storage import PRIORITY_FUNC

    name = f"experience buffer replay_buffer (priority_fn={replay.priority_fn})"
    if replay.priority_fn not in ("linear_decay", "decay_limit_randomization"):
        raise ValueError(f"{name}: expbuf runs linear_decay and decay_limit_randomization")
    args = PRIORITY_FUNC.get(replay.priority_fn).default_config()
    unknown = sorted(set(replay.priority_fn_args or {}) - set(args))
    if unknown:
        raise ValueError(f"{name}: unknown priority_fn_args {', '.join(unknown)}; it takes {', '.join(args)}")
    args.update(replay.priority_fn_args or {})
    cooldown = replay.reuse_cooldown_time
    limit = int(args.get("use_count_limit", 0))
    sigma = float(args.get("sigma", 0.0))
    if cooldown is None and sigma:
        raise ValueError(
            f"{name}: priority_fn_args.sigma={sigma} without reuse perturbs only fresh experiences' priorities, "
            "which an expbuf table does not do; set 0, or set reuse_cooldown_time (the table then adds the noise to "
            "each returning experience's priority)"
        )
    if cooldown is not None and (cooldown < 0 or (cooldown == 0 and not args["decay"])):
        raise ValueError(
            f"{name}: reuse_cooldown_time={cooldown} with decay {args['decay']}: an expbuf table reuses with a "
            "cooldown > 0 or a decay > 0; set one of them"
        )
    return PriorityReplay(replay.priority_fn, float(args["decay"]), cooldown, max(limit, 0), sigma)


def check_reuse(replay: PriorityReplay, table: TableInfo | None) -> None:
    """The table must run the reuse Trinity's config asks for: its settings are the server's rule."""
    if table is None:
        log.warning("expbuf: cannot read the settings of the table; its reuse settings are not checked")
        return
    want = replay.table_settings()
    differ = {key: value for key, value in want.items() if getattr(table, key) != value}
    if differ:
        have = ", ".join(f"{key}={getattr(table, key)}" for key in differ)
        need = ", ".join(f"{key} = {value}" for key, value in want.items())
        raise ValueError(
            f"experience buffer replay_buffer (priority_fn={replay.priority_fn}, decay={replay.decay}, "
            f"reuse_cooldown_time={replay.cooldown}, use_count_limit={replay.limit or 'none'}, sigma={replay.sigma}): "
            f"the expbuf table '{table.name}' has {have}; create it with {need}"
        )


def fixed_group_size(table: TableInfo | None) -> int | None:
    """The size every complete group of the table has; None where it varies (group_size 0)."""
    if table is None:
        return None
    if table.group_by == "none":
        return 1
    return table.group_size or None


def check_batch_size(batch_size: int, group: int | None, capacity: int, table: str) -> None:
    """Whole groups of `group` experiences make `batch_size` only when it is a multiple, and a
    read waits for a whole batch, which a table of `capacity` experiences (0: unbounded) must hold."""
    if group and batch_size % group:
        raise ValueError(
            f"batch_size {batch_size} is not a multiple of the group_size {group} of expbuf table '{table}': "
            f"whole groups never make it; set buffer.train_batch_size to a multiple of {group}"
        )
    if capacity and batch_size > capacity:
        raise ValueError(
            f"batch_size {batch_size} is more than the {capacity} experiences expbuf table '{table}' holds "
            "(capacity_experiences), so a read would never fill; set buffer.train_batch_size to at most "
            f"{capacity}, or create the table with a larger capacity_experiences"
        )
