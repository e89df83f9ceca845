"""The group directory's entries: a complete group's place in a segment (`GroupRef`) or, while the
group still takes members, its `PendingHead`, which keeps its latest members' rows itself (`inline`)
until they pass SPILL_BYTES; then they wait as member rows of their own (a fragment:
members.encode_member_rows) until the group completes.
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import xxhash

from ...schema.errors import DAMAGE, DamagedGroup
from ...schema.states import COMPUTING, State
from ...schema.states import PENDING as PENDING_STATE
from ..records import _pack_str, _unpack_str
from .members import (
    _NONE_INT,
    Member,
    counted_rows,
    decode_member_rows,
    encode_member_rows,
    first_created,
    rows_onto,
)


def fragment_key(prefix: bytes, gkey: str, number: int) -> bytes:
    """A pending group's fragment `number` in the fragments database: its key ends in 5 bytes of its
    own (a zero, then the number), so no two groups' fragments share a key."""
    return prefix + gkey.encode() + b"\x00" + number.to_bytes(4, "big")


def uid_hash(uid: str) -> int:
    """What a pending group's head keeps of a member's uid: a retried push is screened against it
    without the group's fragments read."""
    return xxhash.xxh3_64_intdigest(uid.encode())


def uid_hashes(uids: Iterable[str]) -> list[bytes]:
    """`uid_hash` of each uid, as a head keeps them (PendingHead.added), made in C, no step a uid."""
    return list(map(_HASH.pack, map(xxhash.xxh3_64_intdigest, map(str.encode, uids))))


# A pending head's members kept in it (its `inline` rows) are written as its next fragment once they
# pass this: with its hashes, the head of a group of up to about 50 runs stays a value that fits in
# its B-tree page (LMDB moves a value over about 2 KB of a 4 KB page to pages of its own), and a push
# to a large group rewrites a few of its rows, not all of them. A group of 8 runs whose uids take up
# to 80 bytes (and no versions per token: 8 bytes a segment) keeps every member in its head.
SPILL_BYTES = 1536

_HASH = struct.Struct("<Q")  # a member uid's hash in a head
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


def group_refs(seg: int, count: int, first: int = 0) -> list[bytes]:
    """The directory entries of segment `seg`'s `count` groups from group `first`, encoded: each its
    `GroupRef`'s."""
    return list(map(_REF.pack, itertools.repeat(REF, count), range(first, first + count), itertools.repeat(seg, count)))


