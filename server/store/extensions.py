"""Table extensions, after Reverb's `TableExtension`: a rule that keeps state of its own (an
index, a queue) or acts at a table's events plugs in here instead of being written into the
group rules.

An extension is one class overriding the events it needs; a Store runs the ones registered
with it (`Store.extensions.register`) in every table's transaction, in the order registered.
The events come from inside the writer's transaction: what an extension writes commits, or
is undone, with the request that raised the event. The store's own extensions are the
compute queue (compute_queue.py), the eviction of stale groups (staleness.py) and the
prompt ledger (ledger.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from .records import GroupRecord
from .table_state import Groups, TableState

E = TypeVar("E", bound="TableExtension")


class TableExtension:
    """The events of a table; each does nothing unless overridden."""

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        """A push is about to store new experiences into these groups (before the group rules
        look at them): an extension may refuse it by raising a StoreError, and then nothing
        of it is stored."""

    def on_insert(self, tt: TableState, uids: Sequence[str]) -> None:
        """A push stored these new experiences (duplicates and stale ones excluded)."""

    def on_update(self, tt: TableState, gkey: str, grp: GroupRecord, was: str) -> None:
        """A group moved from live state `was` to another live one (`grp.state`): it completed
        (pending → computing or ready), its advantages were stored, it was leased or requeued."""

    def on_sample(self, tt: TableState, groups: Groups) -> None:
        """A batch of these groups was taken (any delivery)."""

    def on_retire(self, tt: TableState, groups: Groups, state: str) -> None:
        """These live groups leave the table as `state`: consumed, evicted, dropped, failed, or
        DELETED (records.py); `grp.state` is still their last live state."""

    def on_version(self, tt: TableState) -> None:
        """The table's trainer version moved (a trainer's report, or an admin's reset)."""

    def on_upkeep(self, tt: TableState) -> int:
        """The periodic upkeep visits the table; returns the groups it removed."""
        return 0


class Extensions:
    """The extensions of a Store, run at each table's events (table_state.Events)."""

    def __init__(self, extensions: Sequence[TableExtension] = ()) -> None:
        self._all: list[TableExtension] = list(extensions)

    def register(self, extension: E) -> E:
        """Run `extension` at every table's events from the next request on."""
        if not isinstance(extension, TableExtension):
            raise TypeError(f"{extension!r} is not a TableExtension")
        self._all.append(extension)
        return extension

    def __iter__(self) -> Iterator[TableExtension]:
        return iter(self._all)

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        for ext in self._all:
            ext.on_push(tt, gkeys)

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
