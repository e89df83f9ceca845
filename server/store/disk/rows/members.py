"""A block of members' columns (`encode_members`, read by `MemberBlock`), which a segment holds: each
member's small fields (`Member`), each column contiguous, so that a run of members reads a column
with one struct call on a memoryview of the map; and members as rows (`encode_member_rows`), which a
pending group's fragment holds, read whole once when the group completes.

Absent numbers are stored as in records.py: an absent version as -2^63, an absent float as NaN.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple

ROWS = 1  # the rows' own layout, the first byte of a segment and of its state
_PARTIAL = 1  # a group's flag, in a segment's group flags and a pending head's
_NONE_INT = -(2**63)
_DIGEST = 16


class Member(NamedTuple):
    """One experience as its group's rows keep it: what a take, a confirm, the estimators and a
    retried push's check read, without its payload."""

    uid: str
    digest: bytes  # digests.of the stored payload
    size: int
    seq: int  # its place in the table's insertion order
    created: float
    step: int
    response_length: int
    generated: int  # response tokens under the action mask
    version: int | None = None
    reward: float | None = None
    priority: float = 0.0
    advantage: float | None = None
    shaped_reward: float | None = None
    segments: tuple[int, ...] = ()  # per-token policy versions, flattened; () without


# The fixed-width member columns after the digests, in their order in a block: (field, struct code).
_COLUMNS = (
    ("size", "Q"),
    ("seq", "Q"),
    ("created", "d"),
    ("step", "q"),
    ("version", "q"),
    ("reward", "d"),
    ("priority", "d"),
    ("advantage", "d"),
    ("shaped_reward", "d"),
    ("response_length", "I"),
    ("generated", "I"),
)
_WIDTH = {code: struct.calcsize(code) for _, code in _COLUMNS}
# Each column's place in a block, as bytes a member before it (its start: the first column's place
# plus that times the block's members), its code and its width: no table of places made a block.
_AT = {name: (sum(_WIDTH[c] for _, c in _COLUMNS[:at]), code, _WIDTH[code]) for at, (name, code) in enumerate(_COLUMNS)}
_COLUMNS_WIDTH = sum(_WIDTH[code] for _, code in _COLUMNS)  # a member's bytes in the columns
_OPTIONAL_INT = frozenset({"version"})
_OPTIONAL_FLOAT = frozenset({"reward", "advantage", "shaped_reward"})
_FIELD = {name: Member._fields.index(name) for name, _ in _COLUMNS}
_UID, _DIGEST_FIELD, _SEGMENTS = (Member._fields.index(name) for name in ("uid", "digest", "segments"))
_BLOCK = struct.Struct("<II")  # members, flags
_ONE = {code: struct.Struct(f"<{code}") for _, code in _COLUMNS}  # one member's value of a column
_ENDS = struct.Struct("<II")  # where a member's uid starts and ends
_HAS_SEGMENTS = 1
# Bytes of uids before a range copied with it, an end of the range: a few instructions of a copy
# each, where taking the first end off each end makes an int (about 80).
_BEFORE = 64


@functools.lru_cache(maxsize=512)
def _digest_form(count: int) -> struct.Struct:
    """The form of `count` digests side by side: a block's read as that many bytes objects at once."""
    return struct.Struct(f"{_DIGEST}s" * count)


def _absent(name: str) -> int | float | None:
    """The number an optional column stores for an absent value (None); None: the column has none."""
    return _NONE_INT if name in _OPTIONAL_INT else math.nan if name in _OPTIONAL_FLOAT else None


def _stored(name: str, values: Sequence[object]) -> Sequence[object]:
    """A column's values as stored: absent ones (None) as their number. A column with none absent,
    or none present, is not read value by value."""
    absent = _absent(name)
    if absent is None or None not in values:
        return values
    if values.count(None) == len(values):
        return [absent] * len(values)
    return [absent if value is None else value for value in values]


