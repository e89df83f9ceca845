"""Admission of rollouts, after AReaL's bound on off-policyness, and the staleness screen
of pushes.

A rollout worker asks before it starts rollouts. With `max_staleness` s and `batch_size`
B, a table lets rollouts start while submitted <= (s + trainer version + 1) * B, where
`submitted` counts the rollouts granted so far minus those given back. A grant is a
lease: the worker finishes it (saying how many rollouts were accepted; the others give
their room back), or it expires (a crashed worker) and all of it comes back. Grants and
their expiry index are in LMDB, so they survive a restart; `submitted` is a counter.

A push of experiences older than trainer version - s is dropped (counted) or refused,
per the table's `on_stale`; an experience without a version is kept.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import lmdb

from ..core.table_state.state import TableState
from ..disk import layout
from ..disk.kinds import Entry
from ..schema.errors import Forbidden, InvalidRequest, NotFound, StaleExperience, clip, taken_with
from ..schema.sample_spec import MAX_COUNT

# A grant older than a day is a lost worker, not a long rollout.
MAX_GRANT_SECONDS = 86400.0
# A grant id a client makes (an idempotent admit's): as the server's own are, a key of the grants.
GRANT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class GrantRecord(TypedDict):
    """A grant as stored (JSON): its table id, its rollouts, when it expires and, with tokens on,
    the fingerprint of the token that took it (a grant stored before grants had one is anyone's)."""

    t: int
    n: int
    e: float
    o: NotRequired[str]


@dataclass(frozen=True)
class RolloutGrant:
    """Rollouts a worker may start now: `count` (0: none; then no grant id) until `expires`."""

    count: int
    grant_id: str = ""
    expires: float = 0.0


def capacity(tt: TableState) -> int | None:
    """Rollouts that may start now; None when the table sets no bound."""
    cfg = tt.config
    if cfg.staleness.max_staleness is None or not cfg.staleness.batch_size:
        return None
    version = tt.counters.trainer_version or 0
    return max(0, (cfg.staleness.max_staleness + version + 1) * cfg.staleness.batch_size - tt.counters.submitted)


def grant(tt: TableState, count: int, seconds: float, owner: str = "", grant_id: str = "") -> RolloutGrant:
    """RolloutGrant up to `count` rollouts under a lease of `seconds`, bound to `owner` (the
    caller's token fingerprint with tokens on), who alone finishes it. `grant_id`: the client's
    name for it; where a grant of that name is still open (the same admit made again after its
    reply was lost), that grant, not a second one; where it has expired (its room comes back), a
    new one, not the old one with an expiry already past."""
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
        raise InvalidRequest(f"count must be an integer from 1 to {MAX_COUNT}, got {clip(count)}")
    if not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_GRANT_SECONDS:
        raise InvalidRequest(f"grant_seconds is {clip(seconds)}; it must be > 0 and <= {MAX_GRANT_SECONDS:g}")
    if grant_id and GRANT_ID.fullmatch(grant_id) is None:
        raise InvalidRequest(f"grant_id {clip(grant_id)!r} must be 1-64 of A-Z a-z 0-9 _ -")
    made = read_grant(tt.txn, tt.db, grant_id) if grant_id else None
    if made is not None:
        if made["t"] != tt.table_id:
            raise InvalidRequest(f"grant_id '{grant_id}' names an open grant of another table: make a new one")
        check_owner(made.get("o", ""), grant_id, owner)
        if made["e"] > tt.now:
            return RolloutGrant(made["n"], grant_id, made["e"])
        finish(tt, grant_id, made, 0, expired=True)  # expired, the upkeep not yet by: its room back, a new one
    room = capacity(tt)
    granted = count if room is None else min(count, room)
    if granted == 0:
        return RolloutGrant(0)
    grant_id, expires = grant_id or secrets.token_hex(8), tt.now + seconds
    record: GrantRecord = {"t": tt.table_id, "n": granted, "e": expires}
    if owner:
        record["o"] = owner
    tt.txn.put(grant_id.encode(), json.dumps(record).encode(), db=tt.db["grants"])
    tt.txn.put(layout.expiry_key(expires, grant_id), b"", db=tt.db["grant_exp"])
    tt.counters.submitted += granted
    tt.counters.admitted += granted
    tt.save()
    return RolloutGrant(granted, grant_id, expires)


def read_grant(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], grant_id: str) -> GrantRecord | None:
    raw = txn.get(grant_id.encode(), db=dbs["grants"]) if 0 < len(grant_id) <= 64 else None
    if raw is None:
        return None
    record: GrantRecord = json.loads(raw)
    return record


