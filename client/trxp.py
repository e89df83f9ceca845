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
import sys
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
INT64_MAX = 2**63 - 1
# The multi-step estimators compute run * (max step + 1) + step in int64.
MAX_STEP = 2**31 - 1
# Decoding work is counted in steps (a pickle opcode, a reference in the metadata, a tensor
# entry or dimension, a byte handed to a C parser); a payload may take at most WORK_PER_BYTE
# steps per byte plus WORK_BASE. The checks stay far below it by design; the budget is the
# deterministic deadline that stops anything they would miss.
WORK_PER_BYTE = 32
WORK_BASE = 1 << 16
# The items' metadata written out in full, as the store keeps each experience (every shared
# reference expanded), may take at most EXPANSION_PER_BYTE bytes per payload byte plus
# EXPANSION_BASE. Trinity-RFT shares at most a prompt between the runs of a task, which stays
# within a fraction of the tokens those runs carry.
EXPANSION_PER_BYTE = 8
EXPANSION_BASE = 64 << 10
# Error messages show at most this many characters of any input.
MAX_SHOWN = 100
_UNBOUNDED = 1 << 62

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

# Pickle opcodes that build plain data only, with their effect on the unpickler's stack.
# Everything else (globals, reduce, build, persistent ids, sets, out-of-band buffers) is
# refused before unpickling.
_NOOP, _KEY, _VALUE, _MARK, _POP, _POP_MARK, _DUP = range(7)
_FROM_MARK, _DICT, _TUPLE1, _TUPLE2, _TUPLE3, _APPEND, _APPENDS, _SETITEM, _SETITEMS = range(7, 16)
_MEMOIZE, _PUT, _GET, _STOP = range(16, 20)
_PLAIN_EFFECTS = {
    "PROTO": _NOOP, "FRAME": _NOOP, "STOP": _STOP, "MARK": _MARK, "POP": _POP, "POP_MARK": _POP_MARK, "DUP": _DUP,
    "EMPTY_DICT": _VALUE, "DICT": _DICT, "SETITEM": _SETITEM, "SETITEMS": _SETITEMS,
    "EMPTY_LIST": _VALUE, "LIST": _FROM_MARK, "APPEND": _APPEND, "APPENDS": _APPENDS,
    "EMPTY_TUPLE": _VALUE, "TUPLE": _FROM_MARK, "TUPLE1": _TUPLE1, "TUPLE2": _TUPLE2, "TUPLE3": _TUPLE3,
    "NONE": _VALUE, "NEWTRUE": _VALUE, "NEWFALSE": _VALUE,
    "INT": _VALUE, "BININT": _VALUE, "BININT1": _VALUE, "BININT2": _VALUE,
    "LONG": _VALUE, "LONG1": _VALUE, "LONG4": _VALUE, "FLOAT": _VALUE, "BINFLOAT": _VALUE,
    "UNICODE": _KEY, "SHORT_BINUNICODE": _KEY, "BINUNICODE": _KEY, "BINUNICODE8": _KEY,
    "SHORT_BINBYTES": _KEY, "BINBYTES": _KEY, "BINBYTES8": _KEY,
    "MEMOIZE": _MEMOIZE, "PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT,
    "GET": _GET, "BINGET": _GET, "LONG_BINGET": _GET,
}  # fmt: skip
_CONTAINERS = (dict, list, tuple)
_SCALARS = (str, bytes, int, float, type(None))


class TrxpError(ValueError):
    """A payload is not valid TRXP v1; the message names the item and field."""


class Work:
    """Deterministic count of decoding steps, with a ceiling: the CPU deadline of a payload.

    Wall-clock deadlines depend on the machine's load; a step budget refuses the same
    payload everywhere.
    """

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    @classmethod
    def for_payload(cls, size: int) -> Work:
        return cls(WORK_PER_BYTE * size + WORK_BASE)

    def charge(self, steps: int) -> None:
        self.used += steps
        if self.used > self.limit:
            raise TrxpError(f"decoding work exceeds its budget of {self.limit} steps")


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


