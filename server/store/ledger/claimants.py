"""Only a prompt's claimant writes and reads its groups: a push (or a run reported failed, a
seal) into the group of an attempt whose claim ended, of one not handed out, or of one claimed
with another token is refused before anything is stored (`on_pushed`), a copy sent again as a
retry is its claimant's alone (`on_resent`), and the rollouts held in pieces of a prompt's
attempt are read by its claimant alone (`check_reader`). A group of no prompt is anyone's.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.table_state.events import Pushed, Resent
from ..core.table_state.state import TableState
from ..schema.errors import Forbidden, StaleAttempt, clip, taken_with
from .claim_life import entry
from .datasets import DatasetRules
from .hand_out import prompt_of
from .records import PromptRecord, dataset_key, read_group_key
from .states import CLAIMED, PENDING


class ClaimantRules(DatasetRules):
    """The table's events that write into a prompt's groups, refused to all but its claimant."""

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        """Only the claimant of a prompt's attempt pushes its group (with tokens on, the token
        that claimed it: `event.holder`). Refuse a push into the group of an attempt whose claim
        ended, of one not handed out (a prompt's group keys are predictable: a push into one
        would block the claimant to come), or of one claimed with another token."""
        if not self.holds(tt):
            return
        for gkey in event.gkeys:
            found = entry(tt, gkey)
            if found is None:
                named = read_group_key(gkey)
                if named is not None and tt.txn.get(dataset_key(tt.table_id, named[0]), db=tt.db["ledger"]):
                    name, epoch, index, attempt = named
                    raise StaleAttempt(
                        f"group {gkey} is attempt {attempt} of prompt {name}/{epoch}/{index}, which no claim holds"
                        f" (not handed out): {_unchanged(event.call)}; push the groups of the prompts you claim"
                    )
                continue
            (name, epoch, index, attempt), rec = found
            prompt = f"prompt {name}/{epoch}/{index}"
            if rec.attempt != attempt or rec.state != CLAIMED:
                held = f"attempt {rec.attempt} is {rec.state}" if rec.state in (PENDING, CLAIMED) else rec.state
                raise StaleAttempt(
                    f"group {clip(gkey)} is attempt {attempt} of {prompt}, whose claim ended ({held} now): "
                    f"{_unchanged(event.call)}; claim a prompt again"
                )
            _same_holder(gkey, found, event)

    def on_resent(self, tt: TableState, event: Resent) -> None:
        """A copy of what a prompt's group holds is its claimant's to send again (a retry, its
        group complete or trained since): another token's is refused, as its push would be,
        before it hears what the group holds. An attempt whose claim ended keeps no claimant."""
        if not self.holds(tt):
            return
        for gkey in event.gkeys:
            found = entry(tt, gkey)
            if found is not None and found[1].attempt == found[0][3] and found[1].holder:
                _same_holder(gkey, found, event)


def _same_holder(gkey: str, found: tuple[tuple[str, int, int, int], PromptRecord], event: Pushed | Resent) -> None:
    """Refuse a call (`event`, who makes it) into the group of a prompt's attempt (`found`, its
    entry and record) made with another token than the one that claimed it."""
    (name, epoch, index, attempt), rec = found
    if rec.holder != event.holder:
        raise Forbidden(
            f"group {clip(gkey)} is attempt {attempt} of prompt {name}/{epoch}/{index}, claimed with "
            f"{taken_with(rec.holder, event.holder)}: {_unchanged(event.call)}"
        )


def check_reader(tt: TableState, tids: Sequence[str], holder: str) -> None:
    """With tokens on (a `holder`), the rollouts held in pieces of a prompt's attempt are read by
    its claimant alone (pieces a claim that ended left go to the next attempt, read by whoever
    claims it): a read naming the task of an attempt claimed with another token, or of one no
    claim holds, is refused (Forbidden), whatever it holds. A task of no prompt is anyone's."""
    if not holder:
        return
    for tid in dict.fromkeys(tids):
        named = read_group_key(tid)  # an attempt not claimed yet has no group entry: its key says whose it is
        if named is None or tt.txn.get(dataset_key(tt.table_id, named[0]), db=tt.db["ledger"]) is None:
            continue
        name, epoch, index, attempt = named
        rec = prompt_of(tt, name, epoch, index)
        if rec is not None and rec.state == CLAIMED and rec.attempt == attempt:
            if rec.holder == holder:
                continue
            why = f"claimed with {taken_with(rec.holder, holder)}"
        else:
            why = "which no claim holds"
        raise Forbidden(
            f"the rollouts held in pieces of task {clip(tid)} are attempt {attempt} of prompt "
            f"{name}/{epoch}/{index}, {why}: only its claimant reads them"
        )


def _unchanged(call: str) -> str:
    """What a refusal of the ledger's says the refused call did: nothing, naming the call."""
    return "nothing of this push is stored" if call == "push" else f"this {call} call changes nothing"
