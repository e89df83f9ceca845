"""Building TRXP payloads from trusted items: whole batches as Trinity-RFT writes them, one
item in the canonical form the server stores, and batches spliced from stored items
without unpickling them.
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
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from ..schema.experience import TENSOR_FIELDS
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
from .parse import parse
from .pieces import Run, Section, SectionTensors, Stored, cut, parts_of, realized, whole

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
    header_json += b" " * (-len(header_json) % 8)
    tensor_len = 8 + len(header_json) + (sum(map(len, data)) if data_len is None else data_len)
    head = HEADER.pack(MAGIC, VERSION, sum(map(len, meta)), tensor_len)
    return [head, *meta, struct.pack("<Q", len(header_json)), header_json, *data]


# The server stores each experience as a one-item payload whose metadata pickle is laid
# out so that join() can splice many of them without unpickling: protocol 3, no memo
# (so each item's opcodes stand on their own), between a fixed head and tail.
_SPLICE_HEAD = b"\x80\x03}(X\x07\x00\x00\x00versionK\x01X\t\x00\x00\x00num_itemsJ"
_SPLICE_ITEMS = b"X\x05\x00\x00\x00items]("
_SPLICE_TAIL = b"eu."
_SPLICE_ONE = _SPLICE_HEAD + struct.pack("<i", 1) + _SPLICE_ITEMS


class _Runs(list[bytes | memoryview]):
    """A pickler's output as the runs of bytes it writes: its opcodes, and each str or bytes
    value of 64 KiB or more as it is (the pickler hands those over without buffering them)."""

    write = list.append


_picklers = threading.local()  # per thread: a pickler and its output, reused for every item


def fragment(meta: dict[str, Any]) -> list[bytes | memoryview]:
    """An item's metadata as the opcodes of its canonical pickle, without PROTO and STOP, in
    runs of bytes: large values are not copied, so the runs are read while `meta` lives."""
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
        out = runs[:]
    except BaseException:
        del _picklers.one  # not reused after a failure midway
        raise
    finally:
        runs.clear()
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


def _splice_meta(fragments: Sequence[bytes | memoryview]) -> bytes:
    return b"".join([_SPLICE_HEAD, struct.pack("<i", len(fragments)), _SPLICE_ITEMS, *fragments, _SPLICE_TAIL])


def pack_item(item: RawItem) -> bytes:
    """One validated experience as a one-item TRXP payload that join() splices cheaply."""
    tensors = sorted(item.tensors.items(), key=_tensor_order)
    return b"".join(_packed(item.meta, tensors, [len(tensor.data) for _, tensor in tensors], True))


def pack_head(item: RawItem) -> tuple[list[bytes | memoryview], list[str]]:
    """pack_item's payload up to its tensor data, from the tensors' shapes (their data may not
    be there yet: a payload read as it arrives), and the order in which it lays out the tensors'
    data after it."""
    tensors = sorted(item.tensors.items(), key=_tensor_order)
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
    runs = [_SPLICE_ONE, *fragment(meta), _SPLICE_TAIL]
    return frame(runs, header_json, [tensor.data for _, tensor in tensors] if data else [], offset)


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
def _json_text(text: str) -> bytes:
    """A string as the contents of a JSON string, as json.dumps(ensure_ascii=False) writes it."""
    if _JSON_ESCAPED.search(text) is None:
        return text.encode()
    return json.dumps(text, ensure_ascii=False)[1:-1].encode()


def _json_key(key: str) -> str:
    """A string as json.dumps(ensure_ascii=False) writes it, quotes included."""
    return f'"{_json_text(key).decode()}"'


_FIELD_KEYS = {name: _json_key(f"0:{name}") for name in TENSOR_FIELDS}
# Tensor names JSON writes as they are: the key of one is written without a look at its text.
_PLAIN_NAMES = frozenset(TENSOR_FIELDS)


def join(
    payloads: Iterable[bytes],
    extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None = None,
) -> bytes:
    """Concatenate payloads the server stored (already validated) into one batch.

    Payloads made by pack_item are spliced: their metadata opcodes and tensor bytes are
    copied as they are, and only the safetensors header is rewritten. `extra(i, tensors)`
    may add or replace tensors of item i (the server attaches advantages this way).
    Payloads of any other layout are parsed and rebuilt.
    """
    return b"".join([realized(run) for run in join_parts(payloads, extra)])


def join_parts(
    payloads: Iterable[Stored],
    extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None = None,
    drop: Collection[str] = (),
) -> list[Run]:
    """join()'s batch as the runs of bytes it is made of, uncopied: a caller that frames
    the batch (in a reply message, say) copies each byte once. Tensors named in `drop`
    are left out of every item (the server sends advantages beside a batch this way).

    The batch's safetensors header is written entry by entry, the same bytes as json.dumps
    of it; the stored headers are read by `_stored_tensors`, without a JSON parse."""
    payloads = list(payloads)
    dropped = {_json_text(name) for name in drop}
    fragments: list[memoryview] = []
    entries: list[bytes] = []
    data: list[Run] = []
    base = 0
    for index, payload in enumerate(payloads):
        meta, header, section, section_len = parts_of(payload)
        if meta[: len(_SPLICE_ONE)] != _SPLICE_ONE or meta[-len(_SPLICE_TAIL) :] != _SPLICE_TAIL:
            return [_rebuild(payloads, extra, drop)]
        fragments.append(meta[len(_SPLICE_ONE) : -len(_SPLICE_TAIL)])
        stored, whole = _stored_tensors(header, section_len)
        if dropped and any(t[0] in dropped for t in stored):
            stored = [t for t in stored if t[0] not in dropped]
            whole = False
        if whole and extra is None:  # the section as it is, its offsets moved by base
            entries.extend(
                [ENTRY % (index, name, dtype, shape, base + a, base + b) for name, dtype, shape, a, b in stored]
            )
            _extend(data, section)
            base += section_len
            continue
        added: dict[str, RawTensor] = {}
        if extra is not None:
            added = extra(index, stored_tensors(stored, section))
        kept = [t for t in stored if _json_name(t[0]) not in added] if added else stored
        # Tensors kept whole are copied as one run of bytes; a replaced one leaves a gap.
        if whole and len(kept) == len(stored):
            _extend(data, section)
        elif isinstance(section, memoryview):
            data.extend([section[t[3] : t[4]] for t in kept])
        else:
            data.extend([run for t in kept for run in cut(section, t[3], t[4])])
        for name, dtype, shape, start, end in kept:
            entries.append(ENTRY % (index, name, dtype, shape, base, base + end - start))
            base += end - start
        for key, tensor in added.items():
            dims = b",".join([b"%d" % dim for dim in tensor.shape])
            entries.append(
                ENTRY % (index, _json_text(key), _json_text(tensor.dtype), dims, base, base + len(tensor.data))
            )
            base += len(tensor.data)
            data.append(tensor.data)
    return [*frame([_splice_meta(fragments)], b"{" + b",".join(entries) + b"}", [], data_len=base), *data]


# One entry of a batch header, as json.dumps(header, separators=(",", ":"), ensure_ascii=False)
# writes it: the name and dtype as the contents of JSON strings, the shape's dimensions.
ENTRY = b'"%d:%b":{"dtype":"%b","shape":[%b],"data_offsets":[%d,%d]}'
_INT = rb"(?:0|[1-9][0-9]*)"
# One entry of a stored header as pack_item writes it (through json.dumps): item index 0.
_STORED_ENTRY = (
    rb'"0:([^"\\\x00-\x1f]*)":\{"dtype":"([A-Z0-9_]+)","shape":\[((?:' + _INT + rb")(?:," + _INT + rb")*)?\],"
    rb'"data_offsets":\[(' + _INT + rb"),(" + _INT + rb")\]\}"
)
_STORED_ENTRIES = re.compile(_STORED_ENTRY)
_STORED_HEADER = re.compile(rb"\{(?:(?:" + _STORED_ENTRY + rb")(?:,(?:" + _STORED_ENTRY + rb"))*)?\} *")
# A tensor of a stored header: name, dtype and shape as JSON text, start and end offsets.
_Stored = tuple[bytes, bytes, bytes, int, int]


def _stored_tensors(header: bytes, section_len: int) -> tuple[list[_Stored], bool]:
    """The tensors of one stored item's safetensors header in order, and whether they lie
    back to back from the start to the end of its tensor section.

    pack_item writes `{"0:name":{"dtype":..,"shape":[..],"data_offsets":[a,b]},...}` padded
    with spaces: two passes of regular expressions read it, the first checking every byte.
    A header in any other layout is parsed as JSON."""
    if _STORED_HEADER.fullmatch(header) is None:
        return _parsed_tensors(header, section_len)
    found: list[_Stored] = []
    end = 0
    whole = True
    for name, dtype, shape, first, last in _STORED_ENTRIES.findall(header):
        start = int(first)
        whole = whole and start == end
        end = int(last)
        found.append((name, dtype, shape, start, end))
    return found, whole and end == section_len


def stored_entries(header: bytes, section_len: int) -> list[tuple[bytes, bytes, bytes, int, int]]:
    """One stored item's tensors as its safetensors header writes them: name and dtype as the
    contents of JSON strings, dimensions as JSON text, start and end offsets in its section."""
    return _stored_tensors(header, section_len)[0]


def json_text(text: str) -> bytes:
    """A string as the contents of a JSON string, as a stored header writes a name."""
    return _json_text(text)


def stored_tensors(found: list[_Stored], section: Section) -> Mapping[str, RawTensor]:
    """One stored item's tensors (its `stored_entries`) by name, as views of its tensor section,
    or, for a section in pieces, made as each is looked up (pieces.SectionTensors)."""
    if isinstance(section, memoryview):
        return {
            _json_name(name): RawTensor(dtype.decode(), _shape(shape), section[start:end])
            for name, dtype, shape, start, end in found
        }
    entries = {_json_name(name): (dtype.decode(), _shape(shape), a, b) for name, dtype, shape, a, b in found}
    return SectionTensors(entries, section)


def _json_name(text: bytes) -> str:
    """A name as the contents of a JSON string, read back."""
    return json.loads(b'"' + text + b'"') if b"\\" in text else text.decode()


def _parsed_tensors(header: bytes, section_len: int) -> tuple[list[_Stored], bool]:
    """_stored_tensors() of a header in another layout, through a JSON parse."""
    found: list[_Stored] = []
    end = 0
    whole = True
    for key, entry in json.loads(header).items():
        if key == "__metadata__":
            continue
        start, stop = entry["data_offsets"]
        whole = whole and start == end
        end = stop
        shape = b",".join([b"%d" % dim for dim in entry["shape"]])
        found.append((_json_text(key.partition(":")[2]), _json_text(entry["dtype"]), shape, start, stop))
    return found, whole and end == section_len


def _extend(data: list[Run], section: Section) -> None:
    """A whole section onto a payload's runs: one run, or its pieces."""
    if isinstance(section, memoryview):
        data.append(section)
    else:
        data.extend(section)


def _shape(text: bytes) -> tuple[int, ...]:
    return tuple(map(int, text.split(b","))) if text else ()


def _rebuild(
    payloads: Sequence[Stored],
    extra: Callable[[int, Mapping[str, RawTensor]], dict[str, RawTensor]] | None,
    drop: Collection[str],
) -> bytes:
    items = [item for payload in payloads for item in parse(whole(payload), trusted=True)]
    for index, item in enumerate(items):
        for name in drop:
            item.tensors.pop(name, None)
        if extra:
            item.tensors.update(extra(index, item.tensors))
    return build(items)