def parse(payload: bytes | bytearray | memoryview, *, trusted: bool = False, work: Work | None = None) -> list[RawItem]:
    """Split a TRXP payload into validated items without creating tensors.

    `trusted=True` is for payloads the server itself wrote after validating them:
    it skips the pickle opcode scan and the per-item checks, not the restricted
    unpickler nor the bounds checks of the sections. `work` counts the decoding steps
    (by default within the budget of a payload of this size).
    """
    view = memoryview(payload).cast("B")
    size = len(view)
    if work is None:
        work = Work.for_payload(size)
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
    items = _load_items(meta_bytes, trusted=trusted, work=work, max_size=EXPANSION_PER_BYTE * size + EXPANSION_BASE)
    tensors = _parse_safetensors(view[HEADER_SIZE + meta_len :], work)
    per_item: list[dict[str, RawTensor]] = [{} for _ in items]
    for key, tensor in tensors.items():
        index, name = _split_tensor_key(key, len(items))
        per_item[index][name] = tensor
    raw = [RawItem(meta, tensors) for meta, tensors in zip(items, per_item, strict=True)]
    if not trusted:
        for index, item in enumerate(raw):
            _check_tensors(index, item, work)
    return raw


def _load_items(meta_bytes: memoryview, *, trusted: bool, work: Work, max_size: int) -> list[dict[str, Any]]:
    if not trusted:
        _scan_pickle(meta_bytes, work)
    work.charge(len(meta_bytes))  # the unpickler is linear in its input once the scan has passed it
    try:
        meta = _PlainUnpickler(io.BytesIO(meta_bytes)).load()
    except TrxpError:
        raise
    except Exception as exc:  # the unpickler raises many types on malformed input
        raise TrxpError(f"metadata: pickle is not readable ({type(exc).__name__}: {_clip(str(exc))})") from None
    if not isinstance(meta, dict):
        raise TrxpError(f"metadata: expected a dict, got {type(meta).__name__}")
    if meta.get("version") != VERSION:
        raise TrxpError(f"metadata: version is {_show(meta.get('version'))}, expected {VERSION}")
    items, num_items = meta.get("items"), meta.get("num_items")
    if not isinstance(items, list):
        raise TrxpError(f"metadata: 'items' must be a list, got {type(items).__name__}")
    if not _is_int(num_items) or num_items != len(items):
        raise TrxpError(f"metadata: num_items is {_show(num_items)} but {len(items)} items are present")
    if not trusted:
        shape = _Shape(work, max_size, check_keys=False)
        for index, item in enumerate(items):
            _check_meta(index, item, shape)
    return items


class _PlainUnpickler(pickle.Unpickler):
    """Reads plain data only: every global is refused, never looked up."""

    def find_class(self, module: str, name: str) -> Any:
        raise TrxpError(f"metadata: pickle references the global {_clip(module)}.{_clip(name)}; refused")

    def persistent_load(self, pid: Any) -> Any:
        raise TrxpError("metadata: pickle uses persistent ids; refused")


