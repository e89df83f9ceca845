"""A claim's life: made (`claim`: prompts handed to one claimant, the group of each attempt
entered as the prompt's), renewed, released, or ended when its time comes (`expire`, from the
upkeep and before any claim); and what ending one early does: the prompt goes back with
attempt + 1 (or is dropped, its attempts spent), the incomplete group of the ended attempt
dropped with it. Which prompts a claim hands out is hand_out.py's.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from expbuf.client.schema.prompts import MAX_PROMPTS_PER_CALL

from ..core.table_state.state import TableState
from ..core.verbs.retire import retire
from ..disk import layout
from ..rules import partial_holds
from ..schema.errors import Forbidden, taken_with
from ..schema.states import DROPPED as GROUP_DROPPED
from ..schema.states import PENDING as GROUP_PENDING
from ..schema.views import GroupView
from . import prompt_stats
from .claimed import Claimed, ClaimStep, Walk, forget_ids, recall_id, remember_id
from .datasets import DatasetRules, dataset, save
from .hand_out import hand_out, prompt_of, put_prompt
from .records import (
    DatasetRecord,
    PromptRecord,
    expiry_key,
    expiry_prefix,
    group_entry,
    group_entry_key,
    group_key,
    place,
    prompt_eid,
    queue_key,
    read_expiry_key,
    read_group_entry,
)
from .states import CLAIMED, DROPPED, PENDING


class ClaimRules(DatasetRules):
    """The ledger's claims: made, renewed, released, and ended at the upkeep when their time comes."""

    def claim(
        self,
        tt: TableState,
        name: str,
        count: int,
        seconds: float,
        owner: str,
        holder: str,
        parts: Mapping[int, int] | None = None,
        claim_id: str = "",
        first: bool = True,
    ) -> ClaimStep:
        """Up to `count` prompts for one claimant, the ones sent back first, under claims that
        end `seconds` from now; whether the dataset is done (nothing left to hand out or
        train); and whether the claim stopped short, to go on in another transaction: with
        this one's STEP_HASHES spent, or on a shard at an epoch whose part is neither counted
        nor in `parts` (a shard's parts of epochs counted outside the writer, claims.py).
        Claims already ended are ended first, so their prompts go out again now.

        A claim with an id (`claim_id`, the client's for one call) made again, the `first` step
        of a call, answers the prompts the claim of that id handed out that it still holds
        (`again`), and claims none: its reply was lost, and more claimed would be held by no one.
        Where it holds none of them now, it is a claim as any other."""
        dataset(tt, name)
        expire(tt)
        ds = dataset(tt, name)
        if claim_id and first:
            made = recall_id(tt, claim_id, name) or []
            still = [(p, rec) for p in made if (rec := held(tt, name, *p, holder)) is not None]
            if still:
                return ClaimStep([Claimed(*p, rec.expires) for p, rec in still], ds.done, False, again=True)
        room = count if not ds.max_in_flight else max(0, min(count, ds.max_in_flight - ds.in_flight))
        out: list[Claimed] = []
        expires, ledger, more = tt.now + seconds, tt.db["ledger"], False
        walk = Walk(parts or {})
        for nxt in itertools.islice(hand_out(tt, ds, walk), room):
            if nxt is None:
                more = True
                break
            epoch, index, attempt = nxt
            rec = prompt_of(tt, ds.name, epoch, index) or PromptRecord(PENDING, attempt)
            rec.move(CLAIMED, f"{ds.name}/{epoch}/{index}")
            rec.attempt, rec.expires, rec.owner, rec.holder = attempt, expires, owner, holder
            put_prompt(tt, ds.name, epoch, index, rec)
            gkey = group_key(ds.name, epoch, index, attempt)
            tt.txn.put(group_entry_key(tt.table_id, gkey), group_entry(ds.name, epoch, index, attempt), db=ledger)
            tt.txn.put(expiry_key(tt.table_id, expires, ds.name, epoch, index), b"", db=ledger)
            ds.count(epoch, CLAIMED, 1)
            prompt_stats.claimed(tt, ds.name, index)
            out.append(Claimed(epoch, index, attempt, expires))
        if claim_id:
            remember_id(tt, claim_id, name, out, anew=first)
        save(tt, ds)
        return ClaimStep(out, ds.done, more, walk.uncounted)

    def renew(
        self, tt: TableState, name: str, prompts: Sequence[tuple[int, int, int]], seconds: float, holder: str
    ) -> tuple[float, list[tuple[int, int, int]]]:
        """Claims (epoch, index, attempt) now end `seconds` from now; returns when, and the
        prompts whose claim had already ended (not renewed: give up on them). NotFound where the
        table has no such dataset: no claim of it is said to have ended."""
        dataset(tt, name)
        expire(tt)
        expires, ended = tt.now + seconds, []
        for epoch, index, attempt in prompts:
            rec = held(tt, name, epoch, index, attempt, holder)
            if rec is None:
                ended.append((epoch, index, attempt))
                continue
            unexpire(tt, name, epoch, index, rec)
            rec.expires = expires
            put_prompt(tt, name, epoch, index, rec)
            tt.txn.put(expiry_key(tt.table_id, expires, name, epoch, index), b"", db=tt.db["ledger"])
        return expires, ended

    def release(self, tt: TableState, name: str, prompts: Sequence[tuple[int, int, int]], holder: str) -> int:
        """Give claims back now, as if they had ended: each prompt goes back with attempt + 1.
        Returns the claims released (one already ended is not)."""
        ds = dataset(tt, name)
        released = 0
        dropping: list[tuple[str, GroupView]] = []
        for epoch, index, attempt in prompts:
            rec = held(tt, name, epoch, index, attempt, holder)
            if rec is not None:
                _end_claim(tt, ds, epoch, index, rec, dropping)
                released += 1
        _drop(tt, dropping)
        save(tt, ds)
        return released

    def on_upkeep(self, tt: TableState) -> int:
        """End the claims whose time has come; returns the incomplete groups that dropped."""
        if not self.holds(tt):
            return 0
        before = tt.counters.groups_dropped
        if expire(tt):
            tt.save()
        return tt.counters.groups_dropped - before


