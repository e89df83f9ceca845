"""TRXP v1 codec, byte-compatible with Trinity-RFT's Experience.serialize_many.

Layout: b"TRXP" · version u8 = 1 · metadata length u64 LE · tensor length u64 LE ·
metadata (pickle of {"version", "num_items", "items"}) · safetensors blob whose keys
are "{i}:{field}" and "{i}:multi_modal_inputs:{key}".

Payloads come from the network, so decoding trusts nothing: the pickle is scanned
opcode by opcode before a restricted unpickler (plain data only, no globals) reads
it, every length is checked against the bytes actually present before anything is
allocated, and what the server relies on later (eids, integer tokens, consistent
response lengths) is validated here. Every failure is a TrxpError naming the item
and field.

Two levels: `parse`/`build` work on RawItem (metadata plus raw tensor bytes, no
torch), which is what the server stores and batches; `decode`/`encode` convert to
and from Experience objects for users.
"""

from __future__ import annotations

import ctypes
import functools
import io
import json
import math
import pickle
import pickletools
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from .experience import (
    EID,
    META_FIELDS,
    RESPONSE_TENSOR_FIELDS,
    TENSOR_FIELDS,
    TOKEN_TENSOR_FIELDS,
    Experience,
)

MAGIC = b"TRXP"
VERSION = 1
_HEADER = struct.Struct("<4sBQQ")
HEADER_SIZE = _HEADER.size  # 21
MM_PREFIX = "multi_modal_inputs:"
# LMDB keys hold table id + uid; keep uids well inside its 511-byte limit.
MAX_UID_BYTES = 400
MAX_NESTING = 32

# safetensors dtype code -> item size. The order is safetensors' own Dtype order:
# it writes tensors sorted by dtype descending, then by name.
_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
_DTYPE_RANK = {code: rank for rank, code in enumerate(_ITEMSIZE)}
_INTEGER_CODES = frozenset({"U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})
_FLOAT_CODES = frozenset({"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"})
_FLOAT_FIELDS = frozenset(RESPONSE_TENSOR_FIELDS) - {"action_mask"}

# Pickle opcodes that build plain data only. Everything else (globals, reduce,
# build, persistent ids, sets, out-of-band buffers) is refused before unpickling.
_PLAIN_OPCODES = frozenset(
    {
        "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
        "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
        "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
        "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
        "NONE", "NEWTRUE", "NEWFALSE",
        "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
        "FLOAT", "BINFLOAT",
        "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
        "SHORT_BINBYTES", "BINBYTES", "BINBYTES8",
        "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET",
    }
)  # fmt: skip
_MEMO_OPCODES = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})
_PLAIN_TYPES = (dict, list, tuple, str, bytes, int, float, bool, type(None))


class TrxpError(ValueError):
    """A payload is not valid TRXP v1; the message names the item and field."""


