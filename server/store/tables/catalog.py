"""The table catalog: every table's name, id and configuration, read at open and kept in
memory (the `tables` database is its durable form), each table's extensions, and the door to
a table's state in a transaction, with its extensions attached.

The memory follows the disk after each create and drop commits; until then a request in the same
batch (one queued after a drop) still finds the table there. So the door checks the table's
stored record in the request's own transaction (`holds`: the record's bytes as memory knows them)
and refuses one dropped, or dropped and made again, NotFound: nothing of it is stored under a
table that is gone. And each create and drop sets memory from the stored record once committed,
under a lock, so that a drop and a create of one name in one batch leave memory as they left the
disk whichever of their callers wakes first."""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import lmdb
import xxhash

from ..core.ordering import ready
from ..core.table_state.counters import read_counters
from ..core.table_state.events import TableExtension
from ..core.table_state.state import TableState
from ..core.verbs import leases
from ..disk import layout
from ..disk.batch_rows import Reader
from ..disk.environment import Environment
from ..ledger.rules import Ledger
from ..rules.extensions import ExtensionKinds, Extensions, warn_earlier
from ..rules.staleness import StaleEviction
from ..schema.errors import ConfigError, Conflict, NotFound, StoreError, clip
from ..schema.table_config import CONFIG_VERSION, TableConfig, differences, never_serves
from . import admission

_NO_EXTENSIONS = Extensions()
E = TypeVar("E", bound=TableExtension)


