"""Building TRXP payloads from trusted items: whole batches as Trinity-RFT writes them, and one
item in the canonical form the server stores, which splice.py splices into batches without
unpickling them.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import pickle
import re
import struct
import threading
from collections.abc import Sequence
from typing import Any, Final, final

from ...schema.experience import TENSOR_FIELDS
from . import canonical
from .common import (
    CONTAINERS,
    DTYPE_RANK,
    EXACT_CONTAINERS,
    EXACT_SCALARS,
    HEADER,
    ITEMSIZE,
    MAGIC,
    VERSION,
    RawItem,
    RawTensor,
)

# ---- building (trusted input) -----------------------------------------------------


def build(items: Sequence[RawItem]) -> bytes:
    """Compose one TRXP payload from items, as Trinity-RFT's serialize_many writes it."""
    meta = pickle.dumps(
        {"version": VERSION, "num_items": len(items), "items": [item.meta for item in items]},
        protocol=5,
    )
    by_dtype: dict[str, list[tuple[str, str, RawTensor]]] = {}
    for index, item in enumerate(items):
        for name, tensor in item.tensors.items():
            entry = (f"{index}:{name}", name, tensor)
            try:
                by_dtype[tensor.dtype].append(entry)
            except KeyError:
                by_dtype[tensor.dtype] = [entry]
    fields: list[str] = []
    data: list[bytes | memoryview] = []
    offset = 0
    # safetensors' own order: dtype descending, then name; this also keeps data aligned.
    for code in sorted(by_dtype, key=DTYPE_RANK.__getitem__, reverse=True):
        bucket = by_dtype[code]
        bucket.sort(key=_KEY)
        for key, name, tensor in bucket:
            end = offset + len(tensor.data)
            fields.append(_header_entry(f'"{key}"' if name in _PLAIN_NAMES else _json_key(key), tensor, offset, end))
            data.append(tensor.data)
            offset = end
    return b"".join(frame([meta], f"{{{','.join(fields)}}}".encode(), data))


_KEY = operator.itemgetter(0)


def _assemble(meta: bytes, header: dict[str, Any], data: Sequence[bytes | memoryview]) -> bytes:
    return b"".join(_assemble_parts(meta, header, data))


def _assemble_parts(
    meta: bytes, header: dict[str, Any], data: Sequence[bytes | memoryview]
) -> list[bytes | memoryview]:
    """A payload as the runs of bytes it is made of, in order."""
    header_json = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8") if header else b"{}"
    return frame([meta], header_json, data)


def frame(
    meta: Sequence[bytes | memoryview],
    header_json: bytes,
    data: Sequence[bytes | memoryview],
    data_len: int | None = None,
) -> list[bytes | memoryview]:
    """The runs of bytes of a payload whose metadata pickle is the runs `meta` and whose
    safetensors header is already written as JSON, its tensor data `data` (or, given
    `data_len`, data of that many bytes that the runs leave out)."""
    pad = -len(header_json) % 8
    if pad:
        header_json += b" " * pad
    tensor_len = 8 + len(header_json) + (sum([len(run) for run in data]) if data_len is None else data_len)
    head = HEADER.pack(MAGIC, VERSION, sum([len(run) for run in meta]), tensor_len)
    return [head, *meta, _U64.pack(len(header_json)), header_json, *data]


_U64 = struct.Struct("<Q")


# The server stores each experience as a one-item payload whose metadata pickle is laid
# out so that splice.join() can splice many of them without unpickling: protocol 3, no memo
# (so each item's opcodes stand on their own), between a fixed head and tail.
_SPLICE_HEAD = b"\x80\x03}(X\x07\x00\x00\x00versionK\x01X\t\x00\x00\x00num_itemsJ"
_SPLICE_ITEMS = b"X\x05\x00\x00\x00items]("
SPLICE_TAIL = b"eu."
SPLICE_ONE = _SPLICE_HEAD + struct.pack("<i", 1) + _SPLICE_ITEMS


class _Runs:
    """A pickler's output as the runs of bytes it writes: its opcodes, and each str or bytes
    value of 64 KiB or more as it is (the pickler hands those over without buffering them)."""

    def __init__(self) -> None:
        self.runs: list[bytes | memoryview] = []
        self.write = self.runs.append


_picklers = threading.local()  # per thread: a pickler and its output, reused for every item


def fragment(meta: dict[str, Any]) -> list[bytes | memoryview]:
    """An item's metadata as the opcodes of its canonical pickle, without PROTO and STOP, in
    runs of bytes: large values are not copied, so the runs are read while `meta` lives."""
    written = canonical.opcodes(meta)  # most metadata, without the pickler
    return [written] if written is not None else _pickled(meta)


def _pickled(meta: dict[str, Any]) -> list[bytes | memoryview]:
    """fragment's runs as the pickler writes them."""
    runs: _Runs
    pickler: pickle.Pickler
    try:
        runs, pickler = _picklers.one
    except AttributeError:  # the first item in this thread
        runs = _Runs()
        pickler = pickle.Pickler(runs, protocol=3)
        pickler.fast = True  # no memo: the opcodes do not refer to anything outside themselves
        _picklers.one = runs, pickler
    try:
        pickler.dump(_canonical(meta))
        out = runs.runs[:]
    except BaseException:
        del _picklers.one  # not reused after a failure midway
        raise
    finally:
        runs.runs.clear()
    if len(out) == 1:
        return [memoryview(out[0])[2:-1]]
    return [memoryview(out[0])[2:], *out[1:-1], memoryview(out[-1])[:-1]]