# Plain-data opcodes by byte: (name, argument size, stack effect), the size as pickletools
# describes it (>= 0: fixed; negative: up to a newline, or length-prefixed by 1, 4 or 8 bytes).
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_PLAIN_TABLE = {
    op.code.encode("latin-1")[0]: (op.name, op.arg.n if op.arg else 0, _PLAIN_EFFECTS[op.name])
    for op in pickletools.opcodes
    if op.name in _PLAIN_EFFECTS
}
_LENGTH_PREFIX = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def _scan_pickle(data: memoryview, work: Work) -> None:
    """Refuse any opcode that is not plain data, memo indices beyond reason, and dict keys
    other than str or bytes.

    The scan walks the opcodes without executing anything, before the unpickler sees
    them: it stops a tiny pickle from making the unpickler allocate a huge memo, and
    everything but plain data from being built at all. It follows the unpickler's stack
    (whether each entry is a str or bytes, nothing more) so that every dict key is known
    to hash in time linear in its length: ints hash predictably (so keys can be made to
    collide, a quadratic dict) and tuples of shared tuples hash in exponential time.
    """
    raw = bytes(data)
    pos, size, ops = 0, len(raw), 0
    stack: list[bool] = []  # per entry: may it be a dict key (str or bytes)?
    marks: list[int] = []  # stack heights at each MARK
    fence = 0  # the height of the last mark: entries below it belong to an outer MARK
    memo: dict[int, bool] = {}
    push = stack.append
    memoize, get, key, value, put = _MEMOIZE, _GET, _KEY, _VALUE, _PUT  # locals: the loop's hot path
    while pos < size:
        code = raw[pos]
        spec = _PLAIN_TABLE.get(code)
        if spec is None:
            name = _OPCODE_NAMES.get(code, f"0x{code:02x}")
            raise TrxpError(f"metadata: pickle opcode {name} is not plain data (globals and objects are refused)")
        name, arg_size, effect = spec
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
        if effect == memoize:  # the commonest opcodes first
            if len(stack) <= fence:
                raise TrxpError(f"metadata: pickle {name} finds an empty stack")
            memo[len(memo)] = stack[-1]
        elif effect == get:
            memo_index = raw[start] if arg_size == 1 else _memo_index(name, raw[start:pos], ops)
            if memo_index not in memo:
                raise TrxpError(f"metadata: pickle {name} reads memo entry {memo_index}, which was never stored")
            push(memo[memo_index])
        elif effect == key:
            push(True)
        elif effect == value:
            push(False)
        elif effect == put:
            if len(stack) <= fence:
                raise TrxpError(f"metadata: pickle {name} finds an empty stack")
            memo[_memo_index(name, raw[start:pos], ops)] = stack[-1]
        elif effect == _MARK:
            marks.append(len(stack))
            fence = len(stack)
        elif effect in (_FROM_MARK, _DICT, _APPENDS, _SETITEMS, _POP_MARK):
            if not marks:
                raise TrxpError(f"metadata: pickle {name} has no MARK")
            mark = marks.pop()
            fence = marks[-1] if marks else 0
            if effect in (_DICT, _SETITEMS) and not all(stack[mark::2]):
                raise TrxpError("metadata: dict keys must be str or bytes")
            del stack[mark:]
            if effect in (_FROM_MARK, _DICT):
                push(False)
        elif effect in (_TUPLE1, _TUPLE2, _TUPLE3, _APPEND, _SETITEM):
            count = {_TUPLE1: 1, _TUPLE2: 2, _TUPLE3: 3, _APPEND: 1, _SETITEM: 2}[effect]
            if len(stack) - count < fence:
                raise TrxpError(f"metadata: pickle {name} finds too few entries on the stack")
            if effect == _SETITEM and not stack[-2]:
                raise TrxpError("metadata: dict keys must be str or bytes")
            del stack[len(stack) - count :]
            if effect not in (_APPEND, _SETITEM):
                push(False)
        elif effect == _NOOP:
            pass
        elif effect == _POP and marks and marks[-1] == len(stack):
            marks.pop()
            fence = marks[-1] if marks else 0
        elif len(stack) <= fence:
            raise TrxpError(f"metadata: pickle {name} finds an empty stack")
        elif effect == _DUP:
            push(stack[-1])
        elif effect == _POP:
            stack.pop()
        else:  # STOP
            if pos != size:
                raise TrxpError(f"metadata: {size - pos} bytes after the end of the pickle")
            work.charge(ops)
            return
    raise TrxpError("metadata: pickle is truncated (no STOP)")


