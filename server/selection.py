"""Ready-group indexes and the selection orders over them: fifo, lifo, uniform, priority,
each an `Order` class, so a new order is one class.

A group that is ready to be sampled sits in three LMDB indexes, all keyed under its
table's 4-byte prefix:
- `ready`:  rseq (u64 BE)                  -> group key   (fifo from the front, lifo from the back)
- `prio`:   priority (descending) + rseq   -> group key   (highest priority first, ties fifo)
- `slots`:  slot (u64 BE)                  -> group key   (a dense array: uniform picks a random slot)
  with `slotof`: group key -> slot, and the count of slots under the bare prefix.
- `byver`:  lowest model version + rseq    -> priority + group key (groups of a known version)
Every operation costs a few B-tree lookups, so selection does not slow down as the
table grows: no request scans the table. A request with a `min_model_version` reads
only the groups at or above it from `byver`, however many older groups there are:
fifo and lifo merge the versions' runs (a cost of the distinct fresh versions, a few),
priority and uniform order the fresh groups they find. A group with an unknown version
(any member without info["model_version"]) is not in `byver`: it never meets a
minimum version.
"""

from __future__ import annotations

import heapq
import random
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import lmdb

_U64 = struct.Struct(">Q")


def u64(value: int) -> bytes:
    return _U64.pack(value)


def put_rows(txn: lmdb.Transaction, db: lmdb._Database, rows: list[tuple[bytes, bytes]]) -> None:
    """Write (key, value) rows into one database in one call: a push writes hundreds."""
    if rows:
        with txn.cursor(db=db) as cur:
            cur.putmulti(rows)


def _prio_key(priority: float) -> bytes:
    """Big-endian bytes that sort by priority descending."""
    (bits,) = struct.unpack(">Q", struct.pack(">d", float(priority)))
    bits = bits ^ 0xFFFFFFFFFFFFFFFF if bits >> 63 else bits | 1 << 63  # ascending order of floats
    return u64(bits ^ 0xFFFFFFFFFFFFFFFF)  # flip for descending


@dataclass(frozen=True)
class ReadyDbs:
    ready: lmdb._Database
    prio: lmdb._Database
    slots: lmdb._Database
    slotof: lmdb._Database
    byver: lmdb._Database

    @classmethod
    def of(cls, dbs: dict[str, lmdb._Database]) -> ReadyDbs:
        """The ready-group indexes among the store's named databases."""
        return cls(dbs["ready"], dbs["prio"], dbs["slots"], dbs["slotof"], dbs["byver"])


def version_key(version: int) -> bytes:
    """A signed 64-bit version as 8 bytes that sort in its order."""
    return u64(version + (1 << 63))


