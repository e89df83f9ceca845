"""What a claim hands out (`Claimed`), what one transaction of a claim did (`ClaimStep`), and
how far its cursor walked in it (`Walk`): the records a claim's rules (claim_life.py) and the
claims service (services/claims.py) pass between them.

And what a claim made under its client's id handed out, kept so that the claim made again (its
reply lost to a cut connection or a killed server, the client's retry) answers the same prompts
rather than claiming more: those would stay claimed by no one until their lease ended, counting
against max_in_flight, and each such claim would spend an attempt of its prompts. Under the
table's id T in the `ledger` database (records.py lists the others):
- T + "k" + claim id                      -> until (u64 microseconds) + name + 0 + (epoch, index, attempt)...
- T + "i" + until + claim id              -> b"": the ids by when they are forgotten
A claim's id is kept until its lease ends, at most KEPT_SECONDS: a client makes a claim again
within its retries (seconds), a restart's wait at most (minutes).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..core.table_state.state import TableState
from ..disk import layout


@dataclass
class Walk:
    """The cursor's walk in one transaction of a claim: the ownership hashes it spent, the parts
    of epochs a shard counted before the transaction (claims.py), by epoch, the epoch whose
    part it reached uncounted, where it stopped, and the epoch it may not start yet (the one two
    before it not done, hand_out.py), where the claim waits."""

    parts: Mapping[int, int] = field(default_factory=dict)
    hashes: int = 0
    uncounted: int | None = None
    waiting: int | None = None


@dataclass(frozen=True)
class ClaimStep:
    """What one transaction of a claim did: the prompts it handed out, whether the dataset is
    done, and whether it stopped short (`more`), its STEP_HASHES spent or, on a shard, the
    cursor at an epoch whose part is `uncounted`: to count outside the writer, then go on;
    `again`: a claim made again under its id answered what the first handed out."""

    claimed: list[Claimed]
    done: bool
    more: bool
    uncounted: int | None = None
    again: bool = False  # a claim made again under its id: what it handed out the first time


@dataclass(frozen=True)
class Claimed:
    """A prompt handed to a claimant: which, its attempt, and when its claim ends."""

    epoch: int
    index: int
    attempt: int
    expires: float


KEPT_SECONDS = 600.0
_PROMPT = struct.Struct(">IQI")  # epoch, index, attempt
_UNTIL = struct.Struct(">Q")


def _key(table_id: int, claim_id: str) -> bytes:
    return layout.table_prefix(table_id) + b"k" + claim_id.encode()


def _times_prefix(table_id: int) -> bytes:
    return layout.table_prefix(table_id) + b"i"


def _time_key(table_id: int, stamp: bytes, claim_id: str) -> bytes:
    return _times_prefix(table_id) + stamp + claim_id.encode()


def recall_id(tt: TableState, claim_id: str, name: str) -> list[tuple[int, int, int]] | None:
    """The prompts (epoch, index, attempt) a claim of this id handed out of dataset `name`, or
    None where no such claim is kept (never made, made of another dataset, or forgotten)."""
    raw = tt.txn.get(_key(tt.table_id, claim_id), db=tt.db["ledger"])
    if raw is None:
        return None
    head = 8 + len(name.encode()) + 1
    if bytes(raw[8:head]) != name.encode() + b"\0":
        return None
    return [_PROMPT.unpack_from(raw, at) for at in range(head, len(raw), _PROMPT.size)]


def remember_id(tt: TableState, claim_id: str, name: str, claimed: Iterable[Claimed], *, anew: bool) -> None:
    """Keep the prompts a step of the claim handed out under its id: added to those its earlier
    steps did, or, `anew`, in place of what an earlier claim of the id (none held now) did."""
    claimed = list(claimed)
    if not claimed:
        return
    key, db = _key(tt.table_id, claim_id), tt.db["ledger"]
    old = tt.txn.get(key, db=db)
    until = min(max(c.expires for c in claimed), tt.now + KEPT_SECONDS)
    rows = b"".join(_PROMPT.pack(c.epoch, c.index, c.attempt) for c in claimed)
    if old is not None:
        tt.txn.delete(_time_key(tt.table_id, bytes(old[:8]), claim_id), db=db)
        if not anew:
            until = max(until, _UNTIL.unpack_from(old)[0] / 1e6)
            rows = bytes(old[8 + len(name.encode()) + 1 :]) + rows
    stamp = layout.micros(until)
    tt.txn.put(key, stamp + name.encode() + b"\0" + rows, db=db)
    tt.txn.put(_time_key(tt.table_id, stamp, claim_id), b"", db=db)


def forget_ids(tt: TableState, most: int) -> None:
    """Forget the ids whose time has come, at most `most` of them."""
    prefix, db = _times_prefix(tt.table_id), tt.db["ledger"]
    cutoff, gone = layout.micros(tt.now), list[bytes]()
    with tt.txn.cursor(db=db) as cur:
        found = cur.set_range(prefix)
        while found and len(gone) < most:
            key = bytes(cur.key())
            if not key.startswith(prefix) or key[len(prefix) : len(prefix) + 8] > cutoff:
                break
            gone.append(key)
            found = cur.next()
    for key in gone:
        tt.txn.delete(key, db=db)
        tt.txn.delete(_key(tt.table_id, key[len(prefix) + 8 :].decode()), db=db)


def id_problems(tt: TableState) -> list[str]:
    """What `expbuf check` finds wrong with the kept ids: an id without its time (never forgotten),
    a time without its id, a record that does not decode."""
    found: list[str] = []
    by_id, times, db = layout.table_prefix(tt.table_id) + b"k", _times_prefix(tt.table_id), tt.db["ledger"]
    ids = 0
    with tt.txn.cursor(db=db) as cur:
        more = cur.set_range(by_id)
        while more and bytes(cur.key()).startswith(by_id):
            claim_id, value = bytes(cur.key()[len(by_id) :]), bytes(cur.value())
            ids += 1
            name_end = value.find(b"\0", 8)
            if name_end < 0 or (len(value) - name_end - 1) % _PROMPT.size:
                found.append(f"claim id {claim_id!r}: its record does not decode")
            elif tt.txn.get(times + value[:8] + claim_id, db=db) is None:
                found.append(f"claim id {claim_id!r}: no key says when it is forgotten")
            more = cur.next()
        more, stamps = cur.set_range(times), 0
        while more and bytes(cur.key()).startswith(times):
            stamps += 1
            more = cur.next()
    if stamps != ids:
        found.append(f"{stamps} claim ids by time against {ids} claim ids kept")
    return found
