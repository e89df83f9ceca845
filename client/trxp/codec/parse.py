"""Parsing untrusted TRXP payloads into raw items: the header, the metadata pickle and the
safetensors section, every length checked against the bytes present before anything is
allocated, within a work budget proportional to the payload's size.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
from typing import Any, Final

from ...schema.experience import TENSOR_FIELDS
from .checks import check_meta, check_tensors
from .common import (
    EXPANSION_BASE,
    EXPANSION_PER_BYTE,
    HEADER,
    HEADER_SIZE,
    INT64_MAX,
    ITEMSIZE,
    MAGIC,
    MM_PREFIX,
    VERSION,
    MetadataLimit,
    RawItem,
    RawTensor,
    TrxpError,
    Work,
)
from .measure import Shape
from .pickles import scan_pickle
from .shown import clip, is_int, show, show_list
from .unpickler import load_plain

# ---- parsing (untrusted input) ---------------------------------------------------


def parse(
    payload: bytes | bytearray | memoryview,
    *,
    trusted: bool = False,
    work: Work | None = None,
    shape: Shape | None = None,
    limit: MetadataLimit | None = None,
) -> list[RawItem]:
    """Split a TRXP payload into validated items without creating tensors.

    `trusted=True` is for payloads the server itself wrote after validating them:
    it skips the pickle opcode scan and the per-item checks, not the restricted
    unpickler nor the bounds checks of the sections. `work` counts the decoding steps
    (by default within the budget of a payload of this size). `shape` measures each
    item's metadata for check_meta: by default the store's measure, its size written out
    in full within the payload's expansion bound, and each item's within `limit` if given.
    """
    view = memoryview(payload).cast("B")
    size = len(view)
    if work is None:
        work = Work.for_payload(size)
    meta_len = _frame(view, size)
    meta_bytes = view[HEADER_SIZE : HEADER_SIZE + meta_len]
    if shape is None:
        shape = Shape(work, EXPANSION_PER_BYTE * size + EXPANSION_BASE, check_keys=False, limit=limit)
    items, uids = _load_items(meta_bytes, trusted=trusted, work=work, shape=shape)
    tensors = _parse_safetensors(view[HEADER_SIZE + meta_len :], work)
    return _items(items, uids, tensors, work)


def head_length(start: bytes | bytearray | memoryview, size: int) -> int:
    """How many bytes of a payload of `size` bytes come before its tensor data (its TRXP header,
    metadata and safetensors header), read from its first bytes `start`; 0 while `start` is too
    short to tell. A payload whose framing is not TRXP's is refused as parse() refuses it."""
    view = memoryview(start).cast("B")
    if len(view) < HEADER_SIZE and not (view and view[0] == pickle.PROTO[0]):
        return 0
    meta_len = _frame(view, size)
    at = HEADER_SIZE + meta_len
    if len(view) < at + 8:
        return 0
    (header_len,) = struct.unpack_from("<Q", view, at)
    if header_len > size - at - 8:
        raise TrxpError(f"tensors: safetensors header length {header_len} exceeds the {size - at - 8} bytes present")
    length: int = at + 8 + header_len
    return length


def parse_head(
    head: bytes | bytearray | memoryview, size: int, *, received: int, limit: MetadataLimit | None = None
) -> tuple[list[RawItem], list[tuple[int, int, int, str]]]:
    """The items of an untrusted payload of `size` bytes from its `head` (the head_length bytes
    before its tensor data), checked as parse() checks them, each tensor's data an empty view: a
    payload read as it arrives, its data routed as it comes. Its budgets (the work, the metadata
    written out) are those of a payload of the `received` bytes present, not of the size it
    claims, which a sender may not send; one that needs more is refused here and may be parsed
    whole once all of it came. With the items, where each tensor's data lies in the tensor data:
    (start, end, item, name), in the data's order, the data's bytes covered from start to end."""
    view = memoryview(head).cast("B")
    work = Work.for_payload(received)
    meta_len = _frame(view, size)
    shape = Shape(work, EXPANSION_PER_BYTE * received + EXPANSION_BASE, check_keys=False, limit=limit)
    items, uids = _load_items(view[HEADER_SIZE : HEADER_SIZE + meta_len], trusted=False, work=work, shape=shape)
    blob = view[HEADER_SIZE + meta_len :]
    entries = _spans(blob, size - HEADER_SIZE - meta_len - len(blob), work)
    empty = memoryview(b"")
    tensors = {key: RawTensor(dtype, dims, empty) for _, _, dtype, dims, key in entries}
    raw = _items(items, uids, tensors, work)
    places = []
    for start, end, _, _, key in entries:
        index, name = _split_tensor_key(key, len(items))
        places.append((start, end, index, name))
    return raw, places


