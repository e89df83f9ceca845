"""Table extensions, after Reverb's `TableExtension`: a rule that keeps state of its own (an
index, a queue) or acts at a table's events plugs in here instead of being written into the
group rules.

An extension is one class overriding the events it needs, and one registration: a Store
registers its kind under a name (`Store.register_extension("journal", Journal)`, or
`Store(extensions={...})` for the tables a data directory holds already), and a table runs
the kinds its configuration names (`TableConfig.extensions`), each as an instance of its own,
so an extension may keep per-table state. The store's own rules follow from a table's other
settings and run only on the tables that need them (engine.py): the compute queue
(core/compute.py) where the estimator computes, the eviction of stale groups (staleness.py)
where `evict_stale`, the prompt ledger (ledger.py) where the table groups by task and so may
hold datasets. The events come from inside the writer's transaction: what an extension writes
commits, or is undone, with the request that raised the event.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..core.events import Groups, TableExtension
from ..core.state import TableState
from ..disk.records import GroupRecord
from ..schema.errors import clip
from ..schema.table_config import EXTENSION_NAME


class Extensions:
    """One table's extensions, run at its events (core/events.py) in order."""

    def __init__(self, extensions: Sequence[TableExtension] = ()) -> None:
        self._all: list[TableExtension] = list(extensions)

    def add(self, extension: TableExtension) -> None:
        self._all.append(extension)

    def __iter__(self) -> Iterator[TableExtension]:
        return iter(self._all)

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        for ext in self._all:
            ext.on_push(tt, gkeys)

    def on_resend(self, tt: TableState, gkeys: Sequence[str]) -> None:
        for ext in self._all:
            ext.on_resend(tt, gkeys)

    def on_insert(self, tt: TableState, uids: Sequence[str]) -> None:
        for ext in self._all:
            ext.on_insert(tt, uids)

    def on_update(self, tt: TableState, gkey: str, grp: GroupRecord, was: str) -> None:
        for ext in self._all:
            ext.on_update(tt, gkey, grp, was)

    def on_sample(self, tt: TableState, groups: Groups) -> None:
        for ext in self._all:
            ext.on_sample(tt, groups)

    def on_retire(self, tt: TableState, groups: Groups, state: str) -> None:
        for ext in self._all:
            ext.on_retire(tt, groups, state)

    def on_version(self, tt: TableState) -> None:
        for ext in self._all:
            ext.on_version(tt)

    def on_upkeep(self, tt: TableState) -> int:
        return sum(ext.on_upkeep(tt) for ext in self._all)


class ExtensionKinds:
    """The extension kinds a Store knows, by the names tables give them."""

    def __init__(self) -> None:
        self._kinds: dict[str, type[TableExtension]] = {}

    def register(self, name: str, kind: type[TableExtension], *, replace: bool = False) -> type[TableExtension]:
        """Let tables name `kind` as `name`; each table that does runs an instance of its own,
        made with no arguments. A name taken is refused unless `replace`."""
        if not isinstance(kind, type) or not issubclass(kind, TableExtension):
            raise TypeError(f"{kind!r} is not a TableExtension class")
        if not isinstance(name, str) or not EXTENSION_NAME.match(name):
            raise ValueError(
                f"extension name {clip(repr(name), 60)} must start with a letter and hold "
                "1-64 letters, digits, '_', '.' or '-'"
            )
        if name in self._kinds and not replace and self._kinds[name] is not kind:
            raise ValueError(
                f"extension {name!r} is registered already ({self._kinds[name].__name__}); pass replace=True"
            )
        self._kinds[name] = kind
        return kind

    def names(self) -> list[str]:
        return sorted(self._kinds)

    def unknown(self, names: Sequence[str]) -> list[str]:
        """The names among `names` that no kind is registered under."""
        return [name for name in names if name not in self._kinds]

    def make(self, names: Sequence[str]) -> list[TableExtension]:
        """An instance of each kind named, in order (every name registered: see `unknown`)."""
        return [self._kinds[name]() for name in names]

    def refusal(self, table: str, names: Sequence[str]) -> str:
        """What a table naming kinds not registered is told."""
        missing = ", ".join(repr(name) for name in self.unknown(names))
        return (
            f"table '{table}' runs table extension(s) {missing}, which this server has not registered "
            f"(registered: {', '.join(self.names()) or 'none'})"
        )