# An optional column's absent value packed (`_stored`'s number): a column all absent (a push's
# advantages, most pushes' versions) is these bytes repeated, no value packed.
_ABSENT_BYTES = {name: _ONE[code].pack(_absent(name)) for name, code in _COLUMNS if _absent(name) is not None}


def packed(name: str, code: str, values: Sequence[object]) -> bytes:
    """A column's values packed as `code`s, absent ones as `_stored` has them. One value throughout
    (a push's times, mostly its steps) is packed once and repeated: not a float zero, which -0.0
    equals with other bits."""
    count = len(values)
    first = values[0] if count else None
    if first is None:
        if name in _ABSENT_BYTES and count and values.count(None) == count:
            return _ABSENT_BYTES[name] * count
    elif first == values[-1] and (first or code != "d") and values.count(first) == count:
        return _ONE[code].pack(first) * count
    return struct.pack(f"<{count}{code}", *_stored(name, values))


def _offsets(parts: Sequence[bytes | str | tuple[int, ...]]) -> bytes:
    """u32 offsets of consecutive parts, n + 1 of them from 0."""
    return struct.pack(f"<{len(parts) + 1}I", *itertools.accumulate(map(len, parts), initial=0))


def encoded(texts: Sequence[str]) -> list[bytes]:
    """Texts stored UTF-8 one after the other, after their offsets (`_offsets` of their bytes): where
    all are ASCII (mostly), their bytes are their characters, and the texts are joined and encoded
    once, not a call each."""
    joined = "".join(texts)
    if joined.isascii():
        return [_offsets(texts), joined.encode()]
    each = list(map(str.encode, texts))
    return [_offsets(each), *each]


def encode_members(members: Sequence[Member]) -> bytes:
    """A block of members' columns: digests, the fixed-width columns, the uids (offsets, then their
    UTF-8), and where any member has them, the version segments (offsets in values, then i64s)."""
    count = len(members)
    columns = list(zip(*members, strict=True)) if members else [()] * len(Member._fields)
    digests = b"".join(columns[_DIGEST_FIELD])
    if len(digests) != _DIGEST * count:
        raise ValueError(f"a member's digest is not {_DIGEST} bytes")
    segments: Sequence[tuple[int, ...]] = columns[_SEGMENTS]
    flags = _HAS_SEGMENTS if any(segments) else 0
    parts = [_BLOCK.pack(count, flags), digests]
    for name, code in _COLUMNS:
        parts.append(packed(name, code, columns[_FIELD[name]]))
    parts.extend(encoded(columns[_UID]))
    if flags:
        parts.append(_offsets(segments))
        parts.append(struct.pack(f"<{sum(map(len, segments))}q", *itertools.chain.from_iterable(segments)))
    return b"".join(parts)


def join_members(first: MemberBlock, then: MemberBlock) -> bytes:
    """encode_members of `first`'s members, then `then`'s: the two blocks' columns end to end, no
    member read (a segment grown by the groups after it: segments.append_groups)."""
    count = first.count + then.count
    blocks = (first, then)
    has_segments = any(block._segments >= 0 for block in blocks)
    parts: list[bytes | memoryview] = [_BLOCK.pack(count, _HAS_SEGMENTS if has_segments else 0)]
    parts.extend(block.data[block._digests : block._digests + _DIGEST * block.count] for block in blocks)
    for name, _ in _COLUMNS:
        for block in blocks:
            pos, _, width = block.placed(name)
            parts.append(block.data[pos : pos + width * block.count])
    ends = [struct.unpack_from(f"<{block.count + 1}I", block.data, block._uids) for block in blocks]
    parts.append(struct.pack(f"<{count + 1}I", *ends[0], *(end + ends[0][-1] for end in ends[1][1:])))
    parts.extend(
        block.data[block._uid_bytes : block._uid_bytes + end[-1]] for block, end in zip(blocks, ends, strict=True)
    )
    if has_segments:
        offsets = [
            struct.unpack_from(f"<{block.count + 1}I", block.data, block._segments)
            if block._segments >= 0
            else (0,) * (block.count + 1)
            for block in blocks
        ]
        parts.append(struct.pack(f"<{count + 1}I", *offsets[0], *(end + offsets[0][-1] for end in offsets[1][1:])))
        parts.extend(
            block.data[block._segment_values : block._segment_values + 8 * offset[-1]]
            for block, offset in zip(blocks, offsets, strict=True)
            if block._segments >= 0
        )
    return b"".join(parts)


