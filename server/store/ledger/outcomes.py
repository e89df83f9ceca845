"""What became of a claimed prompt: generated once the group of its attempt is complete in the
table (`on_moved`), trained once that group is consumed (`on_retired`) or its runs are reported
trained outside expbuf (`report`); done, dropped or sent back when the table drops the group, as
the dataset's `on_drop` and `zero_variance` say. Each outcome feeds the prompt's statistics
(prompt_stats.py), and under a difficulty order moves the prompt to its bin (binned.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.table_state.events import Moved, Retired
from ..core.table_state.state import TableState
from ..rules import partial_holds
from ..schema.errors import Conflict, clip
from ..schema.states import CONSUMED
from ..schema.states import DROPPED as GROUP_DROPPED
from ..schema.states import PENDING as GROUP_PENDING
from ..schema.views import GroupView
from . import binned, prompt_stats
from .claim_life import entry, held, send_back, unexpire
from .datasets import DatasetRules, dataset, save
from .hand_out import prompt_of, put_prompt
from .orders import order_of
from .records import DatasetRecord, group_key
from .states import CLAIMED, DROPPED, GENERATED, TRAINED


class OutcomeRules(DatasetRules):
    """The table's events that make a claimed prompt generated, trained or dropped, and the
    outcomes reported from outside."""

    def report(
        self, tt: TableState, name: str, outcomes: Sequence[tuple[int, int, int, list[float]]], holder: str
    ) -> int:
        """Prompts whose groups were generated and trained outside expbuf (a framework's own queue
        held their runs), each (epoch, index, attempt) with its runs' rewards: each prompt still
        claimed by that attempt is trained, its statistics taking the rewards, as its group's
        events would have made it. Refuses, storing nothing, a prompt whose attempt's group the
        table holds (that group's events move the prompt). Returns the claims that still held, and
        the prompts trained at that attempt already: a report made again (its reply lost) counts
        what the first one took, as its caller would have heard."""
        ds = dataset(tt, name)
        reported = 0
        named: set[tuple[int, int, int]] = set()
        for epoch, index, attempt, rewards in outcomes:
            if (epoch, index, attempt) in named:  # named again in this report: counted once, its first rewards
                continue
            named.add((epoch, index, attempt))
            rec = held(tt, name, epoch, index, attempt, holder)
            if rec is None:
                done = prompt_of(tt, name, epoch, index)
                reported += done is not None and done.state == TRAINED and done.attempt == attempt
                continue
            gkey = group_key(name, epoch, index, attempt)
            if tt.view(gkey) is not None:
                raise Conflict(
                    f"prompt {name}/{epoch}/{index} has its group {clip(gkey)} in table '{tt.config.name}': its"
                    " group's events make it generated and trained; nothing of this report is stored"
                )
            unexpire(tt, name, epoch, index, rec)
            rec.move(GENERATED, f"{name}/{epoch}/{index}")
            rec.move(TRAINED, f"{name}/{epoch}/{index}")
            rec.expires = 0.0
            put_prompt(tt, name, epoch, index, rec)
            ds.count(epoch, CLAIMED, -1)
            ds.count(epoch, TRAINED, 1)
            _learned(tt, ds, epoch, index, list(rewards))
            prompt_stats.trained(tt, name, epoch, index)
            partial_holds.drop_task(tt, gkey)
            reported += 1
        save(tt, ds)
        return reported

    def on_moved(self, tt: TableState, event: Moved) -> None:
        """Groups completed: the prompt of each, claimed by this attempt, is generated. A batch's
        groups read and write their dataset once."""
        if event.was != GROUP_PENDING or not self.holds(tt):
            return
        loaded: dict[str, DatasetRecord] = {}
        for gkey, grp in event.groups:
            found = entry(tt, gkey)
            if found is None:
                continue
            (name, epoch, index, attempt), rec = found
            if rec.attempt != attempt or rec.state != CLAIMED:
                continue
            ds = loaded.get(name) or loaded.setdefault(name, dataset(tt, name))
            unexpire(tt, name, epoch, index, rec)
            rec.move(GENERATED, f"{name}/{epoch}/{index}")
            rec.expires = 0.0
            put_prompt(tt, name, epoch, index, rec)
            _generated(tt, ds, epoch, index, grp)
            ds.count(epoch, CLAIMED, -1)
            ds.count(epoch, GENERATED, 1)
        for ds in loaded.values():
            save(tt, ds)

    def on_retired(self, tt: TableState, event: Retired) -> None:
        """Groups left the table: a consumed one's prompt is trained; a dropped, evicted,
        failed or deleted one's is done or goes back (on_drop)."""
        if not self.holds(tt):
            return
        state = event.state
        loaded: dict[str, DatasetRecord] = {}  # a batch's groups read and write their dataset once
        for gkey, grp in event.groups:
            found = entry(tt, gkey)
            if found is None:
                continue
            (name, epoch, index, attempt), rec = found
            if rec.attempt != attempt or rec.state not in (CLAIMED, GENERATED):
                continue
            ds = loaded.get(name) or loaded.setdefault(name, dataset(tt, name))
            size = tt.config.grouping.size
            full = bool(size) and len(grp.members) + len(grp.failed) >= size
            if rec.state == CLAIMED and full:  # dropped as it completed (zero variance, a std threshold, staleness)
                _generated(tt, ds, epoch, index, grp)
            if rec.state == CLAIMED:
                unexpire(tt, name, epoch, index, rec)
            ds.count(epoch, rec.state, -1)
            retry = ds.on_drop == "retry"
            if (
                ds.zero_variance != "keep"
                and state == GROUP_DROPPED
                and full
                and prompt_stats.unvaried(_rewards(tt, grp))
            ):
                retry = ds.zero_variance == "retry"  # "skip": done for its epoch, whatever on_drop says
            if state == CONSUMED:
                rec.move(TRAINED, f"{name}/{epoch}/{index}")
                rec.expires = 0.0
                ds.count(epoch, TRAINED, 1)
                put_prompt(tt, name, epoch, index, rec)
                prompt_stats.trained(tt, name, epoch, index)
            elif retry:
                send_back(tt, ds, epoch, index, rec)
            else:
                rec.move(DROPPED, f"{name}/{epoch}/{index}")
                rec.expires = 0.0
                ds.count(epoch, DROPPED, 1)
                put_prompt(tt, name, epoch, index, rec)
        for ds in loaded.values():
            save(tt, ds)


def _generated(tt: TableState, ds: DatasetRecord, epoch: int, index: int, grp: GroupView) -> None:
    """The prompt's statistics take its complete group (`_learned`)."""
    _learned(tt, ds, epoch, index, _rewards(tt, grp))


def _rewards(tt: TableState, grp: GroupView) -> list[float | None]:
    """The group's members' rewards, of those whose records are stored: a member whose record the
    directory lost is quarantined as its group leaves (rules/quarantine.py), and its reward is
    known nowhere else."""
    return [member.reward for member in tt.stored_members(grp).values()]


def _learned(tt: TableState, ds: DatasetRecord, epoch: int, index: int, rewards: list[float | None]) -> None:
    """The prompt's statistics take a group's rewards; under a difficulty order it moves to the
    bin they put it in now."""
    was, now = prompt_stats.outcome(tt, ds, epoch, index, rewards)
    order = order_of(ds)
    if order.bins:
        binned.move(tt, ds, order, index, was, now)
