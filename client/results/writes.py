"""What the calls that store rollouts return: what a push stored (`PushResult`), and what a
report of failed runs did (`FailedRuns`). Each is durable when returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PushResult:
    """What a push stored: uids stored now, uids already stored (a retry), groups it completed,
    and uids dropped as staler than the table's max_staleness. Durable when returned. A push made
    again after its reply was lost (the client's retries do) finds its uids stored by the first:
    they are `duplicates`, and the groups the first completed are not in `completed_groups`; count
    what a push brought into the table with `kept`."""

    stored: list[str]
    duplicates: list[str]
    completed_groups: list[str]
    stale: list[str] = field(default_factory=list)  # dropped as staler than the table's max_staleness
    partial: list[str] = field(default_factory=list)  # pieces of partial rollouts stored (rollouts not finished)

    @property
    def kept(self) -> list[str]:
        """The uids of the push the table holds: stored now, or by an earlier try of it."""
        return self.stored + self.duplicates


@dataclass
class FailedRuns:
    """What a report of failed runs did (fail_runs): the runs recorded now (one reported again is
    not), the groups it completed short, and those it dropped as too short. Durable when returned."""

    recorded: list[str]
    completed_groups: list[str]
    dropped_groups: list[str]
