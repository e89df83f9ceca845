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
    per_item = _parse_safetensors(view[HEADER_SIZE + meta_len :], len(items), work)
    return _items(items, uids, per_item, work)


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
    entries = _spans(blob, size - HEADER_SIZE - meta_len - len(blob), len(items), work)
    empty = memoryview(b"")
    per_item: list[dict[str, RawTensor]] = [{} for _ in items]
    for _, _, dtype, dims, index, name in entries:
        per_item[index][name] = RawTensor(dtype, dims, empty)
    raw = _items(items, uids, per_item, work)
    return raw, [(start, end, index, name) for start, end, _, _, index, name in entries]


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
    items: list[dict[str, Any]], uids: list[str] | None, per_item: list[dict[str, RawTensor]], work: Work
) -> list[RawItem]:
    """The items of a payload: each one's metadata and its tensors (by name, `per_item`), checked
    where their metadata was (`uids`, each one's as check_meta made it; None for a trusted payload)."""
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
        shape.shared = scan_pickle(meta_bytes, work)
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


def _parse_safetensors(blob: memoryview, num_items: int, work: Work) -> list[dict[str, RawTensor]]:
    """The tensors of each of a payload's `num_items` items, by name, from its safetensors blob."""
    size = len(blob)
    if size < 8:
        raise TrxpError(f"tensors: safetensors blob is {size} bytes, too short for its header length")
    (header_len,) = struct.unpack_from("<Q", blob)
    if header_len > size - 8:
        raise TrxpError(f"tensors: safetensors header length {header_len} exceeds the {size - 8} bytes present")
    data = blob[8 + header_len :]
    per_item: list[dict[str, RawTensor]] = [{} for _ in range(num_items)]
    for start, end, dtype, shape, index, name in _spans(blob, len(data), num_items, work):
        per_item[index][name] = RawTensor(dtype, shape, data[start:end])
    return per_item


# A tensor of a safetensors header: (start, end, dtype, shape, item index, name).
_Span = tuple[int, int, str, tuple[int, ...], int, str]


def _spans(blob: memoryview, data_len: int, num_items: int, work: Work) -> list[_Span]:
    """The tensors of a safetensors blob of a payload of `num_items` items, whose header is at the
    start of `blob` and whose data is `data_len` bytes, in the data's order, every byte of the data
    in exactly one tensor, each key naming an item and a known field."""
    (header_len,) = struct.unpack_from("<Q", blob)
    work.charge(header_len)  # the JSON parser is linear in its input
    try:
        text = str(blob[8 : 8 + header_len], "utf-8")
    except UnicodeDecodeError as exc:
        raise _not_json(exc) from None
    written = _written_spans(text, data_len, num_items)
    if written is not None:
        work.charge(2 * len(written))  # as _parse_entry charges each entry of one dimension
        return written
    spans = []
    for start, end, dtype, shape, key in _json_spans(text, data_len, work):  # each key's refusal in the data's order
        index, name = _split_tensor_key(key, num_items)
        spans.append((start, end, dtype, shape, index, name))
    return spans


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


# One header entry as expbuf's writers write it (build.py's ENTRY, json.dumps with separators ","
# and ":"): a key of an item's index and a name without escapes, one dimension (not 0), each
# number as JSON writes an int, of at most 18 digits. Each repeat is possessive, as what follows it
# is a character it does not take.
_WRITTEN_ENTRY: Final = re.compile(
    r'"([0-9][^"\\\x00-\x1f]*+)":\{"dtype":"([A-Z0-9_]++)","shape":\[([1-9][0-9]{0,17}+)\],'
    r'"data_offsets":\[([1-9][0-9]{0,17}+|0),([1-9][0-9]{0,17}+)\]\}'
)
# An entry's text up to its key's ':' (its quote and item index), for the common item indices.
_ENTRY_STARTS: Final = {f'"{index}:': index for index in range(1 << 12)}
_OFFSETS: Final = '],"data_offsets":['  # an entry's text from its shape's end to its start offset


class _Plan:
    """What an entry of a written header shares with the next entries of its name and dtype (a
    writer writes a batch's tensors by dtype, then by key: the same field of item after item): its
    text from its key's ':' to its dimension, and what it makes of it."""

    def __init__(self, text: str, itemsize: int, dtype: str, name: str, last: str, digits: str) -> None:
        self.text = text
        self.itemsize = itemsize
        self.dtype = dtype
        self.name = name
        self.last = last  # the last entry's text up to its key's ':', which the next one's must exceed
        self.digits = digits  # the last entry's dimension as written, its shape (one tuple for a run of them)
        self.shape = (int(digits),)


