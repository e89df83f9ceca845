"""The indexes of ready groups: each an `Index` class that owns its LMDB databases, keeps them
as groups become ready, leave ready or change priority, and checks them for `expbuf check`.

An order (orders.py) reads the index it declares; the store opens the databases of the
indexes of the registered orders, and of the version index every order filters with; a table
keeps them all from its creation, and a lazy one it lacks (a table an earlier release made) is
built in the background from the open (ready.py, services/index_builds.py). The keys' helpers
(`u64`, `prio_key`, `version_key`, `next_prefix`, `put_rows`) are disk/layout.py's.
Every key starts with the table's 4-byte prefix. The built-in indexes (all lazy but `ready`):
- `ready`:  rseq (u64 BE)                  -> group key   (fifo from the front, lifo from the back)
- `prio`:   priority (descending) + rseq   -> group key   (highest priority first, ties fifo)
- `slots`:  slot (u64 BE)                  -> group key   (a dense array: uniform picks a random slot)
  with `slotof`: group key -> slot, and the count of slots under the bare prefix.
- `byver`:  lowest model version + rseq    -> priority + group key (groups of a known version)
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar, NamedTuple

import lmdb

from ...disk.layout import U64, next_prefix, prio_key, priority_of, put_rows, u64, version_key


class ReadyGroup(NamedTuple):
    """What an index knows of a ready group: its key, its place in the ready order (rseq),
    its priority and its lowest model version (None: unknown)."""

    gkey: bytes
    rseq: int
    priority: float
    version: int | None


class Index(ABC):
    """A ready-group index of one table inside one transaction. `databases` names the LMDB
    databases it owns (opened by the store under these names; every key under the table's
    prefix); the hooks run in the transaction that changes the groups, so the index commits
    with them or not at all."""

    databases: ClassVar[tuple[str, ...]]
    # Every table keeps it from its creation. Lazy: a table an earlier release made may lack it
    # (that release kept it only from the first request that read it), and so may every table
    # when its order was registered since; the store then builds it in the background from
    # the open (index_builds.py). Eager: built in the open's own transaction (core/whole_table/migrate.py), as
    # any reader of the database may expect it kept.
    lazy: ClassVar[bool] = False
    # How problems and the log name it, e.g. "the priority index (prio)"; empty: by its databases.
    what: ClassVar[str] = ""
    # Whether it reads a group's priority and version. A build reads each ready group's record for
    # an index that does; for one that does not (the uniform slots) it reads the ready order alone,
    # and the groups it gives the index say priority 0 and no version.
    reads_records: ClassVar[bool] = True

    @classmethod
    def described(cls) -> str:
        return cls.what or f"the index ({', '.join(cls.databases)})"

    def __init__(self, dbs: Mapping[str, lmdb._Database], txn: lmdb.Transaction[bytes], prefix: bytes) -> None:
        self.txn, self.prefix = txn, prefix
        self.db = {name: dbs[name] for name in self.databases}

    @abstractmethod
    def add(self, groups: Sequence[ReadyGroup]) -> None:
        """These groups became ready, in this order."""

    @abstractmethod
    def remove(self, groups: Sequence[ReadyGroup]) -> None:
        """These groups leave ready (taken, leased, retired), in this order."""

    def move(self, before: Sequence[ReadyGroup], after: Sequence[ReadyGroup]) -> None:
        """Ready groups got a new priority and place in the ready order (a replayed group
        requeued, reuse.py): `after[i]` is `before[i]` changed."""
        self.remove(before)
        self.add(after)

    @abstractmethod
    def verify(self, ready: Sequence[ReadyGroup]) -> list[str]:
        """The problems of this index against the table's ready groups; [] when it holds
        exactly them. Each problem names the database it is in."""

    def entries(self, name: str, *, bare: bool = False) -> int:
        """The rows of one of its databases under the table's prefix (the bare prefix counted
        only with `bare`)."""
        n, p = 0, self.prefix
        with self.txn.cursor(db=self.db[name]) as cur:
            found = cur.set_range(p)
            while found and cur.key().startswith(p):
                n += bare or len(cur.key()) > len(p)
                found = cur.next()
        return n

    def clear(self, name: str, limit: int) -> int:
        """Delete up to `limit` rows of one of its databases under the table's prefix; how many."""
        deleted = 0
        with self.txn.cursor(db=self.db[name]) as cur:
            found = cur.set_range(self.prefix)
            while found and deleted < limit and cur.key().startswith(self.prefix):
                found = cur.delete()
                deleted += 1
        return deleted


