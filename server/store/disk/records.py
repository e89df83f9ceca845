"""The records the store keeps, as types with a compact binary encoding.

An item record describes one stored experience, a group record one group of a table,
a lease one batch handed out under a lease. Each is encoded as a fixed struct followed
by its strings (u16 length + UTF-8) and lists; decoding is a struct unpack and a few
slices, an order of magnitude cheaper than JSON, and the bytes are about a third.
`from_v1` reads the JSON records of the first data directory format. A retired experience
whose payload went keeps a compact tombstone instead (`ItemRecord.tombstone`): its state,
digest, retired time and group, 27 bytes and the group id's.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..schema.states import LEASED, STATES, State

# Not a stored state: how a group deleted by request leaves the table, the state of the Retired event
# the extensions hear (on_retired).
DELETED = "deleted"
_STATE_CODE = {state: code for code, state in enumerate(STATES)}

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_NONE_INT = -(2**63)  # an absent version; versions are validated to lie above it


def _pack_str(value: str) -> bytes:
    raw = value.encode()
    return _U16.pack(len(raw)) + raw


def _unpack_str(data: bytes | memoryview, pos: int) -> tuple[str, int]:
    (size,) = _U16.unpack_from(data, pos)
    end = _within(data, pos + 2 + size)
    return str(data[pos + 2 : end], "utf-8"), end  # from a view too, without a copy of its bytes


def _within(data: bytes | memoryview, end: int) -> int:
    """`end`, where the record holds that many bytes: a slice past its end would read a string a
    damaged page cut short as a shorter one."""
    if end > len(data):
        raise ValueError(f"a string runs to byte {end} of a record of {len(data)} bytes: it is cut short")
    return end


def _pack_strs(values: list[str]) -> bytes:
    parts = [_U32.pack(len(values))]
    for value in values:
        raw = value.encode()
        parts.append(_U16.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


def _unpack_strs(data: bytes | memoryview, pos: int) -> tuple[list[str], int]:
    (count,) = _U32.unpack_from(data, pos)
    pos += 4
    values = []
    for _ in range(count):  # _unpack_str, inline: a group's members are read at every take and confirm
        (size,) = _U16.unpack_from(data, pos)
        end = pos + 2 + size
        values.append(str(data[pos + 2 : end], "utf-8"))
        pos = end
    return values, _within(data, pos)  # a string cut short can only be the last: the next length read fails


def _pack_segments(segments: tuple[int, ...]) -> bytes:
    return _U32.pack(len(segments)) + struct.pack(f"<{len(segments)}q", *segments)


def _unpack_segments(data: bytes | memoryview, pos: int) -> tuple[int, ...]:
    (count,) = _U32.unpack_from(data, pos)
    return struct.unpack_from(f"<{count}q", data, pos + 4)


def _opt_float(value: float | None) -> float:
    return math.nan if value is None else value


def _float_or_none(value: float) -> float | None:
    return None if math.isnan(value) else value


@dataclass(slots=True, kw_only=True)
class ItemRecord:
    """One stored experience: its state, group, place in the insertion order, content
    digest and size, how often it was sampled, and what the estimators read."""

    state: State
    group: str
    seq: int
    digest: bytes  # digests.of the stored payload (a tombstone left by format 3: its SHA-256 digest)
    size: int
    created: float
    tid: str
    rid: str
    step: int
    response_length: int
    generated: int  # response tokens under the action mask
    version: int | None = None
    reward: float | None = None
    priority: float = 0.0
    times_sampled: int = 0
    advantage: float | None = None  # the stored value when every generated token carries it
    retired: float | None = None  # when it became a tombstone
    shaped_reward: float | None = None  # the reward after shaping, where a batch stage needs it
    segments: tuple[int, ...] = ()  # per-token policy versions, flattened (version, offset, ...); () without

    _HEAD = struct.Struct("<BQ16sQdqIIqddQddd")

    def encode(self) -> bytes:
        head = self._HEAD.pack(
            _STATE_CODE[self.state],
            self.seq,
            self.digest,
            self.size,
            self.created,
            self.step,
            self.response_length,
            self.generated,
            _NONE_INT if self.version is None else self.version,
            _opt_float(self.reward),
            self.priority,
            self.times_sampled,
            _opt_float(self.advantage),
            _opt_float(self.retired),
            _opt_float(self.shaped_reward),
        )
        group, tid, rid = self.group.encode(), self.tid.encode(), self.rid.encode()
        tail = _pack_segments(self.segments) if self.segments else b""  # a record without them ends at rid
        return b"".join((head, _U16.pack(len(group)), group, _U16.pack(len(tid)), tid, _U16.pack(len(rid)), rid, tail))

    _PLACE = struct.Struct("<BQ16sQ")  # the head up to the size: state, seq, digest, size
    _RETIRED = struct.Struct("<d")
    _RETIRED_AT = struct.calcsize("<BQ16sQdqIIqddQd")  # where `retired` lies in the head

    @classmethod
    def place(cls, data: bytes | memoryview) -> tuple[State, int, int]:
        """The state, seq and size of an encoded record, the rest left undecoded: what
        retiring it needs."""
        state, seq, _, size = cls._PLACE.unpack_from(data)
        return STATES[state], seq, size

    @classmethod
    def group_of(cls, data: bytes | memoryview) -> str:
        """The group of an encoded record, the rest left undecoded: what finding the members of a
        group whose record is lost reads of every record."""
        group, _ = _unpack_str(data, cls._TOMB.size if cls.compact(data) else cls._HEAD.size)
        return group

    @classmethod
    def digest_of(cls, data: bytes | memoryview) -> tuple[bytes, int]:
        """The digest and size of an encoded full record, the rest left undecoded: what the
        scrub compares a payload with."""
        _, _, digest, size = cls._PLACE.unpack_from(data)
        return digest, size

    @classmethod
    def retired_as(cls, data: bytes | memoryview, state: State, when: float) -> bytes:
        """An encoded record as the tombstone it becomes, retired in `state` at `when`: the
        same bytes as decoding, changing and encoding it, without building the record."""
        out = bytearray(data)
        out[0] = _STATE_CODE[state]
        cls._RETIRED.pack_into(out, cls._RETIRED_AT, when)
        return bytes(out)

    # A tombstone whose payload is gone keeps only what a retried push and pruning read: the
    # state (its code with the top bit set, which no full record's first byte has), the
    # digest, when it was retired and its group. The rest decodes as zero.
    _TOMB = struct.Struct("<B16sd")
    _COMPACT = 0x80

    def tombstone(self) -> bytes:
        """This retired record in the compact form of a tombstone."""
        group = self.group.encode()
        head = self._TOMB.pack(self._COMPACT | _STATE_CODE[self.state], self.digest, _opt_float(self.retired))
        return head + _U16.pack(len(group)) + group

    @classmethod
    def tombstone_of(cls, data: bytes | memoryview, state: State, when: float) -> bytes:
        """An encoded live record as the compact tombstone it becomes, retired in `state` at
        `when`, without building the record; ValueError where it is cut short of its group."""
        (size,) = _U16.unpack_from(data, cls._HEAD.size)
        group = bytes(data[cls._HEAD.size : _within(data, cls._HEAD.size + 2 + size)])
        return cls._TOMB.pack(cls._COMPACT | _STATE_CODE[state], bytes(data[9:25]), when) + group

    @classmethod
    def compact(cls, data: bytes | memoryview) -> bool:
        """Whether an encoded record is a compact tombstone."""
        return bool(data[0] & cls._COMPACT)

    @classmethod
    def _decode_tombstone(cls, data: bytes | memoryview) -> ItemRecord:
        code, digest, retired = cls._TOMB.unpack_from(data)
        group, _ = _unpack_str(data, cls._TOMB.size)
        when = _float_or_none(retired)
        return cls(
            state=STATES[code & ~cls._COMPACT],
            group=group,
            seq=0,
            digest=digest,
            size=0,
            created=when or 0.0,
            tid="",
            rid="",
            step=0,
            response_length=0,
            generated=0,
            retired=when,
        )

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ItemRecord:
        if data[0] & cls._COMPACT:
            return cls._decode_tombstone(data)
        (
            state,
            seq,
            digest,
            size,
            created,
            step,
            length,
            generated,
            version,
            reward,
            priority,
            times,
            adv,
            retired,
            shaped,
        ) = cls._HEAD.unpack_from(data)
        group, pos = _unpack_str(data, cls._HEAD.size)
        tid, pos = _unpack_str(data, pos)
        rid, pos = _unpack_str(data, pos)
        # NaN stands for an absent float (x != x: NaN alone), tested inline: a take decodes a record an experience
        return cls(
            state=STATES[state],
            group=group,
            seq=seq,
            digest=digest,
            size=size,
            created=created,
            tid=tid,
            rid=rid,
            step=step,
            response_length=length,
            generated=generated,
            version=None if version == _NONE_INT else version,
            reward=None if reward != reward else reward,
            priority=priority,
            times_sampled=times,
            advantage=None if adv != adv else adv,
            retired=None if retired != retired else retired,
            shaped_reward=None if shaped != shaped else shaped,
            segments=_unpack_segments(data, pos) if pos < len(data) else (),
        )

    @classmethod
    def from_v1(cls, rec: dict[str, Any]) -> ItemRecord:
        return cls(
            state=State(rec["s"]),
            group=rec["g"],
            seq=rec["q"],
            digest=bytes.fromhex(rec["d"])[:16],
            size=rec["n"],
            created=rec["c"],
            tid=rec["tid"],
            rid=rec["rid"],
            step=rec["k"],
            response_length=rec["L"],
            generated=rec["G"],
            version=rec["v"],
            reward=rec["r"],
            priority=rec["p"],
            times_sampled=rec["t"],
            advantage=rec.get("a"),
            retired=rec.get("rt"),
        )


@dataclass(slots=True, kw_only=True)
class GroupRecord:
    """One group of a table: its state, members in push order, and once complete, its
    place in the ready order (`rseq`), priority, lowest policy version and lease."""

    state: State
    created: float
    members: list[str] = field(default_factory=list)
    partial: bool = False
    rseq: int | None = None
    priority: float = 0.0
    version: int | None = None  # the lowest of its members; None if any is unknown
    lease: str = ""
    # Runs its workers reported failed (FailRuns): uid -> reason. A record without them ends
    # after its members (what a release before short groups wrote, and still writes).
    failed: dict[str, str] = field(default_factory=dict)

    _HEAD = struct.Struct("<BBdqdq")

    def encode(self) -> bytes:
        head = self._HEAD.pack(
            _STATE_CODE[self.state],
            self.partial,
            self.created,
            -1 if self.rseq is None else self.rseq,
            self.priority,
            _NONE_INT if self.version is None else self.version,
        )
        body = head + _pack_str(self.lease) + _pack_strs(self.members)
        if not self.failed:
            return body
        return body + _pack_strs([text for uid, reason in self.failed.items() for text in (uid, reason)])

    @property
    def under_lease(self) -> bool:
        """Whether a lease holds it (a batch held for a stream, or leased): a replayed group cooling
        down is leased to no one."""
        return self.state == LEASED and bool(self.lease)

    @property
    def ready_seq(self) -> int:
        """Its place in the ready order, which a group has from the moment it is complete."""
        if self.rseq is None:
            raise ValueError(f"a {self.state} group that was never complete has no place in the ready order")
        return self.rseq

    @classmethod
    def decode(cls, data: bytes | memoryview) -> GroupRecord:
        state, partial, created, rseq, priority, version = cls._HEAD.unpack_from(data)
        lease, pos = _unpack_str(data, cls._HEAD.size)
        members, pos = _unpack_strs(data, pos)
        failed = {}
        if pos < len(data):
            texts, _ = _unpack_strs(data, pos)
            failed = dict(zip(texts[::2], texts[1::2], strict=True))
        return cls(
            state=STATES[state],
            created=created,
            members=members,
            partial=bool(partial),
            rseq=None if rseq < 0 else rseq,
            priority=priority,
            version=None if version == _NONE_INT else version,
            lease=lease,
            failed=failed,
        )

    @classmethod
    def placed(cls, data: bytes | memoryview) -> tuple[int, float, int | None]:
        """A complete group's place in the ready order, priority and lowest version, read from the
        head of its record alone: an index build reads a million of them."""
        _, _, _, rseq, priority, version = cls._HEAD.unpack_from(data)
        if rseq < 0:
            raise ValueError("a group that was never complete has no place in the ready order")
        return rseq, priority, None if version == _NONE_INT else version

    @classmethod
    def from_v1(cls, rec: dict[str, Any]) -> GroupRecord:
        return cls(
            state=State(rec["s"]),
            created=rec["c"],
            members=list(rec["m"]),
            partial=bool(rec.get("x", False)),
            rseq=rec.get("q"),
            priority=rec.get("p", 0.0),
            version=rec.get("v"),
            lease=rec.get("l", ""),
        )


class Counted(NamedTuple):
    """What a take counted as sampled: its experiences, their bytes, their tokens masked as too stale."""

    experiences: int
    nbytes: int
    tokens_masked: int


_LEASE = struct.Struct("<Id")  # table id, expires (NaN: held)
_COUNTED = struct.Struct("<QQQ")
_DEFERRED = b"\x01"  # after a held lease's count: it counts once the batch is confirmed


def pack_lease(
    table_id: int, expires: float | None, owner: str, held: bytes, counted: Counted | None, deferred: bool
) -> bytes:
    """A lease's value: its table, expiry and owner, then `held` (what it holds, as its kind of lease
    writes it), then what its take counted, if it says, and a byte where that count waits for the
    batch's confirmation (`deferred`)."""
    value = _LEASE.pack(table_id, _opt_float(expires)) + _pack_str(owner) + held
    if counted is None:
        return value
    return value + _COUNTED.pack(*counted) + (_DEFERRED if deferred else b"")


