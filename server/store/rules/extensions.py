"""Table extensions, after Reverb's `TableExtension`: a rule that keeps state of its own (an
index, a queue) or acts at a table's events plugs in here instead of being written into the
group rules.

An extension is one class overriding the events it needs, and one registration: a Store
registers its kind under a name (`Store.register_extension("journal", Journal)`, or
`Store(extensions={...})` for the tables a data directory holds already), and a table runs
the kinds its configuration names (`TableConfig.extensions`), each as an instance of its own,
so an extension may keep per-table state. The store's own rules follow from a table's other
settings and run only on the tables that need them (tables/catalog.py): the eviction of stale
groups (staleness.py) where `evict_stale`, the prompt ledger (ledger/rules.py) where the table
groups by task and so may hold datasets. The events come from inside the writer's transaction,
once per step of a request with all the groups it moved (core/table_state/events.py): what an extension
writes commits, or is undone, with the request that raised the event.

An extension written for the hooks of earlier releases, one call per group moved
(`on_update(tt, gkey, grp, was)`) and positional arguments (`on_push(tt, gkeys)`, ...), is
called through an adapter for one release (`EARLIER`), and its registration warns
(DeprecationWarning), naming the hooks that replace them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..core.table_state.events import Inserted, Moved, Pushed, Resent, Retired, TableExtension, Taken
from ..core.table_state.state import TableState
from ..schema.errors import clip
from ..schema.table_config import EXTENSION_NAME

# What one extension does at one event: its hook, or an adapter calling a hook of earlier releases.
Hook = Callable[[TableState, Any], None]


def _gkeys(old: Callable[..., None]) -> Hook:
    return lambda tt, event: old(tt, event.gkeys)


def _uids(old: Callable[..., None]) -> Hook:
    return lambda tt, event: old(tt, event.uids)


def _per_group(old: Callable[..., None]) -> Hook:
    def moved(tt: TableState, event: Moved) -> None:
        for gkey, grp in event.groups:
            old(tt, gkey, grp, event.was)

    return moved


def _groups(old: Callable[..., None]) -> Hook:
    return lambda tt, event: old(tt, event.groups)


def _retired(old: Callable[..., None]) -> Hook:
    return lambda tt, event: old(tt, event.groups, event.state)


# The hooks of earlier releases, by the hook that replaced each: its signature, the new one's,
# and how the new event calls it. An extension that overrides one (and not its new one) is
# called through it for one release, and its registration warns.
EARLIER: dict[str, tuple[str, str, Callable[[Callable[..., None]], Hook]]] = {
    "on_pushed": ("on_push(tt, gkeys)", "on_pushed(tt, event: Pushed)", _gkeys),
    "on_resent": ("on_resend(tt, gkeys)", "on_resent(tt, event: Resent)", _gkeys),
    "on_inserted": ("on_insert(tt, uids)", "on_inserted(tt, event: Inserted)", _uids),
    "on_moved": ("on_update(tt, gkey, grp, was)", "on_moved(tt, event: Moved)", _per_group),
    "on_taken": ("on_sample(tt, groups)", "on_taken(tt, event: Taken)", _groups),
    "on_retired": ("on_retire(tt, groups, state)", "on_retired(tt, event: Retired)", _retired),
}


def _name(signature: str) -> str:
    return signature.partition("(")[0]


def earlier_hooks(kind: type) -> list[str]:
    """The new hooks whose earlier form `kind` overrides, and not the new one."""
    return [
        new
        for new, (old, _, _) in EARLIER.items()
        if hasattr(kind, _name(old)) and getattr(kind, new) is getattr(TableExtension, new)
    ]


def warn_earlier(kind: type, stacklevel: int) -> None:
    """Warn, at an extension's registration, that it overrides hooks of earlier releases, naming
    the hooks that replace them."""
    found = earlier_hooks(kind)
    if found:
        moves = "; ".join(f"{EARLIER[new][0]} -> {EARLIER[new][1]}" for new in found)
        warnings.warn(
            f"TableExtension hooks of earlier releases are deprecated and go in the next release: "
            f"{kind.__name__} overrides {moves} (core/table_state/events.py); "
            "it is called through an adapter until then",
            DeprecationWarning,
            stacklevel=stacklevel + 1,
        )


def _hooks(ext: TableExtension) -> dict[str, Hook]:
    """What `ext` does at each event it hears: the hook it overrides, or an adapter to its
    earlier form; the events it overrides neither of are left out (nothing to call)."""
    kind, hooks = type(ext), {}
    for new, (old, _, adapt) in EARLIER.items():
        if getattr(kind, new) is not getattr(TableExtension, new):
            hooks[new] = getattr(ext, new)
        elif hasattr(kind, _name(old)):
            hooks[new] = adapt(getattr(ext, _name(old)))
    return hooks


class Extensions:
    """One table's extensions, run at its events (core/table_state/events.py) in order: each event calls
    only the extensions that override it."""

    def __init__(self, extensions: Sequence[TableExtension] = ()) -> None:
        self._all: list[TableExtension] = []
        self._hear: dict[str, list[Hook]] = {new: [] for new in EARLIER}
        for extension in extensions:
            self.add(extension)

    def add(self, extension: TableExtension) -> None:
        self._all.append(extension)
        for new, hook in _hooks(extension).items():
            self._hear[new].append(hook)

    def __iter__(self) -> Iterator[TableExtension]:
        return iter(self._all)

    def hears(self, name: str) -> bool:
        return bool(self._hear[name])

    def _each(self, name: str, tt: TableState, event: object) -> None:
        """Each extension that hears event `name`, in order."""
        for hook in self._hear[name]:
            hook(tt, event)

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        self._each("on_pushed", tt, event)

    def on_resent(self, tt: TableState, event: Resent) -> None:
        self._each("on_resent", tt, event)

    def on_inserted(self, tt: TableState, event: Inserted) -> None:
        self._each("on_inserted", tt, event)

    def on_moved(self, tt: TableState, event: Moved) -> None:
        self._each("on_moved", tt, event)

    def on_taken(self, tt: TableState, event: Taken) -> None:
        self._each("on_taken", tt, event)

    def on_retired(self, tt: TableState, event: Retired) -> None:
        self._each("on_retired", tt, event)

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
        warn_earlier(kind, stacklevel=3)  # the caller of Store(extensions=...) or Store.register_extension
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
