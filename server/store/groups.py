"""The rules of one table inside one transaction: experiences join groups, groups move
through their states, and the table keeps within its capacity.

States: pending (the group is incomplete) → computing (its advantages) → ready → leased →
consumed; a group may also be evicted, dropped (zero variance, timeout, std threshold) or
failed (retirement.py: retired experiences keep their record as a tombstone with their
digest, so a retried push is still a duplicate, until `tombstone_seconds`). Counts by state,
bytes and totals are counters written in the same transaction as the records.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import lmdb

from ..errors import Conflict, GroupClosed, InvalidRequest, NotFound, clip
from ..selection import ReadyDbs, ReadyIndex, put_rows, u64
from ..tables import TableConfig, estimator_of
from . import layout, limiter, retirement
from .capacity import make_room
from .records import (
    COMPUTING,
    DROPPED,
    FAILED,
    LIVE,
    PENDING,
    READY,
    STATES,
    GroupRecord,
    ItemRecord,
)
from .types import SHAPING_COUNTERS, Entry, PutResult, ShapingUpdate

_COUNTERS = (
    *STATES,
    "bytes",
    *(f"groups_{state}" for state in LIVE),
    "groups_dropped",
    "groups_failed",
    "pushed",
    "duplicates",
    "sampled",
    "leases_expired",
    # monotonic totals for the metrics
    "bytes_pushed",
    "bytes_sampled",
    "evicted_total",
    "dropped_zero_variance",
    "dropped_timeout",
    "dropped_std_threshold",
    "dropped_stale",
    # what reward shaping and advantage clipping did (see shaping.py)
    *SHAPING_COUNTERS,
    # off-policy control (admission.py)
    "submitted",
    "admitted",
    "grants_expired",
    "rollouts_rejected",
    "stale_dropped",
    # seconds the rate limits held inserts and samples (limiter.py)
    "insert_blocked_seconds",
    "sample_blocked_seconds",
    *limiter.COUNTERS,
    "next_seq",
    "next_rseq",
)


def fresh_counters() -> dict[str, Any]:
    """A table's counters before anything happened (stored ones are laid over these)."""
    return dict.fromkeys(_COUNTERS, 0) | {
        "min_version": None,
        "trainer_version": None,  # the trainer's policy version (set_trainer_version)
        "max_version": None,
        "last_failure": "",
        "reward_moments": None,  # [mean, population variance, count] of the running reward normalisation
    }


def read_counters(txn: lmdb.Transaction, db: lmdb._Database, prefix: bytes) -> dict[str, Any]:
    raw = txn.get(prefix, db=db)
    return fresh_counters() | (json.loads(raw) if raw is not None else {})


def _zero_variance(rewards: list[float | None]) -> bool:
    """Whether a group's rewards are all known and all equal (it teaches nothing)."""
    return None not in rewards and len(set(rewards)) <= 1


