"""Protobuf's base-128 varints, where a message is written or read by hand rather than by
protobuf: a push request around its payload, a sample reply around its columns, a column batch's
entries counted before it is parsed."""

from __future__ import annotations


def write(value: int) -> bytes:
    """`value` (0 to 2**64 - 1) as a varint."""
    if not 0 <= value < 1 << 64:
        raise ValueError(f"a varint holds 0 to 2**64 - 1, not {value}")
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read(raw: bytes | memoryview, at: int) -> tuple[int, int] | None:
    """The varint at `at` and where it ends; None where `raw` ends first or it runs past 64 bits."""
    value = 0
    for shift in range(0, 64, 7):
        if at >= len(raw):
            return None
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
    return None


def field_bytes(length: int) -> int:
    """The bytes a length-delimited field (bytes, string) of `length` bytes takes in a message, its
    number below 16: its key, its length as a varint, and itself."""
    return 1 + max(1, (length.bit_length() + 6) // 7) + length
