"""What a dataset of the prompt ledger may be: the range of each of its settings, and of a
sharded dataset's shards, checked when it is created (the ledger's datasets, datasets.py) and by
`expbuf check` (check.py); and the refusal of a dataset a table does not hold."""

from __future__ import annotations

import math

from expbuf.client.schema.routing import SHARD_NAME

from ..schema.errors import ConfigError, NotFound, clip
from .orders import order_of
from .records import MAX_SIZE, NAME, ON_DROP, ZERO_VARIANCE, DatasetRecord

MAX_EPOCHS = 2**20
MAX_ATTEMPTS = 1000
MAX_SHARDS = 1024


def check(ds: DatasetRecord, group_by: str) -> None:
    """Refuse a dataset whose settings are out of range, naming the setting."""
    where = f"dataset {clip(ds.name)!r}"
    if not isinstance(ds.name, str) or not NAME.match(ds.name):
        raise ConfigError(f"{where}: its name must start with a letter and hold 1-64 letters, digits, '_', '.' or '-'")
    if group_by != "task":
        raise ConfigError(
            f"{where}: its table groups by {group_by}; a dataset's prompts need group_by = task (one group per prompt)"
        )
    for setting, value, low, high in (
        ("size", ds.size, 1, MAX_SIZE),
        ("epochs", ds.epochs, 1, MAX_EPOCHS),
        ("max_in_flight", ds.max_in_flight, 0, MAX_SIZE),
        ("max_attempts", ds.max_attempts, 1, MAX_ATTEMPTS),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"{where}: {setting} is {clip(value)}; it must be an integer in {low}..{high}")
    if ds.seed is not None and (
        not isinstance(ds.seed, int) or isinstance(ds.seed, bool) or not -(2**63) <= ds.seed < 2**63
    ):  # the whole range of the wire's int64
        bounds = f"{-(2**63)}..{2**63 - 1}"
        raise ConfigError(
            f"{where}: seed is {clip(ds.seed)}; it must be an integer in {bounds}, or unset for index order"
        )
    threshold = ds.pass_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ConfigError(f"{where}: pass_threshold is {clip(threshold)}; it must be a finite number")
    if ds.on_drop not in ON_DROP:
        raise ConfigError(f"{where}: on_drop is {clip(ds.on_drop)!r}; expected one of {', '.join(ON_DROP)}")
    if ds.zero_variance not in ZERO_VARIANCE:
        raise ConfigError(
            f"{where}: zero_variance is {clip(ds.zero_variance)!r}; expected one of {', '.join(ZERO_VARIANCE)}"
        )
    skip = ds.skip_epochs
    if not isinstance(skip, int) or isinstance(skip, bool) or not 1 <= skip <= MAX_EPOCHS:
        raise ConfigError(f"{where}: skip_epochs is {clip(skip)}; it must be an integer in 1..{MAX_EPOCHS}")
    order = order_of(ds, where)
    if ds.shards or ds.shard:
        if order.bins or ds.zero_variance == "skip":
            chose = f"order {ds.order!r}" if order.bins else 'zero_variance "skip"'
            raise ConfigError(
                f"{where}: {chose} needs the prompts' statistics in one place, and a sharded table's shards each"
                " keep those of the prompts they own in an epoch; a sharded dataset takes the permutation order"
                " and zero_variance keep or retry"
            )
        check_shards(ds, where)


def check_shards(ds: DatasetRecord, where: str) -> None:
    """A shard's part of a sharded dataset: valid, distinct shard names, this server's among them."""
    if len(ds.shards) > MAX_SHARDS:
        raise ConfigError(f"{where}: shards names {len(ds.shards)} shards; at most {MAX_SHARDS}")
    for name in ds.shards:
        if not SHARD_NAME.fullmatch(name):
            raise ConfigError(
                f"{where}: shard name {clip(name)!r} must be 1-63 letters, digits, '.', '_' or '-' (not first)"
            )
    twice = sorted({name for name in ds.shards if ds.shards.count(name) > 1})
    if twice:
        raise ConfigError(f"{where}: shards names shard {twice[0]!r} twice")
    if ds.shard not in ds.shards:
        raise ConfigError(
            f"{where}: shard is {clip(ds.shard)!r}, not one of its shards {clip(ds.shards)}"
            " (a sharded client sets both: the shards of its map's first epoch, and the one it asks)"
        )


def no_dataset(table: str, name: str) -> NotFound:
    return NotFound(f"table '{table}' has no dataset '{clip(name)}'")