@dataclass(frozen=True)
class RawTensor:
    """A tensor as safetensors stores it: dtype code, shape, little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class RawItem:
    """One experience as it travels: its metadata dict and raw tensors.

    Tensor keys are field names ("tokens") or "multi_modal_inputs:{key}".
    """

    meta: dict[str, Any]
    tensors: dict[str, RawTensor]

    @property
    def eid(self) -> EID:
        return EID(**self.meta["eid"])

    @property
    def uid(self) -> str:
        return self.eid.uid

    @property
    def model_version(self) -> int | None:
        return self.meta.get("info", {}).get("model_version")

    @property
    def response_length(self) -> int:
        return self.tensors["tokens"].numel - self.meta.get("prompt_length", 1)

    @property
    def generated_tokens(self) -> int:
        """Response tokens under the action mask (all of them without a mask)."""
        mask = self.tensors.get("action_mask")
        if mask is None:
            return self.response_length
        if _ITEMSIZE[mask.dtype] == 1:
            return len(mask.data) - bytes(mask.data).count(0)
        return int(tensor_of(mask).count_nonzero())


# ---- parsing (untrusted input) ---------------------------------------------------


def parse(payload: bytes | bytearray | memoryview, *, trusted: bool = False) -> list[RawItem]:
    """Split a TRXP payload into validated items without creating tensors.

    `trusted=True` is for payloads the server itself wrote after validating them:
    it skips the pickle opcode scan and the per-item checks, not the restricted
    unpickler nor the bounds checks of the sections.
    """
    view = memoryview(payload).cast("B")
    size = len(view)
    if size and view[0] == pickle.PROTO[0]:
        raise TrxpError("payload is a plain pickle without the TRXP header; legacy pickle payloads are refused")
    if size < HEADER_SIZE:
        raise TrxpError(f"payload is {size} bytes, shorter than the {HEADER_SIZE}-byte TRXP header")
    magic, version, meta_len, tensor_len = _HEADER.unpack_from(view)
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
    meta_bytes = view[HEADER_SIZE : HEADER_SIZE + meta_len]
    items = _load_items(meta_bytes, trusted=trusted)
    tensors = _parse_safetensors(view[HEADER_SIZE + meta_len :])
    per_item: list[dict[str, RawTensor]] = [{} for _ in items]
    for key, tensor in tensors.items():
        index, name = _split_tensor_key(key, len(items))
        per_item[index][name] = tensor
    raw = [RawItem(meta, tensors) for meta, tensors in zip(items, per_item, strict=True)]
    if not trusted:
        for index, item in enumerate(raw):
            _check_tensors(index, item)
    return raw


def _load_items(meta_bytes: memoryview, *, trusted: bool) -> list[dict[str, Any]]:
    if not trusted:
        _scan_pickle(meta_bytes)
    try:
        meta = _PlainUnpickler(io.BytesIO(meta_bytes)).load()
    except TrxpError:
        raise
    except Exception as exc:  # the unpickler raises many types on malformed input
        raise TrxpError(f"metadata: pickle is not readable ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict):
        raise TrxpError(f"metadata: expected a dict, got {type(meta).__name__}")
    if meta.get("version") != VERSION:
        raise TrxpError(f"metadata: version is {meta.get('version')!r}, expected {VERSION}")
    items, num_items = meta.get("items"), meta.get("num_items")
    if not isinstance(items, list):
        raise TrxpError(f"metadata: 'items' must be a list, got {type(items).__name__}")
    if not _is_int(num_items) or num_items != len(items):
        raise TrxpError(f"metadata: num_items is {num_items!r} but {len(items)} items are present")
    if not trusted:
        for index, item in enumerate(items):
            _check_meta(index, item)
    return items


class _PlainUnpickler(pickle.Unpickler):
    """Reads plain data only: every global is refused, never looked up."""

    def find_class(self, module: str, name: str) -> Any:
        raise TrxpError(f"metadata: pickle references the global {module}.{name}; refused")

    def persistent_load(self, pid: Any) -> Any:
        raise TrxpError("metadata: pickle uses persistent ids; refused")


# Plain-data opcodes by byte: (name, argument size), the size as pickletools describes
# it (>= 0: fixed; negative: up to a newline, or length-prefixed by 1, 4 or 8 bytes).
_OPCODE_TABLE = {op.code.encode("latin-1")[0]: (op.name, op.arg.n if op.arg else 0) for op in pickletools.opcodes}
_PLAIN_TABLE = {code: spec for code, spec in _OPCODE_TABLE.items() if spec[0] in _PLAIN_OPCODES}
_LENGTH_PREFIX = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def _scan_pickle(data: memoryview) -> None:
    """Refuse any opcode that is not plain data, and memo indices beyond reason.

    The scan walks the opcodes without executing anything, before the unpickler
    sees them: it stops a tiny pickle from making the unpickler allocate a huge
    memo, and everything but plain data from being built at all.
    """
    raw = bytes(data)
    pos, size, ops = 0, len(raw), 0
    while pos < size:
        code = raw[pos]
        spec = _PLAIN_TABLE.get(code)
        if spec is None:
            name = _OPCODE_TABLE.get(code, (f"0x{code:02x}",))[0]
            raise TrxpError(f"metadata: pickle opcode {name} is not plain data (globals and objects are refused)")
        name, arg_size = spec
        ops += 1
        start = pos = pos + 1
        if arg_size >= 0:
            pos += arg_size
        elif arg_size == pickletools.UP_TO_NEWLINE:
            newline = raw.find(b"\n", pos)
            if newline < 0:
                raise TrxpError(f"metadata: pickle is truncated in {name}")
            pos = newline + 1
        else:
            width, signed = _LENGTH_PREFIX[arg_size]
            length = int.from_bytes(raw[pos : pos + width], "little", signed=signed)
            if length < 0:
                raise TrxpError(f"metadata: pickle {name} has a negative length")
            start = pos = pos + width
            pos += length
        if pos > size:
            raise TrxpError(f"metadata: pickle is truncated in {name}")
        if name in _MEMO_OPCODES:
            arg = raw[start:pos]
            if name in ("PUT", "GET"):  # protocol 0: a decimal index and a newline
                if not arg[:-1].isdigit():
                    raise TrxpError(f"metadata: pickle {name} has a malformed index")
                index = int(arg)
            else:
                index = int.from_bytes(arg, "little")
            if index > ops:
                raise TrxpError(f"metadata: pickle memo index {index} out of range")
        if name == "STOP":
            if pos != size:
                raise TrxpError(f"metadata: {size - pos} bytes after the end of the pickle")
            return
    raise TrxpError("metadata: pickle is truncated (no STOP)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_plain(value: Any, where: str, depth: int = 0) -> None:
    if depth > MAX_NESTING:
        raise TrxpError(f"{where}: nested deeper than {MAX_NESTING} levels (or cyclic)")
    if not isinstance(value, _PLAIN_TYPES):
        raise TrxpError(f"{where}: {type(value).__name__} is not plain data")
    if isinstance(value, dict):
        for key, inner in value.items():
            _check_plain(key, where, depth + 1)
            _check_plain(inner, where, depth + 1)
    elif isinstance(value, (list, tuple)):
        for inner in value:
            _check_plain(inner, where, depth + 1)


def _check_meta(index: int, item: Any) -> None:
    """Validate the metadata of one item: what the server and trainers rely on."""
    where = f"item {index}"
    if not isinstance(item, dict):
        raise TrxpError(f"{where}: expected a dict, got {type(item).__name__}")
    eid = item.get("eid")
    if not isinstance(eid, dict):
        raise TrxpError(f"{where}: field 'eid' is missing or not a dict")
    for part in ("batch", "task", "run", "step", "suffix"):
        if part not in eid:
            raise TrxpError(f"{where}: field 'eid.{part}' is missing")
    for part in ("batch", "task"):
        if not (_is_int(eid[part]) or isinstance(eid[part], str)):
            raise TrxpError(f"{where}: field 'eid.{part}' must be an int or str, got {type(eid[part]).__name__}")
    for part in ("run", "step"):
        if not _is_int(eid[part]):
            raise TrxpError(f"{where}: field 'eid.{part}' must be an int, got {type(eid[part]).__name__}")
    if not isinstance(eid["suffix"], str):
        raise TrxpError(f"{where}: field 'eid.suffix' must be a str, got {type(eid['suffix']).__name__}")
    uid = EID(**{k: eid[k] for k in ("batch", "task", "run", "step", "suffix")}).uid
    if "\0" in uid:
        raise TrxpError(f"{where}: field 'eid' contains a NUL character")
    try:
        uid_bytes = uid.encode("utf-8")
    except UnicodeEncodeError:
        raise TrxpError(f"{where}: field 'eid' is not valid Unicode") from None
    if len(uid_bytes) > MAX_UID_BYTES:
        raise TrxpError(f"{where}: uid is longer than {MAX_UID_BYTES} bytes")
    where = f"item {index} (uid {uid})"
    reward = item.get("reward")
    if reward is not None:
        if not isinstance(reward, (int, float)):
            raise TrxpError(f"{where}: field 'reward' must be a number, got {type(reward).__name__}")
        if not math.isfinite(reward):
            raise TrxpError(f"{where}: field 'reward' is {reward}, not a finite number")
    prompt_length = item.get("prompt_length", 1)
    if not _is_int(prompt_length) or prompt_length < 0:
        raise TrxpError(f"{where}: field 'prompt_length' must be a non-negative int, got {prompt_length!r}")
    for name in ("info", "metrics"):
        if not isinstance(item.get(name, {}), dict):
            raise TrxpError(f"{where}: field '{name}' must be a dict")
    version = item.get("info", {}).get("model_version")
    if version is not None and not _is_int(version):
        raise TrxpError(f"{where}: field 'info.model_version' must be an int, got {type(version).__name__}")
    for name in ("truncate_status", "response_text", "prompt_text"):
        if item.get(name) is not None and not isinstance(item[name], str):
            raise TrxpError(f"{where}: field '{name}' must be a str or None")
    for name in ("messages", "tools", "chosen_messages", "rejected_messages"):
        if item.get(name) is not None and not isinstance(item[name], list):
            raise TrxpError(f"{where}: field '{name}' must be a list or None")
    custom = item.get("custom_fields", [])
    if not isinstance(custom, list) or not all(
        isinstance(cf, dict)
        and all(isinstance(cf.get(k), str) for k in ("source_field", "destination_field", "data_type"))
        for cf in custom
    ):
        raise TrxpError(f"{where}: field 'custom_fields' must be a list of source/destination/data_type strings")
    keys = item.get("multi_modal_input_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise TrxpError(f"{where}: field 'multi_modal_input_keys' must be a list of str")
    for name, value in item.items():
        _check_plain(value, f"{where}: field '{name}'")


def _parse_safetensors(blob: memoryview) -> dict[str, RawTensor]:
    size = len(blob)
    if size < 8:
        raise TrxpError(f"tensors: safetensors blob is {size} bytes, too short for its header length")
    (header_len,) = struct.unpack_from("<Q", blob)
    if header_len > size - 8:
        raise TrxpError(f"tensors: safetensors header length {header_len} exceeds the {size - 8} bytes present")
    try:
        header = json.loads(bytes(blob[8 : 8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrxpError(f"tensors: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise TrxpError("tensors: safetensors header is not a JSON object")
    data = blob[8 + header_len :]
    spans = sorted(
        (*_parse_entry(key, entry, len(data)), key) for key, entry in header.items() if key != "__metadata__"
    )
    cursor = 0
    tensors: dict[str, RawTensor] = {}
    for start, end, dtype, shape, key in spans:
        if start != cursor:
            raise TrxpError(f"tensors: '{key}' starts at byte {start}, expected {cursor} (gap or overlap)")
        cursor = end
        tensors[key] = RawTensor(dtype, shape, data[start:end])
    if cursor != len(data):
        raise TrxpError(f"tensors: {len(data) - cursor} bytes of tensor data belong to no tensor")
    return tensors


def _parse_entry(key: str, entry: Any, data_len: int) -> tuple[int, int, str, tuple[int, ...]]:
    """Check one safetensors header entry; return (start, end, dtype, shape)."""
    if not isinstance(entry, dict):
        raise TrxpError(f"tensors: '{key}' entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise TrxpError(f"tensors: '{key}' has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise TrxpError(f"tensors: '{key}' shape {shape!r} is not a list of non-negative ints")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise TrxpError(f"tensors: '{key}' data_offsets {offsets!r} fall outside the {data_len} data bytes")
    nbytes = math.prod(shape) * _ITEMSIZE[dtype]
    if nbytes != offsets[1] - offsets[0]:
        raise TrxpError(
            f"tensors: '{key}' shape {shape} of {dtype} needs {nbytes} bytes, offsets span {offsets[1] - offsets[0]}"
        )
    return offsets[0], offsets[1], dtype, tuple(shape)


def _split_tensor_key(key: str, num_items: int) -> tuple[int, str]:
    head, _, name = key.partition(":")
    if not head.isdigit() or not name or int(head) >= num_items:
        raise TrxpError(f"tensors: key '{key}' does not name an item of the {num_items} in the payload")
    if name not in TENSOR_FIELDS and not (name.startswith(MM_PREFIX) and len(name) > len(MM_PREFIX)):
        raise TrxpError(f"tensors: key '{key}' names an unknown field '{name}'")
    return int(head), name


def _check_tensors(index: int, item: RawItem) -> None:
    """Validate the tensors of one item against its metadata."""
    meta = item.meta
    where = f"item {index} (uid {item.uid})"
    for key in meta.get("multi_modal_input_keys", []):
        if MM_PREFIX + key not in item.tensors:
            raise TrxpError(f"{where}: multi-modal input '{key}' is listed but has no tensor")
    for name in item.tensors:
        if name.startswith(MM_PREFIX) and name[len(MM_PREFIX) :] not in meta.get("multi_modal_input_keys", []):
            raise TrxpError(f"{where}: tensor '{name}' is not listed in multi_modal_input_keys")
    tokens = item.tensors.get("tokens")
    if tokens is None:
        raise TrxpError(f"{where}: field 'tokens' is missing")
    for name in TOKEN_TENSOR_FIELDS:
        tensor = item.tensors.get(name)
        if tensor is None:
            continue
        if tensor.dtype not in _INTEGER_CODES:
            raise TrxpError(f"{where}: field '{name}' must hold integer token ids, got {tensor.dtype}")
        if len(tensor.shape) != 1:
            raise TrxpError(f"{where}: field '{name}' must be 1-D, got shape {list(tensor.shape)}")
    prompt_length = meta.get("prompt_length", 1)
    if prompt_length > tokens.numel:
        raise TrxpError(f"{where}: field 'prompt_length' is {prompt_length}, more than the {tokens.numel} tokens")
    response_length = tokens.numel - prompt_length
    for name in RESPONSE_TENSOR_FIELDS:
        tensor = item.tensors.get(name)
        if tensor is None:
            continue
        if len(tensor.shape) != 1:
            raise TrxpError(f"{where}: field '{name}' must be 1-D, got shape {list(tensor.shape)}")
        if tensor.shape[0] != response_length:
            raise TrxpError(
                f"{where}: field '{name}' has length {tensor.shape[0]}, but the response has "
                f"{response_length} tokens ({tokens.numel} tokens - prompt_length {prompt_length})"
            )
        if name in _FLOAT_FIELDS and tensor.dtype not in _FLOAT_CODES:
            raise TrxpError(f"{where}: field '{name}' must be floating point, got {tensor.dtype}")
        if name == "action_mask" and tensor.dtype != "BOOL" and tensor.dtype not in _INTEGER_CODES:
            raise TrxpError(f"{where}: field 'action_mask' must be bool or integer, got {tensor.dtype}")


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
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8") if header else b"{}"
    header_bytes += b" " * (-len(header_bytes) % 8)
    tensor_len = 8 + len(header_bytes) + sum(len(d) for d in data)
    head = _HEADER.pack(MAGIC, VERSION, len(meta), tensor_len)
    return b"".join([head, meta, struct.pack("<Q", len(header_bytes)), header_bytes, *data])


# The server stores each experience as a one-item payload whose metadata pickle is laid
# out so that join() can splice many of them without unpickling: protocol 3, no memo
# (so each item's opcodes stand on their own), between a fixed head and tail.
_SPLICE_HEAD = b"\x80\x03}(X\x07\x00\x00\x00versionK\x01X\t\x00\x00\x00num_itemsJ"
_SPLICE_ITEMS = b"X\x05\x00\x00\x00items]("
_SPLICE_TAIL = b"eu."
_SPLICE_ONE = _SPLICE_HEAD + struct.pack("<i", 1) + _SPLICE_ITEMS


def _fragment(meta: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=3)
    pickler.fast = True  # no memo: the opcodes do not refer to anything outside themselves
    pickler.dump(meta)
    return buffer.getvalue()[2:-1]  # without PROTO and STOP


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
    return _assemble(_splice_meta([_fragment(item.meta)]), header, [tensor.data for _, tensor in entries])


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
    payloads = list(payloads)
    fragments: list[memoryview] = []
    header: dict[str, Any] = {}
    data: list[bytes | memoryview] = []
    base = 0
    for index, payload in enumerate(payloads):
        view = memoryview(payload)
        _, _, meta_len, _ = _HEADER.unpack_from(view)
        meta = view[HEADER_SIZE : HEADER_SIZE + meta_len]
        if meta[: len(_SPLICE_ONE)] != _SPLICE_ONE or meta[-len(_SPLICE_TAIL) :] != _SPLICE_TAIL:
            return _rebuild(payloads, extra)
        fragments.append(meta[len(_SPLICE_ONE) : -len(_SPLICE_TAIL)])
        blob = view[HEADER_SIZE + meta_len :]
        (header_len,) = struct.unpack_from("<Q", blob)
        section = blob[8 + header_len :]
        entries = [
            (key.partition(":")[2], entry)
            for key, entry in json.loads(bytes(blob[8 : 8 + header_len])).items()
            if key != "__metadata__"
        ]
        tensors = {
            name: RawTensor(e["dtype"], tuple(e["shape"]), section[e["data_offsets"][0] : e["data_offsets"][1]])
            for name, e in entries
        }
        added = extra(index, tensors) if extra else {}
        kept = [(name, tensors[name]) for name, _ in entries if name not in added]
        # Tensors kept whole are copied as one run of bytes; a replaced one leaves a gap.
        data.extend([section] if len(kept) == len(entries) else [t.data for _, t in kept])
        for name, tensor in [*kept, *added.items()]:
            end = base + len(tensor.data)
            header[f"{index}:{name}"] = {
                "dtype": tensor.dtype,
                "shape": list(tensor.shape),
                "data_offsets": [base, end],
            }
            base = end
        data.extend(t.data for t in added.values())
    return _assemble(_splice_meta(fragments), header, data)


def _rebuild(
    payloads: Sequence[bytes], extra: Callable[[int, dict[str, RawTensor]], dict[str, RawTensor]] | None
) -> bytes:
    items = [item for payload in payloads for item in parse(payload, trusted=True)]
    if extra:
        for index, item in enumerate(items):
            item.tensors.update(extra(index, item.tensors))
    return build(items)


# ---- Experience objects -----------------------------------------------------------


def decode(payload: bytes | bytearray | memoryview) -> list[Experience]:
    """Decode a TRXP payload into Experience objects (tensors own their memory)."""
    return [to_experience(item) for item in parse(payload)]


def encode(experiences: Iterable[Any]) -> bytes:
    """Encode expbuf or Trinity-RFT experiences (read by attribute name) into TRXP."""
    return build([from_experience(exp) for exp in experiences])


def to_experience(item: RawItem) -> Experience:
    meta = item.meta
    tensors = {name: tensor_of(raw) for name, raw in item.tensors.items()}
    mm = {name[len(MM_PREFIX) :]: tensors.pop(name) for name in list(tensors) if name.startswith(MM_PREFIX)}
    return Experience(
        eid=item.eid,
        **{name: meta[name] for name in META_FIELDS if name in meta},
        custom_fields=meta.get("custom_fields", []),
        multi_modal_inputs={key: mm[key] for key in meta.get("multi_modal_input_keys", [])},
        **tensors,
    )


def from_experience(exp: Any) -> RawItem:
    """Read an Experience-like object (expbuf's or Trinity-RFT's) into a RawItem."""
    eid = exp.eid
    meta: dict[str, Any] = {"eid": eid if isinstance(eid, dict) else _eid_dict(eid)}
    for name in META_FIELDS:
        value = getattr(exp, name, None)
        if name in ("info", "metrics") and value is None:
            value = {}
        elif name == "prompt_length" and value is None:
            value = 1
        elif name == "reward" and value is not None:
            value = float(value)
        meta[name] = value
    meta["custom_fields"] = [_custom_field_dict(cf) for cf in getattr(exp, "custom_fields", None) or []]
    mm = getattr(exp, "multi_modal_inputs", None) or {}
    meta["multi_modal_input_keys"] = list(mm)
    tensors = {}
    for name in TENSOR_FIELDS:
        value = getattr(exp, name, None)
        if value is not None:
            tensors[name] = raw_of(value)
    for key, value in mm.items():
        tensors[MM_PREFIX + key] = raw_of(value)
    item = RawItem(meta, tensors)
    _check_meta(0, meta)
    _check_tensors(0, item)
    return item


def _eid_dict(eid: Any) -> dict[str, Any]:
    return {name: getattr(eid, name) for name in ("batch", "task", "run", "step", "suffix")}


def _custom_field_dict(cf: Any) -> dict[str, str]:
    if isinstance(cf, dict):
        return {k: str(cf[k]) for k in ("source_field", "destination_field", "data_type")}
    return {
        "source_field": cf.source_field,
        "destination_field": cf.destination_field,
        "data_type": str(cf.data_type),
    }


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors code -> torch dtype; torch is imported only when tensors are made."""
    import torch

    return {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E4M3": torch.float8_e4m3fn,
        "I16": torch.int16,
        "U16": torch.uint16,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I32": torch.int32,
        "U32": torch.uint32,
        "F32": torch.float32,
        "F64": torch.float64,
        "I64": torch.int64,
        "U64": torch.uint64,
    }


def tensor_of(raw: RawTensor) -> torch.Tensor:
    """A torch tensor that owns a copy of the raw bytes."""
    import torch

    dtype = _torch_dtypes()[raw.dtype]
    if raw.numel == 0:
        return torch.empty(raw.shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw.data), dtype=dtype).reshape(raw.shape)


def raw_of(value: Any) -> RawTensor:
    """The raw form of a tensor (or anything torch.as_tensor takes), on the CPU."""
    import torch

    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    tensor = tensor.detach().to("cpu").contiguous()
    codes = {dtype: code for code, dtype in _torch_dtypes().items()}
    if tensor.dtype not in codes:
        raise TrxpError(f"tensor dtype {tensor.dtype} has no safetensors code")
    nbytes = tensor.numel() * tensor.element_size()
    data = ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
    return RawTensor(codes[tensor.dtype], tuple(tensor.shape), data)
