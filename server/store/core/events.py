"""The events of a table, after Reverb's `TableExtension`: `Events`, what the table state and
the rules raise (a protocol, so that the state imports no extension), and `TableExtension`, the
class an extension subclasses, overriding the events it needs (rules/extensions.py runs a
table's extensions and knows their kinds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ..disk.records import GroupRecord

if TYPE_CHECKING:
    from .state import TableState

Groups = Sequence[tuple[str, GroupRecord]]


class Events(Protocol):
    """The events of a table its extensions hear (`TableExtension` says when each comes): the
    state raises `on_update`, the rules the others."""

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None: ...
    def on_resend(self, tt: TableState, gkeys: Sequence[str]) -> None: ...
    def on_insert(self, tt: TableState, uids: Sequence[str]) -> None: ...
    def on_update(self, tt: TableState, gkey: str, grp: GroupRecord, was: str) -> None: ...
    def on_sample(self, tt: TableState, groups: Groups) -> None: ...
    def on_retire(self, tt: TableState, groups: Groups, state: str) -> None: ...
    def on_version(self, tt: TableState) -> None: ...
    def on_upkeep(self, tt: TableState) -> int: ...


class TableExtension:
    """The events of a table; each does nothing unless overridden."""

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        """A push is about to store new experiences into these groups (before the group rules
        look at them): an extension may refuse it by raising a StoreError, and then nothing
        of it is stored."""

    def on_resend(self, tt: TableState, gkeys: Sequence[str]) -> None:
        """A push sends again what these groups hold already (duplicates, answered as stored, and
        pieces of rollouts held or finished): an extension may refuse it as on_push may a new one,
        before the push hears it was a copy."""

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
