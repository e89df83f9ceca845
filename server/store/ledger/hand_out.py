"""Which prompts a claim hands out, in a table's transaction: the oldest sent back, then the
dataset's cursor through each epoch in its claim order (orders.py: the permutation, skipping the
prompts a shard does not own, or a difficulty order's draws, binned.py), past the prompts that
sit the epoch out (zero_variance = "skip"), each at its first attempt whose group the table does
not hold; and a prompt's record read and written there, as the ledger's rules (claim_life.py,
outcomes.py) read and write it.

The cursor starts an epoch only once every prompt of the epoch two before it is trained or
dropped (`_may_start`): claims run at most two epochs at once, so a claimant that never trains
what it claims cannot start epoch after epoch (each started epoch is a row a read of the ledger
reads, and records `expbuf check` walks). A claim that meets the bound waits, as one that finds
nothing to hand out does.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..core.table_state.state import TableState
from . import binned
from .claimed import Walk
from .orders import order_of
from .prompt_stats import read_stats
from .records import (
    DatasetRecord,
    Permutation,
    PromptRecord,
    counts_key,
    decode_counts,
    encode_counts,
    group_key,
    prompt_key,
    queue_prefix,
    unplace,
)
from .shards import owns
from .states import DONE, DROPPED, PENDING

# The ownership hashes (one a shard) a claim's cursor spends in one transaction stepping over a
# shard's part of a dataset: with many shards, one prompt owned costs about shards**2 (1,024
# shards: about 1 s a prompt), so a claim goes on in another transaction rather than hold the
# writer (about 50 ms a transaction).
STEP_HASHES = 1 << 16
# What a prompt skipped at the cursor spends of them (its dropped record written, about 15 us
# against a hash's 1 us): a claim of a dataset whose prompts all sit the epoch out walks 1,024
# of them a transaction, not every epoch's at once.
SKIP_HASHES = 64


def prompt_of(tt: TableState, name: str, epoch: int, index: int) -> PromptRecord | None:
    raw = tt.txn.get(prompt_key(tt.table_id, name, epoch, index), db=tt.db["ledger"])
    return None if raw is None else PromptRecord.decode(raw)


def put_prompt(tt: TableState, name: str, epoch: int, index: int, rec: PromptRecord) -> None:
    tt.txn.put(prompt_key(tt.table_id, name, epoch, index), rec.encode(), db=tt.db["ledger"])


def hand_out(tt: TableState, ds: DatasetRecord, walk: Walk) -> Iterator[tuple[int, int, int] | None]:
    """The prompts to hand out, (epoch, index, attempt), for as long as the claim takes
    them: the oldest sent back, then the cursor's (skipping the prompts a shard does not
    own), each at its first attempt whose group the table does not hold (`_untaken`); None,
    last, once the cursor spent STEP_HASHES in this transaction or reached an epoch whose
    part is not counted (`walk.uncounted`)."""
    for epoch, index, attempt in _candidates(tt, ds, walk):
        free = _untaken(tt, ds, epoch, index, attempt)
        if free is not None:
            yield epoch, index, free
    if ds.cursor_epoch < ds.epochs and walk.waiting is None:
        yield None


def _untaken(tt: TableState, ds: DatasetRecord, epoch: int, index: int, attempt: int) -> int | None:
    """The first attempt at the prompt from `attempt` on whose group the table does not hold:
    before a dataset exists a push under its name is a group like any other, and a claim of
    an attempt whose group is taken could never complete it. None, the prompt dropped, when
    every attempt left is taken."""
    while attempt < ds.max_attempts:
        if tt.view(group_key(ds.name, epoch, index, attempt)) is None:
            return attempt
        attempt += 1
    rec = prompt_of(tt, ds.name, epoch, index) or PromptRecord(PENDING, attempt)
    rec.move(DROPPED, f"{ds.name}/{epoch}/{index}")
    rec.attempt = ds.max_attempts - 1
    put_prompt(tt, ds.name, epoch, index, rec)
    ds.count(epoch, DROPPED, 1)
    return None


def _candidates(tt: TableState, ds: DatasetRecord, walk: Walk) -> Iterator[tuple[int, int, int]]:
    """The oldest prompts sent back, then the cursor's, until it spent STEP_HASHES or reached
    an epoch it cannot start (`_start`)."""
    prefix, ledger = queue_prefix(tt.table_id, ds.name), tt.db["ledger"]
    while True:
        with tt.txn.cursor(db=ledger) as cur:
            if not (cur.set_range(prefix) and bytes(cur.key()).startswith(prefix)):
                break
            epoch, index = unplace(cur.value())
            cur.delete()
        rec = prompt_of(tt, ds.name, epoch, index)
        if rec is not None and rec.state == PENDING:
            yield epoch, index, rec.attempt
    order = order_of(ds)
    looks = order.bins or ds.zero_variance == "skip"  # the cursor reads each prompt's statistics
    permutations: dict[int, Permutation] = {}
    while ds.cursor_epoch < ds.epochs and walk.hashes < STEP_HASHES:
        epoch = ds.cursor_epoch
        if not ds.cursor_position and not _may_start(tt, ds, epoch):
            walk.waiting = epoch
            return
        if order.bins and epoch:
            taken = binned.take(tt, ds, order, epoch)
            if taken is None:
                ds.cursor_epoch, ds.cursor_position = epoch + 1, 0
                continue
            index, ds.cursor_position = taken, ds.cursor_position + 1
            if not binned.left(ds, epoch):  # its last prompt: the cursor rests at the next epoch's start
                ds.cursor_epoch, ds.cursor_position = epoch + 1, 0
            walk.hashes += 1
        else:
            if ds.cursor_position + 1 >= ds.size and not _start(tt, ds, epoch + 1, walk):
                return  # the cursor rests on the epoch's last prompt until the next one's part is counted
            permuted = permutations.get(epoch) or permutations.setdefault(epoch, Permutation(ds.seed, epoch, ds.size))
            index = permuted(ds.cursor_position)
            ds.cursor_position += 1
            if ds.cursor_position >= ds.size:
                ds.cursor_epoch, ds.cursor_position = epoch + 1, 0
            walk.hashes += len(ds.shards)  # a shard's part: a rendezvous over its shards for each prompt
            if not owns(ds, epoch, index):
                continue
        if looks:
            stats = read_stats(tt.txn, tt.db["ledger"], tt.table_id, ds.name, index)
            if order.bins:
                binned.enter(tt, ds, order, epoch + 1, index, stats)
            if stats.skip_until > epoch:
                _skip(tt, ds, epoch, index)
                walk.hashes += SKIP_HASHES
                continue
        yield epoch, index, 0


def _skip(tt: TableState, ds: DatasetRecord, epoch: int, index: int) -> None:
    """A prompt sits this epoch out (its group had zero variance within skip_epochs): dropped at
    the cursor, never claimed."""
    rec = PromptRecord(PENDING, 0)
    rec.move(DROPPED, f"{ds.name}/{epoch}/{index}")
    put_prompt(tt, ds.name, epoch, index, rec)
    ds.count(epoch, DROPPED, 1)
    ds.skipped += 1


def _may_start(tt: TableState, ds: DatasetRecord, epoch: int) -> bool:
    """Whether the cursor may start `epoch`: every prompt of the epoch two before it (this
    server's part of it, on a shard) trained or dropped, its moves in this transaction counted."""
    if epoch < 2:
        return True
    raw = tt.txn.get(counts_key(tt.table_id, ds.name, epoch - 2), db=tt.db["ledger"])
    owned, row = (ds.size, {}) if raw is None else decode_counts(raw)
    moved = ds.moved.get(epoch - 2, {})
    return sum(row.get(state, 0) + moved.get(state, 0) for state in DONE) >= owned


def _start(tt: TableState, ds: DatasetRecord, epoch: int, walk: Walk) -> bool:
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
