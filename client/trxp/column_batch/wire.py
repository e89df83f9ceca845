"""The payload of a push as columns on the wire (items.py says its layout): written by the
client from its columns, read by the server (and by a sharded client, which routes its rows).
The ColumnBatch message is read here, with protobuf; what is made of it, in items.py, which
needs no protobuf.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from google.protobuf.message import DecodeError

from expbuf.proto.v1 import buffer_pb2 as pb

from ..codec.common import ITEMSIZE, MetadataLimit, RawItem, TrxpError
from ..codec.shown import show
from ..codec.stream import Head
from .items import HEAD, MAGIC, PushedColumn, check_entries, column_head, column_items


def is_columns(payload: bytes | bytearray | memoryview) -> bool:
    """Whether a pushed payload is a batch of columns (else it is TRXP)."""
    return bytes(payload[: len(MAGIC)]) == MAGIC


@dataclass(slots=True)
class ColumnPayload:
    """A column payload read: its message (values left out), the eids and columns it names, the
    columns' values back to back, and the whole payload's size (its budgets')."""

    message: pb.ColumnBatch
    eids: Eids
    columns: list[PushedColumn]
    data: memoryview
    size: int

    def items(self, limit: MetadataLimit | None = None) -> Iterator[RawItem]:
        """Its experiences in order, each checked as it is made, as a pushed TRXP payload's are."""
        return column_items(self.eids, self.columns, self.data, self.size, limit, self.message.multi_modal_keys)


def read(payload: bytes | bytearray | memoryview) -> ColumnPayload:
    """A column payload's parts, its framing and the eids' counts checked; each eid and column is
    checked as the items are made (ColumnPayload.items)."""
    view = memoryview(payload).cast("B")
    if len(view) < HEAD.size:
        raise TrxpError(f"the column batch is {len(view)} bytes, shorter than its {HEAD.size}-byte head")
    magic, length = HEAD.unpack_from(view)
    if magic != MAGIC:
        raise TrxpError(f"bad magic {bytes(magic)!r}: not a column batch")
    if length > len(view) - HEAD.size:
        raise TrxpError(f"the column batch's message of {length} bytes runs past the {len(view)}-byte payload")
    check_entries(view[HEAD.size : HEAD.size + length], len(view))  # before protobuf makes anything of them
    message = pb.ColumnBatch()
    try:
        message.ParseFromString(bytes(view[HEAD.size : HEAD.size + length]))  # the message alone: no values
    except DecodeError:
        raise TrxpError("the column batch's message is not a ColumnBatch") from None
    columns = []
    for column in message.columns:
        if column.values or column.align:
            raise TrxpError(f"column {show(column.name)} carries values in the message; they follow it")
        columns.append(PushedColumn(column.name, column.dtype, column.items, column.ndim, column.shapes))
    return ColumnPayload(message, Eids(message), columns, view[HEAD.size + length :], len(view))


def head(start: memoryview, size: int, large: int, limit: MetadataLimit | None = None) -> Head | None:
    """The head of a column payload of `size` bytes read from its first bytes `start`, as a
    server reading a push in chunks stages it (stream.StreamedPayload): its items checked within
    the budgets of `start`'s bytes; None where the head is not whole in `start` (the message and
    the one-value columns' values, which then come first) or no experience has more than `large`
    bytes of tensors."""
    view = memoryview(start).cast("B")
    if len(view) < HEAD.size:
        return None
    _, length = HEAD.unpack_from(view)
    if HEAD.size + length > len(view):
        return None
    batch = read(view[: HEAD.size + length])
    at = HEAD.size + length
    found = column_head(
        batch.eids, batch.columns, view[at:], size - at, len(view), large, limit, batch.message.multi_modal_keys
    )
    if found is None:
        return None
    items, places, scalars = found
    return at + scalars, items, places


class Eids(Sequence[dict[str, Any]]):
    """The eids of a column batch, each made from the message's lists when asked for, so that a
    batch holds no object per experience before its items are made."""

    def __init__(self, message: pb.ColumnBatch) -> None:
        count = len(message.suffixes)
        lists: dict[str, Sequence[Any]] = {
            "batches": message.batches,
            "tasks": message.tasks,
            "runs": message.runs,
            "steps": message.steps,
        }
        for name, values in lists.items():
            if len(values) != count:
                raise TrxpError(
                    f"the column batch has {len(values)} {name} for {count} suffixes (one each an experience)"
                )
        self.message, self.size = message, count

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | Sequence[dict[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        message = self.message
        return {
            "batch": _part(message.batches[index], message.int_batches, "batch", index),
            "task": _part(message.tasks[index], message.int_tasks, "task", index),
            "run": message.runs[index],
            "step": message.steps[index],
            "suffix": message.suffixes[index],
        }


def _part(text: str, is_int: bool, name: str, index: int) -> int | str:
    """An eid part as sent, or the int it writes in decimal where the batch marks it one."""
    if not is_int:
        return text
    digits = text[1:] if text[:1] == "-" else text
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 19 and (digits == "0" or digits[0] != "0")):
        raise TrxpError(f"item {index}: field 'eid.{name}' is marked an int, but {show(text)} is not one in decimal")
    return int(text)


def write(message: pb.ColumnBatch, values: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """The runs of bytes of a column payload: `message` (its columns' values empty) and then each
    column's `values`, in order."""
    head = message.SerializeToString()
    return [HEAD.pack(MAGIC, len(head)), head, *values]


def select(batch: ColumnPayload, rows: Sequence[int]) -> bytes:
    """The column payload of some experiences of `batch` (its positions `rows`, increasing): a
    sharded client's part for one shard, its columns in the batch's order (so that it is staged as
    the batch would be). The caller has checked the batch (items())."""
    where = {row: position for position, row in enumerate(rows)}
    message = pb.ColumnBatch(
        int_batches=batch.message.int_batches,
        int_tasks=batch.message.int_tasks,
        multi_modal_keys=batch.message.multi_modal_keys,
    )
    for name in ("batches", "tasks", "runs", "steps", "suffixes"):
        values = getattr(batch.message, name)
        getattr(message, name).extend(values[row] for row in rows)
    runs: list[bytes | memoryview] = []
    offset = 0
    for column in batch.message.columns:
        ndim, itemsize = column.ndim, ITEMSIZE[column.dtype]
        kept = pb.Column(name=column.name, dtype=column.dtype, ndim=ndim)
        for position, item in enumerate(column.items):
            dims = column.shapes[position * ndim : (position + 1) * ndim]
            count = math.prod(dims) * itemsize
            if item in where:
                kept.items.append(where[item])
                kept.shapes.extend(dims)
                runs.append(batch.data[offset : offset + count])
            offset += count
        if kept.items:
            message.columns.append(kept)
    return b"".join(write(message, runs))
