"""value * action_mask, which the storage engine splices into a sampled batch and a client of
compact advantages rebuilds, is computed on the mask's bytes without torch: for every mask
dtype it is torch's `mask.float() * value`, bit for bit (signed zeros, huge integers, overflow)."""

from __future__ import annotations

import random

import pytest
import torch

from expbuf.client.trxp.codec.advantages import scaled
from expbuf.client.trxp.codec.common import RawTensor
from expbuf.client.trxp.codec.convert import raw_of

DTYPES = {
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
}  # fmt: skip
VALUES = [1.5, -0.3, 0.0, -0.0, 3.3e38, -3.3e38, 1e-40, 7.000001]
# An integer that float64 rounds up to a tie that float32 then rounds up again; float32 rounds it down.
TWICE_ROUNDED = (0x800001 << 36) | ((1 << 35) - 1)


def torchs(value: float, mask: torch.Tensor) -> bytes:
    return bytes(raw_of(mask.reshape(-1).to(torch.float32) * value).data)


@pytest.mark.parametrize("code", DTYPES)
def test_an_integer_mask_scales_as_torch_does(code: str) -> None:
    rng, info = random.Random(code), torch.iinfo(DTYPES[code])
    for elements in (
        [0, 1, 1, 0],
        [1, 1, 1],
        [0, 3, -2, 1],
        [info.min, info.max, 2**53 + 1, TWICE_ROUNDED, -TWICE_ROUNDED, 0],
    ):
        numbers = [min(max(n, info.min), info.max) for n in elements]
        mask = torch.tensor([n - 2**64 if n >= 2**63 else n for n in numbers], dtype=torch.int64)
        mask = mask.view(torch.uint64) if code == "U64" else mask.to(DTYPES[code])
        for value in [*VALUES, rng.uniform(-10, 10)]:
            got = scaled(value, len(numbers), raw_of(mask))
            assert (got.dtype, got.shape, bytes(got.data)) == ("F32", (len(numbers),), torchs(value, mask)), numbers


def test_a_bool_mask_of_zeros_and_ones_keeps_its_fast_path_and_any_other_byte_is_true() -> None:
    clean = RawTensor("BOOL", (4,), b"\x00\x01\x01\x00")
    assert bytes(scaled(-0.5, 4, clean).data) == bytes(4) + bytes.fromhex("000000bf") * 2 + bytes(4)
    stray = bytearray(b"\x00\x02\xff\x01")
    want = torchs(-0.5, torch.frombuffer(stray, dtype=torch.bool))
    assert bytes(scaled(-0.5, 4, RawTensor("BOOL", (4,), bytes(stray))).data) == want


@pytest.mark.parametrize("mask", [b"\x01" * 4000, b"", b"\x01" * 3999 + b"\x02", b"\x02" + b"\x01" * 7])
def test_a_bool_mask_of_ones_or_ones_and_a_stray_byte_scales_as_torch_does(mask: bytes) -> None:
    """A mask of ones is found by a comparison with as many ones; one with a stray byte among its
    ones takes the way of any other byte (true), and both give torch's bytes."""
    for value in (-0.5, 2.25):
        want = torchs(value, torch.frombuffer(bytearray(mask), dtype=torch.bool)) if mask else b""
        got = scaled(value, len(mask), RawTensor("BOOL", (len(mask),), mask))
        assert (got.shape, bytes(got.data)) == ((len(mask),), want)