class TableCatalog:
    """The tables of one data directory. A table's extensions are made when it is read at open
    or created: the store's own rules its settings call for, then an instance of each kind it
    names (`kinds`); a stored table naming a kind not registered fails the open."""

    def __init__(
        self, environment: Environment, kinds: ExtensionKinds, ledger: Ledger, clock: Callable[[], float]
    ) -> None:
        self.environment, self.kinds, self.ledger, self.clock = environment, kinds, ledger, clock
        self.db = environment.db
        self._tables: dict[str, tuple[int, TableConfig]] = {}
        self._names: dict[int, str] = {}  # table id -> name
        self._extensions: dict[int, Extensions] = {}  # table id -> its extensions
        self._stamps: dict[int, int] = {}  # table id -> the hash of its stored record (`holds`)
        self._changing = threading.Lock()  # a create's or a drop's memory set from the disk (`_settle`)
        self._stale_eviction = StaleEviction()  # stateless: one serves every table that runs it
        self._everywhere: list[TableExtension] = []  # run on every table (Store.extensions, deprecated)
        with environment.read() as txn:
            for name, raw in txn.cursor(db=self.db["tables"]):
                record = json.loads(raw)
                config = TableConfig.from_stored(record["config"], record.get("v", 1))
                if kinds.unknown(config.extensions):
                    raise StoreError(
                        f"{kinds.refusal(config.name, config.extensions)}: register each kind it names before the "
                        "data directory opens (Store(extensions={NAME: Kind}), ExpbufServer(config, extensions=...))"
                    )
                self._add(name.decode(), record["id"], config, raw)

    def _add(self, name: str, table_id: int, config: TableConfig, raw: bytes) -> None:
        self._tables[name] = (table_id, config)
        self._names[table_id] = name
        self._stamps[table_id] = _stamp(raw)
        if table_id not in self._extensions:  # a table found again (exist_ok) keeps its instances
            self._extensions[table_id] = Extensions(
                [*self._own(config), *self.kinds.make(config.extensions), *self._everywhere]
            )

    def _own(self, config: TableConfig) -> list[TableExtension]:
        """The store's own rules a table's settings call for, and no others: stale eviction where
        it evicts stale groups, the prompt ledger where it groups by task (the tables that may
        hold datasets)."""
        own: list[TableExtension] = []
        if config.staleness.evict_stale:
            own.append(self._stale_eviction)
        if config.grouping.by == "task":
            own.append(self.ledger)
        return own

    def run_everywhere(self, extension: TableExtension) -> None:
        """Run `extension` on every table, those created later too (Store.extensions, deprecated)."""
        self._everywhere.append(extension)
        for extensions in self._extensions.values():
            extensions.add(extension)

    def extensions_of(self, table: str) -> tuple[TableExtension, ...]:
        """A table's extensions, in the order they run."""
        return tuple(self._extensions[self.lookup(table)[0]])

    # ---- lookups -------------------------------------------------------------------------

    def lookup(self, name: str) -> tuple[int, TableConfig]:
        """A table's id and configuration; NotFound names a missing one."""
        try:
            return self._tables[name]
        except KeyError:
            raise NotFound(f"table '{clip(name)}' does not exist") from None

    def stored_id(self, txn: lmdb.Transaction[bytes], name: str) -> int | None:
        """The id the table named has in `txn` (None: there is none), read from its record: a write
        in the same batch as a drop of the table sees it gone, where lookup() still has it until
        the drop's commit."""
        raw = txn.get(name.encode(), db=self.db["tables"])
        return None if raw is None else int(json.loads(raw)["id"])

    def has(self, name: str, table_id: int | None = None) -> bool:
        """Whether a table of that name exists (with id `table_id`, where given: not one made again
        under the name since)."""
        found = self._tables.get(name)
        return found is not None and table_id in (None, found[0])

    def configs(self) -> list[TableConfig]:
        """Every table's configuration, in the order they were created."""
        return [config for _, config in self.entries()]

    def entries(self) -> list[tuple[int, TableConfig]]:
        return sorted(self._tables.values(), key=lambda t: t[0])

    def by_id(self, table_id: int) -> tuple[str, TableConfig] | None:
        """A table id's name and configuration; None for a dropped table."""
        name = self._names.get(table_id)
        if name is None or name not in self._tables:
            return None
        return name, self._tables[name][1]

    # ---- a table's state in a transaction --------------------------------------------------

    def holds(self, txn: Reader, table_id: int, name: str) -> bool:
        """Whether `txn` holds table `table_id` under `name` as memory knows it: not dropped, nor
        dropped and made again, by a request before this one in its batch."""
        raw = txn.get(name.encode(), db=self.db["tables"])
        return raw is not None and _stamp(raw) == self._stamps.get(table_id)

    def state(
        self, txn: lmdb.Transaction[bytes], table_id: int, config: TableConfig, now: float | None = None
    ) -> TableState:
        """A table's state in `txn`; NotFound where `txn` no longer holds the table (`holds`)."""
        if not self.holds(txn, table_id, config.name):
            raise NotFound(f"table '{clip(config.name)}' does not exist")
        return self._state(txn, table_id, config, now)

    def state_of(self, txn: lmdb.Transaction[bytes], table_id: int) -> TableState | None:
        """The state of the table with this id; None for a dropped table."""
        table = self.by_id(table_id)
        if table is None or not self.holds(txn, table_id, table[0]):
            return None
        return self._state(txn, table_id, table[1])

    def _state(
        self, txn: lmdb.Transaction[bytes], table_id: int, config: TableConfig, now: float | None = None
    ) -> TableState:
        extensions = self._extensions.get(table_id, _NO_EXTENSIONS)
        now = self.clock() if now is None else now
        return TableState(txn, self.db, table_id, config, now, extensions, self.environment.views)

    # ---- changes -------------------------------------------------------------------------

    def create(self, config: TableConfig, *, exist_ok: bool = False) -> bool:
        """Create a table; True if created. An identical existing table is fine with exist_ok. A
        table naming an extension kind not registered is refused (ConfigError)."""
        return self.create_all([config], exist_ok=exist_ok)[0]

    def create_all(self, configs: Sequence[TableConfig], *, exist_ok: bool = False) -> list[bool]:
        """Create tables as `create` does, in one transaction: all of them, or none where one is
        refused (a server's [[tables]] blocks, so that a start refused for a later block leaves no
        table of the blocks before it). Whether each was created."""
        for config in configs:
            if self.kinds.unknown(config.extensions):
                raise ConfigError(self.kinds.refusal(config.name, config.extensions))
        if any(config.storage.layout == "rows" for config in configs):
            self.environment.open_rows()
        made = self.environment.submit(lambda txn: [self._made(txn, config, exist_ok=exist_ok) for config in configs])
        for config, (_, table_id, raw) in zip(configs, made, strict=True):
            self._settle(config.name, table_id, config, raw)
        return [created for created, _, _ in made]

    def _made(self, txn: lmdb.Transaction[bytes], config: TableConfig, *, exist_ok: bool) -> tuple[bool, int, bytes]:
        """The table's record made in `txn` where it is not there yet: whether it was, its id and record."""
        db = self.db
        raw = txn.get(config.name.encode(), db=db["tables"])
        never = never_serves(config)
        if raw is None and never is not None:  # one made before this check is left as it is
            raise ConfigError(never)
        if raw is not None:
            record = json.loads(raw)
            if not exist_ok:
                raise Conflict(f"table '{config.name}' already exists")
            other = differences(TableConfig.from_stored(record["config"], record.get("v", 1)), config)
            if other:
                raise Conflict(f"table '{config.name}' already exists with other settings: {'; '.join(other)}")
            return False, record["id"], bytes(raw)
        table_id = int(txn.get(b"next_table_id", b"1", db=db["meta"]))
        txn.put(b"next_table_id", str(table_id + 1).encode(), db=db["meta"])
        record = {"id": table_id, "config": config.to_stored(), "created": self.clock(), "v": CONFIG_VERSION}
        stored = json.dumps(record).encode()
        txn.put(config.name.encode(), stored, db=db["tables"])
        # A new table keeps every index from its creation, so that no request in a new order
        # waits for a build (index_builds.py says why); the mark names them all, so an order
        # registered later has its index built in the background. A rows table (issue 64)
        # keeps one from the first request that reads it (ready.ReadyIndex), but the version
        # index where it evicts stale groups, which a push's version report reads.
        ready.mark_in_use(txn, db, layout.table_prefix(table_id), ready.kept_from_creation(db, config))
        return True, table_id, stored

    def drop(self, name: str) -> int:
        """Delete a table and everything in it; returns the live experiences dropped."""
        table_id, _ = self.lookup(name)
        prefix, db = layout.table_prefix(table_id), self.db

        def op(txn: lmdb.Transaction[bytes]) -> int:
            counters = read_counters(txn, db, prefix)
            txn.delete(name.encode(), db=db["tables"])
            for part in layout.per_table(db):
                with txn.cursor(db=db[part]) as cur:
                    if cur.set_range(prefix):
                        while cur.key().startswith(prefix) and cur.delete():
                            pass
            leases.drop_table(txn, db, table_id)
            admission.drop_table(txn, db, table_id)
            return counters.live()

        dropped = self.environment.submit(op)
        self._settle(name, table_id)
        return dropped

    def _settle(self, name: str, table_id: int, config: TableConfig | None = None, raw: bytes = b"") -> None:
        """Memory set from the disk once a create (`config`, the record it found or wrote: `raw`) or a
        drop of table `table_id` under `name` has committed: kept (a create's) where the disk holds
        that record now, else forgotten, and the name's entry left to another table of the name."""
        with self._changing, self.environment.read() as txn:
            now = txn.get(name.encode(), db=self.db["tables"])
            if config is not None and now is not None and _stamp(now) == _stamp(raw):
                self._add(name, table_id, config, raw)
                return
            if self._tables.get(name, (None,))[0] == table_id:
                del self._tables[name]
            self._names.pop(table_id, None)
            self._extensions.pop(table_id, None)
            self._stamps.pop(table_id, None)


class EveryTable:
    """`Store.extensions` of earlier releases, deprecated: `register(extension)` runs that one
    instance on every table."""

    def __init__(self, catalog: TableCatalog) -> None:
        self._catalog = catalog

    def register(self, extension: E) -> E:
        warnings.warn(
            "Store.extensions.register(extension) is deprecated and goes in the next release: register the "
            "extension's kind with Store.register_extension(name, Kind) and name it in the tables that run it "
            "(TableConfig extensions)",
            DeprecationWarning,
            stacklevel=2,
        )
        if not isinstance(extension, TableExtension):
            raise TypeError(f"{extension!r} is not a TableExtension")
        warn_earlier(type(extension), stacklevel=2)
        self._catalog.run_everywhere(extension)
        return extension


def _stamp(raw: bytes | memoryview) -> int:
    """A stored table record's hash: which record of a name memory knows (`TableCatalog.holds`)."""
    return xxhash.xxh3_64_intdigest(raw)
