"""What the reads of named experiences return: the experiences found with the uids not stored
(`GetResult`, from `get`), and a page of a table's live experiences (`ExperiencePage` of
`ListedExperience`, from `list_experiences`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..schema.experience import Experience


class GetResult(list[Experience]):
    """The experiences found (a list, as before) and `missing_uids`, the requested uids not stored."""

    def __init__(self, experiences: Iterable[Experience], missing_uids: Iterable[str]) -> None:
        super().__init__(experiences)
        self.missing_uids = list(missing_uids)

    def __repr__(self) -> str:
        """A summary: the experiences' tensors would print in full."""
        return f"GetResult(experiences={len(self)}, missing_uids={len(self.missing_uids)})"


@dataclass(frozen=True)
class ListedExperience:
    """A live experience as `list_experiences` lists it; its payload comes from `get`."""

    uid: str
    group_id: str
    state: str  # pending | computing | ready | leased
    model_version: int | None
    reward: float | None
    times_sampled: int


@dataclass(frozen=True)
class ExperiencePage:
    """One page of a table's live experiences in insertion order; pass `next` as `after` for the next."""

    experiences: list[ListedExperience]
    next: int
    done: bool
