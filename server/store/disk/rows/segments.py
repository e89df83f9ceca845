"""A segment (`encode_segment`, read by `SegmentView`): the groups one transaction completed, in
completion order, at most SEGMENT_GROUPS groups and SEGMENT_MEMBERS members (a larger group alone):
the groups' keys, creation times, priorities and lowest versions as group columns, and their
members' as a member block. It is not rewritten when a group moves: what moves is its `SegState`,
a row of its own of a few bytes a group (state, times sampled, the lease holding it) and one a
member (its flags). It is rewritten only to grow: the table's newest segment, while none of its
groups has moved, takes the groups completed after it (`append_groups`).
"""

from __future__ import annotations

import itertools
import math
import operator
import struct
from collections.abc import Collection, Sequence
from typing import NamedTuple

from ...schema.states import LIVE, STATES, State
from ..records import _float_or_none, _opt_float, _pack_str, _unpack_str
from .members import (
    _NONE_INT,
    _PARTIAL,
    ROWS,
    Member,
    MemberBlock,
    encode_members,
    encoded,
    join_members,
    packed,
)

SEGMENT_GROUPS = 64
SEGMENT_MEMBERS = 256
_STATE_CODE = {state: code for code, state in enumerate(STATES)}
_IS_LIVE = bytes(code < len(STATES) and STATES[code] in LIVE for code in range(256))  # a state byte -> 1 if live


class Group(NamedTuple):
    """A complete group as its segment keeps it."""

    key: str
    created: float
    members: Sequence[Member]
    priority: float = 0.0
    version: int | None = None  # the lowest of its members'; None if any is unknown
    partial: bool = False
    failed: tuple[tuple[str, str], ...] = ()  # runs its workers reported failed: (uid, reason)


_SEGMENT = struct.Struct("<BBHQd")  # ROWS, flags, groups, rseq of the first group, completed
_KEYS_ARE_UIDS = 1  # every group is one member whose uid is its key: no keys stored
_UID = operator.itemgetter(Member._fields.index("uid"))  # a member's uid as a tuple's item: no look-up by name
_HAS_FAILED = 2


class _Columns(NamedTuple):
    """Groups' columns as a segment keeps them (`_columns`): what encode_segment writes and
    append_groups writes after a segment's own."""

    sizes: list[int]  # each group's members
    members: list[Member]  # every group's, in order
    keys: tuple[str, ...]
    keys_are_uids: bool  # each group one member whose uid is its key: no keys stored
    numbers: list[bytes]  # created, priorities, versions (8 bytes a group each), then a flags byte a group
    failed: list[tuple[int, str, str]]  # (group index, uid, reason)


def _columns(groups: Sequence[Group]) -> _Columns:
    count = len(groups)
    keys, created, members, priorities, versions, partials, runs = zip(*groups, strict=True)
    sizes = list(map(len, members))
    flat = list(itertools.chain.from_iterable(members))
    # the first group's key against its uid first: where keys are not uids (a table grouped by task),
    # no tuple of uids is made
    keys_are_uids = sizes.count(1) == count > 0 and _UID(flat[0]) == keys[0] and tuple(map(_UID, flat)) == keys
    failed = [(index, uid, reason) for index, g in enumerate(runs) for uid, reason in g] if any(runs) else []
    numbers = [
        packed("created", "d", created),
        struct.pack(f"<{count}d", *priorities),
        packed("version", "q", versions),
        bytes([_PARTIAL if partial else 0 for partial in partials]) if any(partials) else bytes(count),
    ]
    return _Columns(sizes, flat, keys, keys_are_uids, numbers, failed)


def _failed_runs(failed: Sequence[tuple[int, str, str]]) -> list[bytes]:
    """A segment's runs reported failed, as it ends with them (none: nothing)."""
    if not failed:
        return []
    runs = [struct.pack("<H", index) + _pack_str(uid) + _pack_str(reason) for index, uid, reason in failed]
    return [struct.pack("<I", len(failed)), *runs]


def encode_segment(groups: Sequence[Group], rseq0: int, completed: float) -> bytes:
    """The segment of `groups`, the first at `rseq0` in the ready order, completed at `completed`."""
    count = len(groups)
    if not 0 < count < 1 << 16:
        raise ValueError(f"a segment holds 1 to 65535 groups, not {count}")
    made = _columns(groups)
    flags = (_KEYS_ARE_UIDS if made.keys_are_uids else 0) | (_HAS_FAILED if made.failed else 0)
    parts = [
        _SEGMENT.pack(ROWS, flags, count, rseq0, completed),
        struct.pack(f"<{count}I", *itertools.accumulate(made.sizes)),
        *made.numbers,
    ]
    if not made.keys_are_uids:
        parts.extend(encoded(made.keys))
    parts.append(encode_members(made.members))
    parts.extend(_failed_runs(made.failed))
    return b"".join(parts)


