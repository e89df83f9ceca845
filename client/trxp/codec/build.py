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
from typing import Any

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
    if written is not None:
        return [written]
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
    tensors = _in_order(item.tensors)
    return b"".join(_packed(item.meta, tensors, [len(tensor.data) for _, tensor in tensors], True))


def _in_order(tensors: dict[str, RawTensor]) -> list[tuple[str, RawTensor]]:
    """An item's tensors in safetensors' order (_tensor_order), as the last item of the same names
    and dtypes had them (a push's items mostly do) without sorting them again."""
    entries = list(tensors.items())
    kinds = [(name, tensor.dtype) for name, tensor in entries]
    recent = _recent_order.get(len(kinds))
    if recent is not None and recent[0] == kinds:
        return [entries[at] for at in recent[1]]
    order = sorted(range(len(entries)), key=lambda at: _tensor_order(entries[at]))
    _recent_order[len(kinds)] = (kinds, order)
    return [entries[at] for at in order]


def pack_head(item: RawItem) -> tuple[list[bytes | memoryview], list[str]]:
    """pack_item's payload up to its tensor data, from the tensors' shapes (their data may not
    be there yet: a payload read as it arrives), and the order in which it lays out the tensors'
    data after it."""
    tensors = _in_order(item.tensors)
    sizes = [math.prod(tensor.shape) * ITEMSIZE[tensor.dtype] for _, tensor in tensors]
    return _packed(item.meta, tensors, sizes, False), [name for name, _ in tensors]


def _packed(
    meta: dict[str, Any], tensors: list[tuple[str, RawTensor]], sizes: list[int], data: bool
) -> list[bytes | memoryview]:
    """A one-item payload in the canonical form the store keeps (its runs of bytes), the tensors
    of `sizes` bytes laid out in the order given; without their data unless `data`."""
    header: list[str] = []
    offset = 0
    for (name, tensor), size in zip(tensors, sizes, strict=True):
        end = offset + size
        header.append(_header_entry(_FIELD_KEYS.get(name) or _json_key(f"0:{name}"), tensor, offset, end))
        offset = end
    header_json = f"{{{','.join(header)}}}".encode()
    runs = [SPLICE_ONE, *fragment(meta), SPLICE_TAIL]
    return frame(runs, header_json, [tensor.data for _, tensor in tensors] if data else [], offset)


# Of each number of tensors, the names and dtypes of the last item's and their order.
_recent_order: dict[int, tuple[list[tuple[str, str]], list[int]]] = {}


def _tensor_order(entry: tuple[str, RawTensor]) -> tuple[int, str]:
    """safetensors' own order: dtype descending, then name; this also keeps data aligned."""
    return -DTYPE_RANK[entry[1].dtype], entry[0]


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
# writes it: the name and dtype as the contents of JSON strings, the shape's dimensions.
ENTRY = b'"%d:%b":{"dtype":"%b","shape":[%b],"data_offsets":[%d,%d]}'
