"""A push as columns, read into the same checked items a TRXP push makes.

A rollout worker that holds a batch as tensors sends each field's values back to back with each
experience's shape (SampleReply's column layout) and the eids beside them: it builds no
safetensors header and no pickle per experience, and the server scans no pickle. The payload is
MAGIC, the length of a ColumnBatch message (u64, little-endian), that message with its columns'
values left empty, and then each column's values in the message's order, so that the server
parses a small message and reads the values where they arrived. The items made here go through
check_meta and check_tensors and are packed as any pushed item, so an experience pushed as
columns is stored byte for byte as the same experience pushed in TRXP. The message itself is
read with protobuf by wire.py; this module, which the server's ingest and the client share,
sees plain values only.
"""

from __future__ import annotations

import json
import math
import operator
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ...schema.experience import META_FIELDS, TENSOR_FIELDS
from .. import varints
from ..codec import segments
from ..codec.checks import check_meta, check_tensors
from ..codec.common import (
    EXPANSION_BASE,
    EXPANSION_PER_BYTE,
    INT64_MAX,
    ITEMSIZE,
    MM_PREFIX,
    UNBOUNDED,
    MetadataLimit,
    RawItem,
    RawTensor,
    TrxpError,
    Work,
)
from ..codec.measure import Shape
from ..codec.shown import clip, show

MAGIC = b"EXPC"  # a push payload that starts so is a batch of columns, not TRXP
HEAD = struct.Struct("<4sQ")  # MAGIC, the length of the ColumnBatch message after it
INFO = "info"  # the column of each experience's other info, a JSON object in UTF-8 (U8, 1-D)
# The columns an experience's metadata is made of, not its tensors: name -> (dtype, ndim, the key in
# info that holds it, or None for the item's own field). model_version and priority are kept in info
# as Trinity-RFT keeps them; version_segments holds an experience's [version, offset] pairs, [k, 2]
# (client/trxp/codec/segments.py); info's keys are merged into info, none of them given twice.
META_COLUMNS: dict[str, tuple[str, int, str | None]] = {
    "reward": ("F64", 0, None),
    "prompt_length": ("I64", 0, None),
    "model_version": ("I64", 0, "model_version"),
    "priority": ("F64", 0, "priority"),
    segments.KEY: ("I64", 2, segments.KEY),
    INFO: ("U8", 1, INFO),
}
SCALARS = {name: dtype for name, (dtype, ndim, _) in META_COLUMNS.items() if not ndim}  # one value each
MAX_NDIM = 64  # dimensions of one experience's tensor in a column
_TENSOR_NAMES = frozenset(TENSOR_FIELDS)
_FORMATS = {"F64": "<d", "I64": "<q"}
_EMPTY = memoryview(b"")
_START = operator.itemgetter(0, 1)  # a place's start and end: empty tensors at one offset keep their order


# What one entry of a ColumnBatch message costs the server once it is read (protobuf's memory,
# then the objects made of it), by the message's field: an experience (its suffix, one each) at
# least its metadata written out, a column about a KiB (measured: 56 times an empty column's two
# bytes in protobuf, 370 in objects), a multi-modal key a hundred bytes, an eid's batch or task
# protobuf's own string.
_ENTRY_BYTES = {1: 16, 2: 16, 8: 1024, 9: 100}
_SUFFIX = 5


