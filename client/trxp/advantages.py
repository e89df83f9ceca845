"""Advantages of one value per experience, as tensors: the server's expansion and the client's.

Every estimator but the token-level ones gives an experience one advantage for all its
generated tokens. Its `advantages` and `returns` tensors are that value times the action
mask, as float32 (`scaled`). The server either splices them into a sampled batch, or, for a
client that asks for compact advantages, sends the values beside a payload without them
(4 bytes per token each, about 32 KB per experience of 4,000 tokens): the client then adds
them with `attach`, through the same `scaled`, so that the tensors are bit-identical.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .build import ENTRY, frame
from .common import HEADER, HEADER_SIZE, RawTensor, TrxpError

if TYPE_CHECKING:
    import torch

_F32 = struct.Struct("<f")
_HEADER_LEN = struct.Struct("<Q")
ADDED = ("advantages", "returns")  # the tensors a value becomes, both value * action_mask


def flat_tensor(raw: RawTensor | None, length: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of a stored tensor (an action mask, say), or `fill` where it is absent."""
    import torch

    from .convert import tensor_of

    if raw is None:
        return torch.full((length,), fill, dtype=dtype)
    return tensor_of(raw).reshape(-1).to(dtype)


def scaled(value: float, length: int, mask: RawTensor | None) -> RawTensor:
    """float32 `value` for each generated token: value * action_mask, or `length` copies of
    the value where the experience has no mask. A BOOL mask is scaled on its bytes (no torch)."""
    data = _F32.pack(value) * length if mask is None else None
    if mask is not None and mask.dtype == "BOOL":
        data = _scaled_mask(bytes(mask.data), value)
    if data is not None and len(data) == 4 * length:
        return RawTensor("F32", (length,), data)
    import torch

    from .convert import raw_of

    return raw_of(flat_tensor(mask, length, 1, torch.float32) * value)


def _scaled_mask(mask: bytes, value: float) -> bytes | None:
    """A BOOL mask's bytes 0/1 as float32 0 / value; None if it holds other bytes. A mask
    without zeros is one repeat of the value's 4 bytes; any other is written as the k-th
    byte of every float at once, k = 0..3 (a translate and a strided copy each)."""
    if mask.translate(None, b"\x00\x01"):
        return None
    one = _F32.pack(value)
    if not mask.count(0):
        return one * len(mask)
    out = bytearray(4 * len(mask))
    for k in range(4):
        out[k::4] = mask.translate(bytes.maketrans(b"\x01", one[k : k + 1]))
    return bytes(out)


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
        dims = b",".join([b"%d" % dim for dim in tensor.shape])
        for name in ADDED:
            if f"{index}:{name}" in header:
                raise TrxpError(f"compact advantages: item {index} already carries {name}")
            entries.append(ENTRY % (index, name.encode(), tensor.dtype.encode(), dims, base, base + len(tensor.data)))
            base += len(tensor.data)
            data.append(tensor.data)
    head = header_json[:-1] + (b"," if header else b"") + b",".join(entries) + b"}"
    return b"".join(frame([meta], head, data))