class ReadyIndex:
    """Adds, removes and selects ready groups of one table inside a transaction."""

    def __init__(self, dbs: ReadyDbs, txn: lmdb.Transaction[bytes], prefix: bytes) -> None:
        self.dbs, self.txn, self.prefix = dbs, txn, prefix

    def add(self, gkey: bytes, rseq: int, priority: float, version: int | None) -> None:
        self.add_many([(gkey, rseq, priority, version)])

    def add_many(self, groups: Sequence[tuple[bytes, int, float, int | None]]) -> None:
        """Index ready groups (key, rseq, priority, version), in that order; a push that
        completes many groups writes each index in one pass and the slot count once."""
        if not groups:
            return
        p, count = self.prefix, self.count()
        ready, prio, slots, slotof, byver = [], [], [], [], []
        for slot, (gkey, rseq, priority, version) in enumerate(groups, count):
            seq, pkey, skey = u64(rseq), _prio_key(priority), u64(slot)
            ready.append((p + seq, gkey))
            prio.append((p + pkey + seq, gkey))
            slots.append((p + skey, gkey))
            slotof.append((p + gkey, skey))
            if version is not None:
                byver.append(self._version_row(gkey, seq, pkey, version))
        slots.append((p, u64(count + len(groups))))
        dbs, txn = self.dbs, self.txn
        for db, rows in ((dbs.ready, ready), (dbs.prio, prio), (dbs.slots, slots), (dbs.slotof, slotof)):
            put_rows(txn, db, rows)
        put_rows(txn, dbs.byver, byver)

    def add_version(self, gkey: bytes, rseq: int, priority: float, version: int | None) -> None:
        """Index a ready group by its version (nothing for an unknown version)."""
        if version is not None:
            self.txn.put(*self._version_row(gkey, u64(rseq), _prio_key(priority), version), db=self.dbs.byver)

    def _version_row(self, gkey: bytes, seq: bytes, pkey: bytes, version: int) -> tuple[bytes, bytes]:
        """A ready group's key and value in `byver`."""
        return self.prefix + version_key(version) + seq, pkey + gkey

    def remove(self, gkey: bytes, rseq: int, priority: float, version: int | None) -> None:
        self.remove_many([(gkey, rseq, priority, version)])

    def remove_many(self, groups: Sequence[tuple[bytes, int, float, int | None]]) -> None:
        """Unindex ready groups (key, rseq, priority, version). Each freed slot of the dense
        array takes the group then in the last slot, in the order given, as one remove at a
        time would; but the array is changed in memory and written once: the tail it moves
        groups from read in one pass, the slot count read and written once."""
        if not groups:
            return
        p, txn, dbs = self.prefix, self.txn, self.dbs
        freed = []
        for gkey, rseq, priority, version in groups:
            seq = u64(rseq)
            if version is not None:
                txn.delete(p + version_key(version) + seq, db=dbs.byver)
            txn.delete(p + seq, db=dbs.ready)
            txn.delete(p + _prio_key(priority) + seq, db=dbs.prio)
            slot_raw = txn.pop(p + gkey, db=dbs.slotof)
            if slot_raw is not None:
                freed.append((gkey, _U64.unpack(slot_raw)[0]))
        if not freed:
            return
        count = self.count()
        at = self._tail(count - len(freed))  # slot -> group, for every slot a group may move from
        moved: dict[bytes, int] = {}  # group -> the freed slot it moved into
        for gkey, slot in freed:
            slot = moved.pop(gkey, slot)
            count -= 1
            last = at.pop(count)
            if slot != count:
                at[slot] = last
                moved[last] = slot
        with txn.cursor(db=dbs.slots) as cur:  # the slots past the new end go
            found = cur.set_range(p + u64(count))
            while found and cur.key().startswith(p):
                found = cur.delete()
        put_rows(txn, dbs.slots, sorted([(p + u64(slot), at[slot]) for slot in moved.values()] + [(p, u64(count))]))
        put_rows(txn, dbs.slotof, sorted((p + gkey, u64(slot)) for gkey, slot in moved.items()))

    def _tail(self, start: int) -> dict[int, bytes]:
        """The groups in the slots from `start` to the end of the dense array."""
        p, tail = self.prefix, {}
        with self.txn.cursor(db=self.dbs.slots) as cur:
            found = cur.set_range(p + u64(max(start, 0)))
            while found and cur.key().startswith(p):
                tail[_U64.unpack(cur.key()[len(p) :])[0]] = cur.value()
                found = cur.next()
        return tail

    def below_version(self, version: int, limit: int) -> list[str]:
        """Up to `limit` ready groups whose lowest version is below `version`, lowest first,
        read from the front of `byver`: nothing at or above `version` is looked at."""
        end = self.prefix + version_key(version)
        groups: list[str] = []
        with self.txn.cursor(db=self.dbs.byver) as cur:
            found = cur.set_range(self.prefix)
            while found and len(groups) < limit and cur.key() < end:
                groups.append(bytes(cur.value()[8:]).decode())
                found = cur.next()
        return groups

    def count(self) -> int:
        raw = self.txn.get(self.prefix, db=self.dbs.slots)
        return _U64.unpack(raw)[0] if raw else 0

    def candidates(self, order: str, rng: random.Random, min_version: int | None = None) -> Iterator[bytes]:
        """Ready group keys in the named order, each at most once; lazily, so a caller
        that needs k groups reads about k entries. With `min_version`, only groups whose
        lowest version is at least that (from `byver`)."""
        if order not in ORDERS:
            raise ValueError(f"order is {order!r}; expected one of {', '.join(ORDERS)}")
        if min_version is None:
            return ORDERS[order]().candidates(self, rng)
        if order in ("fifo", "lifo"):
            return self._fresh_in_order(min_version, newest=order == "lifo")
        return self._fresh_sorted(min_version, order, rng)

    def _fresh_in_order(self, min_version: int, *, newest: bool) -> Iterator[bytes]:
        """Fresh groups in ready order (lifo: from the back): a merge of the runs of each
        version at or above min_version, each read from its front (or back)."""
        p, sign = self.prefix, -1 if newest else 1
        heads: list[tuple[int, bytes, bytes]] = []  # (sign * rseq, version key, group key) of each run
        with self.txn.cursor(db=self.dbs.byver) as cur:
            found = cur.set_range(p + version_key(min_version))
            while found and cur.key().startswith(p):
                vkey = cur.key()[4:12]
                head = self._run_next(cur, vkey, None, newest=newest)
                if head is not None:
                    heads.append((sign * head[0], vkey, head[1]))
                after = next_prefix(p + vkey)
                found = after is not None and cur.set_range(after)
            heapq.heapify(heads)
            while heads:
                signed, vkey, gkey = heapq.heappop(heads)
                yield gkey
                head = self._run_next(cur, vkey, sign * signed, newest=newest)
                if head is not None:
                    heapq.heappush(heads, (sign * head[0], vkey, head[1]))

    def _run_next(
        self, cur: lmdb.Cursor[bytes], vkey: bytes, after: int | None, *, newest: bool
    ) -> tuple[int, bytes] | None:
        """The (rseq, group key) that follows `after` (None: the first) in one version's
        run, going up, or down for `newest`; None at the run's end."""
        run = self.prefix + vkey
        if newest:
            end = run + u64(after) if after is not None else next_prefix(run)
            found = cur.prev() if end is not None and cur.set_range(end) else cur.last()
        else:
            found = cur.set_range(run + (u64(after + 1) if after is not None else b""))
        if not found or not cur.key().startswith(run):
            return None
        return _U64.unpack(cur.key()[12:20])[0], cur.value()[8:]

    def _fresh_sorted(self, min_version: int, order: str, rng: random.Random) -> Iterator[bytes]:
        """Every fresh group, read once from `byver`, by priority (ties oldest first) or
        shuffled: a cost of the fresh groups, whatever lies below min_version."""
        p = self.prefix
        fresh: list[tuple[bytes, bytes, bytes]] = []  # (priority key, rseq, group key)
        with self.txn.cursor(db=self.dbs.byver) as cur:
            found = cur.set_range(p + version_key(min_version))
            while found and cur.key().startswith(p):
                fresh.append((cur.value()[:8], cur.key()[12:20], cur.value()[8:]))
                found = cur.next()
        if order == "priority":
            fresh.sort()
        else:
            rng.shuffle(fresh)
        for _, _, gkey in fresh:
            yield gkey

    def scan(self, db: lmdb._Database, *, reverse: bool) -> Iterator[bytes]:
        """The values of one of the indexes (ready or prio), from the front or the back."""
        p = self.prefix
        with self.txn.cursor(db=db) as cur:
            if reverse:
                end = next_prefix(p)
                found = cur.prev() if end is not None and cur.set_range(end) else cur.last()
                step = cur.prev
            else:
                found = cur.set_range(p)
                step = cur.next
            while found and cur.key().startswith(p):
                yield cur.value()
                found = step()

    def slot(self, slot: int) -> bytes:
        """The group in one slot of the dense array (0 <= slot < count())."""
        group = self.txn.get(self.prefix + u64(slot), db=self.dbs.slots)
        if group is None:
            raise LookupError(f"ready index: slot {slot} holds no group (the slot array is damaged)")
        return group


class Order(ABC):
    """One way to take ready groups. A new order is one subclass with a `name`: it is
    registered on definition, and sample requests may name it."""

    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        ORDERS[cls.name] = cls

    @abstractmethod
    def candidates(self, index: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        """Ready group keys, each at most once, lazily."""


ORDERS: dict[str, type[Order]] = {}


class Fifo(Order):
    """Oldest completed group first."""

    name = "fifo"

    def candidates(self, index: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        return index.scan(index.dbs.ready, reverse=False)


class Lifo(Order):
    """Newest completed group first."""

    name = "lifo"

    def candidates(self, index: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        return index.scan(index.dbs.ready, reverse=True)


class Uniform(Order):
    """Random groups without replacement: random slots of the dense slot array."""

    name = "uniform"

    def candidates(self, index: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        count, seen = index.count(), set[int]()
        while len(seen) < count:
            slot = rng.randrange(count)
            if slot not in seen:
                seen.add(slot)
                yield index.slot(slot)


class Priority(Order):
    """Highest info["priority"] first, ties oldest first."""

    name = "priority"

    def candidates(self, index: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        return index.scan(index.dbs.prio, reverse=False)


def next_prefix(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key that starts with prefix."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])