def _memo_index(name: str, arg: bytes, ops: int) -> int:
    """The memo index a PUT or GET names, refused beyond the opcodes read so far."""
    if name in ("PUT", "GET"):  # protocol 0: a decimal index and a newline
        digits = arg[:-1]
        if not digits.isdigit() or len(digits) > 20:
            raise TrxpError(f"metadata: pickle {name} has a malformed index")
        index = int(digits)
    else:
        index = int.from_bytes(arg, "little")
    if index > ops:
        raise TrxpError(f"metadata: pickle memo index {index} out of range")
    return index


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_utf8(text: str) -> bool:
    """Whether text encodes to UTF-8 (a lone surrogate does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _clip(text: str) -> str:
    """Untrusted text cut for an error message, with its full length."""
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}… ({len(text)} chars)"


def _show(value: Any) -> str:
    """An untrusted value rendered for an error message in bounded length and time."""
    if isinstance(value, str):
        return repr(value) if len(value) <= MAX_SHOWN else f"{value[:MAX_SHOWN]!r}… ({len(value)} chars)"
    if isinstance(value, bytes):
        return repr(value) if len(value) <= MAX_SHOWN else f"{value[:MAX_SHOWN]!r}… ({len(value)} bytes)"
    if _is_int(value) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"  # its decimal form would take quadratic time
    if isinstance(value, (int, float, type(None))):
        return repr(value)
    if isinstance(value, _CONTAINERS):
        return f"a {type(value).__name__} of {len(value)} entries"
    return f"a {type(value).__name__}"


def _show_list(values: Sequence[Any]) -> str:
    shown = ", ".join(_show(v) for v in values[:8])
    return f"[{shown}{', …' if len(values) > 8 else ''}]"


def _in_range(where: str, field: str, value: Any, low: int, high: int, bounds: str) -> None:
    """Refuse a value that is not an int in [low, high] (bounds: the range as the message says it)."""
    if not _is_int(value):
        raise TrxpError(f"{where}: field '{field}' must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise TrxpError(f"{where}: field '{field}' is {_show(value)}, outside [{bounds}]")


def _number(where: str, field: str, value: Any) -> None:
    """Refuse a value that is not a finite number that converts to a float64."""
    if not isinstance(value, (int, float)):
        raise TrxpError(f"{where}: field '{field}' must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise TrxpError(f"{where}: field '{field}' is {value}, not a finite number")
    if not -sys.float_info.max <= value <= sys.float_info.max:
        raise TrxpError(f"{where}: field '{field}' is {_show(value)}, not representable as a float64")


class _Shape:
    """Measures item metadata, each container once (by id): nesting depth and the bytes it
    takes written out in full, as the store packs each experience (shared references
    expanded). Walking the data as a tree would cost exponential time for memo references
    shared at every level; here the steps are the references present, which the pickle
    spent at least a byte on each."""

    def __init__(self, work: Work, max_size: int, *, check_keys: bool) -> None:
        self.work = work
        self.max_size = max_size
        self.check_keys = check_keys  # not needed after the pickle scan, which refused other keys
        self.size = 0  # of every item measured so far
        self.known: dict[int, tuple[int, int]] = {}  # id -> (height, size), or _OPEN while being measured

    def item(self, where: str, item: dict[Any, Any]) -> None:
        """Measure every field of an item, counting it towards the payload's expansion bound."""
        for name, value in item.items():
            try:
                size = self._container(value, 0)[1] if isinstance(value, _CONTAINERS) else _scalar_size(value)
                self.size += size + _scalar_size(name)
            except TrxpError as exc:
                raise TrxpError(f"{where}: field {_show(name)}: {exc}") from None
            if self.size > self.max_size:
                raise TrxpError(
                    f"{where}: field {_show(name)}: metadata expands to more than {self.max_size} bytes when shared "
                    f"references are written out ({EXPANSION_PER_BYTE} per payload byte + {EXPANSION_BASE})"
                )

    def _container(self, value: dict | list | tuple, depth: int) -> tuple[int, int]:
        key = id(value)
        known = self.known.get(key)
        if known is None:
            if depth > MAX_NESTING:
                raise TrxpError(f"nested deeper than {MAX_NESTING} levels (or cyclic)")
            work = self.work
            work.used += 1 + len(value)
            if work.used > work.limit:
                work.charge(0)
            self.known[key] = _OPEN
            size = 3  # EMPTY_LIST (or dict), MARK, APPENDS (or SETITEMS)
            children: Iterable[Any] = value
            if isinstance(value, dict):
                if self.check_keys and not all(isinstance(k, (str, bytes)) for k in value):
                    raise TrxpError("dict keys must be str or bytes")
                for name in value:
                    size += 5 + (len(name) if name.isascii() else 4 * len(name))
                children = value.values()
            height = 1 if value else 0
            for child in children:
                kind = type(child)
                if kind is str:  # the common cases inline
                    size += 5 + (len(child) if child.isascii() else 4 * len(child))
                elif kind is int:
                    size += 6 + child.bit_length() // 8
                elif kind is float or kind is bool or child is None:
                    size += 9
                elif isinstance(child, _CONTAINERS):
                    child_height, child_size = self._container(child, depth + 1)
                    height = max(height, child_height + 1)
                    size += child_size
                    if size > self.max_size:
                        break  # refused by the caller; no need to add up the rest
                else:
                    size += _scalar_size(child)
            self.known[key] = known = (height, size)
        if depth + known[0] > MAX_NESTING:
            raise TrxpError(f"nested deeper than {MAX_NESTING} levels (or cyclic)")
        return known


# What a container being measured counts as when met again: a cycle, refused as too deep.
_OPEN = (MAX_NESTING + 1, 0)


def _scalar_size(value: Any) -> int:
    """Bytes a scalar takes in a pickle without memo (str: at most 4 bytes a character)."""
    if isinstance(value, str):
        return 5 + (len(value) if value.isascii() else 4 * len(value))
    if isinstance(value, bytes):
        return 5 + len(value)
    if isinstance(value, int):
        return 6 + value.bit_length() // 8
    if isinstance(value, _SCALARS):
        return 9
    raise TrxpError(f"{type(value).__name__} is not plain data")


