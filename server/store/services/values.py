"""Keyed values: bytes a caller stores under names of its own, in a table's key range, durable
when the call returns and dropped with the table.

The store of a data plane that addresses data by name rather than as experiences: TransferQueue
keeps each (sample, field) under "{global_index}@{field}" (client/transferqueue/storage.py). A
put of several values is one commit (all or none); a clear of names not stored is no error. A put
or a clear names at most MAX_KEYS_PER_CALL keys (client/schema/call_limits.py).
Values are not experiences: they count in no order and no experience counter. Each has a record
beside it (rules/value_records.py) with its size, so that the table counts its values and their
bytes (Stats' `values` and `value_bytes`), and those bytes count against capacity_bytes with the
experiences' (rules/capacity.py): a put that would pass it is refused and stores nothing.

A value belongs to the token that wrote it, as a lease or a claim does: its record names the
writer's `owner` (the servicer's fingerprint of the token; "" with tokens off), and another
owner's put or clear of it is refused (Forbidden), changing nothing. A value no token wrote (one
stored with tokens off, or before records) is the next writer's. Any reader reads every value; a
get with an `owner` refuses another owner's, for a reader that trusts only its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import lmdb

from expbuf.client.schema.call_limits import MAX_KEYS_PER_CALL
from expbuf.client.trxp.varints import field_bytes

from ..core.table_state.counters import read_counters, write_counters
from ..disk import layout
from ..disk.environment import Environment
from ..rules import capacity, value_records
from ..rules.value_records import ValueRecord, record, record_key
from ..schema.errors import Forbidden, InvalidRequest, NotFound, TooLarge, check_names, clip
from ..tables.catalog import TableCatalog

MAX_KEY_BYTES = 400  # as a uid: the table's 4-byte prefix and the name stay inside LMDB's 511


class Values:
    """Puts, gets and clears of keyed values over the environment and the table catalog."""

    def __init__(self, environment: Environment, catalog: TableCatalog) -> None:
        self.environment, self.catalog = environment, catalog

    def put(self, table: str, keys: Sequence[str], values: Sequence[bytes], owner: str = "") -> int:
        """Store each value under its key (replacing what a key held) as `owner`'s, in one commit;
        how many. Forbidden where a key holds another owner's value, TableFull (TooLarge on their
        own) where the values would take the table past its capacity_bytes."""
        check_names(keys, "keys", "PutValues", MAX_KEYS_PER_CALL)
        if len(keys) != len(values):
            raise InvalidRequest(f"{len(keys)} keys for {len(values)} values: one value a key")
        names = _names(keys)
        seen: set[bytes] = set()
        for key, name in zip(keys, names, strict=True):
            if name in seen:
                raise InvalidRequest(f"keys: {clip(key)!r} is named more than once")
            seen.add(name)
        table_id, config = self.catalog.lookup(table)
        prefix = layout.table_prefix(table_id)
        dbs = self.environment.db
        kv = dbs["kv"]

        def op(txn: lmdb.Transaction[bytes]) -> int:
            self._exists(txn, table, table_id)
            counters = read_counters(txn, dbs, prefix)
            added, new, rows = 0, 0, []
            for key, name, value in zip(keys, names, values, strict=True):
                was = _held(record(txn, kv, prefix, name), key, owner)
                now = ValueRecord(len(value), owner)
                added += now.held(name) - (was.held(name) if was is not None else 0)
                new += was is None
                rows += [(prefix + name, bytes(value)), (record_key(prefix, name), now.encode())]
            capacity.room_for_values(config, counters, added)
            with txn.cursor(db=kv) as cur:
                cur.putmulti(rows)
            counters.values, counters.value_bytes = counters.values + new, counters.value_bytes + added
            write_counters(txn, dbs, prefix, counters)
            return len(names)

        return self.environment.submit(op, grows=True)

    def get(
        self, table: str, keys: Sequence[str], limit: int | None = None, owner: str | None = None
    ) -> list[bytes | None]:
        """The value of each key, None for one not stored, from the last commit. TooLarge as soon
        as the reply (each value, or missing key's name, with its framing) passes `limit` bytes,
        before the rest are read; with an `owner`, Forbidden for a key another owner's value holds."""
        check_names(keys, "keys", "GetValues", MAX_KEYS_PER_CALL)
        names = _names(keys)
        prefix = self._prefix(table)
        db = self.environment.db["kv"]
        found: list[bytes | None] = []
        size = 0
        with self.environment.read() as txn:
            for key, name in zip(keys, names, strict=True):
                value = txn.get(prefix + name, db=db)
                if value is not None and owner is not None:
                    _held(record(txn, db, prefix, name), key, owner)
                # what the reply takes: each value framed, or each missing key's name framed
                size += field_bytes(len(value) if value is not None else len(name))
                if limit is not None and size > limit:
                    raise TooLarge(
                        f"the values of {len(keys)} keys take more than {limit} bytes, more than one message: "
                        "ask for fewer keys at a time"
                    )
                found.append(value)
        return found

    def clear(self, table: str, keys: Sequence[str], owner: str = "") -> int:
        """Remove the values of these keys, in one commit; how many were stored. Forbidden, removing
        nothing, where a key holds another owner's value."""
        check_names(keys, "keys", "ClearValues", MAX_KEYS_PER_CALL)
        names = _names(keys)
        table_id, _ = self.catalog.lookup(table)
        prefix = layout.table_prefix(table_id)
        dbs = self.environment.db
        kv = dbs["kv"]

        def op(txn: lmdb.Transaction[bytes]) -> int:
            self._exists(txn, table, table_id)
            counters = read_counters(txn, dbs, prefix)
            cleared = 0
            for key, name in zip(keys, names, strict=True):
                was = _held(record(txn, kv, prefix, name), key, owner)
                if was is None:
                    continue
                txn.delete(prefix + name, db=kv)
                txn.delete(record_key(prefix, name), db=kv)
                counters.values, counters.value_bytes = counters.values - 1, counters.value_bytes - was.held(name)
                cleared += 1
            if cleared:
                write_counters(txn, dbs, prefix, counters)
            return cleared

        return self.environment.submit(op)

    def recount(self) -> None:
        """Count the values of each table that may hold values stored before their records
        (value_records.recount); a directory without such tables is not written."""
        db = self.environment.db
        with self.environment.read() as txn:
            due = [
                table_id
                for table_id, _ in self.catalog.entries()
                if value_records.recount_due(txn, db, layout.table_prefix(table_id))
            ]

        def op(txn: lmdb.Transaction[bytes]) -> None:
            for table_id in due:
                value_records.recount(txn, db, layout.table_prefix(table_id))

        if due:
            self.environment.submit(op)

    def _prefix(self, table: str) -> bytes:
        table_id, _ = self.catalog.lookup(table)
        return layout.table_prefix(table_id)

    def _exists(self, txn: lmdb.Transaction[bytes], table: str, table_id: int) -> None:
        """Refuse a change to a table dropped since it was looked up (by a request before this one in
        its batch, too: TableCatalog.holds): its counters and values would outlive it."""
        if not self.catalog.holds(txn, table_id, table):
            raise NotFound(f"table '{clip(table)}' does not exist")


def _held(was: ValueRecord | None, key: str, owner: str) -> ValueRecord | None:
    """The record of a key's value, which `owner` may replace, clear or read as its own; Forbidden
    where another owner wrote it."""
    if was is not None and was.foreign(owner):
        raise Forbidden(
            f"keys: {clip(key)!r} holds a value another token wrote: only that token replaces or clears it "
            "(a value is its writer's, as a lease is); nothing of this call is done"
        )
    return was


def _names(keys: Sequence[str]) -> list[bytes]:
    """The keys as stored: each 1 to MAX_KEY_BYTES bytes of UTF-8."""
    names = [key.encode() for key in keys]
    for key, name in zip(keys, names, strict=True):
        if not name or len(name) > MAX_KEY_BYTES:
            raise InvalidRequest(f"keys: {clip(key)!r} is not a key (1 to {MAX_KEY_BYTES} bytes of UTF-8)")
    return names
