"""Building TRXP payloads from trusted items: whole batches as Trinity-RFT writes them, one
item in the canonical form the server stores, and batches spliced from stored items
without unpickling them.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


from .common import _CONTAINERS, _DTYPE_RANK, _HEADER, HEADER_SIZE, MAGIC, VERSION, RawItem, RawTensor
from .parse import parse

# ---- building (trusted input) -----------------------------------------------------


def build(items: Sequence[RawItem]) -> bytes:
    """Compose one TRXP payload from items, as Trinity-RFT's serialize_many writes it."""
    meta = pickle.dumps(
        {"version": VERSION, "num_items": len(items), "items": [item.meta for item in items]},
        protocol=5,
    )
    entries = [(f"{index}:{name}", tensor) for index, item in enumerate(items) for name, tensor in item.tensors.items()]
    # safetensors' own order: dtype descending, then name; this also keeps data aligned.
    entries.sort(key=lambda kv: (-_DTYPE_RANK[kv[1].dtype], kv[0]))
    header: dict[str, Any] = {}
    offset = 0
    for key, tensor in entries:
        end = offset + len(tensor.data)
        header[key] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    return _assemble(meta, header, [tensor.data for _, tensor in entries])


def _assemble(meta: bytes, header: dict[str, Any], data: Sequence[bytes | memoryview]) -> bytes:
    return b"".join(_assemble_parts(meta, header, data))


def _assemble_parts(
    meta: bytes, header: dict[str, Any], data: Sequence[bytes | memoryview]
) -> list[bytes | memoryview]:
    """A payload as the runs of bytes it is made of, in order."""
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8") if header else b"{}"
    return _frame_parts(meta, header_bytes, data)


