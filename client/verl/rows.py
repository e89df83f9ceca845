"""Reading and writing verl trajectory rows in TransferQueue, the way verl's agent loop does
(`list_of_dict_to_tensordict`, one key per trajectory, a tag beside it)."""

from __future__ import annotations

from typing import Any

import torch
import transfer_queue as tq
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from expbuf.client.verl.convert import Row


def put_rows(partition_id: str, rows: list[Row]) -> None:
    """Write rows (their fields and tags) under their keys; a field missing from some rows is
    None there, except a tensor, which every row must have (verl stacks them)."""
    if not rows:
        return
    names = list(dict.fromkeys(name for row in rows for name in row.fields))
    for name in names:
        kinds = {isinstance(row.fields.get(name), torch.Tensor) for row in rows}
        if True in kinds and len(kinds) > 1:
            raise ValueError(f"field {name} is a tensor in some rows of the batch and missing in others")
    fields = [{name: row.fields.get(name) for name in names} for row in rows]
    tq.kv_batch_put(
        keys=[row.key for row in rows],
        partition_id=partition_id,
        fields=list_of_dict_to_tensordict(fields),
        tags=[row.tag for row in rows],
    )


def _values(value: Any, count: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    if hasattr(value, "tolist"):
        return list(value.tolist())
    return [value] * count


def rows_of(partition_id: str, keys: list[str], tags: dict[str, dict]) -> list[Row]:
    """The rows stored under keys, with their tags from a `kv_list` listing."""
    data = tq.kv_batch_get(keys=keys, partition_id=partition_id)
    columns = {name: _values(data.get(name), len(keys)) for name in data.keys()}  # noqa: SIM118
    return [
        Row(key, dict(tags.get(key, {})), {name: values[i] for name, values in columns.items()})
        for i, key in enumerate(keys)
    ]