def finish(tt: TableState, grant_id: str, record: GrantRecord, accepted: int | None, *, expired: bool = False) -> int:
    """End a grant: `accepted` rollouts stay submitted (None: all), the others give their
    room back. Returns the rollouts given back."""
    count = record["n"]
    if accepted is None:
        accepted = count
    if not isinstance(accepted, int) or isinstance(accepted, bool) or not 0 <= accepted <= count:
        raise InvalidRequest(f"accepted must be an integer from 0 to {count} (the grant's count), got {clip(accepted)}")
    tt.txn.delete(grant_id.encode(), db=tt.db["grants"])
    tt.txn.delete(layout.expiry_key(record["e"], grant_id), db=tt.db["grant_exp"])
    returned = count - accepted
    tt.counters.submitted -= returned
    if expired:
        tt.counters.grants_expired += returned
    else:
        tt.counters.rollouts_rejected += returned
    tt.save()
    return returned


def drop_table(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], table_id: int) -> None:
    """A dropped table's grants go, with their expiry rows: kept, a grant's id named a grant of
    another table to an admit made again under it after the table was made again, refused until
    the grant expired (up to a day)."""
    records = [(key, json.loads(raw)) for key, raw in txn.cursor(db=dbs["grants"])]
    for key, record in [(key, record) for key, record in records if record["t"] == table_id]:
        txn.delete(key, db=dbs["grants"])
        txn.delete(layout.expiry_key(record["e"], key.decode()), db=dbs["grant_exp"])


def reset(tt: TableState) -> int:
    """Forget the rollouts counted against the bound but those of grants still open (a job
    that starts over); returns them. The totals (admitted, expired, rejected) stay."""
    held = 0
    for _, raw in tt.txn.cursor(db=tt.db["grants"]):
        record = json.loads(raw)
        if record["t"] == tt.table_id:
            held += record["n"]
    tt.counters.submitted = held
    tt.save()
    return held


def check_owner(owner: str, grant_id: str, holder: str) -> None:
    """Refuse a finish of a grant taken with another token (`owner`, its record's; empty: anyone's)
    than `holder`'s, as a lease's ack is."""
    if owner and owner != holder:
        whose = taken_with(owner, holder)
        also = "; finish it with that one" if whose == "another token" else ""
        raise Forbidden(f"grant '{clip(grant_id)}' was taken with {whose}{also}")


def unknown_grant(grant_id: str, table: str) -> NotFound:
    return NotFound(f"grant '{clip(grant_id)}' of table '{clip(table)}' is unknown, finished or expired")


@dataclass(frozen=True)
class EndedGrant:
    """A grant a finish or its expiry ended (ended.RecentEnds keeps the latest): its table, owner, the
    rollouts the finish accepted (None: all) and those it gave back."""

    expired: bool
    table_id: int
    owner: str
    accepted: int | None
    returned: int


def finished_again(
    ended: EndedGrant | None, grant_id: str, table: str, table_id: int, accepted: int | None, holder: str
) -> int:
    """What a finish of a grant no longer stored answers: where this server remembers it ended,
    as the first finish did (its reply lost), or why not; else that the grant is unknown."""
    if ended is None or ended.table_id != table_id:
        raise unknown_grant(grant_id, table)
    check_owner(ended.owner, grant_id, holder)
    if ended.expired:
        raise NotFound(
            f"grant '{clip(grant_id)}' of table '{clip(table)}' expired before it was finished: its"
            f" {ended.returned} rollouts' room went back (they count as not accepted)"
        )
    if accepted != ended.accepted:
        first, now = ("all" if n is None else n for n in (ended.accepted, accepted))
        raise InvalidRequest(
            f"grant '{clip(grant_id)}' of table '{clip(table)}' was finished with accepted = {first}, which"
            f" gave back {ended.returned} rollouts; made again with accepted = {now}"
        )
    return ended.returned


def screen(tt: TableState, entries: Sequence[Entry]) -> tuple[list[Entry], list[str]]:
    """The entries to store and the uids dropped as stale (on_stale = drop); a stale
    entry with on_stale = refuse refuses the whole push."""
    cfg, version = tt.config, tt.counters.trainer_version
    lag = cfg.staleness.experience_bound
    if lag is None or version is None:
        return list(entries), []
    bound = version - lag
    stale = [e for e in entries if e.version is not None and e.version < bound]
    if not stale:
        return list(entries), []
    if cfg.staleness.on_stale == "refuse":
        named = "max_staleness" if lag == cfg.staleness.max_staleness else "max_token_staleness"
        oldest = " (its oldest token's)" if stale[0].segments else ""
        raise StaleExperience(
            f"table '{cfg.name}': experience {stale[0].uid} has model_version {stale[0].version}{oldest}, below "
            f"{bound} (trainer version {version} - {named} {lag}); "
            f"{len(stale)} of {len(entries)} experiences are stale, nothing was stored"
        )
    tt.counters.stale_dropped += len(stale)
    dropped = {e.uid for e in stale}
    return [e for e in entries if e.uid not in dropped], sorted(dropped)