def _frame_parts(meta: bytes, header_bytes: bytes, data: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """A payload of metadata, a safetensors header (padded here) and tensor data, as runs of bytes."""
    header_bytes += b" " * (-len(header_bytes) % 8)
    tensor_len = 8 + len(header_bytes) + sum(len(d) for d in data)
    head = _HEADER.pack(MAGIC, VERSION, len(meta), tensor_len)
    return [head, meta, struct.pack("<Q", len(header_bytes)), header_bytes, *data]


# The server stores each experience as a one-item payload whose metadata pickle is laid
# out so that join() can splice many of them without unpickling: protocol 3, no memo
# (so each item's opcodes stand on their own), between a fixed head and tail.
_SPLICE_HEAD = b"\x80\x03}(X\x07\x00\x00\x00versionK\x01X\t\x00\x00\x00num_itemsJ"
_SPLICE_ITEMS = b"X\x05\x00\x00\x00items]("
_SPLICE_TAIL = b"eu."
_SPLICE_ONE = _SPLICE_HEAD + struct.pack("<i", 1) + _SPLICE_ITEMS


def fragment(meta: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=3)
    pickler.fast = True  # no memo: the opcodes do not refer to anything outside themselves
    pickler.dump(_canonical(meta))
    return buffer.getvalue()[2:-1]  # without PROTO and STOP


def _canonical(value: Any) -> Any:
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
            out[key] = _canonical(inner) if isinstance(inner, _CONTAINERS) else inner
        return out
    if not any(isinstance(inner, _CONTAINERS) for inner in value):
        return value  # a list or tuple of scalars is canonical as it is
    canonical = [_canonical(inner) if isinstance(inner, _CONTAINERS) else inner for inner in value]
    return canonical if isinstance(value, list) else tuple(canonical)


def _splice_meta(fragments: Sequence[bytes | memoryview]) -> bytes:
    return b"".join([_SPLICE_HEAD, struct.pack("<i", len(fragments)), _SPLICE_ITEMS, *fragments, _SPLICE_TAIL])


def pack_item(item: RawItem) -> bytes:
    """One validated experience as a one-item TRXP payload that join() splices cheaply."""
    entries = sorted(item.tensors.items(), key=lambda kv: (-_DTYPE_RANK[kv[1].dtype], kv[0]))
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in entries:
        end = offset + len(tensor.data)
        header[f"0:{name}"] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    return _assemble(_splice_meta([fragment(item.meta)]), header, [tensor.data for _, tensor in entries])


def join(
    payloads: Iterable[bytes],
    extra: Callable[[int, dict[str, RawTensor]], dict[str, RawTensor]] | None = None,
) -> bytes:
    """Concatenate payloads the server stored (already validated) into one batch.

    Payloads made by pack_item are spliced: their metadata opcodes and tensor bytes are
    copied as they are, and only the safetensors header is rewritten. `extra(i, tensors)`
    may add or replace tensors of item i (the server attaches advantages this way).
    Payloads of any other layout are parsed and rebuilt.
    """
    return b"".join(join_parts(payloads, extra))


def join_parts(
    payloads: Iterable[bytes | memoryview],
    extra: Callable[[int, dict[str, RawTensor]], dict[str, RawTensor]] | None = None,
) -> list[bytes | memoryview]:
    """join()'s batch as the runs of bytes it is made of, uncopied: a caller that frames
    the batch (in a reply message, say) copies each byte once.

    The batch's safetensors header is written entry by entry, the same bytes as json.dumps
    of it; the stored headers are read by `_stored_tensors`, without a JSON parse."""
    payloads = list(payloads)
    fragments: list[memoryview] = []
    entries: list[bytes] = []
    data: list[bytes | memoryview] = []
    base = 0
    for index, payload in enumerate(payloads):
        view = memoryview(payload)
        _, _, meta_len, _ = _HEADER.unpack_from(view)
        meta = view[HEADER_SIZE : HEADER_SIZE + meta_len]
        if meta[: len(_SPLICE_ONE)] != _SPLICE_ONE or meta[-len(_SPLICE_TAIL) :] != _SPLICE_TAIL:
            return [_rebuild(payloads, extra)]
        fragments.append(meta[len(_SPLICE_ONE) : -len(_SPLICE_TAIL)])
        blob = view[HEADER_SIZE + meta_len :]
        (header_len,) = struct.unpack_from("<Q", blob)
        section = blob[8 + header_len :]
        stored, whole = _stored_tensors(bytes(blob[8 : 8 + header_len]), len(section))
        if whole and extra is None:  # the section as it is, its offsets moved by base
            entries.extend(
                [_ENTRY % (index, name, dtype, shape, base + a, base + b) for name, dtype, shape, a, b in stored]
            )
            data.append(section)
            base += len(section)
            continue
        added: dict[str, RawTensor] = {}
        if extra is not None:
            added = extra(
                index, {t.decode(): RawTensor(d.decode(), _shape(s), section[a:b]) for t, d, s, a, b in stored}
            )
        kept = [t for t in stored if t[0].decode() not in added] if added else stored
        # Tensors kept whole are copied as one run of bytes; a replaced one leaves a gap.
        data.extend([section] if whole and len(kept) == len(stored) else [section[t[3] : t[4]] for t in kept])
        for name, dtype, shape, start, end in kept:
            entries.append(_ENTRY % (index, name, dtype, shape, base, base + end - start))
            base += end - start
        for name, tensor in added.items():
            dims = b",".join([b"%d" % dim for dim in tensor.shape])
            entries.append(
                _ENTRY % (index, _json_text(name), _json_text(tensor.dtype), dims, base, base + len(tensor.data))
            )
            base += len(tensor.data)
            data.append(tensor.data)
    return _frame_parts(_splice_meta(fragments), b"{" + b",".join(entries) + b"}", data)


# One entry of a batch header, as json.dumps(header, separators=(",", ":"), ensure_ascii=False)
# writes it: the name and dtype as the contents of JSON strings, the shape's dimensions.
_ENTRY = b'"%d:%b":{"dtype":"%b","shape":[%b],"data_offsets":[%d,%d]}'
_INT = rb"(?:0|[1-9][0-9]*)"
# One entry of a stored header as pack_item writes it (through json.dumps): item index 0.
_STORED_ENTRY = (
    rb'"0:([^"\\\x00-\x1f]*)":\{"dtype":"([A-Z0-9_]+)","shape":\[((?:' + _INT + rb")(?:," + _INT + rb")*)?\],"
    rb'"data_offsets":\[(' + _INT + rb"),(" + _INT + rb")\]\}"
)
_STORED_ENTRIES = re.compile(_STORED_ENTRY)
_STORED_HEADER = re.compile(rb"\{(?:(?:" + _STORED_ENTRY + rb")(?:,(?:" + _STORED_ENTRY + rb"))*)?\} *")
_JSON_ESCAPED = re.compile(r'[\x00-\x1f"\\]')
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


@functools.lru_cache(maxsize=1024)
def _json_text(text: str) -> bytes:
    """A string as the contents of a JSON string, as json.dumps(ensure_ascii=False) writes it."""
    if _JSON_ESCAPED.search(text) is None:
        return text.encode()
    return json.dumps(text, ensure_ascii=False)[1:-1].encode()


def _shape(text: bytes) -> tuple[int, ...]:
    return tuple(map(int, text.split(b","))) if text else ()


def _rebuild(
    payloads: Sequence[bytes], extra: Callable[[int, dict[str, RawTensor]], dict[str, RawTensor]] | None
) -> bytes:
    items = [item for payload in payloads for item in parse(payload, trusted=True)]
    if extra:
        for index, item in enumerate(items):
            item.tensors.update(extra(index, item.tensors))
    return build(items)