class KeyedIndex(Index):
    """An index of one database with one row per ready group (none where `row` says None):
    a new index of this kind is one `row` method."""

    @abstractmethod
    def row(self, group: ReadyGroup) -> tuple[bytes, bytes] | None:
        """The group's key (after the table's prefix) and value, or None: not indexed."""

    def _rows(self, groups: Sequence[ReadyGroup]) -> Iterator[tuple[ReadyGroup, bytes, bytes]]:
        for group in groups:
            row = self.row(group)
            if row is not None:
                yield group, self.prefix + row[0], row[1]

    def add(self, groups: Sequence[ReadyGroup]) -> None:
        put_rows(self.txn, self.db[self.databases[0]], sorted((key, value) for _, key, value in self._rows(groups)))

    def remove(self, groups: Sequence[ReadyGroup]) -> None:
        db = self.db[self.databases[0]]
        for _, key, _ in self._rows(groups):
            self.txn.delete(key, db=db)

    def verify(self, ready: Sequence[ReadyGroup]) -> list[str]:
        db, problems, expected = self.db[self.databases[0]], [], 0
        for group, key, value in self._rows(ready):
            expected += 1
            if self.txn.get(key, db=db) != value:
                problems.append(f"ready group {group.gkey.decode()} is missing from {self.what}")
        held = self.entries(self.databases[0])
        if held != expected:
            problems.append(f"{self.what} holds {held} groups, {expected} belong in it")
        return problems

    def scan(self, *, reverse: bool) -> Iterator[bytes]:
        """The values of the index, from the front or the back."""
        p = self.prefix
        with self.txn.cursor(db=self.db[self.databases[0]]) as cur:
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


class ReadyOrder(KeyedIndex):
    """The ready order: rseq -> group key."""

    databases = ("ready",)
    what = "the ready index (ready)"

    def row(self, group: ReadyGroup) -> tuple[bytes, bytes]:
        return u64(group.rseq), group.gkey

    def from_rseq(self, start: int, limit: int) -> tuple[list[tuple[int, bytes]], int | None]:
        """Up to `limit` ready groups (rseq, group key) from rseq `start` on, in ready order, and
        the rseq after the last of them (None: no ready group lies past them)."""
        p, found = self.prefix, list[tuple[int, bytes]]()
        with self.txn.cursor(db=self.db["ready"]) as cur:
            more = cur.set_range(p + u64(start))
            while more and cur.key().startswith(p):
                if len(found) == limit:
                    return found, found[-1][0] + 1
                found.append((U64.unpack(cur.key()[len(p) :])[0], bytes(cur.value())))
                more = cur.next()
        return found, None

    def rseq_of(self, gkey: bytes) -> int | None:
        """The place of a ready group known by its key alone (its record lost), read through the
        whole order; None: the order does not name it."""
        p = self.prefix
        with self.txn.cursor(db=self.db["ready"]) as cur:
            found = cur.set_range(p)
            while found and cur.key().startswith(p):
                if cur.value() == gkey:
                    return int(U64.unpack(cur.key()[len(p) :])[0])
                found = cur.next()
        return None

    def before(self, rseq: int) -> int:
        """How many ready groups lie before `rseq` in the ready order (a cost of those groups)."""
        p, end, count = self.prefix, self.prefix + u64(rseq), 0
        with self.txn.cursor(db=self.db["ready"]) as cur:
            found = cur.set_range(p)
            while found and cur.key() < end:
                count += 1
                found = cur.next()
        return count


class PriorityIndex(KeyedIndex):
    """Priority descending, then rseq -> group key."""

    databases = ("prio",)
    lazy = True
    what = "the priority index (prio)"

    def row(self, group: ReadyGroup) -> tuple[bytes, bytes]:
        return prio_key(group.priority) + u64(group.rseq), group.gkey

    def priority_of(self, gkey: bytes, rseq: int) -> float | None:
        """The priority this index holds a ready group at, known by its key and place alone (its
        record lost), read through the whole index; None: it does not hold the group."""
        p, place = self.prefix, u64(rseq)
        with self.txn.cursor(db=self.db["prio"]) as cur:
            found = cur.set_range(p)
            while found and cur.key().startswith(p):
                if cur.key()[len(p) + 8 :] == place and cur.value() == gkey:
                    return priority_of(cur.key()[len(p) : len(p) + 8])
                found = cur.next()
        return None