def check_entries(message: memoryview, size: int) -> None:
    """Refuse, before protobuf reads it, a ColumnBatch message whose entries (experiences, columns,
    keys) would take more memory once read than a payload of `size` bytes may expand to
    (EXPANSION_PER_BYTE a byte): what an entry costs is not what it takes on the wire, where an
    empty column is two bytes. Counted as the message's framing is walked, stopping past the bound."""
    expansion = EXPANSION_PER_BYTE * size + EXPANSION_BASE
    spent, at, end = 0, 0, len(message)
    while at < end:
        key = varints.read(message, at)
        if key is None:
            raise TrxpError("the column batch's message is not a ColumnBatch (a field's key is cut short)")
        number, kind = key[0] >> 3, key[0] & 7
        if kind == 0:
            skip = varints.read(message, key[1])
            at = end + 1 if skip is None else skip[1]
        elif kind == 2:
            length = varints.read(message, key[1])
            at = end + 1 if length is None else length[1] + length[0]
        else:
            at = key[1] + (8 if kind == 1 else 4 if kind == 5 else end)
        if at > end:
            raise TrxpError("the column batch's message is not a ColumnBatch (a field runs past its end)")
        spent += _LEAST_META if number == _SUFFIX else _ENTRY_BYTES.get(number, 0)
        if spent > expansion:
            raise TrxpError(
                f"the column batch's message names more experiences, columns or keys than a payload of {size} bytes "
                f"may hold: they would take more than its {expansion} bytes ({EXPANSION_PER_BYTE} a payload byte and "
                f"{EXPANSION_BASE}) once read"
            )


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
    keys: Sequence[str] = (),
) -> Iterator[RawItem]:
    """The experiences of a batch pushed as columns, in order, each with its eid and the fields its
    columns give it, checked as a TRXP push's items are (within the budgets of a payload of
    `size` bytes); each tensor a view of `data`, the columns' values back to back. An experience
    lists its multi-modal inputs in the order of `keys`, then of their columns.

    Every column's framing is checked first, with no object made per experience; then each
    experience is made and checked as it is taken, so that its metadata counts towards the
    payload's expansion bound before the next is made (a batch of many tiny experiences is
    refused before it holds them all)."""
    framed = _Framed(eids, columns, size, limit, keys)
    if framed.end > len(data):
        raise TrxpError(f"the columns' shapes need {framed.end} bytes of values; {len(data)} are there")
    if framed.end != len(data):
        raise TrxpError(f"{len(data) - framed.end} bytes after the columns' values belong to no column")
    return framed.items(data)


# Where a tensor's data lies in a payload's tensor data: (start, end, item, name), parse_head's form.
Place = tuple[int, int, int, str]


def column_head(
    eids: Sequence[dict[str, Any]],
    columns: Sequence[PushedColumn],
    start: memoryview,
    size: int,
    received: int,
    large: int,
    limit: MetadataLimit | None = None,
    keys: Sequence[str] = (),
) -> tuple[list[RawItem], list[Place], int] | None:
    """A batch of columns read from its head, as parse_head reads a TRXP payload's: `start` holds
    the columns' first values (`size` bytes of values in all), and the metadata columns (reward,
    version segments, ...) come first and are whole in it. The items, checked within the budgets
    of the `received` bytes (each tensor an empty view); where each tensor's data lies in the
    tensor data after the metadata columns; and how many bytes of `start` those take. None where
    it cannot be read so, or where no experience has more than `large` bytes of tensors (it is
    read whole: nothing to stage)."""
    framed = _Framed(eids, columns, received, limit, keys)
    if max(framed.sizes) <= large:
        return None
    leading = 0
    for cursor in framed.cursors:
        if cursor.metadata is None:
            break
        leading = cursor.end
    if any(cursor.metadata is not None and cursor.end > leading for cursor in framed.cursors) or leading > len(start):
        return None  # a metadata column after a tensor column, or not all in `start`
    if framed.end != size:
        raise TrxpError(f"the columns' shapes need {framed.end} bytes of values; the payload has {size}")
    places: list[Place] = []
    items = list(framed.items(start, places))
    places.sort(key=_START)  # made experience by experience; the data comes column by column
    return items, [(begin - leading, end - leading, item, name) for begin, end, item, name in places], leading


