"""The events of a table, after Reverb's `TableExtension`: what one step of a request did to a
batch of groups (`Moved`, `Pushed`, `Resent`, `Inserted`, `Taken`, `Retired`), `Events`, what the
table state and the rules raise them through (a protocol, so that the state imports no
extension), and `TableExtension`, the class an extension subclasses, overriding the events it
needs (rules/extensions.py runs a table's extensions, knows their kinds, and calls an extension
written for the per-group hooks of earlier releases through an adapter).

Each event comes once per step of a request with every group the step moved, never once per
group inside the step's loop: an extension pays its reads and writes once a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ...schema.states import State
from ...schema.views import Groups

if TYPE_CHECKING:
    from .state import TableState


@dataclass(frozen=True, slots=True)
class Moved:
    """Live groups that went from live state `was` to live state `now` in one step: completed
    (pending → computing or ready), their advantages stored (computing → ready), leased, given
    back, cooled or warmed. Their records say `now` already."""

    was: State
    now: State
    groups: Groups


@dataclass(frozen=True, slots=True)
class Pushed:
    """A request is about to store into these groups, before the group rules look at them: a
    push's new experiences or pieces of rollouts (`call` "push"), runs reported failed
    ("FailRuns"), a seal ("Seal"). `holder` is who makes it (the token its caller named; "" where
    the server has none), which a refusal may name with the call."""

    gkeys: Sequence[str]
    holder: str = ""
    call: str = "push"


@dataclass(frozen=True, slots=True)
class Resent:
    """A push sends again what these groups hold already (duplicates, answered as stored, and
    pieces of rollouts held or finished), before the push hears it was a copy; `holder` and
    `call` as Pushed's."""

    gkeys: Sequence[str]
    holder: str = ""
    call: str = "push"


@dataclass(frozen=True, slots=True)
class Inserted:
    """A push stored these new experiences (duplicates and stale ones excluded)."""

    uids: Sequence[str]


@dataclass(frozen=True, slots=True)
class Taken:
    """A batch of these groups was taken, delivered as `delivery`: "consume", "replay", or
    "lease" (a batch held for a stream until its client confirms it is leased too)."""

    groups: Groups
    delivery: str


@dataclass(frozen=True, slots=True)
class Retired:
    """These live groups leave the table as `state`: consumed, evicted, dropped, failed, or
    DELETED (disk/records.py); each record's state is still its last live one."""

    groups: Groups
    state: str


class Events(Protocol):
    """The events of a table its extensions hear (`TableExtension` says when each comes): the
    state raises `on_moved`, the rules the others."""

    def on_pushed(self, tt: TableState, event: Pushed) -> None: ...
    def on_resent(self, tt: TableState, event: Resent) -> None: ...
    def on_inserted(self, tt: TableState, event: Inserted) -> None: ...
    def on_moved(self, tt: TableState, event: Moved) -> None: ...
    def on_taken(self, tt: TableState, event: Taken) -> None: ...
    def on_retired(self, tt: TableState, event: Retired) -> None: ...
    def on_version(self, tt: TableState) -> None: ...
    def on_upkeep(self, tt: TableState) -> int: ...
    def hears(self, name: str) -> bool:
        """Whether any extension hears the event `name` ("on_moved", ...): a step whose event costs
        views to make (a rows table's groups) makes them only then."""
        ...


class TableExtension:
    """The events of a table; each does nothing unless overridden. Each comes from inside the
    request's write transaction, once per step of the request with all the groups it moved."""

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        """A request is about to store into `event.gkeys` (Pushed): an extension may refuse it by
        raising a StoreError, and then nothing of it is stored."""

    def on_resent(self, tt: TableState, event: Resent) -> None:
        """A push sends again what `event.gkeys` hold already: an extension may refuse it as
        on_pushed may a new one, before the push hears it was a copy."""

    def on_inserted(self, tt: TableState, event: Inserted) -> None:
        """A push stored `event.uids`, new experiences."""

    def on_moved(self, tt: TableState, event: Moved) -> None:
        """Groups moved from live state `event.was` to live state `event.now` in one step."""

    def on_taken(self, tt: TableState, event: Taken) -> None:
        """A batch of `event.groups` was taken (any delivery)."""

    def on_retired(self, tt: TableState, event: Retired) -> None:
        """Live groups leave the table as `event.state`, before their records change."""

    def on_version(self, tt: TableState) -> None:
        """The table's trainer version moved (a trainer's report, or an admin's reset)."""

    def on_upkeep(self, tt: TableState) -> int:
        """The periodic upkeep visits the table; returns the groups it removed."""
        return 0

    def hears(self, name: str) -> bool:
        """Whether this extension hears the event `name` (overrides its hook): the store asks before
        it makes views only an event would read."""
        return getattr(type(self), name) is not getattr(TableExtension, name)