def _frame(view: memoryview, size: int) -> int:
    """Check the TRXP header of a payload of `size` bytes (at least its first HEADER_SIZE in
    `view`) against that size; its metadata's length."""
    if size and view[0] == pickle.PROTO[0]:
        raise TrxpError("payload is a plain pickle without the TRXP header; legacy pickle payloads are refused")
    if size < HEADER_SIZE:
        raise TrxpError(f"payload is {size} bytes, shorter than the {HEADER_SIZE}-byte TRXP header")
    magic, version, meta_len, tensor_len = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise TrxpError(f"bad magic {bytes(magic)!r}: not a TRXP payload")
    if version != VERSION:
        raise TrxpError(f"unknown TRXP version {version} (this server reads version {VERSION})")
    if HEADER_SIZE + meta_len > size:
        raise TrxpError(f"metadata length {meta_len} points past the end of the {size}-byte payload")
    if HEADER_SIZE + meta_len + tensor_len > size:
        raise TrxpError(
            f"tensor section is {size - HEADER_SIZE - meta_len} bytes, shorter than the declared {tensor_len}"
        )
    trailing = size - HEADER_SIZE - meta_len - tensor_len
    if trailing:
        raise TrxpError(f"{trailing} trailing bytes after the declared sections")
    length: int = meta_len
    return length


def _items(
    items: list[dict[str, Any]], uids: list[str] | None, tensors: dict[str, RawTensor], work: Work
) -> list[RawItem]:
    """The items of a payload: each one's metadata and its tensors, checked where their metadata
    was (`uids`, each one's as check_meta made it; None for a trusted payload)."""
    per_item: list[dict[str, RawTensor]] = [{} for _ in items]
    for key, tensor in tensors.items():
        index, name = _split_tensor_key(key, len(items))
        per_item[index][name] = tensor
    if uids is None:
        return [RawItem(meta, tensors) for meta, tensors in zip(items, per_item, strict=True)]
    raw = [RawItem(meta, tensors, uid) for meta, tensors, uid in zip(items, per_item, uids, strict=True)]
    for index, item in enumerate(raw):
        check_tensors(index, item, work)
    return raw


def _load_items(
    meta_bytes: memoryview, *, trusted: bool, work: Work, shape: Shape
) -> tuple[list[dict[str, Any]], list[str] | None]:
    """The items of a payload's metadata and, unless `trusted`, each one checked: their uids."""
    if not trusted:
        scan_pickle(meta_bytes, work)
    work.charge(len(meta_bytes))  # the unpickler is linear in its input once the scan has passed it
    try:
        meta = load_plain(meta_bytes)
    except TrxpError:
        raise
    except Exception as exc:  # the unpickler raises many types on malformed input
        raise TrxpError(f"metadata: pickle is not readable ({type(exc).__name__}: {clip(str(exc))})") from None
    if not isinstance(meta, dict):
        raise TrxpError(f"metadata: expected a dict, got {type(meta).__name__}")
    if meta.get("version") != VERSION:
        raise TrxpError(f"metadata: version is {show(meta.get('version'))}, expected {VERSION}")
    items, num_items = meta.get("items"), meta.get("num_items")
    if not isinstance(items, list):
        raise TrxpError(f"metadata: 'items' must be a list, got {type(items).__name__}")
    if not is_int(num_items) or num_items != len(items):
        raise TrxpError(f"metadata: num_items is {show(num_items)} but {len(items)} items are present")
    if trusted:
        return items, None
    return items, [check_meta(index, item, shape) for index, item in enumerate(items)]


def _parse_safetensors(blob: memoryview, work: Work) -> dict[str, RawTensor]:
    size = len(blob)
    if size < 8:
        raise TrxpError(f"tensors: safetensors blob is {size} bytes, too short for its header length")
    (header_len,) = struct.unpack_from("<Q", blob)
    if header_len > size - 8:
        raise TrxpError(f"tensors: safetensors header length {header_len} exceeds the {size - 8} bytes present")
    data = blob[8 + header_len :]
    return {
        key: RawTensor(dtype, shape, data[start:end]) for start, end, dtype, shape, key in _spans(blob, len(data), work)
    }


