"""Advantages of one value per experience, as tensors: the server's expansion and the client's.

Every estimator but the token-level ones gives an experience one advantage for all its
generated tokens. Its `advantages` and `returns` tensors are that value times the action
mask, as float32 (`scaled`). The server either splices them into a sampled batch, or, for a
client that asks for compact advantages, sends the values beside a payload without them
(4 bytes per token each, about 32 KB per experience of 4,000 tokens): the client then adds
them with `attach`, through the same `scaled`, so that the tensors are bit-identical. Both
work on the bytes, without torch: the storage engine splices with them.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from array import array
from collections.abc import Sequence

from .build import ENTRY, dims_text, frame
from .common import HEADER, HEADER_SIZE, ITEMSIZE, NUMBER_FORMAT, RawTensor, TrxpError

_F32 = struct.Struct("<f")
_HEADER_LEN = struct.Struct("<Q")
ADDED = ("advantages", "returns")  # the tensors a value becomes, both value * action_mask
# The struct format of each action mask dtype (bool or integer: checks.py), as its elements are read.
_MASK_FORMAT = {"BOOL": "?", "U8": "B", "I8": "b"} | {
    code: NUMBER_FORMAT[code] for code in ("I16", "U16", "I32", "U32", "I64", "U64")
}


def scaled(value: float, length: int, mask: RawTensor | None) -> RawTensor:
    """float32 `value` for each generated token: value * action_mask, or `length` copies of
    the value where the experience has no mask. The mask's elements and the value are taken
    as float32 and multiplied in float32, as torch does (`mask.float() * value`)."""
    if mask is None:
        return RawTensor("F32", (length,), _F32.pack(value) * length)
    data = _scaled_mask(bytes(mask.data), _F32.pack(value), bytes(4)) if mask.dtype == "BOOL" else None
    if data is None:
        data = _scaled_numbers(mask, value)
    return RawTensor("F32", (len(data) // 4,), data)


def _scaled_mask(mask: bytes, one: bytes, zero: bytes) -> bytes | None:
    """A mask's bytes 0/1 as float32 `zero` / `one`; None if it holds other bytes. A mask
    of ones (a response all generated, the most common) is one repeat of `one`, found by a
    comparison with as many ones (a memset and a memcmp, where the check of every byte and the
    count of zeros each take a step a byte: some 14 instructions a byte of the mask, a 40 KB
    experience's reply 57 k); any other is written as the k-th byte of every float at once,
    k = 0..3 (a translate and a strided copy each)."""
    if mask == b"\x01" * len(mask):
        return one * len(mask)
    if mask.translate(None, b"\x00\x01"):
        return None
    out = bytearray(4 * len(mask))
    for k in range(4):
        out[k::4] = mask.translate(bytes.maketrans(b"\x00\x01", zero[k : k + 1] + one[k : k + 1]))
    return bytes(out)


def _scaled_numbers(mask: RawTensor, value: float) -> bytes:
    """value * mask for a mask of integers (or a bool mask whose bytes are not all 0 or 1):
    a mask of 0 and 1 through `_scaled_mask`, with 0 * value's signed zero; any other
    element by element, each product rounded once to float32."""
    one = _F32.pack(value)
    factor = _F32.unpack(one)[0]
    flags = _zeros_and_ones(mask)
    numbers: tuple[int, ...] = ()
    if flags is None:
        numbers = struct.unpack(f"<{mask.numel}{_MASK_FORMAT[mask.dtype]}", mask.data)
        if not set(numbers) - {0, 1}:  # a bool mask's other bytes are true
            flags = bytes(numbers)
    if flags is not None:
        data = _scaled_mask(flags, one, _F32.pack(0.0 * factor))
        assert data is not None
        return data
    elements = array("f", map(_float32_exact, numbers))  # each element rounded once to float32
    products = array("f", [element * factor for element in elements])  # exact in float64, rounded once
    if sys.byteorder == "big":
        products.byteswap()
    return products.tobytes()


def _zeros_and_ones(mask: RawTensor) -> bytes | None:
    """An integer mask's elements as one byte each where every one is 0 or 1, read from the
    bytes (little-endian: each element's first byte is 0 or 1, its others 0); None otherwise."""
    data = bytes(mask.data)
    if data.translate(None, b"\x00\x01"):
        return None
    first = data[:: ITEMSIZE[mask.dtype]]
    return first if first.count(1) == data.count(1) else None  # every 1 an element's first byte


def _float32_exact(number: int) -> float:
    """A float that rounds to float32 as the integer does: the integer itself up to 2**53; a
    larger one cut to 26 bits and a sticky bit, so that float64 does not round it first."""
    if abs(number) <= 1 << 53:
        return float(number)
    shift = abs(number).bit_length() - 26
    kept = abs(number) >> shift | (abs(number) & ((1 << shift) - 1) != 0)
    return math.copysign(math.ldexp(kept, shift), number)


def attach(payload: bytes, values: Sequence[float], lengths: Sequence[int]) -> bytes:
    """A sampled batch sent with compact advantages (one value and response length per
    experience, in batch order) as the batch the server would have sent in full: each item
    gains its `advantages` and `returns`, `scaled` from its own action mask, appended after
    the payload's tensor bytes. The metadata and the other tensors are copied as they are;
    a payload without values is returned unchanged."""
    if not values:
        return payload
    if len(values) != len(lengths):
        raise TrxpError(f"compact advantages: {len(values)} values but {len(lengths)} response lengths")
    view = memoryview(payload)
    if len(view) < HEADER_SIZE + _HEADER_LEN.size:
        raise TrxpError(f"compact advantages: the payload is {len(view)} bytes, too short for a TRXP batch")
    _, _, meta_len, _ = HEADER.unpack_from(view)
    meta = view[HEADER_SIZE : HEADER_SIZE + meta_len]
    blob = view[HEADER_SIZE + meta_len :]
    (header_len,) = _HEADER_LEN.unpack_from(blob)
    header_json = bytes(blob[8 : 8 + header_len]).rstrip(b" ")
    header = json.loads(header_json)
    section = blob[8 + header_len :]
    items = 1 + max((int(key.partition(":")[0]) for key in header if key != "__metadata__"), default=-1)
    if items != len(values):
        raise TrxpError(f"compact advantages: {len(values)} values for a batch of {items} experiences")
    entries: list[bytes] = []
    data: list[bytes | memoryview] = [section]
    base = len(section)
    for index, (value, length) in enumerate(zip(values, lengths, strict=True)):
        found = header.get(f"{index}:action_mask")
        mask = None
        if found is not None:
            start, end = found["data_offsets"]
            mask = RawTensor(found["dtype"], tuple(found["shape"]), section[start:end])
        tensor = scaled(value, length, mask)
        dims = dims_text(tensor.shape)
        for name in ADDED:
            if f"{index}:{name}" in header:
                raise TrxpError(f"compact advantages: item {index} already carries {name}")
            entries.append(ENTRY % (index, name.encode(), tensor.dtype.encode(), dims, base, base + len(tensor.data)))
            base += len(tensor.data)
            data.append(tensor.data)
    head = header_json[:-1] + (b"," if header else b"") + b",".join(entries) + b"}"
    return b"".join(frame([meta], head, data))