def unpack_lease(data: bytes | memoryview) -> tuple[int, float | None, str, int]:
    """A lease value's table, expiry and owner, and where what it holds begins."""
    table_id, expires = _LEASE.unpack_from(data)
    owner, pos = _unpack_str(data, _LEASE.size)
    return table_id, _float_or_none(expires), owner, pos


def counted_at(data: bytes | memoryview, pos: int) -> tuple[Counted | None, bool]:
    """What a lease's take counted, where `pos`, the end of what it holds, is not the value's end;
    and whether that count waits for the batch's confirmation (a byte after it)."""
    if pos >= len(data):
        return None, False
    return Counted(*_COUNTED.unpack_from(data, pos)), len(data) > pos + _COUNTED.size


@dataclass(slots=True, kw_only=True)
class Lease:
    """Groups of one table handed out together. `expires` None: held for a Sample stream
    until the client confirms the batch. `owner` binds it to the token that took it."""

    table_id: int
    groups: list[str]
    expires: float | None
    owner: str = ""
    # A held batch's: what its take found to count as sampled (experiences, bytes, tokens masked),
    # counted once its client has it (`deferred`), whatever was deleted of it meanwhile. Not
    # deferred: a hold of a release that counted it at the take, which a give-back unsent takes back.
    # None: not held, or held by a release that did not write it (its give-back counts the members
    # it finds).
    counted: Counted | None = None
    deferred: bool = False

    def encode(self) -> bytes:
        groups = _pack_strs(self.groups)
        return pack_lease(self.table_id, self.expires, self.owner, groups, self.counted, self.deferred)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Lease:
        table_id, expires, owner, pos = unpack_lease(data)
        groups, pos = _unpack_strs(data, pos)
        counted, deferred = counted_at(data, pos)
        return cls(table_id=table_id, groups=groups, expires=expires, owner=owner, counted=counted, deferred=deferred)

    @classmethod
    def from_v1(cls, rec: dict[str, Any]) -> Lease:
        return cls(table_id=rec["t"], groups=list(rec["g"]), expires=rec["e"], owner=rec.get("o", ""))