class TableTxn:
    """One table inside one write (or read) transaction."""

    def __init__(
        self,
        txn: lmdb.Transaction,
        dbs: dict[str, lmdb._Database],
        table_id: int,
        config: TableConfig,
        now: float,
    ) -> None:
        self.txn, self.db, self.config, self.table_id, self.now = txn, dbs, config, table_id, now
        self.prefix = layout.table_prefix(table_id)
        self.counters = read_counters(txn, dbs["counters"], self.prefix)
        self.ready = ReadyIndex(ReadyDbs.of(dbs), txn, self.prefix)
        # Write-back caches: a record changed several times in one request is encoded and
        # written once, by save().
        self._items: dict[str, ItemRecord | None] = {}
        self._groups: dict[str, GroupRecord | None] = {}
        self._dirty_items: set[str] = set()
        self._dirty_groups: set[str] = set()

    def save(self) -> None:
        """Write changed records and the counters; every changing request ends with it."""
        items, groups = self._items, self._groups
        put_rows(self.txn, self.db["items"], [(self.key(uid), items[uid].encode()) for uid in self._dirty_items])
        put_rows(self.txn, self.db["groups"], [(self.key(gkey), groups[gkey].encode()) for gkey in self._dirty_groups])
        self._dirty_items.clear()
        self._dirty_groups.clear()
        self.txn.put(self.prefix, json.dumps(self.counters, separators=(",", ":")).encode(), db=self.db["counters"])

    # ---- records -----------------------------------------------------------------------

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def item(self, uid: str) -> ItemRecord | None:
        if uid not in self._items:
            raw = self.txn.get(self.key(uid), db=self.db["items"])
            self._items[uid] = None if raw is None else ItemRecord.decode(raw)
        return self._items[uid]

    def put_item(self, uid: str, rec: ItemRecord) -> None:
        self._items[uid] = rec
        self._dirty_items.add(uid)

    def forget_item(self, uid: str) -> None:
        self._items[uid] = None
        self._dirty_items.discard(uid)
        self.txn.delete(self.key(uid), db=self.db["items"])

    def group(self, gkey: str) -> GroupRecord | None:
        if gkey not in self._groups:
            raw = self.txn.get(self.key(gkey), db=self.db["groups"])
            self._groups[gkey] = None if raw is None else GroupRecord.decode(raw)
        return self._groups[gkey]

    def put_group(self, gkey: str, grp: GroupRecord) -> None:
        self._groups[gkey] = grp
        self._dirty_groups.add(gkey)

    def forget_group(self, gkey: str) -> None:
        self._groups[gkey] = None
        self._dirty_groups.discard(gkey)
        self.txn.delete(self.key(gkey), db=self.db["groups"])

    def members(self, grp: GroupRecord) -> dict[str, ItemRecord]:
        return {uid: self.item(uid) for uid in grp.members}

    def pending_key(self, gkey: str, grp: GroupRecord) -> bytes:
        return self.prefix + layout.micros(grp.created) + gkey.encode()

    def retired_key(self, uid: str, rec: ItemRecord) -> bytes:
        return self.prefix + layout.micros(rec.retired or 0.0) + uid.encode()

    def rseq_key(self, grp: GroupRecord) -> bytes:
        return self.prefix + u64(grp.rseq)

    # ---- push ----------------------------------------------------------------------------

    def put(self, entries: Sequence[Entry]) -> PutResult:
        """Store a push: each new experience joins its group, and each group it fills
        becomes ready (or computing). Per-item work is done in passes over the whole push:
        payloads, insertion order and ready indexes are written one database at a time."""
        if self.txn.get(self.config.name.encode(), db=self.db["tables"]) is None:
            raise NotFound(f"table '{self.config.name}' does not exist")
        result = PutResult()
        fresh: dict[str, Entry] = {}
        for entry in entries:
            known = fresh.get(entry.uid)
            digest = known.digest if known is not None else getattr(self.item(entry.uid), "digest", None)
            if digest is None:
                fresh[entry.uid] = entry
            elif digest == entry.digest:
                result.duplicates.append(entry.uid)
            else:
                raise Conflict(f"uid {entry.uid} already exists with different content")
        self._check_rewards(fresh.values())
        by_group: dict[str, list[Entry]] = defaultdict(list)
        for entry in fresh.values():
            by_group[entry.group_key(self.config.group_by)].append(entry)
        groups: dict[str, GroupRecord] = {}
        opened: set[str] = set()  # groups this push starts: not in the pending index yet
        size = self.config.group_size
        for gkey, members in by_group.items():
            grp = self.group(gkey)
            if grp is None:
                grp = GroupRecord(PENDING, self.now)
                self.counters["groups_pending"] += 1
                opened.add(gkey)
            elif grp.state != PENDING:
                raise GroupClosed(f"group {gkey} is already complete ({grp.state}); it takes no more experiences")
            if size and len(grp.members) + len(members) > size:
                raise GroupClosed(
                    f"group {gkey} has {len(grp.members)} of {size} experiences; {len(members)} more would overfill it"
                )
            groups[gkey] = grp
        make_room(self, len(fresh), sum(len(e.blob) for e in fresh.values()), set(groups))
        self._insert(by_group, groups)
        ready: list[tuple[bytes, int, float, int | None]] = []
        for gkey, grp in groups.items():
            if size == 0 or len(grp.members) >= size:
                result.completed_groups.append(gkey)
                if not self.complete(gkey, grp, partial=False, indexed=gkey not in opened, ready=ready):
                    result.dropped_groups.append(gkey)
            else:
                if gkey in opened:
                    self.txn.put(self.pending_key(gkey, grp), b"", db=self.db["pending"])
                self.put_group(gkey, grp)
        self.ready.add_many(ready)
        result.stored = list(fresh)
        self.counters["pushed"] += len(fresh)
        self.counters["duplicates"] += len(result.duplicates)
        self.save()
        return result

    def _check_rewards(self, entries: Iterable[Entry]) -> None:
        estimator = self.config.estimator
        needs_reward = estimator_of(self.config).needs_reward
        for entry in entries:
            if entry.reward is not None or estimator == "none":
                continue
            if needs_reward or not entry.has_token_rewards:
                raise InvalidRequest(
                    f"uid {entry.uid} has no reward; table '{self.config.name}' computes advantages "
                    f"with {estimator}, which needs one" + (" (or token_level_reward)" if not needs_reward else "")
                )

    def _insert(self, by_group: dict[str, list[Entry]], groups: dict[str, GroupRecord]) -> None:
        """New experiences as pending members of their groups, in push order: their records
        (written by save), payloads and places in the insertion order."""
        prefix, now, seq, nbytes = self.prefix, self.now, self.counters["next_seq"], 0
        blobs, order, versions = [], [], []
        for gkey, members in by_group.items():
            grp = groups[gkey]
            for entry in members:
                size = len(entry.blob)
                self.put_item(
                    entry.uid,
                    ItemRecord(
                        PENDING,
                        gkey,
                        seq,
                        entry.digest,
                        size,
                        now,
                        entry.tid,
                        entry.rid,
                        entry.step,
                        entry.response_length,
                        entry.generated,
                        entry.version,
                        entry.reward,
                        entry.priority,
                    ),
                )
                uid = entry.uid.encode()
                blobs.append((prefix + uid, entry.blob))
                order.append((prefix + u64(seq), uid))
                grp.members.append(entry.uid)
                if entry.version is not None:
                    versions.append(entry.version)
                seq += 1
                nbytes += size
        put_rows(self.txn, self.db["blobs"], blobs)
        put_rows(self.txn, self.db["order"], order)
        counters = self.counters
        counters[PENDING] += seq - counters["next_seq"]
        counters["next_seq"] = seq
        counters["bytes"] += nbytes
        counters["bytes_pushed"] += nbytes
        if versions:
            low, high = counters["min_version"], counters["max_version"]
            counters["min_version"] = min(versions) if low is None else min(low, *versions)
            counters["max_version"] = max(versions) if high is None else max(high, *versions)

    # ---- group states ------------------------------------------------------------------------

    def complete(
        self,
        gkey: str,
        grp: GroupRecord,
        *,
        partial: bool,
        indexed: bool = True,
        ready: list[tuple[bytes, int, float, int | None]] | None = None,
    ) -> bool:
        """A pending group becomes ready, or computing; False if the zero-variance filter
        dropped it. `indexed`: the group is in the pending index (a group opened and filled
        by one push never is). With `ready`, a ready group's index entry is appended there
        for the caller to add with the others (ReadyIndex.add_many) instead of added now."""
        recs = self.members(grp)
        grp.partial = partial
        if self.config.drop_zero_variance and _zero_variance([rec.reward for rec in recs.values()]):
            self.retire(gkey, grp, DROPPED)
            self.counters["groups_dropped"] += 1
            self.counters["dropped_zero_variance"] += 1
            return False
        if indexed:
            self.txn.delete(self.pending_key(gkey, grp), db=self.db["pending"])
        versions = [rec.version for rec in recs.values()]
        grp.version = None if None in versions or not versions else min(versions)
        grp.priority = max((rec.priority for rec in recs.values()), default=0.0)
        grp.rseq = self.counters["next_rseq"]
        self.counters["next_rseq"] += 1
        if self.config.estimator == "none":
            self.set_state(gkey, grp, recs, READY)
            limiter.became_ready(self, len(recs))
            row = (gkey.encode(), grp.rseq, grp.priority, grp.version)
            if ready is None:
                self.ready.add(*row)
            else:
                ready.append(row)
        else:  # sampled only once its advantages are stored (finish_compute)
            self.set_state(gkey, grp, recs, COMPUTING)
            self.txn.put(self.rseq_key(grp), gkey.encode(), db=self.db["compute"])
        return True

    def finish_compute(
        self,
        advantages: dict[str, float | bytes],
        ready: Sequence[str],
        dropped: Sequence[str],
        failed: dict[str, str],
        shaping: ShapingUpdate | None = None,
    ) -> None:
        """One value per experience goes into its record (rewritten anyway to become ready),
        with its shaped reward where the batch stage needs it; token-level advantages, being
        larger, into the adv database. What reward shaping did (its counts and running
        moments) is saved with them. Groups deleted or evicted meanwhile are left alone."""
        if shaping is not None:
            for name, count in shaping.counts.items():
                self.counters[name] += count
            self.counters["reward_moments"] = shaping.moments
        for gkey in [*ready, *dropped, *failed]:
            grp = self.group(gkey)
            if grp is None or grp.state != COMPUTING:
                continue
            if gkey in failed:
                self.retire(gkey, grp, FAILED)
                self.counters["groups_failed"] += 1
                self.counters["last_failure"] = f"group {gkey}: {failed[gkey]}"
            elif gkey in dropped:
                self.retire(gkey, grp, DROPPED)
                self.counters["groups_dropped"] += 1
                self.counters["dropped_std_threshold"] += 1
            else:
                self.txn.delete(self.rseq_key(grp), db=self.db["compute"])
                recs = self.members(grp)
                for uid, rec in recs.items():
                    value = advantages[uid]
                    if shaping is not None and uid in shaping.rewards:
                        rec.shaped_reward = shaping.rewards[uid]
                    if isinstance(value, float):
                        rec.advantage = value
                    else:
                        self.txn.put(self.key(uid), value, db=self.db["adv"])
                self.set_state(gkey, grp, recs, READY)
                limiter.became_ready(self, len(recs))
                self.ready.add(gkey.encode(), grp.rseq, grp.priority, grp.version)

    def set_state(self, gkey: str, grp: GroupRecord, recs: dict[str, ItemRecord], state: str) -> None:
        self.set_states([(gkey, grp, recs)], state)

    def set_states(self, groups: Sequence[tuple[str, GroupRecord, dict[str, ItemRecord]]], state: str) -> None:
        """Live groups and their members (key, record, member records) move to a live
        `state` (retire() makes tombstones)."""
        counters = self.counters
        for gkey, grp, recs in groups:
            for uid, rec in recs.items():
                counters[rec.state] -= 1
                rec.state = state
                self.put_item(uid, rec)
            counters[state] += len(recs)
            self._move_group(gkey, grp, state)

    def _move_group(self, gkey: str, grp: GroupRecord, state: str) -> None:
        if grp.state in LIVE:
            self.counters["groups_" + grp.state] -= 1
        if state in LIVE:
            self.counters["groups_" + state] += 1
        grp.state = state
        self.put_group(gkey, grp)

    def retire(self, gkey: str, grp: GroupRecord, state: str) -> None:
        retirement.retire(self, [(gkey, grp)], state)

    def retire_many(self, groups: Sequence[tuple[str, GroupRecord]], state: str) -> None:
        retirement.retire(self, groups, state)

    # ---- upkeep and admin ----------------------------------------------------------------------

    def expire_groups(self, created_before: float) -> int:
        """Release (flagged partial) or drop incomplete groups created before the cutoff."""
        expired = []
        cutoff = layout.micros(created_before)
        with self.txn.cursor(db=self.db["pending"]) as cur:
            found = cur.set_range(self.prefix)
            while found and cur.key().startswith(self.prefix) and cur.key()[4:12] <= cutoff:
                expired.append(cur.key()[12:].decode())
                found = cur.next()
        for gkey in expired:
            grp = self.group(gkey)
            if self.config.on_group_timeout == "drop":
                self.retire(gkey, grp, DROPPED)
                self.counters["groups_dropped"] += 1
                self.counters["dropped_timeout"] += 1
            else:
                self.complete(gkey, grp, partial=True)
        return len(expired)

    def seal(self, gkey: str) -> int:
        grp = self.group(gkey)
        if grp is None:
            raise NotFound(f"group {clip(gkey)} does not exist in table '{self.config.name}'")
        if grp.state != PENDING:
            raise GroupClosed(f"group {clip(gkey)} is already complete ({grp.state})")
        self.complete(gkey, grp, partial=False)
        self.save()
        return len(grp.members)
