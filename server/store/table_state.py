"""One table inside one transaction, as state: its records (read once, changed in a write-back
cache, written by `save`), its counters, its ready index, and the keys of its indexes.

The rules that change a table (groups.py, capacity.py, retirement.py, leases.py, ...) are
functions over this state; it imports none of them. A table's extensions (extensions.py, a
layer above) are reached through `extensions`, as the `Events` they answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import lmdb

from ..ready_indexes import put_rows, u64
from ..selection import ReadyIndex
from ..tables import TableConfig
from . import layout
from .counters import read_counters
from .records import LIVE, GroupRecord, ItemRecord

# A member's record as the cache holds it: absent (None) when the table has no such uid.
Cached = ItemRecord | None
Groups = Sequence[tuple[str, GroupRecord]]


class Events(Protocol):
    """The events of a table its extensions hear (extensions.py says when each comes): the
    state raises `on_update`, the rules the others."""

    def on_insert(self, tt: TableState, uids: Sequence[str]) -> None: ...
    def on_update(self, tt: TableState, gkey: str, grp: GroupRecord, was: str) -> None: ...
    def on_sample(self, tt: TableState, groups: Groups) -> None: ...
    def on_retire(self, tt: TableState, groups: Groups) -> None: ...
    def on_version(self, tt: TableState) -> None: ...
    def on_upkeep(self, tt: TableState) -> int: ...


class TableState:
    """One table inside one write (or read) transaction."""

    def __init__(
        self,
        txn: lmdb.Transaction,
        dbs: dict[str, lmdb._Database],
        table_id: int,
        config: TableConfig,
        now: float,
        extensions: Events,
    ) -> None:
        self.txn, self.db, self.config, self.table_id, self.now = txn, dbs, config, table_id, now
        self.extensions = extensions
        self.prefix = layout.table_prefix(table_id)
        self.counters = read_counters(txn, dbs["counters"], self.prefix)
        self.ready = ReadyIndex(dbs, txn, self.prefix)
        # Write-back caches: a record changed several times in one request is encoded and
        # written once, by save().
        self._items: dict[str, Cached] = {}
        self._groups: dict[str, GroupRecord | None] = {}
        self._dirty_items: set[str] = set()
        self._dirty_groups: set[str] = set()

    def save(self) -> None:
        """Write changed records and the counters; every changing request ends with it."""
        items, groups = self._items, self._groups
        put_rows(self.txn, self.db["items"], [(self.key(uid), items[uid].encode()) for uid in self._dirty_items])
        put_rows(self.txn, self.db["groups"], [(self.key(gkey), groups[gkey].encode()) for gkey in self._dirty_groups])
        self._dirty_items.clear()
        self._dirty_groups.clear()
        self.txn.put(self.prefix, self.counters.encode(), db=self.db["counters"])

    # ---- records -----------------------------------------------------------------------

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def item(self, uid: str) -> ItemRecord | None:
        if uid not in self._items:
            raw = self.txn.get(self.key(uid), db=self.db["items"])
            self._items[uid] = None if raw is None else ItemRecord.decode(raw)
        return self._items[uid]

    def cached_item(self, uid: str) -> tuple[bool, Cached]:
        """Whether the uid's record was read in this transaction, and the record if it was:
        a caller that only rewrites a few bytes of the others (retirement.py) leaves them
        undecoded."""
        return (True, self._items[uid]) if uid in self._items else (False, None)

    def put_item(self, uid: str, rec: ItemRecord) -> None:
        self._items[uid] = rec
        self._dirty_items.add(uid)

    def forget_item(self, uid: str) -> None:
        self._items[uid] = None
        self._dirty_items.discard(uid)
        self.txn.delete(self.key(uid), db=self.db["items"])

    def group(self, gkey: str) -> GroupRecord | None:
        if gkey not in self._groups:
            raw = self.txn.get(self.key(gkey), db=self.db["groups"])
            self._groups[gkey] = None if raw is None else GroupRecord.decode(raw)
        return self._groups[gkey]

    def put_group(self, gkey: str, grp: GroupRecord) -> None:
        self._groups[gkey] = grp
        self._dirty_groups.add(gkey)

    def forget_group(self, gkey: str) -> None:
        self._groups[gkey] = None
        self._dirty_groups.discard(gkey)
        self.txn.delete(self.key(gkey), db=self.db["groups"])

    def members(self, grp: GroupRecord) -> dict[str, ItemRecord]:
        return {uid: self.item(uid) for uid in grp.members}

    # ---- keys of the per-table indexes ---------------------------------------------------

    def pending_key(self, gkey: str, grp: GroupRecord) -> bytes:
        return self.prefix + layout.micros(grp.created) + gkey.encode()

    def retired_key(self, uid: str, rec: ItemRecord) -> bytes:
        return self.prefix + layout.micros(rec.retired or 0.0) + uid.encode()

    def rseq_key(self, grp: GroupRecord) -> bytes:
        return self.prefix + u64(grp.rseq)

    # ---- states and their counts ---------------------------------------------------------

    def set_state(self, gkey: str, grp: GroupRecord, recs: dict[str, ItemRecord], state: str) -> None:
        self.set_states([(gkey, grp, recs)], state)

    def set_states(self, groups: Sequence[tuple[str, GroupRecord, dict[str, ItemRecord]]], state: str) -> None:
        """Live groups and their members (key, record, member records) move to a live
        `state` (retirement.py makes tombstones)."""
        counters = self.counters
        for gkey, grp, recs in groups:
            for uid, rec in recs.items():
                counters.add(rec.state, -1)
                rec.state = state
                self.put_item(uid, rec)
            counters.add(state, len(recs))
            self.move_group(gkey, grp, state)

    def move_group(self, gkey: str, grp: GroupRecord, state: str) -> None:
        """A group's own state and the counts of groups by live state; a move between live
        states is the extensions' `on_update`."""
        was = grp.state
        if was in LIVE:
            self.counters.add_groups(was, -1)
        if state in LIVE:
            self.counters.add_groups(state, 1)
        grp.state = state
        self.put_group(gkey, grp)
        if was in LIVE and state in LIVE and was != state:
            self.extensions.on_update(self, gkey, grp, was)