class MemberBlock:
    """A view of a block of members' columns (`encode_members`) at `pos` in `data`, a segment's or
    a fragment's value: each read unpacks only the columns and members it asks for."""

    __slots__ = ("_columns", "_digests", "_segment_values", "_segments", "_uid_bytes", "_uids", "count", "data", "end")

    def __init__(self, data: bytes | memoryview, pos: int = 0) -> None:
        count, flags = _BLOCK.unpack_from(data, pos)
        self.data, self.count = data, count
        pos += _BLOCK.size
        self._digests = pos
        pos += _DIGEST * count
        self._columns = pos  # the first column's place (_AT: each one's)
        pos += _COLUMNS_WIDTH * count
        self._uids = pos
        self._uid_bytes = pos + 4 * (count + 1)
        (size,) = struct.unpack_from("<I", data, pos + 4 * count)
        pos = self._uid_bytes + size
        self._segments = self._segment_values = -1
        if flags & _HAS_SEGMENTS:
            self._segments = pos
            (values,) = struct.unpack_from("<I", data, pos + 4 * count)
            self._segment_values = pos + 4 * (count + 1)
            pos = self._segment_values + 8 * values
        self.end = pos  # past the block

    def placed(self, name: str) -> tuple[int, str, int]:
        """A column's place in the data, its code and its width."""
        before, code, width = _AT[name]
        return self._columns + before * self.count, code, width

    def uids(self, lo: int, hi: int) -> list[str]:
        """The uids of members lo to hi (excluded)."""
        if hi <= lo:
            return []
        ends, joined = self._uid_range(lo, hi)
        if joined.isascii():  # (mostly) its characters are its bytes: one decode, cut as text
            text = joined.decode("ascii")
            return [text[a:b] for a, b in zip(ends, ends[1:], strict=False)]  # noqa: RUF007 (_cut)
        return [str(uid, "utf-8") for uid in self._cut(ends, joined)]

    def uid_bytes(self, lo: int, hi: int) -> list[bytes]:
        """The uids of members lo to hi (excluded), as stored (UTF-8): what a key is made of."""
        if hi <= lo:
            return []
        return self._cut(*self._uid_range(lo, hi))

    def keys(self, prefix: bytes, lo: int, hi: int) -> list[bytes]:
        """The keys of members lo to hi's payloads in a table of `prefix`: each uid as stored after it,
        cut and joined in one pass (a take's and a confirm's hundreds)."""
        if hi <= lo:
            return []
        ends, joined = self._uid_range(lo, hi)
        return [prefix + joined[a:b] for a, b in zip(ends, ends[1:], strict=False)]  # noqa: RUF007 (_cut)

    def _uid_range(self, lo: int, hi: int) -> tuple[Sequence[int], bytes]:
        """The ends of members lo to hi's uids, and bytes to cut them from at those ends (one copy
        out of the map): the block's uid bytes from its first where those before member lo are few
        beside the range (_BEFORE an end: a take's, a confirm's), so that no int is made an end by
        taking the first off; else (a member far into a large group) the range's alone, its ends so
        made."""
        ends = struct.unpack_from(f"<{hi - lo + 1}I", self.data, self._uids + 4 * lo)
        first, last, at = ends[0], ends[-1], self._uid_bytes
        if first <= _BEFORE * len(ends):
            return ends, bytes(self.data[at : at + last])
        return [end - first for end in ends], bytes(self.data[at + first : at + last])

    @staticmethod
    def _cut(ends: Sequence[int], joined: bytes) -> list[bytes]:
        """`joined` cut at `ends`, each pair of ends from zip, which reuses its tuple from one pair to
        the next where pairwise makes one a pair (about 140 instructions a uid)."""
        return [joined[a:b] for a, b in zip(ends, ends[1:], strict=False)]  # noqa: RUF007 (_cut)

    def uid(self, i: int) -> str:
        return self.uids(i, i + 1)[0]

    def digests(self, lo: int, hi: int) -> tuple[bytes, ...]:
        """The digests of members lo to hi (excluded): cut by one unpack, no slice or int made a digest."""
        return _digest_form(hi - lo).unpack_from(self.data, self._digests + _DIGEST * lo)

    def column(self, name: str, lo: int, hi: int) -> Sequence[int | float | None]:
        """A member column (a field of Member) of members lo to hi (excluded), absent values as None."""
        pos, code, width = self.placed(name)
        values = struct.unpack_from(f"<{hi - lo}{code}", self.data, pos + width * lo)
        # a column is mostly all absent or all present, which a pass in C finds: no step a member
        if name in _OPTIONAL_FLOAT:
            total = sum(values)
            if total == total:  # no NaN among them (nor infinities of both signs, looked at below)
                return values
            if all(map(math.isnan, values)):
                return [None] * len(values)
            return [None if value != value else value for value in values]  # NaN: absent
        if name in _OPTIONAL_INT:
            absent = values.count(_NONE_INT)
            if not absent:
                return values
            if absent == len(values):
                return [None] * absent
            return [None if value == _NONE_INT else value for value in values]
        return values

    def segments(self, i: int) -> tuple[int, ...]:
        """Member i's version segments, flattened; () without."""
        if self._segments < 0:
            return ()
        a, b = struct.unpack_from("<II", self.data, self._segments + 4 * i)
        return struct.unpack_from(f"<{b - a}q", self.data, self._segment_values + 8 * a)

    def segments_of(self, lo: int, hi: int) -> list[tuple[int, ...]]:
        """The version segments of members lo to hi (excluded): one list of ()s in a block without any."""
        if self._segments < 0:
            return [()] * (hi - lo)
        return [self.segments(i) for i in range(lo, hi)]

    def members(self, lo: int = 0, hi: int | None = None) -> list[Member]:
        """Members lo to hi (excluded; the end by default), every field read."""
        hi = self.count if hi is None else hi
        if hi <= lo:
            return []
        if hi == lo + 1:  # one member alone (a uniform take's group of one): a call a field, no lists
            return [self._member(lo)]
        columns: dict[str, Sequence[object]] = {name: self.column(name, lo, hi) for name, _ in _COLUMNS}
        columns["uid"], columns["digest"] = self.uids(lo, hi), self.digests(lo, hi)
        columns["segments"] = self.segments_of(lo, hi)
        return [Member._make(row) for row in zip(*(columns[name] for name in Member._fields), strict=True)]

    def _member(self, i: int) -> Member:
        row: list[object] = [None] * len(Member._fields)
        data = self.data
        for name, _ in _COLUMNS:
            pos, code, width = self.placed(name)
            value = _ONE[code].unpack_from(data, pos + width * i)[0]
            absent = value != value if name in _OPTIONAL_FLOAT else name in _OPTIONAL_INT and value == _NONE_INT
            row[_FIELD[name]] = None if absent else value  # NaN, or the absent int: None, as `column` has it
        a, b = _ENDS.unpack_from(data, self._uids + 4 * i)
        row[_UID] = str(data[self._uid_bytes + a : self._uid_bytes + b], "utf-8")
        row[_DIGEST_FIELD] = bytes(data[self._digests + _DIGEST * i : self._digests + _DIGEST * (i + 1)])
        row[_SEGMENTS] = self.segments(i)
        return Member._make(row)