@dataclass(slots=True, kw_only=True)
class PendingHead:
    """A group that still takes members, or waits for its advantages: when it was opened, a hash of
    each member's uid in push order (`uid_hash`), how many fragments hold its first members, the rows
    of the members after those (`inline`: encode_member_rows'), and the runs its workers reported
    failed. A complete group waiting for its advantages (computing) keeps its place in the compute
    queue (`queued`: its key there), whether it completed partial, and its priority and version as
    they were when it completed (`placed`: a member deleted meanwhile changes neither, as a records
    table's group record keeps them; None in a head written before format 11), until its advantages
    are stored and it goes into a segment with them."""

    created: float
    hashes: list[int] = field(default_factory=list)
    fragments: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    partial: bool = False
    queued: int | None = None
    placed: tuple[float, int | None] | None = None  # a computing group's priority and version
    inline: bytes = b""

    _HEAD = struct.Struct("<BBIId")  # PENDING, flags, members, fragments, created
    _PARTIAL, _FAILED, _QUEUED, _INLINE, _PLACED = 1, 2, 4, 8, 16
    _PLACE = struct.Struct("<dq")  # priority, version (_NONE_INT: unknown)

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
            | (self._INLINE if self.inline else 0)
            | (0 if self.placed is None else self._PLACED)
        )
        parts = [self._HEAD.pack(PENDING, flags, count, self.fragments, self.created)]
        parts.append(struct.pack(f"<{count}Q", *self.hashes))
        if self.failed:
            texts = [text for uid, reason in self.failed.items() for text in (uid, reason)]
            parts.append(struct.pack("<I", len(texts)))
            parts.extend(map(_pack_str, texts))
        if self.queued is not None:
            parts.append(struct.pack("<Q", self.queued))
        if self.placed is not None:
            priority, version = self.placed
            parts.append(self._PLACE.pack(priority, _NONE_INT if version is None else version))
        parts.append(self.inline)
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
        queued = None
        if flags & cls._QUEUED:
            (queued,) = struct.unpack_from("<Q", data, pos)
            pos += 8
        placed = None
        if flags & cls._PLACED:
            priority, version = cls._PLACE.unpack_from(data, pos)
            placed, pos = (priority, None if version == _NONE_INT else version), pos + cls._PLACE.size
        inline = bytes(data[pos:]) if flags & cls._INLINE else b""
        if not inline and pos != len(data):
            raise ValueError(f"a pending head of {len(data)} bytes, {pos} read")
        return cls(
            created=created, hashes=hashes, fragments=fragments, failed=failed, partial=bool(flags & cls._PARTIAL),
            queued=queued, placed=placed, inline=inline,
        )  # fmt: skip

    @classmethod
    def plain(cls, data: bytes) -> tuple[int, float] | None:
        """Of a head with members, none of its runs reported failed and no place in the compute queue
        (what a push meets most), its members' count and when it opened, the rest of it not decoded
        (`holds` screens its hashes, `added` adds to it as it is); None for any other head, and for
        one cut short of its hashes (decoding it names the damage)."""
        if len(data) < cls._HEAD.size:
            return None
        _, flags, count, _, created = cls._HEAD.unpack_from(data)
        if flags & ~cls._INLINE or not count or len(data) < cls._HEAD.size + 8 * count:
            return None
        return count, created

    @classmethod
    def holds(cls, data: bytes, count: int, uids: Iterable[str]) -> bool:
        """Whether one of these uids' hashes is among the `count` of a `plain` head, found in its bytes
        (at a hash's place: a match across two hashes is none), its hashes not unpacked: a retried
        push is screened so against each of the hundreds of heads a push reaches."""
        start, end = cls._HEAD.size, cls._HEAD.size + 8 * count
        for uid in uids:
            wanted = _HASH.pack(uid_hash(uid))
            at = data.find(wanted, start, end)
            while at >= 0:
                if (at - start) % 8 == 0:
                    return True
                at = data.find(wanted, at + 1, end)
        return False

    @classmethod
    def added(cls, data: bytes, rows: bytes, hashes: bytes) -> bytes | None:
        """A `plain` head's encoding with members added (their rows: members.member_rows', joined; their
        uids' hashes: `uid_hashes`', joined), the bytes decode(data), add(members) and encode() make,
        without the head decoded: a push adds a run to hundreds of them. None where their rows would
        spill from it (`add` writes its fragment then)."""
        _, flags, count, fragments, created = cls._HEAD.unpack_from(data)
        end, adding = cls._HEAD.size + 8 * count, len(hashes) // 8
        inline = rows_onto(data[end:] if flags & cls._INLINE else b"", rows, adding)
        if len(inline) > SPILL_BYTES:
            return None
        head = cls._HEAD.pack(PENDING, cls._INLINE, count + adding, fragments, created)
        return b"".join([head, data[cls._HEAD.size : end], hashes, inline])

    @classmethod
    def _every_staying(
        cls, raws: Sequence[bytes], header: tuple[tuple[int, ...], ...], room: bool, uids: Sequence[str]
    ) -> list[bytes] | None:
        """`staying`'s hashes where every one of these heads stays (a GRPO worker's push reaches such
        heads alone), found with no step a head at all; None where one may not. `header`: their kinds,
        flags and counts; `room`: whether each has room for its new members."""
        kinds, flags, counts = header
        if kinds.count(PENDING) != len(raws) or flags.count(cls._INLINE) != len(raws) or 0 in counts:
            return None
        if not room or len(uids) != len(raws):
            return None
        ends = list(map(cls._HEAD.size.__add__, map((8).__mul__, counts)))
        if not all(map(operator.le, ends, map(len, raws))):
            return None
        hashes = uid_hashes(uids)
        return hashes if max(map(bytes.find, raws, hashes, itertools.repeat(cls._HEAD.size), ends)) < 0 else None

    @classmethod
    def opened(
        cls, created: float, rows: Sequence[bytes], hashes: Sequence[bytes], counts: Sequence[int]
    ) -> list[bytes] | None:
        """The heads of groups one request opens at `created`, none of their runs reported failed, each
        with its first `counts` members' rows and uids' hashes (each group's joined: `member_rows`',
        `uid_hashes`'): the bytes a new head's `add` and `encode` make, made in C over them all, no
        step a head; None where one's rows would spill from it (`add` writes its fragment then)."""
        inline = counted_rows(rows, counts)
        if max(map(len, inline), default=0) > SPILL_BYTES:
            return None
        kind, flags, none, when = map(itertools.repeat, (PENDING, cls._INLINE, 0, created))
        first = map(cls._HEAD.pack, kind, flags, counts, none, when)  # no fragment
        return list(map(b"".join, zip(first, hashes, inline, strict=True)))

    @classmethod
    def staying(
        cls, raws: Sequence[bytes | None], adding: Sequence[int], size: int, uids: Sequence[str]
    ) -> tuple[list[int], list[bytes]]:
        """Of these directory entries (None: a group not there), each taking `adding` new members (their
        `uids`, each entry's in turn), those that are `plain` heads keeping rows themselves and staying
        pending with them (fewer than `size` members in all), none of their new uids among their own
        (nor, rarely, found across two of their hashes: `holds` tells those apart): their indexes, and
        their new members' uids' hashes (`uid_hashes`'), each head's joined. A push's runs join such
        heads as they are (`added`); any other entry is read as `plain` and `holds` read it. Read in C
        over them all, but for a step a head to pick them out: a GRPO worker's push reaches hundreds."""
        present = cast("Sequence[bytes]", raws)  # where None is not among them
        if size and None not in raws and min(map(len, present), default=0) >= cls._HEAD.size:
            kinds, flags, counts, _, _ = zip(*map(cls._HEAD.unpack_from, present), strict=True)
            after = list(map(operator.add, counts, adding))
            if min(after) >= size:  # none stays: the push completes (or overfills) every group
                return [], []
            every = cls._every_staying(present, (kinds, flags, counts), max(after) < size, uids)
            if every is not None:
                return list(range(len(raws))), every
        at: list[int] = []
        heads: list[bytes] = []
        for number, raw in enumerate(raws if size else ()):
            if raw is not None and len(raw) >= cls._HEAD.size:
                at.append(number)
                heads.append(raw)
        if not heads:
            return [], []
        kinds, flags, counts, _, _ = zip(*map(cls._HEAD.unpack_from, heads), strict=True)
        ends = list(map(cls._HEAD.size.__add__, map((8).__mul__, counts)))
        reached = map(operator.add, counts, [adding[number] for number in at])
        fit = zip(
            map(PENDING.__eq__, kinds), map(cls._INLINE.__eq__, flags), counts, map(size.__gt__, reached),
            map(operator.le, ends, map(len, heads)), strict=True,
        )  # fmt: skip
        chosen = [(number, raw, end) for number, raw, end, ok in zip(at, heads, ends, map(all, fit), strict=True) if ok]
        if len(uids) == len(raws):  # a run a group: each head's one hash sought in C
            mine = uid_hashes([uids[number] for number, _, _ in chosen])
            sought = map(
                bytes.find,
                [raw for _, raw, _ in chosen],
                mine,
                itertools.repeat(cls._HEAD.size),
                [e for *_, e in chosen],
            )
            kept = [
                (number, hashed)
                for (number, _, _), hashed, found in zip(chosen, mine, sought, strict=True)
                if found < 0
            ]
        else:
            starts = list(itertools.accumulate(adding, initial=0))
            kept = []
            for number, raw, end in chosen:
                mine = uid_hashes(uids[starts[number] : starts[number + 1]])
                if all(raw.find(hashed, cls._HEAD.size, end) < 0 for hashed in mine):
                    kept.append((number, b"".join(mine)))
        return [number for number, _ in kept], [hashed for _, hashed in kept]

    @classmethod
    def outline(cls, data: bytes) -> tuple[float, float] | None:
        """Of a `plain` head that keeps every member itself (no fragment): when it opened and when its
        first member was pushed (its rows in the pending index and the index of the oldest), the rest
        of it not decoded, as a push completes hundreds of them; None for any other head, and for one
        whose first row does not read (decoding it names the damage)."""
        if len(data) < cls._HEAD.size:
            return None
        kind, flags, count, fragments, created = cls._HEAD.unpack_from(data)
        end = cls._HEAD.size + 8 * count
        if kind != PENDING or flags != cls._INLINE or fragments or not count or len(data) < end:
            return None
        try:
            first = first_created(memoryview(data)[end:])
        except DAMAGE:
            return None
        return None if first is None else (created, first)

    @classmethod
    def plain_rows(cls, data: bytes, count: int) -> list[Member] | None:
        """The rows of a `plain` head of `count` members that keeps them all itself (no fragment), read
        without the head decoded: a push completes hundreds of them. None for one with fragments, or
        whose rows do not read as its `count` members (read then as any other head is:
        TableState.pending_members names the damage)."""
        _, flags, _, fragments, _ = cls._HEAD.unpack_from(data)
        if fragments or flags != cls._INLINE:
            return None
        try:
            found = decode_member_rows(memoryview(data)[cls._HEAD.size + 8 * count :])
        except DAMAGE:
            return None
        return found if len(found) == count else None

    def inline_rows(self) -> list[Member]:
        """The members its head keeps (`inline`), after those of its fragments in push order."""
        return decode_member_rows(self.inline) if self.inline else []

    def add(self, members: Sequence[Member]) -> bytes | None:
        """New members (some) join the head: their hashes, and their rows inline; the rows inline
        then (its next fragment's value) where they pass SPILL_BYTES, which the caller writes."""
        self.hashes.extend([uid_hash(member.uid) for member in members])
        self.inline = encode_member_rows(members, onto=self.inline)
        if len(self.inline) <= SPILL_BYTES:
            return None
        spilled, self.inline = self.inline, b""
        self.fragments += 1
        return spilled


def group_entry(gkey: str, data: bytes | memoryview) -> GroupRef | PendingHead:
    """Group `gkey`'s directory entry, as `directory_entry` reads it; DamagedGroup where it does not
    decode, so that a request that changes or ends the group is refused by name (and told the way
    out of a pending or computing group's: its first byte says so)."""
    try:
        return directory_entry(data)
    except DAMAGE as exc:
        pending = bytes(data[:1]) == bytes([PENDING])
        raise DamagedGroup(gkey, f"{type(exc).__name__}: {exc}", pending=pending) from None


def directory_entry(data: bytes | memoryview) -> GroupRef | PendingHead:
    """A group directory's value: a complete group's place, or a pending group's head."""
    kind = data[0]
    if kind == REF:
        return GroupRef.decode(data)
    if kind == PENDING:
        return PendingHead.decode(data)
    raise ValueError(f"a group directory entry of kind {kind}")
