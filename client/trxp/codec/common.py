"""The TRXP layout's constants and the types the codec works on: raw tensors, raw items, the
work counter that bounds decoding, and the one error it raises.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Final

from ...schema.experience import EID, RESPONSE_TENSOR_FIELDS

MAGIC = b"TRXP"
VERSION = 1
HEADER = struct.Struct("<4sBQQ")
HEADER_SIZE = HEADER.size  # 21
MM_PREFIX: Final = "multi_modal_inputs:"
SEGMENTS_KEY: Final = "version_segments"  # where an experience's info carries its per-token versions (segments.py)
# LMDB keys hold table id + uid; keep uids well inside its 511-byte limit.
MAX_UID_BYTES: Final = 400
MAX_NESTING: Final = 32
INT64_MAX: Final = 2**63 - 1
# float32's largest finite value: the bound of a reward (advantages are float32).
FLOAT32_MAX: Final = 3.4028234663852886e38
# The multi-step estimators compute run * (max step + 1) + step in int64.
MAX_STEP: Final = 2**31 - 1
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
UNBOUNDED = 1 << 62

# safetensors dtype code -> item size. The order is safetensors' own Dtype order:
# it writes tensors sorted by dtype descending, then by name.
ITEMSIZE: Final[dict[str, int]] = {
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
DTYPE_RANK = {code: rank for rank, code in enumerate(ITEMSIZE)}
INTEGER_CODES: Final = frozenset({"U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})
FLOAT_CODES: Final = frozenset({"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"})
FLOAT_FIELDS: Final = frozenset(RESPONSE_TENSOR_FIELDS) - {"action_mask"}

# The struct format of each multi-byte dtype Python reads as numbers, in the machine's byte order as
# torch.frombuffer reads them; BF16 is read as its 16 bits, sign bit apart.
NUMBER_FORMAT = {
    "I16": "h",
    "U16": "H",
    "F16": "e",
    "I32": "i",
    "U32": "I",
    "F32": "f",
    "I64": "q",
    "U64": "Q",
    "F64": "d",
}
CONTAINERS: Final = (dict, list, tuple)
SCALARS = (str, bytes, int, float, type(None))
# The exact types of plain data, for the checks that look no closer at them (subclasses do).
EXACT_CONTAINERS = frozenset(CONTAINERS)
EXACT_SCALARS = frozenset({*SCALARS, bool})


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
class MetadataLimit:
    """The most an item's metadata may take written out (Shape's measure), and how a refusal
    names that limit: a setting of the server that holds the payload."""

    size: int
    name: str


@dataclass(slots=True, init=False)
class RawTensor:
    """A tensor as safetensors stores it: dtype code, shape, little-endian bytes.

    Not changed once made; not frozen, as a frozen dataclass's construction costs each
    tensor a push decodes or encodes three times as much."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    def __init__(self, dtype: str, shape: tuple[int, ...], data: bytes | memoryview) -> None:
        """Written out rather than made by dataclass, whose __init__ is interpreted even where
        mypyc compiles the class: a push makes one for each of its tensors."""
        self.dtype = dtype
        self.shape = shape
        self.data = data

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(init=False)
class RawItem:
    """One experience as it travels: its metadata dict and raw tensors.

    Tensor keys are field names ("tokens") or "multi_modal_inputs:{key}".
    """

    meta: dict[str, Any]
    tensors: dict[str, RawTensor]
    checked_uid: str | None  # its uid as the check of its eid made it (check_meta); None unchecked

    def __init__(self, meta: dict[str, Any], tensors: dict[str, RawTensor], checked_uid: str | None = None) -> None:
        """Written out, as RawTensor's is: a push makes one for each of its experiences. The
        uid is passed only by whoever checked `meta` and leaves its eid as it is, so that the
        store's entry takes it (ids_of) instead of making it again."""
        self.meta = meta
        self.tensors = tensors
        self.checked_uid = checked_uid

    @property
    def eid(self) -> EID:
        return EID(**self.meta["eid"])

    @property
    def uid(self) -> str:
        return self.eid.uid

    @property
    def model_version(self) -> int | None:
        """The policy version of the experience: its oldest token's where it carries version
        segments (segments.py), else info["model_version"]."""
        return versions(self.meta.get("info", {}))[0]

    @property
    def version_segments(self) -> tuple[int, ...]:
        """The version segments of a checked item, flattened (version, offset, ...); () without."""
        return versions(self.meta.get("info", {}))[1]

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
        return count_nonzero(mask)


def versions(info: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """A checked experience's `model_version` and `version_segments` (RawItem's), its info read
    once: a push's entry asks for both of every experience."""
    segments = info.get(SEGMENTS_KEY)
    if not segments:
        version: int | None = info.get("model_version")
        return version, ()
    return segments[0][0], tuple([number for pair in segments for number in pair])


def count_nonzero(raw: RawTensor) -> int:
    """How many of a tensor's elements are not zero (-0.0 is zero), read from its bytes without torch,
    so the storage engine counts an action mask's generated tokens without importing it."""
    data = memoryview(raw.data).cast("B")
    if ITEMSIZE[raw.dtype] == 1:
        # A single turn's mask holds no zero (every response token generated): memchr finds the
        # first zero in a vectorised pass, and only the bytes from it on are counted one at a time
        # (bytes.count of one byte: some 5 instructions a byte, 20 k a 40 KB experience's mask).
        held = data.tobytes()
        first = held.find(0)
        return len(held) if first < 0 else len(held) - held.count(0, first)
    if raw.dtype == "BF16":
        return sum(1 for (bits,) in struct.iter_unpack("<H", data) if bits & 0x7FFF)
    return sum(1 for (value,) in struct.iter_unpack("<" + NUMBER_FORMAT[raw.dtype], data) if value)
