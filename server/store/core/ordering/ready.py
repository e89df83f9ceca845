"""`ReadyIndex`: the ready-group indexes of one table that the store keeps for the registered
orders (orders.py), and the builds of those a table lacks.

A table keeps every index from its creation. A lazy index (`Index.lazy`: the built-in priority,
slot and version indexes) may be missing from a table an earlier release made (it kept one only
from the first request that read it), or when its order was registered since: the store builds
it in the background from the open (services/index_builds.py), in chunks of BUILD_CHUNK ready
groups, each a write transaction of its own (`ReadyIndex.build_step`), so pushes wait for at most
one chunk however many groups are ready. A request that reads it meanwhile raises
`IndexBuilding` before it changes anything, and its caller waits for the build, then tries it
again: no request is served from a part of an index. While an index is being built, the changes
of ready groups reach the part of it built so far (the groups before its cursor in the ready
order), and the build reaches the others; its cursor is kept in the table's counters database
(`BUILDING`), so a build cut short by a stop or a crash goes on from there at the next open.

Every selection costs a few B-tree lookups, so it does not slow down as the table grows: no
request scans the table. A request with a `min_model_version` reads only the groups at or
above it from the version index (`byver`), however many older groups there are: fifo and
lifo merge the versions' runs (a cost of the distinct fresh versions, a few), priority and
uniform order the fresh groups they find, and an order without a way of its own takes its
candidates that are fresh. A group with an unknown version (any member without
info["model_version"]) is not in `byver`: it never meets a minimum version.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import NamedTuple, TypeVar, cast

import lmdb

from ...schema.errors import InvalidRequest
from ...schema.table_config import TableConfig
from . import orders
from .indexes import Index, PriorityIndex, ReadyGroup, ReadyOrder, VersionIndex
from .orders import ORDERS

I = TypeVar("I", bound=Index)  # noqa: E741
# A ready group as the rules pass it: key, rseq, priority, version (a ReadyGroup or a plain tuple).
Row = tuple[bytes, int, float, int | None]
# What a build reads its groups with (table_state.TableState.ready_groups): up to a limit of ready
# groups from an rseq on, with or without their records; the rseq to go on from; those lost.
ReadyGroups = Callable[[int, int, bool], tuple[list[ReadyGroup], int | None, list[str]]]
# After a table's prefix in the counters database: the databases of the lazy indexes
# (Index.lazy) the table keeps, comma separated. Absent (a table from before the mark): all.
IN_USE = b"indexes"
# After a table's prefix in the counters database: the lazy indexes being built, each as its first
# database's name = its cursor (`clear` while rows an earlier release left are deleted, then the
# rseq the build goes on from), comma separated.
BUILDING = b"building"
# The ready groups (or stale rows deleted) a build's transaction takes at most. In a large file a
# priority row lands on a page of its own (priorities are random) and a group's record is read
# from anywhere, so a chunk costs its rows' pages in the commit: at 2,048, pushes made during a
# build of 2.5 M groups waited 82 / 520 ms (p50 / p99); at 256, 29 / 100 ms, the build taking
# 2.4x as long (bench_growth.py --restart, a loaded 2-core machine).
BUILD_CHUNK = 256
_CLEAR = -1  # a build's cursor while it deletes stale rows


class IndexBuilding(Exception):
    """A request needs a lazy index its table does not keep yet; the caller waits while the
    store builds it in the background (index_builds.py) and tries the request again. Nothing
    of the request is kept: it is raised before the request changes anything it would keep.

    `first_use`: the table keeps the index from the first request that reads it (a rows table's),
    so the build is that request's own cost, which a records table paid at each push: the request
    waits for it whatever its own wait for data, where it would be refused past that wait on a
    table that lacks it since an earlier release."""

    def __init__(self, prefix: bytes, index: type[Index], *, first_use: bool = False) -> None:
        super().__init__(f"the index {index.__name__} of table {prefix!r} is being built")
        self.prefix, self.index, self.first_use = prefix, index, first_use


def in_use(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes) -> set[str] | None:
    """The index databases a table keeps; None: every one (a table from before the mark, or
    databases without the counters)."""
    if "counters" not in dbs:
        return None
    raw = txn.get(prefix + IN_USE, db=dbs["counters"])
    return None if raw is None else set(bytes(raw).decode("ascii").split(",")) - {""}


def mark_in_use(
    txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes, names: set[str]
) -> None:
    """Record the lazy indexes' databases a table keeps, in the transaction that builds them."""
    txn.put(prefix + IN_USE, ",".join(sorted(names)).encode("ascii"), db=dbs["counters"])


def builds(txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes) -> dict[str, int]:
    """The lazy indexes a table is building, by their first database's name: each one's cursor."""
    if "counters" not in dbs:
        return {}
    raw = txn.get(prefix + BUILDING, db=dbs["counters"])
    found = {}
    for part in bytes(raw or b"").decode("ascii").split(","):
        name, _, cursor = part.partition("=")
        if name:
            found[name] = _CLEAR if cursor == "clear" else int(cursor)
    return found


def _mark_builds(
    txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes, found: dict[str, int]
) -> None:
    if not found:
        txn.delete(prefix + BUILDING, db=dbs["counters"])
        return
    text = ",".join(f"{name}={'clear' if cursor == _CLEAR else cursor}" for name, cursor in sorted(found.items()))
    txn.put(prefix + BUILDING, text.encode("ascii"), db=dbs["counters"])


def forget_builds(
    txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes, indexes: Sequence[type[Index]]
) -> None:
    """Forget a table's builds under way of these indexes (their rows were emptied: a build
    starts over)."""
    found = builds(txn, dbs, prefix)
    if any(cls.databases[0] in found for cls in indexes):
        _mark_builds(
            txn, dbs, prefix, {name: at for name, at in found.items() if name not in {c.databases[0] for c in indexes}}
        )


def forget_kept(
    txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database], prefix: bytes, indexes: Sequence[type[Index]]
) -> None:
    """A table keeps these indexes no more (their rows were emptied: a rows table keeps one again from
    the next request that reads it)."""
    used, names = in_use(txn, dbs, prefix), {name for cls in indexes for name in cls.databases}
    if used is not None and used & names:
        mark_in_use(txn, dbs, prefix, used - names)


