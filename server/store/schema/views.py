"""A group and an experience as code outside the table core reads them: views, read-only.

The rules, the prompt ledger, the events the extensions hear, the compute queue's jobs and the
batch stage read a table's groups as `GroupView`s and its experiences as `MemberView`s, never the
records the table core keeps, and change them only through the core's verbs: so the core may keep
them as it likes (issue 64: records today, rows per batch of groups next). The views are protocols:
what the core hands out has these attributes (today its records do), and mypy holds the code that
reads views to reading them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from .states import State


class GroupView(Protocol):
    """A group: its state, its members' uids in push order, the runs its workers reported failed
    (uid -> reason) and the lease holding it ("" for none)."""

    @property
    def state(self) -> State: ...
    @property
    def members(self) -> Sequence[str]: ...
    @property
    def failed(self) -> Mapping[str, str]: ...
    @property
    def lease(self) -> str: ...
    @property
    def under_lease(self) -> bool: ...


class MemberView(Protocol):
    """An experience: its state and group, its payload's digest and size, its place in the table's
    insertion order (`seq`), what the estimators, staleness and reuse read of it."""

    @property
    def state(self) -> State: ...
    @property
    def group(self) -> str: ...
    @property
    def digest(self) -> bytes: ...
    @property
    def size(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def tid(self) -> str: ...
    @property
    def rid(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def response_length(self) -> int: ...
    @property
    def generated(self) -> int: ...
    @property
    def version(self) -> int | None: ...
    @property
    def reward(self) -> float | None: ...
    @property
    def priority(self) -> float: ...
    @property
    def times_sampled(self) -> int: ...
    @property
    def advantage(self) -> float | None: ...
    @property
    def shaped_reward(self) -> float | None: ...
    @property
    def segments(self) -> tuple[int, ...]: ...


# Groups as the verbs and events name them: key and view.
Groups = Sequence[tuple[str, GroupView]]
# A group with its members' views (uid -> view), as the verbs that move groups take them.
Members = tuple[str, GroupView, Mapping[str, MemberView]]
