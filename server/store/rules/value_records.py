"""The record beside each keyed value (services/values.py): the value's size and the token that
wrote it, in the `kv` database at the table's prefix, RECORD, then the value's key.

No key starts with RECORD (0xFF begins no UTF-8 text), so a table's values are the keys of its
range below RECORD and their records the keys above it, dropped with the table as its values are.
From the records a put or a clear counts the table's values and their bytes (the counters
`values` and `value_bytes`: each key's bytes and its value's, which count against capacity_bytes)
without reading the values it replaces, and tells whose each value is.

A table whose counters a release before records wrote (no `values` among them), or that has none
and holds values, holds values without records: `recount`, when the store opens, writes each one's
record (no token's: the first token that replaces it takes it) and counts them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import lmdb

from ..core.table_state.counters import read_counters, stored_names, write_counters
from ..core.table_state.state import TableState

RECORD = b"\xff"
_SIZE = struct.Struct(">Q")


@dataclass(frozen=True)
class ValueRecord:
    """A value's size, and the fingerprint of the token that wrote it ("": none, tokens off)."""

    size: int
    owner: str = ""

    def encode(self) -> bytes:
        return _SIZE.pack(self.size) + self.owner.encode()

    @classmethod
    def decode(cls, raw: bytes) -> ValueRecord:
        """A stored record; a ValueError (what the checks take as damage) for one that is not."""
        if len(raw) < _SIZE.size:
            raise ValueError(f"a value record of {len(raw)} bytes, not at least {_SIZE.size}")
        (size,) = _SIZE.unpack_from(raw)
        return cls(size, bytes(raw[_SIZE.size :]).decode())

    def held(self, name: bytes) -> int:
        """The bytes the value counts as: its key's and its own."""
        return len(name) + self.size

    def foreign(self, owner: str) -> bool:
        """Whether the value is another token's than `owner`'s (never, where either is none)."""
        return bool(owner and self.owner and self.owner != owner)


def record_key(prefix: bytes, name: bytes) -> bytes:
    return prefix + RECORD + name


def record(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes, name: bytes) -> ValueRecord | None:
    """The record of the value under `name`; None where none is stored."""
    raw = txn.get(record_key(prefix, name), db=db)
    return None if raw is None else ValueRecord.decode(raw)


def _values(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes) -> Iterator[tuple[bytes, int]]:
    """The names of a table's values, with each value's size, in key order."""
    with txn.cursor(db=db) as cur:
        found = cur.set_range(prefix)
        while found and cur.key().startswith(prefix) and cur.key()[len(prefix) :][:1] != RECORD:
            yield bytes(cur.key()[len(prefix) :]), len(cur.value())
            found = cur.next()


def _records(txn: lmdb.Transaction[bytes], db: lmdb._Database, prefix: bytes) -> Iterator[tuple[bytes, ValueRecord]]:
    """The names of a table's value records, with each record, in key order."""
    start = prefix + RECORD
    with txn.cursor(db=db) as cur:
        found = cur.set_range(start)
        while found and cur.key().startswith(start):
            yield bytes(cur.key()[len(start) :]), ValueRecord.decode(cur.value())
            found = cur.next()


def recount_due(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> bool:
    """Whether a table may hold values a release before records stored: its counters are of
    such a release, or it has none, and it holds a value."""
    stored = stored_names(txn, dbs, prefix)
    if stored is not None and "values" in stored:
        return False
    return next(_values(txn, dbs["kv"], prefix), None) is not None


def recount(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], prefix: bytes) -> int:
    """Write the record of each value that has none, and the table's value counters from its
    values; how many values it holds."""
    kv, count, total = dbs["kv"], 0, 0
    missing: list[tuple[bytes, bytes]] = []
    for name, size in _values(txn, kv, prefix):
        if record(txn, kv, prefix, name) is None:
            missing.append((record_key(prefix, name), ValueRecord(size).encode()))
        count, total = count + 1, total + len(name) + size
    for key, raw in missing:
        txn.put(key, raw, db=kv)
    counters = read_counters(txn, dbs, prefix)
    counters.values, counters.value_bytes = count, total
    write_counters(txn, dbs, prefix, counters)
    return count


def verify(tt: TableState) -> list[str]:
    """The problems of a table's values: a value without its record or of another size than it
    says, a record without its value, counters that are not what the records count. None for a
    table whose values the store's next open counts (`recount_due`)."""
    if recount_due(tt.txn, tt.db, tt.prefix):
        return []
    kv, problems = tt.db["kv"], []
    records = dict(_records(tt.txn, kv, tt.prefix))
    count, total = 0, 0
    for name, size in _values(tt.txn, kv, tt.prefix):
        found = records.pop(name, None)
        if found is None:
            problems.append(f"keyed value {name[:80]!r} has no record")
        elif found.size != size:
            problems.append(f"keyed value {name[:80]!r} is {size} bytes, its record says {found.size}")
        count, total = count + 1, total + len(name) + size
    problems += [f"the record of keyed value {name[:80]!r} has no value" for name in records]
    if (tt.counters.values, tt.counters.value_bytes) != (count, total):
        problems.append(
            f"counters values and value_bytes are {tt.counters.values} and {tt.counters.value_bytes} but "
            f"{count} values of {total} bytes were found"
        )
    return problems