class _Framed:
    """A batch's columns with their framing checked and their cursors at their starts; the count
    of experiences against the payload's expansion bound."""

    def __init__(
        self,
        eids: Sequence[dict[str, Any]],
        columns: Sequence[PushedColumn],
        size: int,
        limit: MetadataLimit | None,
        keys: Sequence[str],
    ) -> None:
        count = len(eids)
        if not count:
            raise TrxpError("the column batch holds no experience")
        work = Work.for_payload(size)
        work.charge(count)
        expansion = EXPANSION_PER_BYTE * size + EXPANSION_BASE
        if count * _LEAST_META > expansion:  # what the items' checks would find, before any is made
            raise TrxpError(
                f"the column batch's {count} experiences take at least {_LEAST_META} bytes of metadata each "
                f"written out, more than the {expansion} of its {size} bytes ({EXPANSION_PER_BYTE} per payload "
                f"byte + {EXPANSION_BASE})"
            )
        metas = [column.name for column in columns if column.name in META_COLUMNS]
        if len(set(metas)) != len(metas):
            raise TrxpError(f"the column batch has a metadata column twice ({', '.join(sorted(metas))})")
        self.cursors, offset = [], 0
        self.sizes = [0] * count  # each experience's bytes of tensors
        for column in columns:
            cursor = _Cursor(column, count, offset, work, self.sizes)
            self.cursors.append(cursor)
            offset = cursor.end
        self.end = offset
        work.charge(count * len(self.cursors))  # items() looks at every column for every experience
        self.eids, self.work = eids, work
        work.charge(len(keys))
        self.rank = {MM_PREFIX + key: place for place, key in reversed(list(enumerate(keys)))}
        self.shape = Shape(work, expansion, check_keys=False, limit=limit)

    def items(self, data: memoryview, places: list[Place] | None = None) -> Iterator[RawItem]:
        """Each experience made and checked in turn; with `places`, its tensors empty views and
        where their data lies listed there."""
        for index in range(len(self.eids)):
            meta = _meta(self.eids[index])
            tensors: dict[str, RawTensor] = {}
            for cursor in self.cursors:
                if cursor.next == index:
                    cursor.take(meta, tensors, data, places)
            inputs = [name for name in tensors if name.startswith(MM_PREFIX)]
            if len(inputs) > 1 and self.rank:
                inputs.sort(key=lambda name: self.rank.get(name, len(self.rank)))
            meta["multi_modal_input_keys"] = [name[len(MM_PREFIX) :] for name in inputs]
            # Measured whole: the containers of the last experience, let go, may stand again at the
            # same addresses among this one's, where Shape would take them for those measured.
            self.shape.forget()
            item = RawItem(meta, tensors, check_meta(index, meta, self.shape))
            check_tensors(index, item, self.work)
            yield item


def _meta(eid: dict[str, Any]) -> dict[str, Any]:
    """An experience's metadata as the client's encode writes it for an Experience with these
    fields unset; the metadata columns fill in the rest (META_COLUMNS)."""
    meta: dict[str, Any] = dict.fromkeys(META_FIELDS)
    meta["eid"] = eid
    meta["info"] = {}
    meta["metrics"] = {}
    meta["prompt_length"] = 1
    meta["custom_fields"] = []
    return meta


def _least_meta() -> int:
    """The fewest bytes an experience's metadata takes written out (Shape's measure), as
    _meta makes it for the shortest eid."""
    shape = Shape(Work(UNBOUNDED), UNBOUNDED, check_keys=False)
    meta = _meta({"batch": "", "task": "", "run": 0, "step": 0, "suffix": ""})
    meta["multi_modal_input_keys"] = []
    shape.item(0, "", meta)
    return shape.size


_LEAST_META = _least_meta()