def keeps(used: set[str] | None, cls: type[Index], *, rows: bool = False) -> bool:
    """Whether a table whose mark is `used` keeps this index. A rows table (issue 64) keeps no ready
    order (its runs are that order) and, of the others, those its mark names, lazy or not: each from
    the first request that read it (`ReadyIndex`)."""
    if rows:
        return cls is not ReadyOrder and used is not None and set(cls.databases) <= used
    return not cls.lazy or used is None or set(cls.databases) <= used


def every_lazy(dbs: Mapping[str, lmdb._Database]) -> set[str]:
    """The databases of every lazy index the store opened: a new table's mark (it keeps them all)."""
    return {name for cls in orders.KEPT if cls.lazy and all(n in dbs for n in cls.databases) for name in cls.databases}


def kept_from_creation(dbs: Mapping[str, lmdb._Database], config: TableConfig) -> set[str]:
    """A new table's mark: every lazy index; a rows table's, none but the version index where it
    evicts stale groups (its pushes' and version reports' eviction reads it), since it keeps the
    others from the first request that reads them (`ReadyIndex`)."""
    if config.storage.layout != "rows":
        return every_lazy(dbs)
    return set(VersionIndex.databases) & set(dbs) if config.staleness.evict_stale else set()


class BuildStep(NamedTuple):
    """What one chunk of a build did: whether the table keeps the index now, the ready groups
    it indexed, and the ready groups whose records are lost, which it left out: its caller fails
    them in the same transaction (rules/quarantine.fail_lost_groups), so that no kept index
    lacks a ready group."""

    kept: bool
    groups: int
    lost: tuple[str, ...] = ()


