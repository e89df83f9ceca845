"""The group directory's entries: a complete group's place in a segment (`GroupRef`) or, while the
group still takes members, its `PendingHead`; the members each push added to a pending group wait
as member rows of their own (a fragment: members.encode_member_rows) until the group completes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

from ...schema.states import COMPUTING, State
from ...schema.states import PENDING as PENDING_STATE
from ..records import _pack_str, _unpack_str


def fragment_key(prefix: bytes, gkey: str, number: int) -> bytes:
    """A pending group's fragment `number` in the fragments database: its key ends in 5 bytes of its
    own (a zero, then the number), so no two groups' fragments share a key."""
    return prefix + gkey.encode() + b"\x00" + number.to_bytes(4, "big")


def uid_hash(uid: str) -> int:
    """What a pending group's head keeps of a member's uid: a retried push is screened against it
    without the group's fragments read."""
    return xxhash.xxh3_64_intdigest(uid.encode())


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


@dataclass(slots=True, kw_only=True)
class PendingHead:
    """A group that still takes members, or waits for its advantages: when it was opened, a hash of
    each member's uid in push order (`uid_hash`), how many fragments hold the members, and the runs
    its workers reported failed. A complete group waiting for its advantages (computing) keeps its
    place in the compute queue (`queued`: its key there) and whether it completed partial, until its
    advantages are stored and it goes into a segment with them."""

    created: float
    hashes: list[int] = field(default_factory=list)
    fragments: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    partial: bool = False
    queued: int | None = None

    _HEAD = struct.Struct("<BBIId")  # PENDING, flags, members, fragments, created
    _PARTIAL, _FAILED, _QUEUED = 1, 2, 4

    @property
    def state(self) -> State:
        """Its group's state: pending, or computing once it waits in the compute queue."""
        return PENDING_STATE if self.queued is None else COMPUTING

    def encode(self) -> bytes:
        count = len(self.hashes)
        flags = (
            (self._PARTIAL if self.partial else 0)
            | (self._FAILED if self.failed else 0)
            | (0 if self.queued is None else self._QUEUED)
        )
        parts = [self._HEAD.pack(PENDING, flags, count, self.fragments, self.created)]
        parts.append(struct.pack(f"<{count}Q", *self.hashes))
        if self.failed:
            texts = [text for uid, reason in self.failed.items() for text in (uid, reason)]
            parts.append(struct.pack("<I", len(texts)))
            parts.extend(map(_pack_str, texts))
        if self.queued is not None:
            parts.append(struct.pack("<Q", self.queued))
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> PendingHead:
        _, flags, count, fragments, created = cls._HEAD.unpack_from(data)
        pos = cls._HEAD.size
        hashes = list(struct.unpack_from(f"<{count}Q", data, pos))
        pos += 8 * count
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
        return cls(created=created, hashes=hashes, fragments=fragments, failed=failed, partial=partial, queued=queued)


def directory_entry(data: bytes | memoryview) -> GroupRef | PendingHead:
    """A group directory's value: a complete group's place, or a pending group's head."""
    kind = data[0]
    if kind == REF:
        return GroupRef.decode(data)
    if kind == PENDING:
        return PendingHead.decode(data)
    raise ValueError(f"a group directory entry of kind {kind}")