class VersionIndex(KeyedIndex):
    """Lowest model version, then rseq -> priority key + group key, for the groups of a known
    version: every order reads it for a request's `min_model_version`, the staleness rule
    for the groups below a version."""

    databases = ("byver",)
    lazy = True
    what = "the version index (byver)"

    def row(self, group: ReadyGroup) -> tuple[bytes, bytes] | None:
        if group.version is None:
            return None
        return version_key(group.version) + u64(group.rseq), prio_key(group.priority) + group.gkey

    def priority_of(self, gkey: bytes, rseq: int, version: int) -> float | None:
        """The priority this index holds a ready group at, known by its key, place and version
        (its record lost); None: it does not hold the group."""
        value = self.txn.get(self.prefix + version_key(version) + u64(rseq), db=self.db["byver"])
        return None if value is None or value[8:] != gkey else priority_of(value[:8])

    def below(self, version: int, limit: int) -> list[str]:
        """Up to `limit` ready groups whose lowest version is below `version`, lowest first,
        read from the front: nothing at or above `version` is looked at."""
        end = self.prefix + version_key(version)
        groups: list[str] = []
        with self.txn.cursor(db=self.db["byver"]) as cur:
            found = cur.set_range(self.prefix)
            while found and len(groups) < limit and cur.key() < end:
                groups.append(bytes(cur.value()[8:]).decode())
                found = cur.next()
        return groups

    def at_least(self, version: int) -> Iterator[tuple[bytes, bytes, bytes]]:
        """Every group at or above `version`: (version key + rseq, priority key, group key)."""
        p = self.prefix
        with self.txn.cursor(db=self.db["byver"]) as cur:
            found = cur.set_range(p + version_key(version))
            while found and cur.key().startswith(p):
                yield cur.key()[4:20], cur.value()[:8], cur.value()[8:]
                found = cur.next()

    def in_ready_order(self, min_version: int, *, newest: bool) -> Iterator[bytes]:
        """Groups at or above min_version in ready order (newest: from the back): a merge of
        the runs of each version, each read from its front (or back), a cost of the distinct
        versions, a few."""
        p, sign = self.prefix, -1 if newest else 1
        heads: list[tuple[int, bytes, bytes]] = []  # (sign * rseq, version key, group key) of each run
        with self.txn.cursor(db=self.db["byver"]) as cur:
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
        return U64.unpack(cur.key()[12:20])[0], cur.value()[8:]


class Slots(Index):
    """A dense array of the ready groups, slot -> group key, with each group's slot in
    `slotof` and the count under the bare prefix: uniform picks random slots."""

    databases = ("slots", "slotof")
    lazy = True
    what = "the uniform slots (slots, slotof)"
    reads_records = False

    def add(self, groups: Sequence[ReadyGroup]) -> None:
        """Slots at the end of the array; the count is written once."""
        if not groups:
            return
        p, count = self.prefix, self.count()
        slots, slotof = [], []
        for slot, group in enumerate(groups, count):
            slots.append((p + u64(slot), group.gkey))
            slotof.append((p + group.gkey, u64(slot)))
        slots.append((p, u64(count + len(groups))))
        put_rows(self.txn, self.db["slots"], sorted(slots))
        put_rows(self.txn, self.db["slotof"], sorted(slotof))

    def remove(self, groups: Sequence[ReadyGroup]) -> None:
        """Each freed slot takes the group then in the last slot, in the order given, as one
        remove at a time would; but the array is changed in memory and written once: the tail
        it moves groups from read in one pass, the slot count read and written once."""
        p, txn = self.prefix, self.txn
        freed = []
        for group in groups:
            slot_raw = txn.pop(p + group.gkey, db=self.db["slotof"])
            if slot_raw is not None:
                freed.append((group.gkey, U64.unpack(slot_raw)[0]))
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
        with txn.cursor(db=self.db["slots"]) as cur:  # the slots past the new end go
            found = cur.set_range(p + u64(count))
            while found and cur.key().startswith(p):
                found = cur.delete()
        rows = sorted([(p + u64(slot), at[slot]) for slot in moved.values()] + [(p, u64(count))])
        put_rows(txn, self.db["slots"], rows)
        put_rows(txn, self.db["slotof"], sorted((p + gkey, u64(slot)) for gkey, slot in moved.items()))

    def verify(self, ready: Sequence[ReadyGroup]) -> list[str]:
        p, problems = self.prefix, []
        for group in ready:
            slot = self.txn.get(p + group.gkey, db=self.db["slotof"])
            if slot is None or self.txn.get(p + slot, db=self.db["slots"]) != group.gkey:
                problems.append(f"ready group {group.gkey.decode()} is missing from the uniform slots (slots, slotof)")
        for name in self.databases:
            if self.entries(name) != len(ready):
                problems.append(f"the {name} index holds {self.entries(name)} groups, {len(ready)} are ready")
        if self.count() != len(ready):
            problems.append(f"{self.count()} uniform slots for {len(ready)} ready groups")
        return problems

    def _tail(self, start: int) -> dict[int, bytes]:
        """The groups in the slots from `start` to the end of the dense array."""
        p, tail = self.prefix, {}
        with self.txn.cursor(db=self.db["slots"]) as cur:
            found = cur.set_range(p + u64(max(start, 0)))
            while found and cur.key().startswith(p):
                tail[U64.unpack(cur.key()[len(p) :])[0]] = cur.value()
                found = cur.next()
        return tail

    def count(self) -> int:
        raw = self.txn.get(self.prefix, db=self.db["slots"])
        return U64.unpack(raw)[0] if raw else 0

    def slot(self, slot: int) -> bytes:
        """The group in one slot of the dense array (0 <= slot < count())."""
        group = self.txn.get(self.prefix + u64(slot), db=self.db["slots"])
        if group is None:
            raise LookupError(f"ready index: slot {slot} holds no group (the slot array is damaged)")
        return group