class ReadyIndex:
    """The ready-group indexes of one table inside a transaction: those of the registered
    orders and the version index whose databases the store opened, of which the table keeps
    the eager ones and the lazy ones it was made with or has had built since. A request that
    needs a lazy one the table does not keep yet raises IndexBuilding; its caller waits while
    the store builds it chunk by chunk in the background (`build_step`, from `ready_groups`),
    after which the table keeps it. So no push ever waits for a whole build.

    A rows table (`rows`, issue 64) keeps its ready groups' order in its runs, not in the ready
    index, and keeps any other index only from the first request that read it (its mark starts
    empty; `keeps`): a table taken in fifo or lifo order alone writes nothing to them. Its groups'
    place in the ready order (a ReadyGroup's rseq) is their segment's id plus their index there."""

    def __init__(
        self,
        dbs: Mapping[str, lmdb._Database],
        txn: lmdb.Transaction[bytes],
        prefix: bytes,
        *,
        buildable: bool = False,
        rows: bool = False,
    ) -> None:
        # `buildable`: its table's state can read its ready groups for a build (`build_step`). The
        # state is passed to each build, never kept: a state that kept its index and an index that
        # kept its state would be a cycle, and the read transaction a dropped state names would
        # hold one of LMDB's reader slots until the garbage collector found the cycle.
        self.dbs, self.txn, self.prefix, self.buildable, self.rows = dbs, txn, prefix, buildable, rows
        self._made: dict[type[Index], Index] = {}  # made when first used: a request reads one or two
        self._kept: list[type[Index]] | None = None
        self._builds: dict[str, int] | None = None

    def opened(self) -> list[type[Index]]:
        """The indexes whose databases the store opened: the registered orders' and the version index."""
        return [cls for cls in orders.KEPT if all(name in self.dbs for name in cls.databases)]

    def kept(self) -> list[type[Index]]:
        """The opened indexes this table keeps."""
        if self._kept is None:
            used = in_use(self.txn, self.dbs, self.prefix)
            self._kept = [cls for cls in self.opened() if keeps(used, cls, rows=self.rows)]
        return self._kept

    def wanted(self) -> list[type[Index]]:
        """The opened indexes to build in the background from the open: those this table lacks (a
        rows table's: those whose build a request began, which it lacks only until then)."""
        building = self.building()
        return [cls for cls in self.opened() if cls not in self.kept() and (not self.rows or cls in building)]

    def indexing(self) -> bool:
        """Whether this table keeps or builds any index its groups' moves must reach (a rows table
        taken in fifo or lifo order alone keeps none)."""
        return bool(self.kept() or self.building())

    def building(self) -> dict[type[Index], int]:
        """The opened indexes this table is building, each with its cursor (_CLEAR: deleting
        stale rows; else the rseq the build goes on from: the groups before it are indexed)."""
        if self._builds is None:
            self._builds = builds(self.txn, self.dbs, self.prefix)
        return {cls: self._builds[cls.databases[0]] for cls in self.opened() if cls.databases[0] in self._builds}

    def of(self, cls: type[I]) -> I:
        """The index of one class; IndexBuilding when the table does not keep it yet (the caller
        builds it and asks again), refused when the store did not open it (its order was
        registered after the store opened)."""
        index = self._made.get(cls)
        if index is None:
            if self.rows and cls is ReadyOrder:
                raise InvalidRequest(
                    "a table of layout rows keeps its ready order as runs, not in the ready index: "
                    "an order that reads that index does not take from it"
                )
            if cls not in self.kept():
                if cls not in self.opened():
                    raise InvalidRequest(
                        f"the index {cls.__name__} ({', '.join(cls.databases)}) is not open in this store: "
                        "an order is registered before the store opens"
                    )
                if not self.buildable:
                    raise InvalidRequest(
                        f"the index {cls.__name__} is not kept by this table, and cannot be built here"
                    )
                raise IndexBuilding(self.prefix, cls, first_use=self.rows)
            index = self._made[cls] = cls(self.dbs, self.txn, self.prefix)
        return cast(I, index)

    def build_step(self, cls: type[Index], ready_groups: ReadyGroups, limit: int | None = None) -> BuildStep:
        """One chunk of the build of an index the table does not keep: up to `limit` (default
        BUILD_CHUNK) stale rows deleted (rows a release that kept every index wrote while it served the table), then up
        to `limit` ready groups indexed, from the cursor on in the ready order, as `ready_groups`
        reads them (table_state.TableState.ready_groups). The last chunk marks it kept."""
        if cls in self.kept():
            return BuildStep(True, 0)
        if not self.buildable:
            raise InvalidRequest(f"the index {cls.__name__} is not kept by this table, and cannot be built here")
        index, found = cls(self.dbs, self.txn, self.prefix), builds(self.txn, self.dbs, self.prefix)
        cursor = found.get(cls.databases[0], _CLEAR)
        budget = BUILD_CHUNK if limit is None else limit
        if cursor == _CLEAR:
            for name in cls.databases:
                budget -= index.clear(name, budget)
            if budget <= 0:
                found[cls.databases[0]] = _CLEAR
                self._saved(found)
                return BuildStep(False, 0)
            cursor = 0
        groups, after, lost = ready_groups(cursor, budget, cls.reads_records)
        index.add(groups)
        if after is not None:
            found[cls.databases[0]] = after
            self._saved(found)
            return BuildStep(False, len(groups), tuple(lost))
        found.pop(cls.databases[0], None)
        self._saved(found)
        used = in_use(self.txn, self.dbs, self.prefix) or set()
        mark_in_use(self.txn, self.dbs, self.prefix, used | set(cls.databases))
        self.kept().append(cls)
        return BuildStep(True, len(groups), tuple(lost))

    def _saved(self, found: dict[str, int]) -> None:
        _mark_builds(self.txn, self.dbs, self.prefix, found)
        self._builds = found

    @property
    def versions(self) -> VersionIndex:
        return self.of(VersionIndex)

    def _every(self) -> list[Index]:
        return [self.of(cls) for cls in self.kept()]

    def _partial(self) -> list[tuple[Index, int]]:
        """The indexes being built past their stale rows, each with its cursor."""
        return [(cls(self.dbs, self.txn, self.prefix), at) for cls, at in self.building().items() if at != _CLEAR]

    def add(self, gkey: bytes, rseq: int, priority: float, version: int | None) -> None:
        self.add_many([(gkey, rseq, priority, version)])

    def add_many(self, groups: Sequence[Row]) -> None:
        """Index groups that became ready, in that order: each index writes them in one pass
        (one being built, those before its cursor: the build reaches the others)."""
        if groups:
            rows = [ReadyGroup(*group) for group in groups]
            for index in self._every():
                index.add(rows)
            for index, at in self._partial():
                index.add([row for row in rows if row.rseq < at])

    def remove(self, gkey: bytes, rseq: int, priority: float, version: int | None) -> None:
        self.remove_many([(gkey, rseq, priority, version)])

    def remove_many(self, groups: Sequence[Row]) -> None:
        """Unindex groups that leave ready, in that order (from an index being built too, which
        holds those before its cursor: removing one it lacks changes nothing)."""
        if groups:
            rows = [ReadyGroup(*group) for group in groups]
            for index in self._every():
                index.remove(rows)
            for index, _ in self._partial():
                index.remove(rows)

    def move_many(self, before: Sequence[Row], after: Sequence[Row]) -> None:
        """Ready groups that got a new priority and place (`after[i]` is `before[i]` changed)."""
        if before:
            old, new = [ReadyGroup(*group) for group in before], [ReadyGroup(*group) for group in after]
            for index in self._every():
                index.move(old, new)
            for index, at in self._partial():
                index.remove(old)
                index.add([row for row in new if row.rseq < at])

    def verify(self, ready: Sequence[Row]) -> list[str]:
        """The problems of every kept index against the table's ready groups, of every index
        being built against those before its cursor, and the rows of an opened index the table
        neither keeps nor builds (which belong nowhere)."""
        rows = [ReadyGroup(*group) for group in ready]
        problems = [problem for index in self._every() for problem in index.verify(rows)]
        for index, at in self._partial():
            problems += index.verify([row for row in rows if row.rseq < at])
        building = self.building()
        for cls in self.opened():
            if cls not in self.kept() and cls not in building:
                index = cls(self.dbs, self.txn, self.prefix)
                for name in cls.databases:
                    if index.entries(name, bare=True):
                        problems.append(
                            f"the {name} index holds {index.entries(name, bare=True)} rows, "
                            "but the table does not keep it (it was never read in its order)"
                        )
        return problems

    def lost(self, gkey: bytes, version: int | None, priority: float) -> ReadyGroup | None:
        """A ready group whose record is lost, as the indexes hold it (so that it can leave them):
        its place from the ready order, its priority from the version or the priority index where
        the table keeps one (a replayed group's is its own, reuse.py), else `priority`, its
        members' highest, as its completion gave it; its lowest `version` its members say. None:
        the ready order does not name it."""
        rseq = self.of(ReadyOrder).rseq_of(gkey)
        if rseq is None:
            return None
        kept, held = self.kept(), None
        if version is not None and VersionIndex in kept:
            held = self.versions.priority_of(gkey, rseq, version)
        if held is None and PriorityIndex in kept:
            held = self.of(PriorityIndex).priority_of(gkey, rseq)
        return ReadyGroup(gkey, rseq, priority if held is None else held, version)

    def below_version(self, version: int, limit: int) -> list[str]:
        """Up to `limit` ready groups whose lowest version is below `version`, lowest first."""
        return self.versions.below(version, limit)

    def candidates(self, order: str, rng: random.Random, min_version: int | None = None) -> Generator[bytes]:
        """Ready group keys in the named order, each at most once, lazily (a generator: closing it
        closes the cursors the order reads from). With `min_version`, only groups whose lowest
        version is at least that (from `byver`)."""
        if order not in ORDERS:
            raise ValueError(f"order is {order!r}; expected one of {', '.join(ORDERS)}")
        chosen = ORDERS[order]()
        yield from chosen.candidates(self, rng) if min_version is None else chosen.fresh(self, min_version, rng)