class _Cursor:
    """A column read in step with the batch's experiences: its framing checked whole when made
    (name, dtype, positions, each shape against INT64_MAX, where its values end), then each
    experience's part taken in turn."""

    def __init__(self, column: PushedColumn, count: int, offset: int, work: Work, sizes: list[int]) -> None:
        name, dtype, items, ndim = column.name, column.dtype, column.items, column.ndim
        self.where = where = f"column {show(name)}"
        self.metadata = metadata = META_COLUMNS.get(name)
        if metadata is not None:
            if (dtype, ndim) != metadata[:2]:
                what = f"one {metadata[0]} value" if not metadata[1] else f"[version, offset] pairs of {metadata[0]}"
                raise TrxpError(
                    f"{where} holds {what} an experience (ndim {metadata[1]}), got {show(dtype)}, ndim {ndim}"
                )
        elif name not in _TENSOR_NAMES and not (name.startswith(MM_PREFIX) and len(name) > len(MM_PREFIX)):
            raise TrxpError(
                f"{where} names no field of an experience (tensors: {', '.join(TENSOR_FIELDS)}, "
                f"'{MM_PREFIX}KEY'; metadata: {', '.join(META_COLUMNS)})"
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
        last, end = -1, offset
        for position, index in enumerate(items):
            if not last < index < count:
                raise TrxpError(
                    f"{where}: items must be increasing positions in the batch of {count}, got {index} after {last}"
                )
            last = index
            dims = shapes[position * ndim : (position + 1) * ndim]
            nbytes = _nbytes(where, index, dims, itemsize)
            end += nbytes
            if metadata is None:
                sizes[index] += nbytes
            elif name == INFO:
                work.charge(nbytes)  # the JSON parser is linear in its input
            elif ndim:
                if dims[1] != 2:
                    raise TrxpError(f"{where}: experience {index}'s shape {list(dims)} is not [pairs, 2]")
                work.charge(dims[0])  # a pair read into a list each
        self.name, self.dtype, self.ndim, self.itemsize = name, dtype, ndim, itemsize
        self.items, self.shapes = items, shapes
        self.position, self.offset, self.end = 0, offset, end
        self.next = items[0] if len(items) else -1

    def take(
        self, meta: dict[str, Any], tensors: dict[str, RawTensor], data: memoryview, places: list[Place] | None
    ) -> None:
        """The part of the experience at `self.next`, put in its metadata or its tensors (an empty
        view, its place in `places`, where given)."""
        position, ndim, name = self.position, self.ndim, self.name
        dims = tuple(self.shapes[position * ndim : (position + 1) * ndim])
        start = self.offset
        end = start + (0 if 0 in dims else math.prod(dims)) * self.itemsize
        if self.metadata is not None:
            key, info = self.metadata[2], meta["info"]
            if name == INFO:
                given = _info(self.where, self.next, data[start:end])
                if given.keys() & info.keys():
                    raise TrxpError(f"{self.where}: experience {self.next}'s info gives {_twice(given, info)} twice")
                info.update(given)
            elif key is None:
                meta[name] = struct.unpack_from(_FORMATS[self.dtype], data, start)[0]
            elif key in info:
                raise TrxpError(f"{self.where}: experience {self.next}'s info gives {key!r} twice")
            elif ndim:
                flat = struct.unpack_from(f"<{2 * dims[0]}q", data, start)
                info[key] = [[flat[at], flat[at + 1]] for at in range(0, len(flat), 2)]
            else:
                info[key] = struct.unpack_from(_FORMATS[self.dtype], data, start)[0]
        elif name in tensors:
            raise TrxpError(f"{self.where}: experience {self.next} has the field in two columns")
        elif places is not None:
            tensors[name] = RawTensor(self.dtype, dims, _EMPTY)
            places.append((start, end, self.next, name))
        else:
            tensors[name] = RawTensor(self.dtype, dims, data[start:end])
        self.position, self.offset = position + 1, end
        self.next = self.items[position + 1] if position + 1 < len(self.items) else -1


def _info(where: str, index: int, text: memoryview) -> dict[str, Any]:
    """An experience's info column: a JSON object, read within JSON's own nesting."""
    try:
        value = json.loads(bytes(text).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TrxpError(
            f"{where}: experience {index}'s info is not a JSON object in UTF-8 ({clip(str(exc))})"
        ) from None
    if not isinstance(value, dict):
        raise TrxpError(f"{where}: experience {index}'s info is a JSON {type(value).__name__}, not an object")
    return value


def _twice(given: dict[str, Any], info: dict[str, Any]) -> str:
    return ", ".join(repr(key) for key in sorted(given.keys() & info.keys()))


def _nbytes(where: str, index: int, dims: Sequence[int], itemsize: int) -> int:
    """The bytes of a tensor of shape `dims`, refused as a TRXP push's is where its non-zero
    dimensions' product (times the item size) passes 2**63, as torch and safetensors multiply them."""
    product = itemsize
    for dim in dims:
        product *= dim or 1
        if product > INT64_MAX:
            raise TrxpError(
                f"{where}: experience {index}'s shape {list(dims)} has more elements than a tensor can hold "
                f"(the product of its non-zero dimensions times {itemsize} bytes must stay below 2**63)"
            )
    return 0 if 0 in dims else product