def append_groups(view: SegmentView, groups: Sequence[Group]) -> bytes:
    """The segment of `view`'s groups then `groups`, at its rseq and completion time: encode_segment's
    bytes of them all, made of `view`'s columns and the new groups' end to end, none of its groups
    read (a table's newest segment, untouched since it was written, grown by the groups completed
    after it: core/verbs/rows/segments.py)."""
    made, held = _columns(groups), view.groups
    count = held + len(groups)
    if count >= 1 << 16:
        raise ValueError(f"a segment holds 1 to 65535 groups, not {count}")
    keys_are_uids = made.keys_are_uids and bool(view._flags & _KEYS_ARE_UIDS)
    failed = view.runs() + [(index + held, uid, reason) for index, uid, reason in made.failed]
    flags = (_KEYS_ARE_UIDS if keys_are_uids else 0) | (_HAS_FAILED if failed else 0)
    ends = itertools.accumulate(made.sizes, initial=view.members.count)
    parts: list[bytes | memoryview] = [
        _SEGMENT.pack(ROWS, flags, count, view.rseq0, view.completed),
        struct.pack(f"<{count}I", *view.ends, *itertools.islice(ends, 1, None)),
    ]
    data, at = view.data, view._created
    for width, column in zip((8, 8, 8, 1), made.numbers, strict=True):  # each of its columns, then the new
        parts += [data[at : at + width * held], column]
        at += width * held
    if not keys_are_uids:
        parts.extend(encoded([*view.keys(0, held), *made.keys]))
    parts.append(join_members(view.members, MemberBlock(encode_members(made.members))))
    parts.extend(_failed_runs(failed))
    return b"".join(parts)


class SegmentView:
    """A view of a segment's value (a memoryview of the map, or bytes): its header and group ends read,
    the rest as asked."""

    __slots__ = (
        "_created", "_failed", "_flags", "_keys", "_priority", "_version", "completed", "data", "ends", "groups",
        "members", "rseq0",
    )  # fmt: skip

    def __init__(self, data: bytes | memoryview) -> None:
        rows, flags, count, self.rseq0, self.completed = _SEGMENT.unpack_from(data)
        if rows != ROWS:
            raise ValueError(f"a segment of rows {rows}, not {ROWS}")
        self.data, self.groups, self._flags = data, count, flags
        pos = _SEGMENT.size
        self.ends: tuple[int, ...] = struct.unpack_from(f"<{count}I", data, pos)  # each group's members' end
        self._created = pos = pos + 4 * count
        self._priority = pos = pos + 8 * count
        self._version = pos = pos + 8 * count
        pos += 9 * count  # versions, then a flags byte a group
        self._keys = -1
        if not flags & _KEYS_ARE_UIDS:
            self._keys = pos
            (size,) = struct.unpack_from("<I", data, pos + 4 * count)
            pos += 4 * (count + 1) + size
        self.members = MemberBlock(data, pos)
        self._failed = self.members.end if flags & _HAS_FAILED else -1

    def span(self, g: int) -> tuple[int, int]:
        """Group g's members: from, to (excluded)."""
        return (self.ends[g - 1] if g else 0), self.ends[g]

    def bounds(self, places: Sequence[int]) -> tuple[Sequence[int], Sequence[int]]:
        """Where the members of the groups at `places` begin, and where they end (excluded): slices of
        `ends` where the places are consecutive ascending ones (a fifo take's), no step a group."""
        ends = self.ends
        if isinstance(places, range) and places.step == 1 and places:
            first, stop = places.start, places.stop
            return (ends[first - 1 : stop - 1] if first else (0, *ends[: stop - 1])), ends[first:stop]
        return [ends[g - 1] if g else 0 for g in places], [ends[g] for g in places]

    @property
    def keys_are_uids(self) -> bool:
        """Whether every group is one member whose uid is its key (group g's member is member g)."""
        return self._keys < 0

    def keys(self, lo: int, hi: int) -> list[str]:
        """The keys of groups lo to hi (excluded)."""
        if self._keys < 0:
            return self.members.uids(lo, hi)
        data, base = self.data, self._keys + 4 * (self.groups + 1)
        ends = struct.unpack_from(f"<{hi - lo + 1}I", data, self._keys + 4 * lo)
        return [str(data[base + a : base + b], "utf-8") for a, b in itertools.pairwise(ends)]

    def created(self, lo: int, hi: int) -> tuple[float, ...]:
        return struct.unpack_from(f"<{hi - lo}d", self.data, self._created + 8 * lo)

    def priorities(self, lo: int, hi: int) -> tuple[float, ...]:
        return struct.unpack_from(f"<{hi - lo}d", self.data, self._priority + 8 * lo)

    def versions(self, lo: int, hi: int) -> list[int | None]:
        values = struct.unpack_from(f"<{hi - lo}q", self.data, self._version + 8 * lo)
        return [None if value == _NONE_INT else value for value in values]

    def partial(self, g: int) -> bool:
        return bool(self.data[self._version + 8 * self.groups + g] & _PARTIAL)

    def failed(self, g: int) -> dict[str, str]:
        """The runs group g's workers reported failed: uid -> reason."""
        return {uid: reason for index, uid, reason in self.runs() if index == g}

    def runs(self) -> list[tuple[int, str, str]]:
        """Every run its groups' workers reported failed: (group index, uid, reason), in group order."""
        found: list[tuple[int, str, str]] = []
        if self._failed < 0:
            return found
        (count,) = struct.unpack_from("<I", self.data, self._failed)
        pos = self._failed + 4
        for _ in range(count):
            (index,) = struct.unpack_from("<H", self.data, pos)
            uid, pos = _unpack_str(self.data, pos + 2)
            reason, pos = _unpack_str(self.data, pos)
            found.append((index, uid, reason))
        return found

    def group(self, g: int) -> Group:
        """Group g, every field read."""
        lo, hi = self.span(g)
        return Group(
            key=self.keys(g, g + 1)[0],
            created=self.created(g, g + 1)[0],
            members=self.members.members(lo, hi),
            priority=self.priorities(g, g + 1)[0],
            version=self.versions(g, g + 1)[0],
            partial=self.partial(g),
            failed=tuple(self.failed(g).items()),
        )


