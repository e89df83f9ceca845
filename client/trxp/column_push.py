"""A push as columns, read into the same checked items a TRXP push makes.

A rollout worker that holds a batch as tensors sends each field's values back to back with each
experience's shape (SampleReply's column layout) and the eids beside them: it builds no
safetensors header and no pickle per experience, and the server scans no pickle. The payload is
MAGIC, the length of a ColumnBatch message (u64, little-endian), that message with its columns'
values left empty, and then each column's values in the message's order, so that the server
parses a small message and reads the values where they arrived. The items made here go through
check_meta and check_tensors and are packed as any pushed item, so an experience pushed as
columns is stored byte for byte as the same experience pushed in TRXP. The message itself is
read by the service (server/rpc/ingest.py); this module sees plain values only.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..schema.experience import META_FIELDS, TENSOR_FIELDS
from .checks import Shape, check_meta, check_tensors, show
from .common import (
    EXPANSION_BASE,
    EXPANSION_PER_BYTE,
    INT64_MAX,
    ITEMSIZE,
    MM_PREFIX,
    MetadataLimit,
    RawItem,
    RawTensor,
    TrxpError,
    Work,
)

MAGIC = b"EXPC"  # a push payload that starts so is a batch of columns, not TRXP
HEAD = struct.Struct("<4sQ")  # MAGIC, the length of the ColumnBatch message after it
# The columns of one value per experience a push may carry, with their dtype; model_version is
# kept in info, as Trinity-RFT keeps it.
SCALARS = {"reward": "F64", "prompt_length": "I64", "model_version": "I64"}
MAX_NDIM = 64  # dimensions of one experience's tensor in a column
_TENSOR_NAMES = frozenset(TENSOR_FIELDS)
_FORMATS = {"F64": "<d", "I64": "<q"}


@dataclass(slots=True)
class PushedColumn:
    """One column of a pushed batch as the wire gives it: the experiences that hold the field
    (`items`, positions in the batch) and `ndim` numbers of shape for each; their values are the
    batch's data after those of the columns before it."""

    name: str
    dtype: str
    items: Sequence[int]
    ndim: int
    shapes: Sequence[int]


def column_items(
    eids: Sequence[dict[str, Any]],
    columns: Sequence[PushedColumn],
    data: memoryview,
    size: int,
    limit: MetadataLimit | None = None,
) -> list[RawItem]:
    """The experiences of a batch pushed as columns, each with its eid and the fields its
    columns give it, checked as a TRXP push's items are (within the budgets of a payload of
    `size` bytes); each tensor a view of `data`, the columns' values back to back."""
    count = len(eids)
    if not count:
        raise TrxpError("the column batch holds no experience")
    work = Work.for_payload(size)
    work.charge(count + len(columns))
    metas = [_meta(eid) for eid in eids]
    tensors: list[dict[str, RawTensor]] = [{} for _ in range(count)]
    scalars = [column.name for column in columns if column.name in SCALARS]
    if len(set(scalars)) != len(scalars):
        raise TrxpError(f"the column batch has a one-value column twice ({', '.join(sorted(scalars))})")
    offset = 0
    for column in columns:
        offset = _place(column, metas, tensors, data, offset, work)
    if offset != len(data):
        raise TrxpError(f"{len(data) - offset} bytes after the columns' values belong to no column")
    shape = Shape(work, EXPANSION_PER_BYTE * size + EXPANSION_BASE, check_keys=False, limit=limit)
    items = []
    for index, (meta, held) in enumerate(zip(metas, tensors, strict=True)):
        meta["multi_modal_input_keys"] = [name[len(MM_PREFIX) :] for name in held if name.startswith(MM_PREFIX)]
        item = RawItem(meta, held)
        check_meta(index, meta, shape)
        check_tensors(index, item, work)
        items.append(item)
    return items


def _meta(eid: dict[str, Any]) -> dict[str, Any]:
    """An experience's metadata as the client's encode writes it for an Experience with these
    fields unset; the columns fill in reward, prompt_length and info's model_version."""
    meta: dict[str, Any] = dict.fromkeys(META_FIELDS)
    meta["eid"] = eid
    meta["info"] = {}
    meta["metrics"] = {}
    meta["prompt_length"] = 1
    meta["custom_fields"] = []
    return meta


def _place(
    column: PushedColumn,
    metas: list[dict[str, Any]],
    tensors: list[dict[str, RawTensor]],
    data: memoryview,
    offset: int,
    work: Work,
) -> int:
    """Give each experience its part of `column`, whose values start at `offset` in `data`, every
    length checked against the bytes present; where the next column's values start."""
    name, dtype, items, ndim = column.name, column.dtype, column.items, column.ndim
    where = f"column {show(name)}"
    scalar = SCALARS.get(name)
    if scalar is not None:
        if dtype != scalar or ndim != 0:
            raise TrxpError(f"{where} holds one {scalar} value an experience (ndim 0), got {show(dtype)}, ndim {ndim}")
    elif name not in _TENSOR_NAMES and not (name.startswith(MM_PREFIX) and len(name) > len(MM_PREFIX)):
        raise TrxpError(
            f"{where} names no field of an experience (tensors: {', '.join(TENSOR_FIELDS)}, "
            f"'{MM_PREFIX}KEY'; one value each: {', '.join(SCALARS)})"
        )
    itemsize = ITEMSIZE.get(dtype)
    if itemsize is None:
        raise TrxpError(f"{where} has unsupported dtype {show(dtype)}")
    if not 0 <= ndim <= MAX_NDIM:
        raise TrxpError(f"{where} has ndim {ndim}; at most {MAX_NDIM}")
    shapes = column.shapes
    if len(shapes) != ndim * len(items):
        raise TrxpError(f"{where} has {len(shapes)} shape numbers for {len(items)} experiences of ndim {ndim}")
    work.charge(len(items) + len(shapes))
    count, last = len(metas), -1
    for position, index in enumerate(items):
        if not last < index < count:
            raise TrxpError(
                f"{where}: items must be increasing positions in the batch of {count}, got {index} after {last}"
            )
        last = index
        dims = tuple(shapes[position * ndim : (position + 1) * ndim])
        nbytes = math.prod(dims) * itemsize
        if nbytes > INT64_MAX:
            raise TrxpError(
                f"{where}: experience {index}'s shape {list(dims)} has more elements than a tensor can hold"
            )
        end = offset + nbytes
        if end > len(data):
            raise TrxpError(f"{where}: its shapes need more than the {len(data)} bytes of the columns' values")
        if scalar is not None:
            _set_scalar(name, metas[index], struct.unpack_from(_FORMATS[dtype], data, offset)[0])
        elif name in tensors[index]:
            raise TrxpError(f"{where}: experience {index} has the field in two columns")
        else:
            tensors[index][name] = RawTensor(dtype, dims, data[offset:end])
        offset = end
    return offset


def _set_scalar(name: str, meta: dict[str, Any], value: float | int) -> None:
    if name == "model_version":
        meta["info"]["model_version"] = value
    else:
        meta[name] = value
