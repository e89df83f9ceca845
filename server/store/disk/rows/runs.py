"""What the ready orders keep (`RunRow`: consecutive groups of one segment) and a lease of runs
(`RowLease`)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from ..records import Counted, Lease, counted_at, pack_lease, unpack_lease

_RUN = struct.Struct("<QHH")  # seg, first, length
# What a lease of runs holds begins with this count, which a lease of groups (records.Lease, whose
# held part begins with its groups' count) never reaches: one reading tells the two apart.
_RUNS_MARK = 0xFFFFFFFF


class RunRow(NamedTuple):
    """Consecutive groups of one segment: its groups first to first + length (excluded)."""

    seg: int
    first: int
    length: int

    def encode(self) -> bytes:
        return _RUN.pack(self.seg, self.first, self.length)

    @classmethod
    def decode(cls, data: bytes | memoryview, pos: int = 0) -> RunRow:
        seg, first, length = _RUN.unpack_from(data, pos)
        return cls(seg, first, length)


@dataclass(slots=True, kw_only=True)
class RowLease:
    """A batch of one table's groups handed out together, named by runs (records.Lease names groups).
    `expires` None: held for a Sample stream until the client confirms it; `owner` binds it to the
    token that took it; `counted`, what its take found to count as sampled, and whether that waits
    for the batch's confirmation (records.Lease.counted, .deferred)."""

    table_id: int
    runs: list[RunRow]
    expires: float | None
    owner: str = ""
    counted: Counted | None = None
    deferred: bool = False

    def encode(self) -> bytes:
        held = struct.pack("<II", _RUNS_MARK, len(self.runs)) + b"".join(run.encode() for run in self.runs)
        return pack_lease(self.table_id, self.expires, self.owner, held, self.counted, self.deferred)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> RowLease:
        table_id, expires, owner, pos = unpack_lease(data)
        mark, count = struct.unpack_from("<II", data, pos)
        if mark != _RUNS_MARK:
            raise ValueError("a lease of groups, not of runs")
        pos += 8
        runs = [RunRow.decode(data, pos + _RUN.size * k) for k in range(count)]
        counted, deferred = counted_at(data, pos + _RUN.size * count)
        return cls(table_id=table_id, runs=runs, expires=expires, owner=owner, counted=counted, deferred=deferred)


def decode_lease(data: bytes | memoryview) -> Lease | RowLease:
    """A lease's value, of groups (a records table's) or of runs (a rows table's)."""
    _, _, _, pos = unpack_lease(data)
    if struct.unpack_from("<I", data, pos)[0] == _RUNS_MARK:
        return RowLease.decode(data)
    return Lease.decode(data)