def _spans(blob: memoryview, data_len: int, work: Work) -> list[tuple[int, int, str, tuple[int, ...], str]]:
    """The tensors of a safetensors blob whose header is at the start of `blob` and whose data is
    `data_len` bytes: (start, end, dtype, shape, key) in the data's order, every byte of the data
    in exactly one tensor."""
    (header_len,) = struct.unpack_from("<Q", blob)
    work.charge(header_len)  # the JSON parser is linear in its input
    try:
        text = str(blob[8 : 8 + header_len], "utf-8")
    except UnicodeDecodeError as exc:
        raise _not_json(exc) from None
    written = _written_spans(text, data_len)
    if written is None:
        return _json_spans(text, data_len, work)
    work.charge(2 * len(written))  # as _parse_entry charges each entry of one dimension
    return written


def _not_json(exc: ValueError | RecursionError) -> TrxpError:
    return TrxpError(f"tensors: safetensors header is not valid JSON ({clip(str(exc))})")


def _json_spans(text: str, data_len: int, work: Work) -> list[tuple[int, int, str, tuple[int, ...], str]]:
    """_spans of a header read as JSON, each entry checked (_parse_entry): any header _written_spans
    does not read, and each refusal of one."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also ints of 4300+ digits
        raise _not_json(exc) from None
    if not isinstance(header, dict):
        raise TrxpError("tensors: safetensors header is not a JSON object")
    spans = [_parse_entry(key, entry, data_len, work) for key, entry in header.items() if key != "__metadata__"]
    if not _in_order(spans):
        spans.sort()
    cursor = 0
    for start, end, _, _, key in spans:
        if start != cursor:
            raise TrxpError(f"tensors: {show(key)} starts at byte {start}, expected {cursor} (gap or overlap)")
        cursor = end
    if cursor != data_len:
        raise TrxpError(f"tensors: {data_len - cursor} bytes of tensor data belong to no tensor")
    return spans


# One header entry as expbuf's writers write it (build.py's _header_entry, json.dumps with
# separators "," and ":"): a key of an item's index and a name without escapes, one dimension
# (not 0), each number as JSON writes an int, of at most 18 digits. Each repeat is possessive, as
# what follows it is a character it does not take. Splitting a header at its entries leaves
# 5 groups an entry and the text between them.
_WRITTEN_ENTRY: Final = re.compile(
    r'"([0-9][^"\\\x00-\x1f]*+)":\{"dtype":"([A-Z0-9_]++)","shape":\[([1-9][0-9]{0,17}+)\],'
    r'"data_offsets":\[([1-9][0-9]{0,17}+|0),([1-9][0-9]{0,17}+)\]\}'
)
_GROUPS: Final = 6  # an entry's 5 groups and the text after it


def _written_spans(text: str, data_len: int) -> list[tuple[int, int, str, tuple[int, ...], str]] | None:
    """_spans' result for a header in the form expbuf's writers write (entries of one dimension in
    the data's order, no space but the padding after it), read by one regular expression instead
    of json.loads and each entry's checks; None for any other header, which _spans reads as JSON.
    Accepts only what json.loads and the checks accept, with the same spans: every text between
    the entries is checked to be exactly the JSON around them, so the header is that JSON."""
    parts: list[str] = _WRITTEN_ENTRY.split(text)  # each group matches something in a written entry
    last = len(parts) - 1
    if not last or parts[0] != "{" or parts[last].rstrip(" ") != "}":
        return None
    spans: list[tuple[int, int, str, tuple[int, ...], str]] = []
    cursor, written = 0, "0"  # where the last entry ended, and that offset as its entry wrote it
    dtype, itemsize = "", 0
    for at in range(1, last, _GROUPS):
        if at > 1 and parts[at - 1] != ",":
            return None
        if parts[at + 1] != dtype:  # entries come by dtype: its size is looked up where it changes
            dtype = parts[at + 1]
            found = ITEMSIZE.get(dtype)
            if found is None:
                return None
            itemsize = found
        if parts[at + 3] != written:  # each number is written one way only
            return None
        written = parts[at + 4]
        end = int(written)
        dim = int(parts[at + 2])
        if end - cursor != dim * itemsize:
            return None
        spans.append((cursor, end, dtype, (dim,), parts[at]))
        cursor = end
    if cursor != data_len or len(set(parts[1:last:_GROUPS])) != len(spans):
        return None  # duplicate keys: json.loads keeps one of them
    return spans


def _in_order(spans: list[tuple[int, int, str, tuple[int, ...], str]]) -> bool:
    """Whether spans are already as sorted() orders them: each starting where the one before ends and
    none empty (so each starts past the one before), the data's order as a client writes the header."""
    cursor = 0
    for start, end, _, _, _ in spans:
        if start != cursor or end == start:
            return False
        cursor = end
    return True


def _parse_entry(key: str, entry: Any, data_len: int, work: Work) -> tuple[int, int, str, tuple[int, ...], str]:
    """Check one safetensors header entry; return (start, end, dtype, shape, key). JSON makes no
    subclasses, so `type(x) is int` is an int that is not a bool."""
    if type(entry) is not dict:
        raise TrxpError(f"tensors: {show(key)} entry is not an object")
    # JSON off the wire: each value's type is checked here before it is used.
    dtype: Any = entry.get("dtype")
    shape: Any = entry.get("shape")
    offsets: Any = entry.get("data_offsets")
    itemsize = ITEMSIZE.get(dtype) if type(dtype) is str else None
    if type(shape) is list and len(shape) == 1 and type(offsets) is list and len(offsets) == 2 and itemsize:
        dim, start, end = shape[0], offsets[0], offsets[1]  # the common case: one dimension, not 0
        if (
            type(dim) is int
            and type(start) is int
            and type(end) is int
            and 0 < dim <= data_len
            and start >= 0
            and end <= data_len
            and end - start == dim * itemsize
        ):
            work.charge(2)
            return start, end, dtype, (dim,), key
    return _checked_entry(key, dtype, shape, offsets, itemsize, data_len, work)


def _checked_entry(
    key: str, dtype: Any, shape: Any, offsets: Any, itemsize: int | None, data_len: int, work: Work
) -> tuple[int, int, str, tuple[int, ...], str]:
    """_parse_entry's every check, in its order: each refusal names the first thing wrong."""
    if itemsize is None:
        raise TrxpError(f"tensors: {show(key)} has unsupported dtype {show(dtype)}")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        shown = show_list(shape) if isinstance(shape, list) else show(shape)
        raise TrxpError(f"tensors: {show(key)} shape {shown} is not a list of non-negative ints")
    work.charge(1 + len(shape))
    if type(offsets) is not list or len(offsets) != 2 or not (type(offsets[0]) is int and type(offsets[1]) is int):
        offsets_ok = False
    else:
        start, end = offsets
        offsets_ok = 0 <= start <= end <= data_len
    if not offsets_ok:
        shown = show_list(offsets) if isinstance(offsets, list) else show(offsets)
        raise TrxpError(f"tensors: {show(key)} data_offsets {shown} fall outside the {data_len} data bytes")
    # torch and safetensors multiply the dimensions in int64 even when one of them is 0.
    product = itemsize
    for dim in shape:
        product *= dim or 1
        if product > INT64_MAX:
            raise TrxpError(
                f"tensors: {show(key)} shape {show_list(shape)} has more elements than a tensor can hold "
                f"(the product of its non-zero dimensions times {itemsize} bytes must stay below 2**63)"
            )
    nbytes = 0 if 0 in shape else product
    if nbytes != end - start:
        raise TrxpError(
            f"tensors: {show(key)} shape {show_list(shape)} of {dtype} needs {nbytes} bytes, offsets span {end - start}"
        )
    return start, end, dtype, tuple(shape), key


# Item indices as Python writes them (ASCII digits, no sign or leading 0), the common ones
# looked up rather than checked character by character.
_INDICES: Final = {str(index): index for index in range(1 << 12)}
_TENSOR_FIELDS: Final = frozenset(TENSOR_FIELDS)


def _split_tensor_key(key: str, num_items: int) -> tuple[int, str]:
    """Split "{i}:{field}"; i is written as Python writes an int (ASCII digits, no sign or leading 0)."""
    head, _, name = key.partition(":")
    index = _INDICES.get(head)
    if index is None:
        canonical = head.isascii() and head.isdigit() and len(head) <= 19 and (head == "0" or head[0] != "0")
        index = int(head) if canonical else num_items
    if not name or index >= num_items:
        raise TrxpError(f"tensors: key {show(key)} does not name an item of the {num_items} in the payload")
    if name not in _TENSOR_FIELDS and not (name.startswith(MM_PREFIX) and len(name) > len(MM_PREFIX)):
        raise TrxpError(f"tensors: key {show(key)} names an unknown field {show(name)}")
    return index, name
