"""The TRXP layout's constants and the types the codec works on: raw tensors, raw items, the
work counter that bounds decoding, and the one error it raises.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from ..experience import (
    EID,
    RESPONSE_TENSOR_FIELDS,
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
# The exact types of plain data, for the checks that look no closer at them (subclasses do).
_EXACT_CONTAINERS = frozenset(_CONTAINERS)
_EXACT_SCALARS = frozenset({*_SCALARS, bool})


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


@dataclass(slots=True)
class RawTensor:
    """A tensor as safetensors stores it: dtype code, shape, little-endian bytes.

    Not changed once made; not frozen, as a frozen dataclass's construction costs each
    tensor a push decodes or encodes three times as much."""

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
        version: int | None = self.meta.get("info", {}).get("model_version")
        return version

    @property
    def response_length(self) -> int:
        prompt_length: int = self.meta.get("prompt_length", 1)
        return self.tensors["tokens"].numel - prompt_length

    @property
    def generated_tokens(self) -> int:
        """Response tokens under the action mask (all of them without a mask)."""
        mask = self.tensors.get("action_mask")
        if mask is None:
            return self.response_length
        if _ITEMSIZE[mask.dtype] == 1:
            return len(mask.data) - bytes(mask.data).count(0)
        from .convert import tensor_of  # torch only for masks that are not bytes

        return int(tensor_of(mask).count_nonzero())