_EID_PARTS = ("batch", "task", "run", "step", "suffix")
_INT64_BOUNDS = "-2**63, 2**63 - 1"


def _check_eid(where: str, eid: Any) -> str:
    """Validate an eid; return its uid, which reads unambiguously from the right: task and
    suffix hold no '/', run and step are non-negative ints, so only batch may hold '/'."""
    if not isinstance(eid, dict):
        raise TrxpError(f"{where}: field 'eid' is missing or not a dict")
    unknown = [key for key in eid if key not in _EID_PARTS]
    if unknown:
        raise TrxpError(
            f"{where}: field 'eid' has unknown keys {_show_list(unknown)} (it holds {', '.join(_EID_PARTS)})"
        )
    for part in _EID_PARTS:
        if part not in eid:
            raise TrxpError(f"{where}: field 'eid.{part}' is missing")
    for part in ("batch", "task"):
        if not isinstance(eid[part], str):
            if not _is_int(eid[part]):
                raise TrxpError(f"{where}: field 'eid.{part}' must be an int or str, got {type(eid[part]).__name__}")
            _in_range(where, f"eid.{part}", eid[part], -(2**63), INT64_MAX, _INT64_BOUNDS)
    _in_range(where, "eid.run", eid["run"], 0, INT64_MAX, "0, 2**63 - 1")
    _in_range(where, "eid.step", eid["step"], 0, MAX_STEP, "0, 2**31 - 1")
    if not isinstance(eid["suffix"], str):
        raise TrxpError(f"{where}: field 'eid.suffix' must be a str, got {type(eid['suffix']).__name__}")
    for part in ("task", "suffix"):
        if isinstance(eid[part], str) and "/" in eid[part]:
            raise TrxpError(f"{where}: field 'eid.{part}' contains '/' ({_show(eid[part])}); only batch may")
    uid = EID(**eid).uid
    if "\0" in uid:
        raise TrxpError(f"{where}: field 'eid' contains a NUL character")
    try:
        uid_bytes = uid.encode("utf-8")
    except UnicodeEncodeError:
        raise TrxpError(f"{where}: field 'eid' is not valid Unicode") from None
    if len(uid_bytes) > MAX_UID_BYTES:
        raise TrxpError(f"{where}: uid is {len(uid_bytes)} bytes, longer than {MAX_UID_BYTES}")
    return uid


def _check_meta(index: int, item: Any, shape: _Shape) -> None:
    """Validate the metadata of one item: what the server, its estimators and trainers rely on."""
    where = f"item {index}"
    if not isinstance(item, dict):
        raise TrxpError(f"{where}: expected a dict, got {type(item).__name__}")
    where = f"item {index} (uid {_clip(_check_eid(where, item.get('eid')))})"
    shape.item(where, item)
    reward = item.get("reward")
    if reward is not None:
        _number(where, "reward", reward)
    _in_range(where, "prompt_length", item.get("prompt_length", 1), 0, INT64_MAX, "0, 2**63 - 1")
    for name in ("info", "metrics"):
        if not isinstance(item.get(name, {}), dict):
            raise TrxpError(f"{where}: field '{name}' must be a dict")
    info = item.get("info", {})
    version = info.get("model_version")
    if version is not None:
        _in_range(where, "info.model_version", version, 0, INT64_MAX, "0, 2**63 - 1")
    if info.get("priority") is not None:
        _number(where, "info.priority", info["priority"])
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
    if not isinstance(keys, list) or not all(isinstance(k, str) and _is_utf8(k) for k in keys):
        raise TrxpError(f"{where}: field 'multi_modal_input_keys' must be a list of str (UTF-8, they name tensors)")
    if len(set(keys)) != len(keys):
        raise TrxpError(f"{where}: field 'multi_modal_input_keys' lists a key twice")
    shape.work.charge(len(custom) + len(keys))