def _written_spans(text: str, data_len: int, num_items: int) -> list[_Span] | None:
    """_spans' result for a header in the form expbuf's writers write (entries of one dimension in
    the data's order, each name's keys ascending, no space but the padding after it), read without
    json.loads; None for any other header, which _spans reads as JSON. Accepts only what json.loads
    and the checks accept, with the same spans: each entry is the text of a match of _WRITTEN_ENTRY,
    or the text of the plan of the entry before it with only its item index, its dimension (as JSON
    writes it) and its offsets changed (each offset written from the int it must be), the text
    between them exactly the JSON around them; as each name's keys ascend, no key is written twice."""
    if not text.startswith("{"):
        return None
    spans: list[_Span] = []
    plans: dict[str, _Plan] = {}  # by name: the plan of its last entry
    plan: _Plan | None = None  # the entry before's
    pos, cursor, written = 1, 0, "0"  # where the last entry ended, and that offset as its entry wrote it
    while True:
        colon = text.find(":", pos)
        opening = text[pos : colon + 1]
        index = _ENTRY_STARTS.get(opening, -1)
        if index < 0 and opening.startswith('"'):  # an index past the table's
            index = _item_index(opening[1:-1], num_items)
        if plan is not None and 0 <= index < num_items and opening > plan.last:
            at = colon + len(plan.text)  # where the plan's text ends: the dimension, which a match ends at its ']'
            digits = text[at : text.find("]", at)]
            if digits != plan.digits and _dimension(digits):
                plan.digits, plan.shape = digits, (int(digits),)
            end = cursor + plan.shape[0] * plan.itemsize
            ended = str(end)
            # The entry from its key's ':' on, compared at once; an end of 19 digits or more lies
            # past data_len: refused below.
            entry = f"{plan.text}{digits}{_OFFSETS}{written},{ended}]}}"
            after = colon + len(entry)
            if digits != plan.digits or text[colon:after] != entry:
                plan = None
        else:
            plan = None
        if plan is None:
            match = _WRITTEN_ENTRY.match(text, pos)
            planned = None if match is None else _planned(match, colon, cursor, num_items, plans)
            if match is None or planned is None:
                return None
            plan, index = planned
            end, ended, after = cursor + plan.shape[0] * plan.itemsize, match.group(5), match.end()
        plan.last = opening
        spans.append((cursor, end, plan.dtype, plan.shape, index, plan.name))
        cursor, written, pos = end, ended, after + 1
        if after == len(text) or text[after] != ",":
            break
    if text[after:].rstrip(" ") != "}" or cursor != data_len:
        return None
    return spans


def _dimension(digits: str) -> bool:
    """Whether `digits` is a dimension as a match reads one: as JSON writes an int of 1 to 18 digits, not 0."""
    return 0 < len(digits) <= 18 and digits.isascii() and digits.isdigit() and digits[0] != "0"


def _planned(
    match: re.Match[str], colon: int, cursor: int, num_items: int, plans: dict[str, _Plan]
) -> tuple[_Plan, int] | None:
    """The plan of an entry matched by _WRITTEN_ENTRY at `cursor` in the data, whose key's first
    ':' is at `colon`, and its item index; None where its dtype, offsets or key are not as the
    checks and json.loads would take them, or its key does not ascend after its name's last."""
    key, dtype, dims, start, end = match.groups()
    itemsize = ITEMSIZE.get(dtype)
    if itemsize is None or int(start) != cursor or int(end) - cursor != int(dims) * itemsize:
        return None  # each number is written one way only
    try:
        index, name = _split_tensor_key(key, num_items)
    except TrxpError:
        return None  # refused by the JSON path after its checks of the whole header, as before
    last = plans.get(name)
    opening = match.string[match.start() : colon + 1]
    if last is not None and not opening > last.last:
        return None  # read as JSON: a key written twice, or keys out of a writer's order
    plan = plans[name] = _Plan(match.string[colon : match.start(3)], itemsize, dtype, name, opening, dims)
    return plan, index


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
        index = _item_index(head, num_items)
    if not name or index >= num_items:
        raise TrxpError(f"tensors: key {show(key)} does not name an item of the {num_items} in the payload")
    if name not in _TENSOR_FIELDS and not (name.startswith(MM_PREFIX) and len(name) > len(MM_PREFIX)):
        raise TrxpError(f"tensors: key {show(key)} names an unknown field {show(name)}")
    return index, name


def _item_index(head: str, num_items: int) -> int:
    """The item index `head` writes as Python writes an int (ASCII digits, no sign or leading 0);
    num_items, which names no item, for any other text."""
    canonical = head.isascii() and head.isdigit() and len(head) <= 19 and (head == "0" or head[0] != "0")
    return int(head) if canonical else num_items
