"""The prompt ledger: datasets of prompts on a table, and the life of each prompt, every change
made in the transaction of the event that makes it.

A prompt (dataset, epoch, index) is pending until a rollout worker claims it; then claimed,
by one claimant at a time, under a claim that ends unless renewed; generated once the group
of its attempt (ledger_records.group_key) is complete in the table; trained once that group
is consumed (a consumed batch confirmed, a lease acked, a replay spent, a group retired as
trained). A claim that ends before its group is complete (it expired, or was released) sends
the prompt back with attempt + 1, to be handed out before any new prompt; the incomplete group
of the ended attempt is dropped, and a later push into it is refused (StaleAttempt, naming the
attempt), so no group mixes attempts. A group the table drops (zero variance, a group timeout,
eviction, a failed computation, a delete) counts its prompt as done, dropped, or sends it back,
as the dataset's `on_drop` says; a prompt sent back `max_attempts` times is dropped.
`max_in_flight` bounds the prompts claimed, or generated and not yet trained.

The rules run as a table extension (extensions.py): the table's groups say when a prompt was
generated or trained, with no change to the group rules.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from expbuf.client.schema.prompts import MAX_PROMPTS_PER_CALL

from ..core.table_state.events import Moved, Pushed, Resent, Retired, TableExtension
from ..core.table_state.state import TableState
from ..core.verbs.retire import retire
from ..disk import layout
from ..rules import partials
from ..schema.errors import ConfigError, Conflict, Forbidden, StaleAttempt, clip
from ..schema.states import CONSUMED
from ..schema.states import DROPPED as GROUP_DROPPED
from ..schema.states import PENDING as GROUP_PENDING
from ..schema.views import GroupView
from . import binned, prompt_stats
from .claimed import Claimed, ClaimStep, Walk
from .hand_out import hand_out, prompt_of, put_prompt
from .orders import order_of
from .records import (
    DatasetRecord,
    PromptRecord,
    counts_key,
    dataset_key,
    datasets_prefix,
    decode_counts,
    encode_counts,
    expiry_key,
    expiry_prefix,
    group_entry,
    group_entry_key,
    group_key,
    place,
    prompt_eid,
    queue_key,
    read_dataset,
    read_expiry_key,
    read_group_entry,
    read_group_key,
)
from .settings import check, no_dataset
from .shards import count_part
from .states import CLAIMED, COUNTED, DROPPED, GENERATED, PENDING, TRAINED


class Ledger(TableExtension):
    """The ledger's rules over one table's state, and the table events that move prompts."""

    def __init__(self) -> None:
        self._holds: dict[int, bool] = {}  # table id -> whether it holds a dataset, read once

    def holds(self, tt: TableState) -> bool:
        """Whether the table holds a dataset: a table without one pays one lookup, once."""
        known = self._holds.get(tt.table_id)
        if known is None:
            prefix = datasets_prefix(tt.table_id)
            with tt.txn.cursor(db=tt.db["ledger"]) as cur:
                known = bool(cur.set_range(prefix)) and bytes(cur.key()).startswith(prefix)
            self._holds[tt.table_id] = known
        return known

    # ---- datasets ----------------------------------------------------------------------------

    def create(self, tt: TableState, ds: DatasetRecord, *, exist_ok: bool) -> tuple[DatasetRecord, bool]:
        """A new dataset, or the identical one that exists (exist_ok); (record, created)."""
        check(ds, tt.config.grouping.by)
        ds.order_options = order_of(ds).options  # its defaults filled in
        if ds.zero_variance == "retry" and not tt.config.grouping.drop_zero_variance:
            raise ConfigError(
                f'dataset {clip(ds.name)!r}: zero_variance = "retry" claims again a prompt whose group the table'
                f" drops for its equal rewards; table '{tt.config.name}' keeps such groups (drop_zero_variance is off)"
            )
        raw = tt.txn.get(dataset_key(tt.table_id, ds.name), db=tt.db["ledger"])
        if raw is not None:
            found = DatasetRecord.decode(raw)
            differ = [
                f"{key}: the dataset has {found.settings()[key]!r}, the request {value!r}"
                for key, value in ds.settings().items()
                if found.settings()[key] != value
            ]
            if exist_ok and not differ:
                return found, False
            detail = f" with other settings: {'; '.join(differ)}" if differ else ""
            raise Conflict(f"table '{tt.config.name}' already has dataset '{ds.name}'{detail}")
        ds.created, ds.totals = tt.now, {}
        if ds.shards:  # an epoch's counts without a record own `size` prompts: a shard's own fewer
            ds.owned = ds.owned[:1] or [count_part(ds, 0)]  # counted before the write (claims.py)
            tt.txn.put(counts_key(tt.table_id, ds.name, 0), encode_counts(ds.owned[0], {}), db=tt.db["ledger"])
            ds.owned_total, ds.counted = ds.owned[0], 1  # a later epoch's part: when it starts (hand_out.py)
        else:
            ds.owned_total, ds.counted = ds.size * ds.epochs, ds.epochs  # nothing written per epoch
        self._save(tt, ds)
        self._holds[tt.table_id] = True
        return ds, True

    def dataset(self, tt: TableState, name: str) -> DatasetRecord:
        found = read_dataset(tt.txn, tt.db["ledger"], tt.table_id, name)
        if found is None:
            raise no_dataset(tt.config.name, name)
        return found

    def _save(self, tt: TableState, ds: DatasetRecord) -> None:
        """Write the dataset's record, and the counts of each epoch whose prompts moved since
        it was read."""
        ledger = tt.db["ledger"]
        for epoch, moved in ds.moved.items():
            key = counts_key(tt.table_id, ds.name, epoch)
            raw = tt.txn.get(key, db=ledger)
            owned, row = (ds.size, {}) if raw is None else decode_counts(raw)
            tt.txn.put(key, encode_counts(owned, {s: row.get(s, 0) + moved.get(s, 0) for s in COUNTED}), db=ledger)
        ds.moved = {}
        tt.txn.put(dataset_key(tt.table_id, ds.name), ds.encode(), db=ledger)

    # ---- claims ------------------------------------------------------------------------------

    def claim(
        self,
        tt: TableState,
        name: str,
        count: int,
        seconds: float,
        owner: str,
        holder: str,
        parts: Mapping[int, int] | None = None,
    ) -> ClaimStep:
        """Up to `count` prompts for one claimant, the ones sent back first, under claims that
        end `seconds` from now; whether the dataset is done (nothing left to hand out or
        train); and whether the claim stopped short, to go on in another transaction: with
        this one's STEP_HASHES spent, or on a shard at an epoch whose part is neither counted
        nor in `parts` (a shard's parts of epochs counted outside the writer, claims.py).
        Claims already ended are ended first, so their prompts go out again now."""
        self.dataset(tt, name)
        self.expire(tt)
        ds = self.dataset(tt, name)
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
        self._save(tt, ds)
        return ClaimStep(out, ds.done, more, walk.uncounted)

    def renew(
        self, tt: TableState, name: str, prompts: Sequence[tuple[int, int, int]], seconds: float, holder: str
    ) -> tuple[float, list[tuple[int, int, int]]]:
        """Claims (epoch, index, attempt) now end `seconds` from now; returns when, and the
        prompts whose claim had already ended (not renewed: give up on them)."""
        self.expire(tt)
        expires, ended = tt.now + seconds, []
        for epoch, index, attempt in prompts:
            rec = self._held(tt, name, epoch, index, attempt, holder)
            if rec is None:
                ended.append((epoch, index, attempt))
                continue
            self._unexpire(tt, name, epoch, index, rec)
            rec.expires = expires
            put_prompt(tt, name, epoch, index, rec)
            tt.txn.put(expiry_key(tt.table_id, expires, name, epoch, index), b"", db=tt.db["ledger"])
        return expires, ended

    def release(self, tt: TableState, name: str, prompts: Sequence[tuple[int, int, int]], holder: str) -> int:
        """Give claims back now, as if they had ended: each prompt goes back with attempt + 1.
        Returns the claims released (one already ended is not)."""
        ds = self.dataset(tt, name)
        released = 0
        dropping: list[tuple[str, GroupView]] = []
        for epoch, index, attempt in prompts:
            rec = self._held(tt, name, epoch, index, attempt, holder)
            if rec is not None:
                self._end_claim(tt, ds, epoch, index, rec, dropping)
                released += 1
        _drop(tt, dropping)
        self._save(tt, ds)
        return released

    def report(
        self, tt: TableState, name: str, outcomes: Sequence[tuple[int, int, int, list[float]]], holder: str
    ) -> int:
        """Prompts whose groups were generated and trained outside expbuf (a framework's own queue
        held their runs), each (epoch, index, attempt) with its runs' rewards: each prompt still
        claimed by that attempt is trained, its statistics taking the rewards, as its group's
        events would have made it. Refuses, storing nothing, a prompt whose attempt's group the
        table holds (that group's events move the prompt). Returns the claims that still held."""
        ds = self.dataset(tt, name)
        reported = 0
        for epoch, index, attempt, rewards in outcomes:
            rec = self._held(tt, name, epoch, index, attempt, holder)
            if rec is None:
                continue
            gkey = group_key(name, epoch, index, attempt)
            if tt.view(gkey) is not None:
                raise Conflict(
                    f"prompt {name}/{epoch}/{index} has its group {clip(gkey)} in table '{tt.config.name}': its"
                    " group's events make it generated and trained; nothing of this report is stored"
                )
            self._unexpire(tt, name, epoch, index, rec)
            rec.move(GENERATED, f"{name}/{epoch}/{index}")
            rec.move(TRAINED, f"{name}/{epoch}/{index}")
            rec.expires = 0.0
            put_prompt(tt, name, epoch, index, rec)
            ds.count(epoch, CLAIMED, -1)
            ds.count(epoch, TRAINED, 1)
            self._learned(tt, ds, epoch, index, list(rewards))
            prompt_stats.trained(tt, name, epoch, index)
            partials.drop_task(tt, gkey)
            reported += 1
        self._save(tt, ds)
        return reported

    def expire(self, tt: TableState) -> int:
        """End the table's claims whose time has come, the first MAX_PROMPTS_PER_CALL of them (a
        claim's end costs what its release does: the rest end in the next transaction, the
        upkeep's pass coming back while the table holds claims); returns how many."""
        prefix = expiry_prefix(tt.table_id)
        cutoff = layout.micros(tt.now)
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
            ds = loaded.get(name) or loaded.setdefault(name, self.dataset(tt, name))
            self._end_claim(tt, ds, epoch, index, rec, dropping)
        _drop(tt, dropping)
        for ds in loaded.values():
            self._save(tt, ds)
        return len(due)

    def _held(
        self, tt: TableState, name: str, epoch: int, index: int, attempt: int, holder: str
    ) -> PromptRecord | None:
        """The claim of this attempt at the prompt, if it still holds; another token's is refused."""
        rec = prompt_of(tt, name, epoch, index)
        if rec is None or rec.state != CLAIMED or rec.attempt != attempt:
            return None
        if rec.holder != holder:
            raise Forbidden(f"prompt {name}/{epoch}/{index} was claimed with another token")
        return rec

    def _end_claim(
        self,
        tt: TableState,
        ds: DatasetRecord,
        epoch: int,
        index: int,
        rec: PromptRecord,
        dropping: list[tuple[str, GroupView]],
    ) -> None:
        """A claim ended before its group was complete: the prompt goes back (or is dropped,
        its attempts spent), and the attempt's incomplete group, if any, joins `dropping`, the
        groups the caller drops together (`_drop`: one event for the claims it ends)."""
        gkey = group_key(ds.name, epoch, index, rec.attempt)
        self._unexpire(tt, ds.name, epoch, index, rec)
        ds.count(epoch, CLAIMED, -1)
        self._send_back(tt, ds, epoch, index, rec)
        if rec.state == PENDING:  # the next attempt's claimant gets the rollouts held in pieces back
            partials.carry(tt, gkey, prompt_eid(ds.name, epoch, index, rec.attempt))
        else:  # dropped, its attempts spent
            partials.drop_task(tt, gkey)
        grp = tt.view(gkey)
        if grp is not None and grp.state == GROUP_PENDING:  # after the prompt moved on: its event is no news
            dropping.append((gkey, grp))
            ds.attempts_dropped += 1

    def _send_back(self, tt: TableState, ds: DatasetRecord, epoch: int, index: int, rec: PromptRecord) -> None:
        """The prompt goes out again with attempt + 1, before any new one; dropped instead once
        it had max_attempts."""
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

    # ---- the table's events ------------------------------------------------------------------

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        """Only the claimant of a prompt's attempt pushes its group (with tokens on, the token
        that claimed it: `event.holder`). Refuse a push into the group of an attempt whose claim
        ended, of one not handed out (a prompt's group keys are predictable: a push into one
        would block the claimant to come), or of one claimed with another token."""
        if not self.holds(tt):
            return
        for gkey in event.gkeys:
            found = _entry(tt, gkey)
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
            found = _entry(tt, gkey)
            if found is not None and found[1].attempt == found[0][3] and found[1].holder:
                _same_holder(gkey, found, event)

    def on_moved(self, tt: TableState, event: Moved) -> None:
        """Groups completed: the prompt of each, claimed by this attempt, is generated. A batch's
        groups read and write their dataset once."""
        if event.was != GROUP_PENDING or not self.holds(tt):
            return
        loaded: dict[str, DatasetRecord] = {}
        for gkey, grp in event.groups:
            found = _entry(tt, gkey)
            if found is None:
                continue
            (name, epoch, index, attempt), rec = found
            if rec.attempt != attempt or rec.state != CLAIMED:
                continue
            ds = loaded.get(name) or loaded.setdefault(name, self.dataset(tt, name))
            self._unexpire(tt, name, epoch, index, rec)
            rec.move(GENERATED, f"{name}/{epoch}/{index}")
            rec.expires = 0.0
            put_prompt(tt, name, epoch, index, rec)
            self._generated(tt, ds, epoch, index, grp)
            ds.count(epoch, CLAIMED, -1)
            ds.count(epoch, GENERATED, 1)
        for ds in loaded.values():
            self._save(tt, ds)

    def on_retired(self, tt: TableState, event: Retired) -> None:
        """Groups left the table: a consumed one's prompt is trained; a dropped, evicted,
        failed or deleted one's is done or goes back (on_drop)."""
        if not self.holds(tt):
            return
        state = event.state
        loaded: dict[str, DatasetRecord] = {}  # a batch's groups read and write their dataset once
        for gkey, grp in event.groups:
            found = _entry(tt, gkey)
            if found is None:
                continue
            (name, epoch, index, attempt), rec = found
            if rec.attempt != attempt or rec.state not in (CLAIMED, GENERATED):
                continue
            ds = loaded.get(name) or loaded.setdefault(name, self.dataset(tt, name))
            size = tt.config.grouping.size
            full = bool(size) and len(grp.members) + len(grp.failed) >= size
            if rec.state == CLAIMED and full:  # dropped as it completed (zero variance, a std threshold, staleness)
                self._generated(tt, ds, epoch, index, grp)
            if rec.state == CLAIMED:
                self._unexpire(tt, name, epoch, index, rec)
            ds.count(epoch, rec.state, -1)
            retry = ds.on_drop == "retry"
            if (
                ds.zero_variance != "keep"
                and state == GROUP_DROPPED
                and full
                and prompt_stats.unvaried([member.reward for member in tt.members(grp).values()])
            ):
                retry = ds.zero_variance == "retry"  # "skip": done for its epoch, whatever on_drop says
            if state == CONSUMED:
                rec.move(TRAINED, f"{name}/{epoch}/{index}")
                rec.expires = 0.0
                ds.count(epoch, TRAINED, 1)
                put_prompt(tt, name, epoch, index, rec)
                prompt_stats.trained(tt, name, epoch, index)
            elif retry:
                self._send_back(tt, ds, epoch, index, rec)
            else:
                rec.move(DROPPED, f"{name}/{epoch}/{index}")
                rec.expires = 0.0
                ds.count(epoch, DROPPED, 1)
                put_prompt(tt, name, epoch, index, rec)
        for ds in loaded.values():
            self._save(tt, ds)

    def on_upkeep(self, tt: TableState) -> int:
        """End the claims whose time has come; returns the incomplete groups that dropped."""
        if not self.holds(tt):
            return 0
        before = tt.counters.groups_dropped
        if self.expire(tt):
            tt.save()
        return tt.counters.groups_dropped - before

    def _generated(self, tt: TableState, ds: DatasetRecord, epoch: int, index: int, grp: GroupView) -> None:
        """The prompt's statistics take its complete group (`_learned`)."""
        self._learned(tt, ds, epoch, index, [member.reward for member in tt.members(grp).values()])

    def _learned(self, tt: TableState, ds: DatasetRecord, epoch: int, index: int, rewards: list[float | None]) -> None:
        """The prompt's statistics take a group's rewards; under a difficulty order it moves to the
        bin they put it in now."""
        was, now = prompt_stats.outcome(tt, ds, epoch, index, rewards)
        order = order_of(ds)
        if order.bins:
            binned.move(tt, ds, order, index, was, now)

    # ---- records -----------------------------------------------------------------------------

    def _unexpire(self, tt: TableState, name: str, epoch: int, index: int, rec: PromptRecord) -> None:
        if rec.expires:
            tt.txn.delete(expiry_key(tt.table_id, rec.expires, name, epoch, index), db=tt.db["ledger"])


def _entry(tt: TableState, gkey: str) -> tuple[tuple[str, int, int, int], PromptRecord] | None:
    """The prompt whose attempt a group is, and that prompt's record; None for a group of no
    prompt."""
    raw = tt.txn.get(group_entry_key(tt.table_id, gkey), db=tt.db["ledger"]) if len(gkey) <= 400 else None
    if raw is None:
        return None
    entry = read_group_entry(raw)
    rec = prompt_of(tt, *entry[:3])
    return None if rec is None else (entry, rec)


def _drop(tt: TableState, groups: list[tuple[str, GroupView]]) -> None:
    """The incomplete groups of the claims a call ended are dropped, together."""
    if groups:
        retire(tt, groups, GROUP_DROPPED)
        tt.counters.groups_dropped += len(groups)


def _same_holder(gkey: str, found: tuple[tuple[str, int, int, int], PromptRecord], event: Pushed | Resent) -> None:
    """Refuse a call (`event`, who makes it) into the group of a prompt's attempt (`found`, its
    entry and record) made with another token than the one that claimed it."""
    (name, epoch, index, attempt), rec = found
    if rec.holder != event.holder:
        raise Forbidden(
            f"group {clip(gkey)} is attempt {attempt} of prompt {name}/{epoch}/{index}, claimed with another token: "
            f"{_unchanged(event.call)}"
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
            why = "claimed with another token"
        else:
            why = "which no claim holds"
        raise Forbidden(
            f"the rollouts held in pieces of task {clip(tid)} are attempt {attempt} of prompt "
            f"{name}/{epoch}/{index}, {why}: only its claimant reads them"
        )


def _unchanged(call: str) -> str:
    """What a refusal of the ledger's says the refused call did: nothing, naming the call."""
    return "nothing of this push is stored" if call == "push" else f"this {call} call changes nothing"
