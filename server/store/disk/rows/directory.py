"""The group directory's entries: a complete group's place in a segment (`GroupRef`) or, while the
group still takes members, its `PendingHead`. The members a request adds to pending groups wait in
one fragment of that request (a block of members' columns, members.encode_members), shared by the
groups it reached: each head names its members' ranges there (`FragmentRef`), and a fragment's
count row says how many ranges of heads name it, so that it goes with the last of them.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

from ..records import _pack_str, _unpack_str

_FRAGMENT = struct.Struct(">Q")
_COUNT = struct.Struct("<I")


def fragment_key(prefix: bytes, fragment: int) -> bytes:
    """A table's fragment in the fragments database: T + its number (8 bytes)."""
    return prefix + _FRAGMENT.pack(fragment)


def fragment_count_key(prefix: bytes, fragment: int) -> bytes:
    """The row counting the ranges of pending heads that name a fragment: its key and a zero byte, so
    it sorts right after its fragment."""
    return prefix + _FRAGMENT.pack(fragment) + b"\x00"


def encode_count(count: int) -> bytes:
    return _COUNT.pack(count)


def decode_count(data: bytes | memoryview) -> int:
    (count,) = _COUNT.unpack_from(data)
    if len(data) != _COUNT.size:
        raise ValueError(f"a fragment's count row of {len(data)} bytes")
    return int(count)


class FragmentRef(NamedTuple):
    """Members lo to hi (excluded) of fragment `fragment`: those of a pending group one request added."""

    fragment: int
    lo: int
    hi: int


def uid_hashes(uids: Iterable[str]) -> bytes:
    """What a pending group's head keeps of its members' uids, 8 bytes each (XXH3-64's digest): a
    retried push is screened against them without the group's fragments read."""
    digest = xxhash.xxh3_64_digest
    return b"".join([digest(uid.encode()) for uid in uids])


_REF = struct.Struct("<BxHQ")  # REF, group, seg
REF, PENDING = 1, 2  # the kinds of a group directory's entries, their first byte


class GroupRef(NamedTuple):
    """A complete group's place: its segment and its group's index there."""

    seg: int
    group: int

    def encode(self) -> bytes:
        return _REF.pack(REF, self.group, self.seg)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> GroupRef:
        _, group, seg = _REF.unpack_from(data)
        return cls(seg, group)


def group_refs(seg: int, count: int) -> list[bytes]:
    """The directory entries of segment `seg`'s `count` groups, encoded: each its `GroupRef`'s."""
    return [_REF.pack(REF, group, seg) for group in range(count)]


_REF_ROW = struct.Struct("<QII")  # a FragmentRef in a head
_FRAGMENT_REF = functools.partial(tuple.__new__, FragmentRef)  # FragmentRef._make, less its count


@dataclass(slots=True, kw_only=True)
class PendingHead:
    """A group that still takes members, or waits for its advantages: when it was opened, a hash of
    each member's uid in push order (`uid_hashes`), the ranges of fragments that hold the members in
    that order (`refs`), and the runs its workers reported failed. A complete group waiting for its
    advantages (computing) keeps its place in the compute queue (`queued`: its key there) and whether
    it completed partial, until its advantages are stored and it goes into a segment with them."""

    created: float
    hashed: bytes = b""  # its members' `uid_hashes`, in push order: a push adds its own, reading none
    ranges: bytes = b""  # its FragmentRefs as stored (`refs`): a push to it adds one, reading none
    failed: dict[str, str] = field(default_factory=dict)
    partial: bool = False
    queued: int | None = None

    _HEAD = struct.Struct("<BBIId")  # PENDING, flags, members, refs, created
    _PARTIAL, _FAILED, _QUEUED = 1, 2, 4

    @property
    def size(self) -> int:
        """How many members it has."""
        return len(self.hashed) // 8

    def may_hold(self, hashed: bytes) -> bool:
        """Whether it may hold a member of any of these uids (`uid_hashes`'s): False only where it holds
        none (a hash found across two of its own is a false alarm, which a read of its members settles)."""
        kept = self.hashed
        if len(hashed) == 8:
            return hashed in kept
        return any(hashed[at : at + 8] in kept for at in range(0, len(hashed), 8))

    @property
    def refs(self) -> list[FragmentRef]:
        """The ranges of fragments that hold its members, in push order."""
        return list(map(_FRAGMENT_REF, _REF_ROW.iter_unpack(self.ranges)))

    @refs.setter
    def refs(self, refs: list[FragmentRef]) -> None:
        self.ranges = b"".join(_REF_ROW.pack(*ref) for ref in refs)

    def add(self, ref: FragmentRef) -> None:
        """One more range of a fragment holding its members, after the others."""
        self.ranges += _REF_ROW.pack(*ref)

    def encode(self) -> bytes:
        flags = (
            (self._PARTIAL if self.partial else 0)
            | (self._FAILED if self.failed else 0)
            | (0 if self.queued is None else self._QUEUED)
        )
        parts = [self._HEAD.pack(PENDING, flags, self.size, len(self.ranges) // _REF_ROW.size, self.created)]
        parts.append(self.hashed)
        parts.append(self.ranges)
        if self.failed:
            texts = [text for uid, reason in self.failed.items() for text in (uid, reason)]
            parts.append(struct.pack("<I", len(texts)))
            parts.extend(map(_pack_str, texts))
        if self.queued is not None:
            parts.append(struct.pack("<Q", self.queued))
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> PendingHead:
        _, flags, count, nrefs, created = cls._HEAD.unpack_from(data)
        pos = cls._HEAD.size + 8 * count
        end = pos + _REF_ROW.size * nrefs
        hashed, ranges = bytes(data[cls._HEAD.size : pos]), bytes(data[pos:end])
        if not flags:  # (most heads: nothing reported failed, pending)
            return cls(created=created, hashed=hashed, ranges=ranges)
        pos = end
        failed = {}
        if flags & cls._FAILED:
            (size,) = struct.unpack_from("<I", data, pos)
            pos += 4
            texts = []
            for _ in range(size):
                text, pos = _unpack_str(data, pos)
                texts.append(text)
            failed = dict(zip(texts[::2], texts[1::2], strict=True))
        queued = struct.unpack_from("<Q", data, pos)[0] if flags & cls._QUEUED else None
        partial = bool(flags & cls._PARTIAL)
        return cls(created=created, hashed=hashed, ranges=ranges, failed=failed, partial=partial, queued=queued)


def directory_entry(data: bytes | memoryview) -> GroupRef | PendingHead:
    """A group directory's value: a complete group's place, or a pending group's head."""
    kind = data[0]
    if kind == REF:
        return GroupRef.decode(data)
    if kind == PENDING:
        return PendingHead.decode(data)
    raise ValueError(f"a group directory entry of kind {kind}")