def _canonical(value: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> Any:
    """The same plain data with every dict's keys sorted (str before bytes), so that equal
    content packs to equal bytes whatever order a client wrote its keys in."""
    if isinstance(value, dict):
        try:
            keys = sorted(value)
        except TypeError:  # str and bytes keys together
            keys = sorted(value, key=lambda key: (isinstance(key, bytes), key))
        out = {}
        for key in keys:
            inner = value[key]
            kind = type(inner)
            if kind in EXACT_SCALARS or (kind in EXACT_CONTAINERS and not inner) or not isinstance(inner, CONTAINERS):
                out[key] = inner  # scalars and empty containers are canonical as they are
            else:
                out[key] = _canonical(inner)
        return out
    if not any(isinstance(inner, CONTAINERS) for inner in value):
        return value  # a list or tuple of scalars is canonical as it is
    canonical = [_canonical(inner) if isinstance(inner, CONTAINERS) else inner for inner in value]
    return canonical if isinstance(value, list) else tuple(canonical)


def splice_meta(fragments: Sequence[bytes | memoryview]) -> bytes:
    """The metadata pickle of a batch of items spliced from their canonical pickles' opcodes."""
    return b"".join([_SPLICE_HEAD, struct.pack("<i", len(fragments)), _SPLICE_ITEMS, *fragments, SPLICE_TAIL])


def pack_item(item: RawItem) -> bytes:
    """One validated experience as a one-item TRXP payload that splice.join() splices cheaply."""
    layout, tensors = _laid_out(item.tensors)
    data = [tensor.data for tensor in tensors]
    header, size = _header(layout, tensors, [len(run) for run in data])
    parts = _framed(item.meta, header, size)
    parts.extend(data)
    return b"".join(parts)


def pack_head(item: RawItem) -> tuple[list[bytes | memoryview], list[str]]:
    """pack_item's payload up to its tensor data, from the tensors' shapes (their data may not
    be there yet: a payload read as it arrives), and the order in which it lays out the tensors'
    data after it."""
    layout, tensors = _laid_out(item.tensors)
    header, size = _header(layout, tensors, [math.prod(tensor.shape) * ITEMSIZE[tensor.dtype] for tensor in tensors])
    return _framed(item.meta, header, size), [layout.names[at] for at in layout.order]


def _framed(meta: dict[str, Any], header: bytes, size: int) -> list[bytes | memoryview]:
    """The runs of a one-item payload up to its tensor data: its frame, metadata pickle
    (`meta`'s) and safetensors header (padded as frame() pads it), before `size` bytes of data."""
    pad = _PADS[-len(header) % 8]
    parts: list[bytes | memoryview] = [_FRAME_HEAD, b""]
    parts[1] = _LENGTHS(_meta(meta, parts), 8 + len(header) + len(pad) + size)
    parts.append(_LENGTH(len(header) + len(pad)))
    parts.append(header)
    parts.append(pad)
    return parts


def _meta(meta: dict[str, Any], parts: list[bytes | memoryview]) -> int:
    """Append an item's metadata pickle in the canonical form the store keeps (between the
    splice's fixed head and tail) to `parts`; its length. Written by the pickler (large values),
    it goes as the pickler's own runs, large values not copied: the payload's join is their one
    copy, so packing an experience of large metadata holds it twice at most, not three times."""
    out = [SPLICE_ONE]
    if canonical.write(meta, out):  # most metadata is written without the pickler
        out.append(SPLICE_TAIL)
        joined = b"".join(out)
        parts.append(joined)
        return len(joined)
    runs = [SPLICE_ONE, *_pickled(meta), SPLICE_TAIL]
    parts.extend(runs)
    return sum(map(len, runs))


@final
class _Layout:
    """An item's tensors of these names and dtypes (in its order) and the safetensors header of
    a one-item payload of them as bytes % formats it: the tensors in safetensors' order (dtype
    descending, then name; this also keeps data aligned), each entry's dimensions and data
    offsets left to format. A push's items mostly have the names and dtypes of the item before,
    so they are laid out without sorting and their header written without a word of JSON made
    again."""

    def __init__(self, names: list[str], dtypes: list[str], dims: list[int]) -> None:
        self.names = names
        self.dtypes = dtypes
        self.dims = dims  # each tensor's number of dimensions
        self.order = sorted(range(len(names)), key=lambda at: (-DTYPE_RANK[dtypes[at]], names[at]))
        entries = []
        for at in self.order:
            key = (_FIELD_KEYS.get(names[at]) or _json_key(f"0:{names[at]}")).replace("%", "%%")
            shape = ",".join(["%d"] * dims[at])
            entries.append(f'{key}:{{"dtype":"{dtypes[at]}","shape":[{shape}],"data_offsets":[%d,%d]}}')
        self.form = f"{{{','.join(entries)}}}".encode()


# Of each number of tensors, the layout of the last item's.
_LAYOUTS: Final[dict[int, _Layout]] = {}
_PADS: Final = [b" " * pad for pad in range(8)]
# A payload's frame (HEADER) as its magic and version, then its metadata's and tensors' lengths, packed
# by methods bound once (a call of a Struct's method looks it up at every call).
_FRAME_HEAD: Final = HEADER.pack(MAGIC, VERSION, 0, 0)[:5]
_LENGTHS: Final = struct.Struct("<QQ").pack
_LENGTH: Final = _U64.pack


def _laid_out(tensors: dict[str, RawTensor]) -> tuple[_Layout, list[RawTensor]]:
    """The layout of an item's tensors (the last item's, where it had the same names, dtypes
    and numbers of dimensions), and the tensors in its order."""
    names = list(tensors.keys())
    values = list(tensors.values())
    layout = _LAYOUTS.get(len(names))
    if layout is None or names != layout.names or not _fits(layout, values):
        layout = _LAYOUTS[len(names)] = _Layout(
            names, [tensor.dtype for tensor in values], [len(tensor.shape) for tensor in values]
        )
    return layout, [values[at] for at in layout.order]


def _fits(layout: _Layout, tensors: list[RawTensor]) -> bool:
    """Whether tensors of the layout's names have its dtypes and numbers of dimensions."""
    for at, tensor in enumerate(tensors):
        if tensor.dtype != layout.dtypes[at] or len(tensor.shape) != layout.dims[at]:
            return False
    return True


def _header(layout: _Layout, tensors: list[RawTensor], sizes: list[int]) -> tuple[bytes, int]:
    """The safetensors header of a one-item payload of `tensors` (in the layout's order) of
    `sizes` bytes (unpadded), and their data's length."""
    values: list[int] = []
    end = 0
    for at, tensor in enumerate(tensors):
        for dim in tensor.shape:
            if type(dim) is not int:  # as json.dumps writes it (_header_entry)
                return _written_header(layout, tensors, sizes)
            values.append(dim)
        values.append(end)
        end += sizes[at]
        values.append(end)
    return layout.form % tuple(values), end


def _written_header(layout: _Layout, tensors: list[RawTensor], sizes: list[int]) -> tuple[bytes, int]:
    """_header, of tensors whose dimensions are not all ints, each entry written as JSON."""
    entries = []
    end = 0
    for at, tensor in enumerate(tensors):
        name = layout.names[layout.order[at]]
        start, end = end, end + sizes[at]
        entries.append(_header_entry(_FIELD_KEYS.get(name) or _json_key(f"0:{name}"), tensor, start, end))
    return f"{{{','.join(entries)}}}".encode(), end


def _header_entry(key: str, tensor: RawTensor, start: int, end: int) -> str:
    """A tensor's entry in a safetensors header under its key (written as JSON), exactly as
    json.dumps writes it (separators "," and ":", no ASCII escaping), formatted directly
    when its shape needs no JSON's care."""
    shape = tensor.shape
    if len(shape) == 1 and type(shape[0]) is int:
        dims = f"[{shape[0]}]"
    else:
        dims = json.dumps(list(shape), separators=(",", ":"))
    return f'{key}:{{"dtype":"{tensor.dtype}","shape":{dims},"data_offsets":[{start},{end}]}}'


_JSON_ESCAPED = re.compile(r'[\x00-\x1f"\\]')


@functools.lru_cache(maxsize=1024)
def json_text(text: str) -> bytes:
    """A string as the contents of a JSON string, as json.dumps(ensure_ascii=False) writes it (and
    a stored header writes a name)."""
    if _JSON_ESCAPED.search(text) is None:
        return text.encode()
    return json.dumps(text, ensure_ascii=False)[1:-1].encode()


def _json_key(key: str) -> str:
    """A string as json.dumps(ensure_ascii=False) writes it, quotes included."""
    return f'"{json_text(key).decode()}"'


_FIELD_KEYS = {name: _json_key(f"0:{name}") for name in TENSOR_FIELDS}
# Tensor names JSON writes as they are: the key of one is written without a look at its text.
_PLAIN_NAMES = frozenset(TENSOR_FIELDS)


# One entry of a batch header, as json.dumps(header, separators=(",", ":"), ensure_ascii=False)
# writes it: its item index (ENTRY_AT); its text from the name to its start offset (ENTRY_TEXT: the
# name and dtype as the contents of JSON strings, the shape's dimensions, dims_text); its start and
# end offsets (ENTRY_SPAN).
ENTRY_AT = b'"%d:'
ENTRY_TEXT = b'%b":{"dtype":"%b","shape":[%b],"data_offsets":['
ENTRY_SPAN = b"%d,%d]}"
ENTRY = ENTRY_AT + ENTRY_TEXT + ENTRY_SPAN


def dims_text(shape: Sequence[int]) -> bytes:
    """A shape as a header's entry writes it: its dimensions, comma-separated."""
    return b",".join([b"%d" % dim for dim in shape])