def expire(tt: TableState) -> int:
    """End the table's claims whose time has come, the first MAX_PROMPTS_PER_CALL of them (a
    claim's end costs what its release does: the rest end in the next transaction, the
    upkeep's pass coming back while the table holds claims); returns how many."""
    prefix = expiry_prefix(tt.table_id)
    cutoff = layout.micros(tt.now)
    forget_ids(tt, MAX_PROMPTS_PER_CALL)
    due: list[tuple[str, int, int]] = []
    with tt.txn.cursor(db=tt.db["ledger"]) as cur:
        found = cur.set_range(prefix)
        while (
            found
            and len(due) < MAX_PROMPTS_PER_CALL
            and bytes(cur.key()).startswith(prefix)
            and bytes(cur.key())[5:13] <= cutoff
        ):
            due.append(read_expiry_key(bytes(cur.key())))
            found = cur.next()
    loaded: dict[str, DatasetRecord] = {}
    dropping: list[tuple[str, GroupView]] = []
    for name, epoch, index in due:
        rec = prompt_of(tt, name, epoch, index)
        if rec is None or rec.state != CLAIMED or rec.expires > tt.now:
            continue
        ds = loaded.get(name) or loaded.setdefault(name, dataset(tt, name))
        _end_claim(tt, ds, epoch, index, rec, dropping)
    _drop(tt, dropping)
    for ds in loaded.values():
        save(tt, ds)
    return len(due)


def held(tt: TableState, name: str, epoch: int, index: int, attempt: int, holder: str) -> PromptRecord | None:
    """The claim of this attempt at the prompt, if it still holds; another token's is refused."""
    rec = prompt_of(tt, name, epoch, index)
    if rec is None or rec.state != CLAIMED or rec.attempt != attempt:
        return None
    if rec.holder != holder:
        raise Forbidden(f"prompt {name}/{epoch}/{index} was claimed with {taken_with(rec.holder, holder)}")
    return rec


def entry(tt: TableState, gkey: str) -> tuple[tuple[str, int, int, int], PromptRecord] | None:
    """The prompt whose attempt a group is (entered when the attempt was claimed), and that
    prompt's record; None for a group of no prompt."""
    raw = tt.txn.get(group_entry_key(tt.table_id, gkey), db=tt.db["ledger"]) if len(gkey) <= 400 else None
    if raw is None:
        return None
    found = read_group_entry(raw)
    rec = prompt_of(tt, *found[:3])
    return None if rec is None else (found, rec)


def _end_claim(
    tt: TableState,
    ds: DatasetRecord,
    epoch: int,
    index: int,
    rec: PromptRecord,
    dropping: list[tuple[str, GroupView]],
) -> None:
    """A claim ended before its group was complete: the prompt goes back (or is dropped, its
    attempts spent), and the attempt's incomplete group, if any, joins `dropping`, the groups
    the caller drops together (`_drop`: one event for the claims it ends)."""
    gkey = group_key(ds.name, epoch, index, rec.attempt)
    unexpire(tt, ds.name, epoch, index, rec)
    ds.count(epoch, CLAIMED, -1)
    send_back(tt, ds, epoch, index, rec)
    if rec.state == PENDING:  # the next attempt's claimant gets the rollouts held in pieces back
        partial_holds.carry(tt, gkey, prompt_eid(ds.name, epoch, index, rec.attempt))
    else:  # dropped, its attempts spent
        partial_holds.drop_task(tt, gkey)
    grp = tt.view(gkey)
    if grp is not None and grp.state == GROUP_PENDING:  # after the prompt moved on: its event is no news
        dropping.append((gkey, grp))
        ds.attempts_dropped += 1


def send_back(tt: TableState, ds: DatasetRecord, epoch: int, index: int, rec: PromptRecord) -> None:
    """The prompt goes out again with attempt + 1, before any new one; dropped instead once it
    had max_attempts."""
    rec.expires, rec.owner, rec.holder = 0.0, "", ""
    prompt = f"{ds.name}/{epoch}/{index}"
    if rec.attempt + 1 >= ds.max_attempts:
        rec.move(DROPPED, prompt)
        ds.count(epoch, DROPPED, 1)
    else:
        rec.move(PENDING, prompt)
        rec.attempt += 1
        tt.txn.put(queue_key(tt.table_id, ds.name, ds.next_seq), place(epoch, index), db=tt.db["ledger"])
        ds.next_seq += 1
        ds.reissued += 1
    put_prompt(tt, ds.name, epoch, index, rec)


def unexpire(tt: TableState, name: str, epoch: int, index: int, rec: PromptRecord) -> None:
    """The claim's entry among the claims by when they end goes (renewed, ended, or its group complete)."""
    if rec.expires:
        tt.txn.delete(expiry_key(tt.table_id, rec.expires, name, epoch, index), db=tt.db["ledger"])


def _drop(tt: TableState, groups: list[tuple[str, GroupView]]) -> None:
    """The incomplete groups of the claims a call ended are dropped, together."""
    if groups:
        retire(tt, groups, GROUP_DROPPED)
        tt.counters.groups_dropped += len(groups)
        tt.counters.dropped_claim_ended += len(groups)
