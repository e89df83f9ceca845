"""A batch of stored experiences as columns: for each tensor field asked for, the values of the
experiences that have it, back to back in batch order, with each one's shape.

Each stored experience's tensors are found through its safetensors header, read as join() reads
it (build.stored_entries: no parse of the metadata pickle, no JSON parse of a header pack_item
wrote), and handed on as views of the stored bytes (the pieces a tensor spans, for a section
stored in pieces: pieces.py): the caller that frames the reply copies each byte once. A field
stored with several dtypes or ranks in one batch makes one column for each (Trinity-RFT lets a
client send log-probs as float32 in one experience and bfloat16 in another); the client merges
them where it can.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .build import json_text, stored_entries, stored_tensors
from .common import RawTensor
from .pieces import Stored, cut, parts_of

# Columns of one value per experience that the server keeps beside each experience's payload (in
# its record), by name, with their dtype: an experience without one (no reward, no version) is
# left out of its column.
SCALARS = {"reward": "F64", "model_version": "I64", "response_length": "I64"}
_PACK = {"F64": "<%dd", "I64": "<%dq"}


@dataclass
class ColumnParts:
    """One column of a batch: the experiences (`items`, batch positions) whose `name` tensor has
    this dtype and rank, their shapes (`ndim` numbers each, flattened) and their bytes as runs."""

    name: str
    dtype: str
    ndim: int
    items: list[int] = field(default_factory=list)
    shapes: list[int] = field(default_factory=list)
    values: list[bytes | memoryview] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(map(len, self.values))


def column_parts(
    payloads: Iterable[Stored],
    fields: Sequence[str],
    extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None = None,
    added: Sequence[str] = (),
) -> list[ColumnParts]:
    """The columns of `fields` over stored one-item payloads, in the order `fields` names them
    (each field's columns in the order their first experience comes). `extra(i, tensors)`
    gives tensors that item i gets on top of its stored ones (the server's advantages); it is
    called only when a field in `added` (the names it may give) is asked for."""
    wanted = {json_text(name): name for name in fields}  # as the stored headers write them
    computed = bool(extra is not None and set(fields) & set(added))
    columns: dict[tuple[bytes, bytes, bytes], ColumnParts] = {}
    for index, payload in enumerate(payloads):
        _, header, section, section_len = parts_of(payload)
        found = stored_entries(header, section_len)
        given: Mapping[str, RawTensor] = {}
        if computed:
            assert extra is not None
            given = extra(index, stored_tensors(found, section))
        for text, dtype, dims, start, end in found:
            if text not in wanted:
                continue
            tensor = given.get(wanted[text]) if given else None
            if tensor is None:
                _add(columns, wanted, index, (text, dtype, dims), None, cut(section, start, end))
            else:  # replaced: in the stored one's place
                _computed(columns, wanted, index, text, tensor)
        names = {text for text, *_ in found}
        for name, tensor in given.items():
            text = json_text(name)
            if text in wanted and text not in names:
                _computed(columns, wanted, index, text, tensor)
    return in_order(columns.values(), fields)


def _computed(
    columns: dict[tuple[bytes, bytes, bytes], ColumnParts],
    wanted: dict[bytes, str],
    index: int,
    text: bytes,
    tensor: RawTensor,
) -> None:
    """Item `index`'s tensor that the caller's `extra` gave (a computed advantage) into its column."""
    dims = b",".join([b"%d" % dim for dim in tensor.shape])
    _add(columns, wanted, index, (text, tensor.dtype.encode(), dims), tensor.shape, [tensor.data])


def _add(
    columns: dict[tuple[bytes, bytes, bytes], ColumnParts],
    wanted: dict[bytes, str],
    index: int,
    entry: tuple[bytes, bytes, bytes],
    shape: tuple[int, ...] | None,
    data: list[bytes | memoryview],
) -> None:
    """Item `index`'s tensor (its name, dtype and dimensions as its header writes them) into the
    column of its field, dtype and rank."""
    text, dtype, dims = entry
    if shape is None:
        shape = tuple(map(int, dims.split(b","))) if dims else ()
    key = (text, dtype, b"%d" % len(shape))
    column = columns.get(key)
    if column is None:
        column = columns[key] = ColumnParts(wanted[text], dtype.decode(), len(shape))
    column.items.append(index)
    column.shapes.extend(shape)
    column.values.extend(data)


def scalar_column(name: str, values: Sequence[float | int | None]) -> ColumnParts | None:
    """The column of one value per experience of `name` (one of SCALARS), of the experiences
    that have one; None when none has."""
    dtype = SCALARS[name]
    items = [index for index, value in enumerate(values) if value is not None]
    if not items:
        return None
    data = struct.pack(_PACK[dtype] % len(items), *[values[index] for index in items])
    return ColumnParts(name, dtype, 0, items, [], [data])


def in_order(columns: Iterable[ColumnParts], fields: Sequence[str]) -> list[ColumnParts]:
    """Columns in the order `fields` names them (a stable sort: a field's columns keep theirs)."""
    rank = {name: at for at, name in enumerate(fields)}
    return sorted(columns, key=lambda column: rank[column.name])
