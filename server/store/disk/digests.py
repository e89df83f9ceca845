"""The content digest of a stored experience: 16 bytes that tell a retried push of the same
content (a duplicate) from other content under the same uid (a conflict), and a stored payload
from a damaged one.

Format 4 digests with XXH3-128, some 25 times faster than SHA-256 (with SHA-NI) over an 8 or
40 KB payload (bench/RESULTS.md). The digest guards against retries and damage, not forgery:
only the pusher of a uid chooses the content stored under it. Format 3 digested with SHA-256:
the upgrade gives every stored payload its new digest, and the tombstones it leaves keep their
old one (their payloads are gone) until they are pruned: a retried push matches either
(pushes.put).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import xxhash

from expbuf.client.trxp.stored.pieces import SplitPayload, Stored, realized


def of(blob: Stored) -> bytes:
    """The digest of a payload as the store keeps it (one stored in chunks: of its bytes end to end)."""
    if isinstance(blob, SplitPayload):
        hasher = running()
        for run in blob.runs():  # a Window read, and let go, one at a time
            hasher.update(realized(run))
        return hasher.digest()
    return xxhash.xxh3_128_digest(blob)


def matches(blob: Stored, size: int, digest: bytes) -> bool:
    """Whether `blob` is the payload of `size` bytes and `digest` a record names (`mismatch` says
    why not)."""
    if len(blob) != size:
        return False
    return (of(blob) if isinstance(blob, SplitPayload) else xxhash.xxh3_128_digest(blob)) == digest


def all_match(blobs: Sequence[Stored], sizes: Sequence[int], found: Sequence[bytes]) -> list[bool]:
    """`matches` of each payload of a batch, a call for the batch (a take reads hundreds)."""
    digest = xxhash.xxh3_128_digest
    return [
        len(blob) == size and (of(blob) if isinstance(blob, SplitPayload) else digest(blob)) == want
        for blob, size, want in zip(blobs, sizes, found, strict=True)
    ]


def each_matches(blobs: Sequence[bytes | memoryview], sizes: Sequence[int], found: Sequence[bytes]) -> bool:
    """Whether every payload of a batch, each stored whole, is the one its record names: its sizes
    and digests taken and compared a list at a time, no Python step an experience (a take asks it of
    hundreds; `all_match` then says which one is not)."""
    return list(map(len, blobs)) == list(sizes) and list(map(xxhash.xxh3_128_digest, blobs)) == list(found)


def mismatch(blob: Stored, size: int, digest: bytes) -> str | None:
    """Why `blob` is not the payload of `size` bytes and `digest` a record names, or None."""
    if len(blob) != size:
        return differs(len(blob), b"", size, digest)
    return differs(size, of(blob), size, digest)


def differs(found_size: int, found_digest: bytes, size: int, digest: bytes) -> str | None:
    """Why a payload of `found_size` bytes and `found_digest` is not the one of `size` bytes and
    `digest` a record names, or None."""
    if found_size != size:
        return f"its payload is {found_size} bytes, its record says {size}"
    return None if found_digest == digest else "its payload does not match its digest"


def running() -> xxhash.xxh3_128:
    """A digest taken over bytes as they pass (`update`): `of` them end to end."""
    return xxhash.xxh3_128()


def format_3(blob: bytes | memoryview) -> bytes:
    """The digest format 3 kept: the first 16 bytes of SHA-256."""
    return hashlib.sha256(blob).digest()[:16]