# A member as one row (a pending group's fragment holds its members so, one after the other: read
# whole, and written a few at a time, where a block's columns cost a call a column): digest, the
# fixed-width fields (absent numbers as in a block), its uid's and segments' lengths; then its uid
# and its segments.
_ROW = struct.Struct("<16sQQdqIIqddddHI")
_COUNT = struct.Struct("<I")


def encode_member_rows(members: Sequence[Member], onto: bytes = b"") -> bytes:
    """Members as rows (a fragment's value, or a pending head's latest members): a count, then each
    member's row, uid and segments (`member_rows`); after those `onto` holds (rows of this form)
    where it is given."""
    return rows_onto(onto, b"".join(member_rows(members)), len(members))


def rows_onto(onto: bytes | memoryview, rows: bytes, count: int) -> bytes:
    """`count` rows of `member_rows` (joined: `rows`) after those `onto` holds (`encode_member_rows`'
    form; empty: none), with the count of them all before."""
    total = _COUNT.pack(count + (_COUNT.unpack_from(onto)[0] if onto else 0))
    return b"".join([total, onto[_COUNT.size :], rows])


def counted_rows(rows: Iterable[bytes], counts: Iterable[int]) -> list[bytes]:
    """`encode_member_rows`' form of each of these: `count` rows of `member_rows`, joined (`rows`),
    their count before them, made in C over them all, no step one."""
    return list(map(operator.add, map(_COUNT.pack, counts), rows))