def _parse_safetensors(blob: memoryview, work: Work) -> dict[str, RawTensor]:
    size = len(blob)
    if size < 8:
        raise TrxpError(f"tensors: safetensors blob is {size} bytes, too short for its header length")
    (header_len,) = struct.unpack_from("<Q", blob)
    if header_len > size - 8:
        raise TrxpError(f"tensors: safetensors header length {header_len} exceeds the {size - 8} bytes present")
    work.charge(header_len)  # the JSON parser is linear in its input
    try:
        header = json.loads(bytes(blob[8 : 8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also ints of 4300+ digits
        raise TrxpError(f"tensors: safetensors header is not valid JSON ({_clip(str(exc))})") from None
    if not isinstance(header, dict):
        raise TrxpError("tensors: safetensors header is not a JSON object")
    data = blob[8 + header_len :]
    spans = sorted(
        (*_parse_entry(key, entry, len(data), work), key) for key, entry in header.items() if key != "__metadata__"
    )
    cursor = 0
    tensors: dict[str, RawTensor] = {}
    for start, end, dtype, shape, key in spans:
        if start != cursor:
            raise TrxpError(f"tensors: {_show(key)} starts at byte {start}, expected {cursor} (gap or overlap)")
        cursor = end
        tensors[key] = RawTensor(dtype, shape, data[start:end])
    if cursor != len(data):
        raise TrxpError(f"tensors: {len(data) - cursor} bytes of tensor data belong to no tensor")
    return tensors


def _parse_entry(key: str, entry: Any, data_len: int, work: Work) -> tuple[int, int, str, tuple[int, ...]]:
    """Check one safetensors header entry; return (start, end, dtype, shape)."""
    if not isinstance(entry, dict):
        raise TrxpError(f"tensors: {_show(key)} entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise TrxpError(f"tensors: {_show(key)} has unsupported dtype {_show(dtype)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        shown = _show_list(shape) if isinstance(shape, list) else _show(shape)
        raise TrxpError(f"tensors: {_show(key)} shape {shown} is not a list of non-negative ints")
    work.charge(1 + len(shape))
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        shown = _show_list(offsets) if isinstance(offsets, list) else _show(offsets)
        raise TrxpError(f"tensors: {_show(key)} data_offsets {shown} fall outside the {data_len} data bytes")
    # torch and safetensors multiply the dimensions in int64 even when one of them is 0.
    itemsize, product = _ITEMSIZE[dtype], 1
    for dim in shape:
        product *= dim or 1
        if product * itemsize > INT64_MAX:
            raise TrxpError(
                f"tensors: {_show(key)} shape {_show_list(shape)} has more elements than a tensor can hold "
                f"(the product of its non-zero dimensions times {itemsize} bytes must stay below 2**63)"
            )
    nbytes = 0 if 0 in shape else product * itemsize
    if nbytes != offsets[1] - offsets[0]:
        raise TrxpError(
            f"tensors: {_show(key)} shape {_show_list(shape)} of {dtype} needs {nbytes} bytes, "
            f"offsets span {offsets[1] - offsets[0]}"
        )
    return offsets[0], offsets[1], dtype, tuple(shape)


def _split_tensor_key(key: str, num_items: int) -> tuple[int, str]:
    """Split "{i}:{field}"; i is written as Python writes an int (ASCII digits, no sign or leading 0)."""
    head, _, name = key.partition(":")
    canonical = head.isascii() and head.isdigit() and len(head) <= 19 and (head == "0" or head[0] != "0")
    if not canonical or not name or int(head) >= num_items:
        raise TrxpError(f"tensors: key {_show(key)} does not name an item of the {num_items} in the payload")
    if name not in TENSOR_FIELDS and not (name.startswith(MM_PREFIX) and len(name) > len(MM_PREFIX)):
        raise TrxpError(f"tensors: key {_show(key)} names an unknown field {_show(name)}")
    return int(head), name


def _check_tensors(index: int, item: RawItem, work: Work) -> None:
    """Validate the tensors of one item against its metadata."""
    meta = item.meta
    where = f"item {index} (uid {_clip(item.uid)})"
    keys = meta.get("multi_modal_input_keys", [])
    work.charge(len(keys) + len(item.tensors))
    for key in keys:
        if MM_PREFIX + key not in item.tensors:
            raise TrxpError(f"{where}: multi-modal input {_show(key)} is listed but has no tensor")
    listed = set(keys)
    for name in item.tensors:
        if name.startswith(MM_PREFIX) and name[len(MM_PREFIX) :] not in listed:
            raise TrxpError(f"{where}: tensor {_show(name)} is not listed in multi_modal_input_keys")
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
    work = Work(_UNBOUNDED)  # the caller's own objects: checked like a payload, without its size bounds
    _check_meta(0, meta, _Shape(work, _UNBOUNDED, check_keys=True))
    _check_tensors(0, item, work)
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
