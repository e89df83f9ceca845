"""The group directory's entries: a complete group's place in a segment (`GroupRef`) or, while the
group still takes members, its `PendingHead`; the members each push added to a pending group wait
as member rows of their own (a fragment: members.encode_member_rows) until the group completes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

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


@dataclass(slots=True, kw_only=True)
class PendingHead:
    """A group that still takes members: when it was opened, a hash of each member's uid in push order
    (`uid_hash`), how many fragments hold the members, and the runs its workers reported failed."""

    created: float
    hashes: list[int] = field(default_factory=list)
    fragments: int = 0
    failed: dict[str, str] = field(default_factory=dict)

    _HEAD = struct.Struct("<BBIId")  # PENDING, flags, members, fragments, created
    _FAILED = 2

    def encode(self) -> bytes:
        count = len(self.hashes)
        flags = self._FAILED if self.failed else 0
        head = self._HEAD.pack(PENDING, flags, count, self.fragments, self.created)
        body = head + struct.pack(f"<{count}Q", *self.hashes)
        if not self.failed:
            return body
        texts = [text for uid, reason in self.failed.items() for text in (uid, reason)]
        return body + struct.pack("<I", len(texts)) + b"".join(map(_pack_str, texts))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> PendingHead:
        _, flags, count, fragments, created = cls._HEAD.unpack_from(data)
        pos = cls._HEAD.size
        hashes = list(struct.unpack_from(f"<{count}Q", data, pos))
        failed = {}
        if flags & cls._FAILED:
            pos += 8 * count
            (size,) = struct.unpack_from("<I", data, pos)
            pos += 4
            texts = []
            for _ in range(size):
                text, pos = _unpack_str(data, pos)
                texts.append(text)
            failed = dict(zip(texts[::2], texts[1::2], strict=True))
        return cls(created=created, hashes=hashes, fragments=fragments, failed=failed)


def directory_entry(data: bytes | memoryview) -> GroupRef | PendingHead:
    """A group directory's value: a complete group's place, or a pending group's head."""
    kind = data[0]
    if kind == REF:
        return GroupRef.decode(data)
    if kind == PENDING:
        return PendingHead.decode(data)
    raise ValueError(f"a group directory entry of kind {kind}")
