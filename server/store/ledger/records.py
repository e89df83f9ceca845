"""The prompt ledger's records and keys (rules.py composes its rules).

A table's datasets of prompts live in the `ledger` database, under the table's id T:
- T + "d" + name                          -> DatasetRecord (JSON): settings, cursor, totals
- T + "c" + name + 0 + epoch              -> the epoch's prompts owned, claimed, generated, trained, dropped (5 x u64)
- T + "p" + name + 0 + epoch + index      -> PromptRecord: a prompt handed out at least once
- T + "q" + name + 0 + seq                -> epoch + index: prompts to hand out again, oldest first
- T + "g" + group key                     -> name + 0 + epoch + index + attempt: whose group it is
- T + "x" + expiry + name + 0 + epoch + index -> b"": claims by when they end
- T + "s" + name + 0 + index              -> KeptStats: how a prompt fared, over its epochs (prompt_stats.py)
- T + "o" + name + 0 + epoch + bin + rank + index -> b"": a difficulty order's prompts left in an epoch (binned.py)
(epoch u32, index u64, seq u64, attempt u32, expiry in microseconds, all big-endian.) A
prompt never handed out has no record: it is pending, at or beyond the dataset's cursor (one a
"skip" sat out of an epoch has one, dropped at attempt 0, never claimed). An
epoch's counts are written at its first event, or on a shard of a sharded table when the epoch
starts (its part of the epoch is counted then, ledger/shards.py); an epoch without them owns
`size` prompts, all pending.

An epoch visits the indexes 0..size-1 in a permutation fixed by the dataset's seed
(`Permutation`: a keyed Feistel network with cycle walking, so the cursor maps a position to its
index in constant time and memory, whatever the size), or in index order without a seed.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lmdb

from expbuf.client.schema.prompts import PromptState

from ..disk import layout
from ..disk.layout import U32, U64
from .states import CLAIMED, COUNTED, DONE, GENERATED, PENDING, PROMPT_STATES, check_prompt_move

ON_DROP = ("done", "retry")
# A prompt whose group's rewards are all equal: as any other ("keep": trained, or dropped by the
# table's drop_zero_variance and then as on_drop says), sent back for another attempt ("retry",
# the table dropping such groups), or done for its epoch and skipped for the next skip_epochs.
ZERO_VARIANCE = ("keep", "retry", "skip")
# A dataset's name starts with a letter: a group key that began with a number would read as a
# rollout batch to a sharded client's shard epochs (routing.py).
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]{0,63}$")
MAX_SIZE = 2**40

_COUNTS = struct.Struct(">5Q")  # an epoch's prompts owned, claimed, generated, trained, dropped
_PROMPT = struct.Struct("<BIdB")  # state, attempt, expires (0: none), holder length
_STATE_CODE = {state: code for code, state in enumerate(PROMPT_STATES)}


def prompt_eid(name: str, epoch: int, index: int, attempt: int) -> tuple[str, str]:
    """The EID batch and task of the experiences of one attempt at a prompt."""
    return f"{name}/{epoch}", f"{index}@{attempt}"


def group_key(name: str, epoch: int, index: int, attempt: int) -> str:
    """The group of one attempt at a prompt, as a table grouping by task keys it (EID tid)."""
    batch, task = prompt_eid(name, epoch, index, attempt)
    return f"{batch}/{task}"


_GROUP_KEY = re.compile(
    r"([A-Za-z][A-Za-z0-9_.\-]{0,63})/(0|[1-9][0-9]{0,19})/(0|[1-9][0-9]{0,19})@(0|[1-9][0-9]{0,9})"
)


def read_group_key(gkey: str) -> tuple[str, int, int, int] | None:
    """(dataset, epoch, index, attempt) of a group key as `group_key` makes them; None for any
    other key."""
    found = _GROUP_KEY.fullmatch(gkey)
    return None if found is None else (found[1], int(found[2]), int(found[3]), int(found[4]))


@dataclass
class DatasetRecord:
    """A dataset of prompts on a table, its cursor and its totals.

    `totals[state]` counts the prompts of every epoch in each state but pending (the rest of
    the `owned_total` prompts this server hands out of the `counted` epochs: `size` per epoch,
    every epoch; or on a shard of a sharded table those it owns of the epochs started, each
    epoch's part counted as it starts, ledger/shards.py), so that the totals and whether the
    dataset is `done` read this record alone. Each epoch's prompts owned and counts by state
    are a record of their own (`counts_key`), so that an event rewrites this record and its
    epoch's, whatever the epochs. `owned` and `counts` hold them, one row per epoch started
    (`started`), only when read for a caller (`read_epochs`), and are never stored here: an
    epoch past the cursor's has had no prompt handed out, all its prompts pending."""

    name: str
    size: int
    epochs: int = 1
    seed: int | None = None
    max_in_flight: int = 0  # claimed plus generated but not trained; 0: no bound
    on_drop: str = "done"
    max_attempts: int = 5
    created: float = 0.0
    shards: list[str] = field(default_factory=list)  # a sharded table's shards of epoch 0, sorted
    shard: str = ""  # this server's name among them
    owned_total: int = 0  # the prompts of the counted epochs this server hands out
    # the epochs in owned_total: every one, or on a shard those started (0 through the cursor's);
    # a record written before shards counted each epoch as it starts counted them all at create
    counted: int = 0
    cursor_epoch: int = 0
    cursor_position: int = 0
    next_seq: int = 0
    reissued: int = 0  # claims handed out again (a claim ended, or a group dropped with on_drop = "retry")
    attempts_dropped: int = 0  # incomplete groups of attempts whose claim ended, dropped
    pass_threshold: float = 0.0  # a run passes when its reward is above it (KeptStats.passes)
    order: str = "permutation"  # the claim order of each epoch's prompts (orders.py)
    order_options: dict[str, float] = field(default_factory=dict)  # its options, its defaults filled in
    zero_variance: str = "keep"  # a prompt whose group's rewards are all equal (ZERO_VARIANCE)
    skip_epochs: int = 1  # with zero_variance = "skip": the epochs it sits out
    skipped: int = 0  # prompts an epoch skipped (dropped at the cursor): zero variance in an epoch before
    # a difficulty order's prompts left to hand out, by epoch (the cursor's and the next) and bin (binned.py)
    binned: dict[str, list[int]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    # the prompts generated at least once, by the band of their pass rate (prompt_stats.PASS_BANDS)
    pass_bands: dict[str, int] = field(default_factory=dict)
    owned: list[int] = field(default_factory=list)  # per epoch started: read for a caller, not stored
    counts: list[dict[str, int]] = field(default_factory=list)  # per epoch started: read for a caller, not stored
    # per epoch, the changes of its counts by an event not yet written: the ledger writes each
    # epoch's record once, with the dataset's, whatever the prompts the event moved; not stored
    moved: dict[int, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shards = sorted(self.shards)  # the same shards in any order are the same placement

    def settings(self) -> dict[str, Any]:
        """What the creator chose: an identical CreateDataset with exist_ok finds it."""
        keys = (
            "size",
            "epochs",
            "seed",
            "max_in_flight",
            "on_drop",
            "max_attempts",
            "shards",
            "shard",
            "pass_threshold",
            "order",
            "order_options",
            "zero_variance",
            "skip_epochs",
        )
        return {key: getattr(self, key) for key in keys}

    @property
    def started(self) -> int:
        """The epochs started: those up to the cursor's (every one once the cursor is past the last)."""
        return min(self.cursor_epoch + 1, self.epochs)

    def states(self, epoch: int) -> dict[str, int]:
        """A started epoch's prompts by state, pending included (those of its `owned` in no
        other); the epochs must have been read (`read_epochs`)."""
        row = self.counts[epoch]
        held: dict[str, int] = {state: row.get(state, 0) for state in COUNTED}
        return {PENDING: self.owned[epoch] - sum(held.values()), **held}

    def overall(self) -> dict[str, int]:
        """The prompts of every epoch counted by state, pending included, from the record alone
        (on a shard: of the epochs started, its part of a later one not counted yet)."""
        held: dict[str, int] = {state: self.totals.get(state, 0) for state in COUNTED}
        return {PENDING: self.owned_total - sum(held.values()), **held}

    def total(self, *states: str) -> int:
        return sum(self.totals.get(state, 0) for state in states)

    @property
    def in_flight(self) -> int:
        return self.total(CLAIMED, GENERATED)

    @property
    def done(self) -> bool:
        """Every prompt of every epoch trained, or dropped as done (a shard's: once it counted its
        part of the last epoch, every prompt of its parts)."""
        return self.counted >= self.epochs and self.total(*DONE) >= self.owned_total

    def count(self, epoch: int, state: str, delta: int) -> None:
        """`delta` more prompts of the epoch in `state`: in the totals, and in its epoch's record
        when the dataset is saved (`moved`)."""
        self.totals[state] = self.totals.get(state, 0) + delta
        moved = self.moved.setdefault(epoch, {})
        moved[state] = moved.get(state, 0) + delta

    def encode(self) -> bytes:
        stored = {key: value for key, value in vars(self).items() if key not in ("owned", "counts", "moved")}
        return json.dumps(stored, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> DatasetRecord:
        stored = json.loads(bytes(raw))
        stored.setdefault("counted", stored.get("epochs", 1))  # written when every epoch was counted at create
        return cls(**stored)


def counts_key(table_id: int, name: str, epoch: int) -> bytes:
    return counts_prefix(table_id, name) + U32.pack(epoch)


def counts_prefix(table_id: int, name: str) -> bytes:
    return layout.table_prefix(table_id) + b"c" + name.encode() + b"\0"


def counts_epoch(key: bytes) -> int:
    """The epoch of an epoch's counts key."""
    epoch: int = U32.unpack_from(key, len(key) - 4)[0]
    return epoch


def encode_counts(owned: int, row: dict[str, int]) -> bytes:
    return _COUNTS.pack(owned, *(row.get(state, 0) for state in COUNTED))


def decode_counts(raw: bytes | memoryview) -> tuple[int, dict[str, int]]:
    """An epoch's prompts owned, and its counts by state with the states of none left out."""
    owned, *counts = _COUNTS.unpack(raw)
    return owned, {state: n for state, n in zip(COUNTED, counts, strict=True) if n}


@dataclass
class PromptRecord:
    """A prompt handed out at least once: its state, the attempt that holds or held it, when
    its claim ends (claimed only), who claimed it (a name the claimant gave) and the token
    that did (its fingerprint, when tokens are on)."""

    state: PromptState
    attempt: int
    expires: float = 0.0
    owner: str = ""
    holder: str = ""

    def move(self, to: PromptState, prompt: str) -> None:
        """Move to `to`, as PROMPT_MOVES allows (states.py): the one way a prompt's state changes."""
        check_prompt_move(prompt, self.state, to)
        self.state = to

    def encode(self) -> bytes:
        holder, owner = self.holder.encode(), self.owner.encode()
        return _PROMPT.pack(_STATE_CODE[self.state], self.attempt, self.expires, len(holder)) + holder + owner

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> PromptRecord:
        code, attempt, expires, holder = _PROMPT.unpack_from(raw)
        rest = bytes(raw[_PROMPT.size :])
        return cls(PROMPT_STATES[code], attempt, expires, rest[holder:].decode(), rest[:holder].decode())


def dataset_key(table_id: int, name: str) -> bytes:
    return layout.table_prefix(table_id) + b"d" + name.encode()


def datasets_prefix(table_id: int) -> bytes:
    return layout.table_prefix(table_id) + b"d"


def prompt_key(table_id: int, name: str, epoch: int, index: int) -> bytes:
    return prompts_prefix(table_id, name) + U32.pack(epoch) + U64.pack(index)


def prompts_prefix(table_id: int, name: str) -> bytes:
    return layout.table_prefix(table_id) + b"p" + name.encode() + b"\0"


def prompt_of(key: bytes) -> tuple[int, int]:
    """(epoch, index) of a prompt key."""
    return U32.unpack_from(key, len(key) - 12)[0], U64.unpack_from(key, len(key) - 8)[0]


def queue_key(table_id: int, name: str, seq: int) -> bytes:
    return queue_prefix(table_id, name) + U64.pack(seq)


def queue_prefix(table_id: int, name: str) -> bytes:
    return layout.table_prefix(table_id) + b"q" + name.encode() + b"\0"


def place(epoch: int, index: int) -> bytes:
    return U32.pack(epoch) + U64.pack(index)


def unplace(raw: bytes | memoryview) -> tuple[int, int]:
    return U32.unpack_from(raw)[0], U64.unpack_from(raw, 4)[0]


def group_entry_key(table_id: int, gkey: str) -> bytes:
    return layout.table_prefix(table_id) + b"g" + gkey.encode()


def group_entry(name: str, epoch: int, index: int, attempt: int) -> bytes:
    return name.encode() + b"\0" + place(epoch, index) + U32.pack(attempt)


def read_group_entry(raw: bytes | memoryview) -> tuple[str, int, int, int]:
    """(dataset, epoch, index, attempt) of a group entry."""
    data = bytes(raw)
    name, rest = data[:-16], data[-16:]
    epoch, index = unplace(rest)
    return name.rstrip(b"\0").decode(), epoch, index, U32.unpack_from(rest, 12)[0]


def expiry_key(table_id: int, expires: float, name: str, epoch: int, index: int) -> bytes:
    return expiry_prefix(table_id) + layout.micros(expires) + name.encode() + b"\0" + place(epoch, index)


def expiry_prefix(table_id: int) -> bytes:
    return layout.table_prefix(table_id) + b"x"


def read_datasets(txn: lmdb.Transaction[bytes], db: lmdb._Database, table_id: int) -> list[DatasetRecord]:
    """A table's dataset records, by name."""
    prefix = datasets_prefix(table_id)
    out = []
    with txn.cursor(db=db) as cur:
        found = cur.set_range(prefix)
        while found and bytes(cur.key()).startswith(prefix):
            out.append(DatasetRecord.decode(cur.value()))
            found = cur.next()
    return out


def read_dataset(txn: lmdb.Transaction[bytes], db: lmdb._Database, table_id: int, name: str) -> DatasetRecord | None:
    """One dataset's record; None when the table has no such dataset."""
    raw = txn.get(dataset_key(table_id, name), db=db) if len(name) <= 64 else None
    return None if raw is None else DatasetRecord.decode(raw)


def read_epochs(txn: lmdb.Transaction[bytes], db: lmdb._Database, table_id: int, ds: DatasetRecord) -> DatasetRecord:
    """The dataset with each started epoch's prompts owned and counts read into `owned` and
    `counts` (an epoch without its record has had no event: `size` owned, none counted); the
    records of the epochs after them (a shard's parts, written at create before shards counted
    each epoch as it starts) are not read."""
    ds.owned, ds.counts = [ds.size] * ds.started, [{} for _ in range(ds.started)]
    prefix = counts_prefix(table_id, ds.name)
    with txn.cursor(db=db) as cur:
        found = cur.set_range(prefix)
        while found and bytes(cur.key()).startswith(prefix):
            epoch = counts_epoch(bytes(cur.key()))
            if epoch >= ds.started:
                break
            ds.owned[epoch], ds.counts[epoch] = decode_counts(cur.value())
            found = cur.next()
    return ds


def read_prompts(
    txn: lmdb.Transaction[bytes],
    db: lmdb._Database,
    table_id: int,
    name: str,
    after: tuple[int, int] | None,
    limit: int,
) -> Iterator[tuple[int, int, PromptRecord]]:
    """Up to `limit` of a dataset's prompt records in (epoch, index) order, after `after`."""
    prefix = prompts_prefix(table_id, name)
    start = prefix + (place(*after) + b"\0" if after is not None else b"")
    with txn.cursor(db=db) as cur:
        found = cur.set_range(start)
        while found and limit > 0 and bytes(cur.key()).startswith(prefix):
            epoch, index = prompt_of(bytes(cur.key()))
            yield epoch, index, PromptRecord.decode(cur.value())
            limit -= 1
            found = cur.next()


def oldest_claim(txn: lmdb.Transaction[bytes], db: lmdb._Database, table_id: int) -> bytes | None:
    """When the table's first claim ends (8 sortable bytes), or None if it has no claim."""
    prefix = expiry_prefix(table_id)
    with txn.cursor(db=db) as cur:
        if cur.set_range(prefix) and bytes(cur.key()).startswith(prefix):
            return bytes(cur.key()[5:13])
    return None


def read_expiry_key(key: bytes) -> tuple[str, int, int]:
    """(dataset, epoch, index) of a claim expiry key."""
    name = key[13:-12].rstrip(b"\0").decode()
    epoch, index = unplace(key[-12:])
    return name, epoch, index


class Permutation:
    """An epoch's visit of 0..size-1: the position itself without a seed; else a permutation
    keyed by (seed, epoch), a 4-round Feistel network over the smallest even power of two at
    least `size`, walked until it lands below `size` (fewer than 4 steps on average). Keyed
    once, so that a claim mapping many positions hashes each round once."""

    def __init__(self, seed: int | None, epoch: int, size: int) -> None:
        self.size = size
        self.keyed = None
        if seed is not None and size > 1:
            self.half = max(1, ((size - 1).bit_length() + 1) // 2)
            self.mask = (1 << self.half) - 1
            key = U64.pack(seed & (2**64 - 1)) + U32.pack(epoch)
            self.keyed = hashlib.blake2b(digest_size=8, key=key)  # a copy is cheaper than keying anew

    def __call__(self, position: int) -> int:
        if self.keyed is None:
            return position
        half, mask, value = self.half, self.mask, position
        while True:
            left, right = value >> half, value & mask
            for round_ in _ROUNDS:
                digest = self.keyed.copy()
                digest.update(U64.pack(right) + round_)
                left, right = right, left ^ (int.from_bytes(digest.digest(), "big") & mask)
            value = (left << half) | right
            if value < self.size:
                return value


_ROUNDS = tuple(bytes([round_]) for round_ in range(4))


def permuted(seed: int | None, epoch: int, size: int, position: int) -> int:
    """The index at `position` of an epoch's visit of 0..size-1 (Permutation)."""
    return Permutation(seed, epoch, size)(position)
