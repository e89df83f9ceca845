"""A table's datasets of prompts: one made (`create`), read (`dataset`) and written back with the
counts of each epoch whose prompts moved (`save`), and whether the table holds any, which every
other rule of the ledger asks first (`DatasetRules.holds`: a table without one pays one lookup).
"""

from __future__ import annotations

from ..core.table_state.events import TableExtension
from ..core.table_state.state import TableState
from ..schema.errors import ConfigError, Conflict, clip
from .orders import order_of
from .records import (
    DatasetRecord,
    counts_key,
    dataset_key,
    datasets_prefix,
    decode_counts,
    encode_counts,
    read_dataset,
)
from .settings import check, no_dataset
from .shards import count_part
from .states import COUNTED


class DatasetRules(TableExtension):
    """The ledger's datasets on each table, and which tables hold one."""

    def __init__(self) -> None:
        self._holds: dict[int, bool] = {}  # table id -> whether it holds a dataset, read once

    def holds(self, tt: TableState) -> bool:
        """Whether the table holds a dataset: a table without one pays one lookup, once."""
        known = self._holds.get(tt.table_id)
        if known is None:
            prefix = datasets_prefix(tt.table_id)
            with tt.txn.cursor(db=tt.db["ledger"]) as cur:
                known = bool(cur.set_range(prefix)) and bytes(cur.key()).startswith(prefix)
            self._holds[tt.table_id] = known
        return known

    def create(self, tt: TableState, ds: DatasetRecord, *, exist_ok: bool) -> tuple[DatasetRecord, bool]:
        """A new dataset, or the identical one that exists (exist_ok); (record, created)."""
        check(ds, tt.config.grouping.by)
        ds.order_options = order_of(ds).options  # its defaults filled in
        if ds.zero_variance == "retry" and not tt.config.grouping.drop_zero_variance:
            raise ConfigError(
                f'dataset {clip(ds.name)!r}: zero_variance = "retry" claims again a prompt whose group the table'
                f" drops for its equal rewards; table '{tt.config.name}' keeps such groups (drop_zero_variance is off)"
            )
        raw = tt.txn.get(dataset_key(tt.table_id, ds.name), db=tt.db["ledger"])
        if raw is not None:
            found = DatasetRecord.decode(raw)
            differ = [
                f"{key}: the dataset has {found.settings()[key]!r}, the request {value!r}"
                for key, value in ds.settings().items()
                if found.settings()[key] != value
            ]
            if exist_ok and not differ:
                return found, False
            detail = f" with other settings: {'; '.join(differ)}" if differ else ""
            raise Conflict(f"table '{tt.config.name}' already has dataset '{ds.name}'{detail}")
        ds.created, ds.totals = tt.now, {}
        if ds.shards:  # an epoch's counts without a record own `size` prompts: a shard's own fewer
            ds.owned = ds.owned[:1] or [count_part(ds, 0)]  # counted before the write (claims.py)
            tt.txn.put(counts_key(tt.table_id, ds.name, 0), encode_counts(ds.owned[0], {}), db=tt.db["ledger"])
            ds.owned_total, ds.counted = ds.owned[0], 1  # a later epoch's part: when it starts (hand_out.py)
        else:
            ds.owned_total, ds.counted = ds.size * ds.epochs, ds.epochs  # nothing written per epoch
        save(tt, ds)
        self._holds[tt.table_id] = True
        return ds, True


def dataset(tt: TableState, name: str) -> DatasetRecord:
    found = read_dataset(tt.txn, tt.db["ledger"], tt.table_id, name)
    if found is None:
        raise no_dataset(tt.config.name, name)
    return found


def save(tt: TableState, ds: DatasetRecord) -> None:
    """Write the dataset's record, and the counts of each epoch whose prompts moved since it was
    read."""
    ledger = tt.db["ledger"]
    for epoch, moved in ds.moved.items():
        key = counts_key(tt.table_id, ds.name, epoch)
        raw = tt.txn.get(key, db=ledger)
        owned, row = (ds.size, {}) if raw is None else decode_counts(raw)
        tt.txn.put(key, encode_counts(owned, {s: row.get(s, 0) + moved.get(s, 0) for s in COUNTED}), db=ledger)
    ds.moved = {}
    tt.txn.put(dataset_key(tt.table_id, ds.name), ds.encode(), db=ledger)
