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
from collections.abc import Iterator, Mapping, Sequence

from expbuf.client.schema.prompts import MAX_PROMPTS_PER_CALL

from ..disk import layout
from ..disk.records import GroupRecord
from ..rules import partials
from ..rules.extensions import TableExtension
from ..rules.retirement import retire
from ..rules.table_state import Groups, TableState
from ..schema.errors import Conflict, Forbidden, StaleAttempt, clip
from ..schema.states import CONSUMED
from ..schema.states import DROPPED as GROUP_DROPPED
from ..schema.states import PENDING as GROUP_PENDING
from .claimed import Claimed, ClaimStep, Walk
from .records import (
    DatasetRecord,
    Permutation,
    PromptRecord,
    PromptStats,
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
    pass_band,
    place,
    prompt_eid,
    prompt_key,
    queue_key,
    queue_prefix,
    read_dataset,
    read_expiry_key,
    read_group_entry,
    read_group_key,
    read_stats,
    stats_key,
    unplace,
)
from .settings import check, no_dataset
from .shards import count_part, owns
from .states import CLAIMED, COUNTED, DROPPED, GENERATED, PENDING, TRAINED

# The ownership hashes (one a shard) a claim's cursor spends in one transaction stepping over a
# shard's part of a dataset: with many shards, one prompt owned costs about shards**2 (1,024
# shards: about 1 s a prompt), so a claim goes on in another transaction rather than hold the
# writer (about 50 ms a transaction).
STEP_HASHES = 1 << 16


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
            ds.owned_total, ds.counted = ds.owned[0], 1  # a later epoch's part: when it starts (_start)
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

    def _count(self, ds: DatasetRecord, epoch: int, state: str, delta: int) -> None:
        """`delta` more prompts of the epoch in `state`: in the dataset's totals, and its epoch's
        record when the dataset is saved."""
        ds.totals[state] = ds.totals.get(state, 0) + delta
        moved = ds.moved.setdefault(epoch, {})
        moved[state] = moved.get(state, 0) + delta

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
        for nxt in itertools.islice(self._hand_out(tt, ds, walk), room):
            if nxt is None:
                more = True
                break
            epoch, index, attempt = nxt
            rec = self._prompt(tt, ds.name, epoch, index) or PromptRecord(PENDING, attempt)
            rec.move(CLAIMED, f"{ds.name}/{epoch}/{index}")
            rec.attempt, rec.expires, rec.owner, rec.holder = attempt, expires, owner, holder
            self._put(tt, ds.name, epoch, index, rec)
            gkey = group_key(ds.name, epoch, index, attempt)
            tt.txn.put(group_entry_key(tt.table_id, gkey), group_entry(ds.name, epoch, index, attempt), db=ledger)
            tt.txn.put(expiry_key(tt.table_id, expires, ds.name, epoch, index), b"", db=ledger)
            self._count(ds, epoch, CLAIMED, 1)
            stats = self._stats(tt, ds.name, index)
            stats.attempts += 1
            self._put_stats(tt, ds.name, index, stats)
            out.append(Claimed(epoch, index, attempt, expires))
        self._save(tt, ds)
        return ClaimStep(out, ds.done, more, walk.uncounted)

    def _hand_out(self, tt: TableState, ds: DatasetRecord, walk: Walk) -> Iterator[tuple[int, int, int] | None]:
        """The prompts to hand out, (epoch, index, attempt), for as long as the claim takes
        them: the oldest sent back, then the cursor's (skipping the prompts a shard does not
        own), each at its first attempt whose group the table does not hold (`_untaken`); None,
        last, once the cursor spent STEP_HASHES in this transaction or reached an epoch whose
        part is not counted (`walk.uncounted`)."""
        for epoch, index, attempt in self._candidates(tt, ds, walk):
            free = self._untaken(tt, ds, epoch, index, attempt)
            if free is not None:
                yield epoch, index, free
        if ds.cursor_epoch < ds.epochs:
            yield None

    def _untaken(self, tt: TableState, ds: DatasetRecord, epoch: int, index: int, attempt: int) -> int | None:
        """The first attempt at the prompt from `attempt` on whose group the table does not hold:
        before a dataset exists a push under its name is a group like any other, and a claim of
        an attempt whose group is taken could never complete it. None, the prompt dropped, when
        every attempt left is taken."""
        while attempt < ds.max_attempts:
            if tt.group(group_key(ds.name, epoch, index, attempt)) is None:
                return attempt
            attempt += 1
        rec = self._prompt(tt, ds.name, epoch, index) or PromptRecord(PENDING, attempt)
        rec.move(DROPPED, f"{ds.name}/{epoch}/{index}")
        rec.attempt = ds.max_attempts - 1
        self._put(tt, ds.name, epoch, index, rec)
        self._count(ds, epoch, DROPPED, 1)
        return None

    def _candidates(self, tt: TableState, ds: DatasetRecord, walk: Walk) -> Iterator[tuple[int, int, int]]:
        """The oldest prompts sent back, then the cursor's, until it spent STEP_HASHES or reached
        an epoch it cannot start (`_start`)."""
        prefix, ledger = queue_prefix(tt.table_id, ds.name), tt.db["ledger"]
        while True:
            with tt.txn.cursor(db=ledger) as cur:
                if not (cur.set_range(prefix) and bytes(cur.key()).startswith(prefix)):
                    break
                epoch, index = unplace(cur.value())
                cur.delete()
            rec = self._prompt(tt, ds.name, epoch, index)
            if rec is not None and rec.state == PENDING:
                yield epoch, index, rec.attempt
        orders: dict[int, Permutation] = {}
        while ds.cursor_epoch < ds.epochs and walk.hashes < STEP_HASHES:
            epoch = ds.cursor_epoch
            if ds.cursor_position + 1 >= ds.size and not self._start(tt, ds, epoch + 1, walk):
                return  # the cursor rests on the epoch's last prompt until the next one's part is counted
            order = orders.get(epoch) or orders.setdefault(epoch, Permutation(ds.seed, epoch, ds.size))
            index = order(ds.cursor_position)
            ds.cursor_position += 1
            if ds.cursor_position >= ds.size:
                ds.cursor_epoch, ds.cursor_position = epoch + 1, 0
            walk.hashes += len(ds.shards)  # a shard's part: a rendezvous over its shards for each prompt
            if owns(ds, epoch, index):
                yield epoch, index, 0

    def _start(self, tt: TableState, ds: DatasetRecord, epoch: int, walk: Walk) -> bool:
        """Whether the cursor may move on into `epoch`: one with its part counted (every epoch
        but a shard's not started, and the end), or one whose part the claim counted outside the
        writer (`walk.parts`), written now with the epoch's counts; else the walk stops there."""
        if epoch >= ds.epochs or epoch < ds.counted:
            return True
        owned = walk.parts.get(epoch)
        if owned is None:
            walk.uncounted = epoch
            return False
        tt.txn.put(counts_key(tt.table_id, ds.name, epoch), encode_counts(owned, {}), db=tt.db["ledger"])
        ds.owned_total += owned
        ds.counted = epoch + 1
        return True

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
            self._put(tt, name, epoch, index, rec)
            tt.txn.put(expiry_key(tt.table_id, expires, name, epoch, index), b"", db=tt.db["ledger"])
        return expires, ended

    def release(self, tt: TableState, name: str, prompts: Sequence[tuple[int, int, int]], holder: str) -> int:
        """Give claims back now, as if they had ended: each prompt goes back with attempt + 1.
        Returns the claims released (one already ended is not)."""
        ds = self.dataset(tt, name)
        released = 0
        for epoch, index, attempt in prompts:
            rec = self._held(tt, name, epoch, index, attempt, holder)
            if rec is not None:
                self._end_claim(tt, ds, epoch, index, rec)
                released += 1
        self._save(tt, ds)
        return released

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
        for name, epoch, index in due:
            rec = self._prompt(tt, name, epoch, index)
            if rec is None or rec.state != CLAIMED or rec.expires > tt.now:
                continue
            ds = loaded.get(name) or loaded.setdefault(name, self.dataset(tt, name))
            self._end_claim(tt, ds, epoch, index, rec)
        for ds in loaded.values():
            self._save(tt, ds)
        return len(due)

    def _held(
        self, tt: TableState, name: str, epoch: int, index: int, attempt: int, holder: str
    ) -> PromptRecord | None:
        """The claim of this attempt at the prompt, if it still holds; another token's is refused."""
        rec = self._prompt(tt, name, epoch, index)
        if rec is None or rec.state != CLAIMED or rec.attempt != attempt:
            return None
        if rec.holder != holder:
            raise Forbidden(f"prompt {name}/{epoch}/{index} was claimed with another token")
        return rec

    def _end_claim(self, tt: TableState, ds: DatasetRecord, epoch: int, index: int, rec: PromptRecord) -> None:
        """A claim ended before its group was complete: the prompt goes back (or is dropped,
        its attempts spent), and the attempt's incomplete group, if any, is dropped."""
        gkey = group_key(ds.name, epoch, index, rec.attempt)
        self._unexpire(tt, ds.name, epoch, index, rec)
        self._count(ds, epoch, CLAIMED, -1)
        self._send_back(tt, ds, epoch, index, rec)
        if rec.state == PENDING:  # the next attempt's claimant gets the rollouts held in pieces back
            partials.carry(tt, gkey, prompt_eid(ds.name, epoch, index, rec.attempt))
        else:  # dropped, its attempts spent
            partials.drop_task(tt, gkey)
        grp = tt.group(gkey)
        if grp is not None and grp.state == GROUP_PENDING:  # after the prompt moved on: its event is no news
            retire(tt, [(gkey, grp)], GROUP_DROPPED)
            tt.counters.groups_dropped += 1
            ds.attempts_dropped += 1

    def _send_back(self, tt: TableState, ds: DatasetRecord, epoch: int, index: int, rec: PromptRecord) -> None:
        """The prompt goes out again with attempt + 1, before any new one; dropped instead once
        it had max_attempts."""
        rec.expires, rec.owner, rec.holder = 0.0, "", ""
        prompt = f"{ds.name}/{epoch}/{index}"
        if rec.attempt + 1 >= ds.max_attempts:
            rec.move(DROPPED, prompt)
            self._count(ds, epoch, DROPPED, 1)
        else:
            rec.move(PENDING, prompt)
            rec.attempt += 1
            tt.txn.put(queue_key(tt.table_id, ds.name, ds.next_seq), place(epoch, index), db=tt.db["ledger"])
            ds.next_seq += 1
            ds.reissued += 1
        self._put(tt, ds.name, epoch, index, rec)

    # ---- the table's events ------------------------------------------------------------------

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        """Only the claimant of a prompt's attempt pushes its group (with tokens on, the token
        that claimed it: `tt.holder`). Refuse a push into the group of an attempt whose claim
        ended, of one not handed out (a prompt's group keys are predictable: a push into one
        would block the claimant to come), or of one claimed with another token."""
        if not self.holds(tt):
            return
        for gkey in gkeys:
            found = self._entry(tt, gkey)
            if found is None:
                named = read_group_key(gkey)
                if named is not None and tt.txn.get(dataset_key(tt.table_id, named[0]), db=tt.db["ledger"]):
                    name, epoch, index, attempt = named
                    raise StaleAttempt(
                        f"group {gkey} is attempt {attempt} of prompt {name}/{epoch}/{index}, which no claim holds"
                        " (not handed out): nothing of this push is stored; push the groups of the prompts you claim"
                    )
                continue
            (name, epoch, index, attempt), rec = found
            prompt = f"prompt {name}/{epoch}/{index}"
            if rec.attempt != attempt or rec.state != CLAIMED:
                held = f"attempt {rec.attempt} is {rec.state}" if rec.state in (PENDING, CLAIMED) else rec.state
                raise StaleAttempt(
                    f"group {clip(gkey)} is attempt {attempt} of {prompt}, whose claim ended ({held} now): "
                    "nothing of this push is stored; claim a prompt again"
                )
            if rec.holder != tt.holder:
                raise Forbidden(
                    f"group {clip(gkey)} is attempt {attempt} of {prompt}, claimed with another token: "
                    "nothing of this push is stored"
                )

    def on_update(self, tt: TableState, gkey: str, grp: GroupRecord, was: str) -> None:
        """A group completed: its prompt, claimed by this attempt, is generated."""
        if was != GROUP_PENDING or not self.holds(tt):
            return
        found = self._entry(tt, gkey)
        if found is None:
            return
        (name, epoch, index, attempt), rec = found
        if rec.attempt != attempt or rec.state != CLAIMED:
            return
        ds = self.dataset(tt, name)
        self._unexpire(tt, name, epoch, index, rec)
        rec.move(GENERATED, f"{name}/{epoch}/{index}")
        rec.expires = 0.0
        self._put(tt, name, epoch, index, rec)
        self._generated(tt, ds, index, grp)
        self._count(ds, epoch, CLAIMED, -1)
        self._count(ds, epoch, GENERATED, 1)
        self._save(tt, ds)

    def on_retire(self, tt: TableState, groups: Groups, state: str) -> None:
        """Groups left the table: a consumed one's prompt is trained; a dropped, evicted,
        failed or deleted one's is done or goes back (on_drop)."""
        if not self.holds(tt):
            return
        loaded: dict[str, DatasetRecord] = {}  # a batch's groups read and write their dataset once
        for gkey, grp in groups:
            found = self._entry(tt, gkey)
            if found is None:
                continue
            (name, epoch, index, attempt), rec = found
            if rec.attempt != attempt or rec.state not in (CLAIMED, GENERATED):
                continue
            ds = loaded.get(name) or loaded.setdefault(name, self.dataset(tt, name))
            size = tt.config.grouping.size
            if rec.state == CLAIMED and size and len(grp.members) + len(grp.failed) >= size:
                self._generated(tt, ds, index, grp)  # complete, and dropped as it completed (zero variance)
            if rec.state == CLAIMED:
                self._unexpire(tt, name, epoch, index, rec)
            self._count(ds, epoch, rec.state, -1)
            if state == CONSUMED:
                rec.move(TRAINED, f"{name}/{epoch}/{index}")
                rec.expires = 0.0
                self._count(ds, epoch, TRAINED, 1)
                self._put(tt, name, epoch, index, rec)
                stats = self._stats(tt, name, index)
                stats.trained += 1
                stats.last_epoch = epoch
                version = tt.counters.trainer_version
                stats.last_step = -1 if version is None else version
                self._put_stats(tt, name, index, stats)
            elif ds.on_drop == "retry":
                self._send_back(tt, ds, epoch, index, rec)
            else:
                rec.move(DROPPED, f"{name}/{epoch}/{index}")
                rec.expires = 0.0
                self._count(ds, epoch, DROPPED, 1)
                self._put(tt, name, epoch, index, rec)
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

    # ---- records -----------------------------------------------------------------------------

    def _prompt(self, tt: TableState, name: str, epoch: int, index: int) -> PromptRecord | None:
        raw = tt.txn.get(prompt_key(tt.table_id, name, epoch, index), db=tt.db["ledger"])
        return None if raw is None else PromptRecord.decode(raw)

    def _put(self, tt: TableState, name: str, epoch: int, index: int, rec: PromptRecord) -> None:
        tt.txn.put(prompt_key(tt.table_id, name, epoch, index), rec.encode(), db=tt.db["ledger"])

    def _generated(self, tt: TableState, ds: DatasetRecord, index: int, grp: GroupRecord) -> None:
        """A prompt's group is complete: its rewards into the prompt's statistics."""
        stats = self._stats(tt, ds.name, index)
        was = pass_band(stats)
        rewards = [member.reward for member in tt.members(grp).values() if member.reward is not None]
        stats.generated_group(rewards, ds.pass_threshold)
        self._put_stats(tt, ds.name, index, stats)
        now = pass_band(stats)
        if was != now:
            if was is not None:
                ds.pass_bands[was] = ds.pass_bands.get(was, 0) - 1
            if now is not None:
                ds.pass_bands[now] = ds.pass_bands.get(now, 0) + 1

    def _stats(self, tt: TableState, name: str, index: int) -> PromptStats:
        return read_stats(tt.txn, tt.db["ledger"], tt.table_id, name, index)

    def _put_stats(self, tt: TableState, name: str, index: int, stats: PromptStats) -> None:
        tt.txn.put(stats_key(tt.table_id, name, index), stats.encode(), db=tt.db["ledger"])

    def _unexpire(self, tt: TableState, name: str, epoch: int, index: int, rec: PromptRecord) -> None:
        if rec.expires:
            tt.txn.delete(expiry_key(tt.table_id, rec.expires, name, epoch, index), db=tt.db["ledger"])

    def _entry(self, tt: TableState, gkey: str) -> tuple[tuple[str, int, int, int], PromptRecord] | None:
        """The prompt whose attempt a group is, and that prompt's record; None for a group of
        no prompt."""
        raw = tt.txn.get(group_entry_key(tt.table_id, gkey), db=tt.db["ledger"]) if len(gkey) <= 400 else None
        if raw is None:
            return None
        entry = read_group_entry(raw)
        rec = self._prompt(tt, *entry[:3])
        return None if rec is None else (entry, rec)