class SegState:
    """What changes of a segment's groups: each one's state, times sampled and the lease holding it
    (the 8 bytes of its id; zero: none), each member's flags, and when the last group retired.
    Read and written in place over a bytearray; `encode` is its bytes."""

    _HEAD = struct.Struct("<BBHId")  # ROWS, flags (any member flag set), groups, members, retired (NaN: not yet)
    _ANY_FLAGS = 1
    LEASE = 8  # bytes of a lease tag
    DELETED = 1  # a member's flag: deleted (a Delete), out of its group: never served, counted or a duplicate
    QUARANTINED = 2  # a failed group's member found damaged (rules/quarantine.py): counted quarantined, no payload
    __slots__ = ("_flags", "_leases", "_times", "buf", "groups", "members")

    def __init__(self, buf: bytearray) -> None:
        rows, _, groups, members, _ = self._HEAD.unpack_from(buf)
        groups, members = int(groups), int(members)
        if rows != ROWS:
            raise ValueError(f"a segment's state of rows {rows}, not {ROWS}")
        if len(buf) != self._HEAD.size + (1 + 4 + self.LEASE) * groups + members:
            raise ValueError(f"a segment's state of {len(buf)} bytes for {groups} groups and {members} members")
        self.buf, self.groups, self.members = buf, groups, members
        self._times = self._HEAD.size + groups
        self._leases = self._times + 4 * groups
        self._flags = self._leases + self.LEASE * groups

    @classmethod
    def new(cls, states: Sequence[State], members: int) -> SegState:
        """The state of a new segment whose groups are in `states`, none sampled or leased."""
        groups = len(states)
        buf = bytearray(cls._HEAD.size + (1 + 4 + cls.LEASE) * groups + members)
        cls._HEAD.pack_into(buf, 0, ROWS, 0, groups, members, math.nan)
        buf[cls._HEAD.size : cls._HEAD.size + groups] = bytes(map(_STATE_CODE.__getitem__, states))
        return cls(buf)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> SegState:
        return cls(bytearray(data))

    def encode(self) -> bytes:
        return bytes(self.buf)

    def state(self, g: int) -> State:
        return STATES[self.buf[self._HEAD.size + g]]

    def states(self, lo: int, hi: int) -> list[State]:
        base = self._HEAD.size
        return [STATES[code] for code in self.buf[base + lo : base + hi]]

    def all_in(self, states: Collection[State]) -> bool:
        """Whether every group of the segment is in one of `states` (its state bytes read at once)."""
        base = self._HEAD.size
        return set(self.buf[base : base + self.groups]) <= {_STATE_CODE[state] for state in states}

    def live_mask(self) -> bytes:
        """A byte a group: 1 where it is in a live state, else 0."""
        base = self._HEAD.size
        return bytes(self.buf[base : base + self.groups]).translate(_IS_LIVE)

    def live_shape(self) -> bytes:
        """What the segment's live members follow from: whether each group is live, then each member's
        flags. A change that leaves it alike (a take's, a give-back's) moves no live member."""
        return self.live_mask() + self.buf[self._flags :]

    def set_state(self, g: int, state: State) -> None:
        self.buf[self._HEAD.size + g] = _STATE_CODE[state]

    def set_states(self, lo: int, hi: int, state: State, tag: bytes) -> None:
        """Groups lo to hi (excluded) in `state`, under the lease `tag`: a run's bytes written at once."""
        if len(tag) != self.LEASE:
            raise ValueError(f"a lease tag is {self.LEASE} bytes, not {len(tag)}")
        base = self._HEAD.size
        self.buf[base + lo : base + hi] = bytes((_STATE_CODE[state],)) * (hi - lo)
        self.buf[self._leases + self.LEASE * lo : self._leases + self.LEASE * hi] = tag * (hi - lo)

    def under(self, lo: int, hi: int, state: State, tag: bytes) -> range | list[int]:
        """Those of groups lo to hi (excluded) in `state` under the lease `tag`: a run whose groups
        all are (a lease's run, as it was taken) read at once."""
        code, base, leases = _STATE_CODE[state], self._HEAD.size, self._leases
        buf, n = self.buf, hi - lo
        if (
            buf[base + lo : base + hi] == bytes((code,)) * n
            and buf[leases + self.LEASE * lo : leases + self.LEASE * hi] == tag * n
        ):
            return range(lo, hi)
        return [g for g in range(lo, hi) if buf[base + g] == code and self.lease(g) == tag]

    def times(self, g: int) -> int:
        times: int = struct.unpack_from("<I", self.buf, self._times + 4 * g)[0]
        return times

    def times_of(self, lo: int, hi: int) -> tuple[int, ...]:
        """The times sampled of groups lo to hi (excluded)."""
        return struct.unpack_from(f"<{hi - lo}I", self.buf, self._times + 4 * lo)

    def set_times(self, g: int, times: int) -> None:
        struct.pack_into("<I", self.buf, self._times + 4 * g, times)

    def lease(self, g: int) -> bytes:
        pos = self._leases + self.LEASE * g
        return bytes(self.buf[pos : pos + self.LEASE])

    def set_lease(self, g: int, tag: bytes) -> None:
        if len(tag) != self.LEASE:
            raise ValueError(f"a lease tag is {self.LEASE} bytes, not {len(tag)}")
        pos = self._leases + self.LEASE * g
        self.buf[pos : pos + self.LEASE] = tag

    @property
    def any_flags(self) -> bool:
        """Whether any member has a flag set: a take reads them only then."""
        return bool(self.buf[1] & self._ANY_FLAGS)

    def flags(self, i: int) -> int:
        return self.buf[self._flags + i]

    def set_flags(self, i: int, flags: int) -> None:
        self.buf[self._flags + i] = flags
        if flags:
            self.buf[1] |= self._ANY_FLAGS

    def flag(self, i: int, flag: int) -> None:
        """Member i's `flag` set, its others kept."""
        self.set_flags(i, self.flags(i) | flag)

    def quarantined(self, lo: int, hi: int) -> list[int]:
        """Members lo to hi (excluded) that are quarantined (and not deleted since)."""
        if not self.any_flags:
            return []
        flags = self.buf[self._flags + lo : self._flags + hi]
        return [lo + k for k, flag in enumerate(flags) if flag & (self.QUARANTINED | self.DELETED) == self.QUARANTINED]

    def kept(self, lo: int, hi: int) -> range | list[int]:
        """Members lo to hi (excluded) but those deleted."""
        if not self.any_flags:
            return range(lo, hi)
        flags = self.buf[self._flags + lo : self._flags + hi]
        return [lo + k for k, flag in enumerate(flags) if not flag & self.DELETED]

    @property
    def retired(self) -> float | None:
        """When the last of its groups retired; None while one is live."""
        return _float_or_none(self._HEAD.unpack_from(self.buf)[4])

    @retired.setter
    def retired(self, when: float | None) -> None:
        struct.pack_into("<d", self.buf, self._HEAD.size - 8, _opt_float(when))


def agreeing(view: SegmentView, state: SegState) -> tuple[SegmentView, SegState]:
    """A segment's rows and state; ValueError where they do not agree (damage: a take, a read and the
    check pass over or report such a segment)."""
    if (state.groups, state.members) != (view.groups, view.members.count):
        raise ValueError(f"its state is of {state.groups} groups and {state.members} members")
    return view, state