def member_rows(members: Sequence[Member]) -> list[bytes]:
    """Each member's row, uid and segments as `encode_member_rows` writes them after its count: a push
    to hundreds of pending groups encodes its members' rows in one call, each group's head then takes
    its own (PendingHead.added). Each member's fields are unpacked as a tuple, not read by name."""
    pack, nan, found = _ROW.pack, math.nan, []
    for member in members:
        text, digest, size, seq, created, step, length, generated, version, reward, priority, adv, shaped, segs = member
        uid = text.encode()
        row = pack(
            digest, size, seq, created, step, length, generated, _NONE_INT if version is None else version,
            nan if reward is None else reward, priority, nan if adv is None else adv,
            nan if shaped is None else shaped, len(uid), len(segs),
        ) + uid  # fmt: skip
        found.append(row + struct.pack(f"<{len(segs)}q", *segs) if segs else row)
    return found


def decode_member_rows(data: bytes | memoryview) -> list[Member]:
    """The members of `encode_member_rows`, in their order (made as tuples: every field is given)."""
    (count,) = _COUNT.unpack_from(data)
    pos, found, unpack, size_of = _COUNT.size, [], _ROW.unpack_from, _ROW.size
    for _ in range(count):
        digest, size, seq, created, step, length, generated, version, reward, priority, adv, shaped, n, s = unpack(
            data, pos
        )
        pos += size_of
        uid = str(data[pos : pos + n], "utf-8")
        pos += n
        segments: tuple[int, ...] = ()
        if s:
            segments = struct.unpack_from(f"<{s}q", data, pos)
            pos += 8 * s
        found.append(
            _MEMBER((
                uid, bytes(digest), size, seq, created, step, length, generated,
                None if version == _NONE_INT else version, None if reward != reward else reward, priority,
                None if adv != adv else adv, None if shaped != shaped else shaped, segments,
            ))
        )  # fmt: skip
    if pos != len(data):
        raise ValueError(f"member rows of {len(data)} bytes, {pos} read")
    return found


_MEMBER = functools.partial(tuple.__new__, Member)  # Member._make less its count: every field given


_CREATED_FIELD = 3  # of a row's fields as _ROW reads them: digest, size, seq, created


def first_created(data: bytes | memoryview) -> float | None:
    """When the first member of `encode_member_rows` was pushed (None: it holds none), its row alone read."""
    (count,) = _COUNT.unpack_from(data)
    if not count:
        return None
    created: float = _ROW.unpack_from(data, _COUNT.size)[_CREATED_FIELD]
    return created
