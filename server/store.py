"""Durable storage of experiences in LMDB: tables, groups, states, leases.

Layout (named LMDB databases; per-table keys start with the table's 4-byte id T):
- tables:   name -> {"id", "config", "created"}          meta: next table id
- items:    T + uid -> item record (state, group, seq, digest, bytes, times sampled, version, reward)
- blobs:    T + uid -> the experience as a one-item TRXP payload (live experiences only)
- groups:   T + group key -> group record (state, members, created, ready seq, priority, lease)
- tasks, runs, steps: T + id + NUL + uid -> b"" (experiences by task, run and step group)
- order:    T + seq -> uid (live experiences in insertion order: eviction, oldest age)
- pending:  T + created + group key -> b"" (incomplete groups, for group timeouts)
- counters: T -> counts by state, bytes and totals, updated in the same transaction
- ready, prio, slots, slotof: ready groups (see selection.py)
- leases:   lease id -> {"t", "g", "e"};  lease_exp: expiry + lease id -> b""

Every change goes through one writer thread that applies the requests waiting in
its queue inside one write transaction (each in a nested transaction, so one
refused request leaves the others intact) and commits once with fsync: concurrent
pushers share the cost of the fsync. A request returns only after that commit.
Nothing lives only in memory, so a restart restores every table, group, lease and
counter; a crash leaves the last committed state (LMDB is copy-on-write).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import queue
import random
import secrets
import shutil
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from expbuf.client import trxp

from .errors import (
    Conflict,
    Forbidden,
    GroupClosed,
    InvalidRequest,
    NotFound,
    StorageFull,
    StoreClosed,
    StoreError,
    TableFull,
    TooLarge,
    clip,
)
from .sample_spec import SampleSpec
from .selection import ReadyDbs, ReadyIndex, u64
from .tables import CONFIG_VERSION, NEEDS_REWARD, TOKEN_LEVEL, TableConfig, batch_stage, default_table

# Experience states. Live: pending (its group is incomplete), ready, leased.
# Experience (and group) states. Live: pending (the group is incomplete), computing (its
# advantages are being computed), ready, leased. The others are tombstones.
PENDING, COMPUTING, READY, LEASED = "pending", "computing", "ready", "leased"
CONSUMED, EVICTED, DROPPED, FAILED = "consumed", "evicted", "dropped", "failed"
LIVE = (PENDING, COMPUTING, READY, LEASED)
RETIRED = (CONSUMED, EVICTED, DROPPED, FAILED)
STATES = (*LIVE, CONSUMED, EVICTED, DROPPED, FAILED)
GROUP_KEY_OF = {"task": "tid", "run": "rid", "step": "sid", "none": "uid"}
# A sample request looks at most this many ready groups (those older than its
# min_model_version are skipped), so one request costs the writer a bounded time.
MAX_SCAN = 4096
_DBS = (
    "meta", "tables", "items", "blobs", "adv", "groups", "order", "pending", "compute",
    "retired",
    "counters", "ready", "prio", "slots", "slotof", "leases", "lease_exp",
)  # fmt: skip
_PER_TABLE = tuple(db for db in _DBS if db not in ("meta", "tables", "leases", "lease_exp"))
_U32 = struct.Struct(">I")
T = TypeVar("T")
log = logging.getLogger("expbuf.store")
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
    "next_seq",
    "next_rseq",
)


def _fresh_counters() -> dict[str, Any]:
    """A table's counters before anything happened (stored ones are laid over these)."""
    return dict.fromkeys(_COUNTERS, 0) | {"min_version": None, "max_version": None, "last_failure": ""}


@dataclass(frozen=True)
class Entry:
    """One validated experience ready to store: its identity and one-item payload."""

    uid: str
    tid: str
    rid: str
    sid: str
    blob: bytes
    digest: str
    version: int | None
    reward: float | None
    priority: float
    has_token_rewards: bool
    step: int
    response_length: int
    generated: int  # response tokens under the action mask

    @classmethod
    def of(cls, item: trxp.RawItem) -> Entry:
        eid = item.eid
        blob = trxp.pack_item(item)
        priority = item.meta.get("info", {}).get("priority", 0.0)
        return cls(
            uid=eid.uid,
            tid=eid.tid,
            rid=eid.rid,
            sid=eid.sid,
            blob=blob,
            digest=hashlib.sha256(blob).hexdigest()[:32],  # SHA-NI makes it the fastest here
            version=item.model_version,
            reward=item.meta.get("reward"),
            priority=float(priority) if isinstance(priority, (int, float)) else 0.0,
            has_token_rewards="token_level_reward" in item.tensors,
            step=eid.step,
            response_length=item.response_length,
            generated=item.generated_tokens,
        )


@dataclass
class PutResult:
    stored: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    completed_groups: list[str] = field(default_factory=list)
    dropped_groups: list[str] = field(default_factory=list)  # by the zero-variance filter


@dataclass
class Sampled:
    """A selected batch: uids in group order, their group ids and stored payloads."""

    uids: list[str]
    group_ids: list[str]
    blobs: list[bytes]
    advantages: list[Advantage] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # policy version of each experience
    newest_version: int | None = None  # the newest version pushed to the table, for staleness
    lease_id: str = ""
    lease_expires: float = 0.0
    partial: bool = False

    @property
    def payload(self) -> bytes:
        return batch_payload(self.blobs, self.advantages)


# An experience's computed advantage: (value, response length) when every generated token
# carries the same value, the stored token-level record (advantages.py) otherwise, or None.
Advantage = tuple[float, int] | bytes | None


def _advantage(txn: lmdb.Transaction, db: lmdb._Database, key: bytes, rec: dict[str, Any]) -> Advantage:
    if "a" in rec:
        return (rec["a"], rec["L"])
    return txn.get(key, db=db)


def finish_batch(
    config: TableConfig, records: Sequence[dict[str, Any]], advantages: list[Advantage]
) -> list[Advantage]:
    """A sampled batch's advantages: statistics over the batch, where the estimator has them."""
    if not batch_stage(config) or not records:
        return advantages
    from .advantages import finish_batch as finish  # torch is imported only where advantages are computed

    return finish(config, records, advantages)


def batch_payload(blobs: Sequence[bytes], advantages: Sequence[Advantage]) -> bytes:
    """One TRXP batch of stored experiences, with their computed advantages and returns."""
    if all(a is None for a in advantages):
        return trxp.join(blobs)
    from .advantages import expand  # torch is imported only where advantages are attached

    return trxp.join(blobs, lambda index, tensors: expand(advantages[index], tensors))


@dataclass
class ComputeJob:
    """Completed groups of one table whose advantages are to be computed."""

    table: str
    config: TableConfig
    groups: list[str]
    members: list[list[str]]
    records: dict[str, dict[str, Any]]  # item records: reward, ids, step, lengths
    blobs: dict[str, bytes]  # the stored experiences, only for estimators that read tokens

    def split(self) -> list[ComputeJob]:
        """One job per group, to find which group a failed computation cannot take."""
        return [
            ComputeJob(
                self.table,
                self.config,
                [gkey],
                [members],
                {uid: self.records[uid] for uid in members},
                {uid: self.blobs[uid] for uid in members if uid in self.blobs},
            )
            for gkey, members in zip(self.groups, self.members, strict=True)
        ]


@dataclass(frozen=True)
class _Op:
    fn: Callable[[lmdb.Transaction], Any]
    future: Future


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _loads(raw: bytes | None) -> Any:
    return None if raw is None else json.loads(raw)


class Store:
    """The LMDB storage engine behind the expbuf server."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 1 << 30,
        max_map_size: int = 1 << 40,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
        batch_limit: int = 512,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.path / "expbuf.lock", "a+")  # noqa: SIM115 - held for the store's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise StoreError(f"another expbuf process is using {self.path}") from None
        self.max_map_size = max_map_size
        self.clock = clock
        self._rng = random.Random(seed)
        self._batch_limit = batch_limit
        self._env = lmdb.open(
            str(self.path), map_size=map_size, max_dbs=len(_DBS), sync=True, metasync=True, readahead=False
        )
        self._db = {name: self._env.open_db(name.encode()) for name in _DBS}
        self._ready_dbs = ReadyDbs(self._db["ready"], self._db["prio"], self._db["slots"], self._db["slotof"])
        self._readers = 0
        self._resizing = False
        self._gate = threading.Condition()
        self._changed = threading.Condition()
        self._generation = 0
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._closed = False
        self._tables: dict[str, tuple[int, TableConfig]] = {}
        self.maintenance_failures = 0  # upkeep steps skipped because they failed (tick)
        self._reported: set[str] = set()
        with self._env.begin(db=self._db["tables"]) as txn:
            for name, raw in txn.cursor():
                rec = _loads(raw)
                config = TableConfig.from_stored(rec["config"], rec.get("v", 1))
                self._tables[name.decode()] = (rec["id"], config)
        self._writer = threading.Thread(target=self._write_loop, name="expbuf-writer", daemon=True)
        self._writer.start()
        if "default" not in self._tables:
            self.create_table(default_table(), exist_ok=True)

    # ---- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Finish and commit every queued request, then close the environment."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        self._env.close()
        self._lock_file.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the writer thread -----------------------------------------------------------

    def _submit(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        if self._closed:
            raise StoreClosed("the store is closed")
        future: Future = Future()
        self._queue.put(_Op(fn, future))
        return future.result()

    def _write_loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            ops = [op]
            stop = False
            while len(ops) < self._batch_limit:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                ops.append(more)
            self._apply(ops)
            if stop:
                return

    def _apply(self, ops: list[_Op]) -> None:
        """Run ops in one transaction, each nested so a refusal undoes only itself."""
        while True:
            results: list[tuple[bool, Any]] = []
            parent = self._env.begin(write=True)
            try:
                if len(ops) == 1:  # nothing to protect from a refusal: no nested transaction
                    results.append(self._run(ops[0], parent))
                else:
                    for op in ops:
                        child = self._env.begin(write=True, parent=parent)
                        results.append(self._run(op, child))
                        (child.commit if results[-1][0] else child.abort)()
                if any(ok for ok, _ in results):
                    parent.commit()
                else:
                    parent.abort()
                break
            except lmdb.MapFullError:
                parent.abort()
                if not self._grow():
                    full = StorageFull(
                        f"the LMDB map of {self.path} is full: it reached max_map_size ({self.max_map_size} bytes)"
                    )
                    results = [(False, full)] * len(ops)
                    break
            except lmdb.Error as exc:  # a full disk or an I/O error: nothing was committed
                parent.abort()
                failed = StorageFull(
                    f"writing to {self.path} failed; nothing was stored (is its disk full or failing? "
                    f"free: {_free_bytes(self.path)} bytes; LMDB said: {exc})"
                )
                results = [(False, failed)] * len(ops)
                break
        for op, (ok, value) in zip(ops, results, strict=True):
            if ok:
                op.future.set_result(value)
            else:
                op.future.set_exception(value)
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    @staticmethod
    def _run(op: _Op, txn: lmdb.Transaction) -> tuple[bool, Any]:
        """Run one request; a refusal is its result, a full map aborts the whole batch."""
        try:
            return True, op.fn(txn)
        except lmdb.MapFullError:
            raise
        except Exception as exc:
            return False, exc

    def _grow(self) -> bool:
        """Double the map once no reader holds a transaction; False at max_map_size."""
        size = self._env.info()["map_size"]
        if size >= self.max_map_size:
            return False
        with self._gate:
            self._resizing = True
            self._gate.wait_for(lambda: self._readers == 0)
            try:
                self._env.set_mapsize(min(size * 2, self.max_map_size))
            finally:
                self._resizing = False
                self._gate.notify_all()
        return True

    @contextlib.contextmanager
    def _read(self) -> Iterator[lmdb.Transaction]:
        with self._gate:
            self._gate.wait_for(lambda: not self._resizing)
            self._readers += 1
        try:
            with self._env.begin() as txn:
                yield txn
        finally:
            with self._gate:
                self._readers -= 1
                self._gate.notify_all()

    def _wait_for_change(self, generation: int, deadline: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._generation != generation, max(0.0, deadline - time.monotonic()))

    # ---- tables ----------------------------------------------------------------------

    def create_table(self, config: TableConfig, *, exist_ok: bool = False) -> bool:
        """Create a table; True if created. An identical existing table is fine with exist_ok."""

        def op(txn: lmdb.Transaction) -> tuple[bool, int]:
            raw = txn.get(config.name.encode(), db=self._db["tables"])
            if raw is not None:
                existing = TableConfig.from_stored(_loads(raw)["config"], _loads(raw).get("v", 1))
                if exist_ok and existing == config:
                    return False, _loads(raw)["id"]
                raise Conflict(f"table '{config.name}' already exists")
            table_id = int(txn.get(b"next_table_id", b"1", db=self._db["meta"]))
            txn.put(b"next_table_id", str(table_id + 1).encode(), db=self._db["meta"])
            record = {"id": table_id, "config": config.to_dict(), "created": self.clock(), "v": CONFIG_VERSION}
            txn.put(config.name.encode(), _dumps(record), db=self._db["tables"])
            return True, table_id

        created, table_id = self._submit(op)
        self._tables[config.name] = (table_id, config)
        return created

    def list_tables(self) -> list[TableConfig]:
        return [config for _, config in sorted(self._tables.values(), key=lambda t: t[0])]

    def has_table(self, name: str) -> bool:
        return name in self._tables

    def table(self, name: str) -> TableConfig:
        return self._table(name)[1]

    def _table(self, name: str) -> tuple[int, TableConfig]:
        try:
            return self._tables[name]
        except KeyError:
            raise NotFound(f"table '{clip(name)}' does not exist") from None

    def drop_table(self, name: str) -> int:
        """Delete a table and everything in it; returns the live experiences dropped."""
        table_id, _ = self._table(name)
        prefix = _U32.pack(table_id)

        def op(txn: lmdb.Transaction) -> int:
            counters = _loads(txn.get(prefix, db=self._db["counters"])) or {}
            txn.delete(name.encode(), db=self._db["tables"])
            for db in _PER_TABLE:
                with txn.cursor(db=self._db[db]) as cur:
                    if cur.set_range(prefix):
                        while cur.key().startswith(prefix) and cur.delete():
                            pass
            return sum(counters.get(s, 0) for s in LIVE)

        dropped = self._submit(op)
        self._tables.pop(name, None)
        return dropped

    # ---- push ------------------------------------------------------------------------

    def put(self, table: str, items: Sequence[trxp.RawItem], *, timeout: float | None = None) -> PutResult:
        """Store validated items durably. A full table in block mode waits until timeout."""
        entries = [Entry.of(item) for item in items]
        return self.put_entries(table, entries, timeout=timeout)

    def put_entries(self, table: str, entries: Sequence[Entry], *, timeout: float | None = None) -> PutResult:
        table_id, config = self._table(table)
        deadline = time.monotonic() + (timeout if timeout is not None else 0.0)
        while True:
            generation = self._generation
            try:
                return self._submit(lambda txn: _TableTxn(self, txn, table_id, config).put(entries))
            except TableFull:
                if config.when_full != "block" or time.monotonic() >= deadline:
                    raise
                self._wait_for_change(generation, deadline)

    # ---- sample, ack, nack -----------------------------------------------------------

    def sample(
        self,
        spec: SampleSpec,
        *,
        timeout: float | None = None,
        hold: bool = False,
        owner: str = "",
        stop: Callable[[], bool] | None = None,
    ) -> Sampled | None:
        """Select whole ready groups; None if not enough arrived within the wait.

        `timeout` bounds the wait (default: the spec's wait_seconds). With `hold`, a
        consumed batch is not retired yet but held under a lease without expiry, until
        the caller confirms it (`ack`) or gives it back (`nack`); holds left by a
        stopped server return to the buffer at the next start (`release_holds`).
        `owner` binds a lease to whoever took it. `stop` is polled while waiting (a
        cancelled RPC ends the wait early, with None).
        """
        table_id, config = self._table(spec.table)
        deadline = time.monotonic() + (spec.wait_seconds if timeout is None else timeout)
        while True:
            generation = self._generation
            final = time.monotonic() >= deadline
            result = self._submit(
                lambda txn, final=final: _TableTxn(self, txn, table_id, config).sample(
                    spec, spec.allow_partial and final, self._rng, hold=hold, owner=owner
                )
            )
            if result is not None or final:
                return result
            if stop is not None and stop():
                return None
            self._wait_for_change(generation, min(deadline, time.monotonic() + 0.25))

    def ack(self, lease_id: str, table: str | None = None, owner: str = "") -> int:
        """Consume the groups of a lease; returns the experiences acknowledged. With a
        table (a caller's request), the lease must be of that table and that owner."""
        return self._submit(lambda txn: self._end_lease(txn, lease_id, requeue=False, table=table, owner=owner))

    def nack(self, lease_id: str, table: str | None = None, owner: str = "") -> int:
        """Return the groups of a lease to the buffer; returns the experiences requeued."""
        return self._submit(lambda txn: self._end_lease(txn, lease_id, requeue=True, table=table, owner=owner))

    def release_holds(self) -> int:
        """Return every batch held for a stream of an earlier run of the server; the
        streams that held them are gone. Returns the experiences requeued."""

        def op(txn: lmdb.Transaction) -> int:
            held = [key.decode() for key, raw in txn.cursor(db=self._db["leases"]) if _loads(raw)["e"] is None]
            return sum(self._end_lease(txn, lease_id, requeue=True) for lease_id in held)

        return self._submit(op)

    def _end_lease(
        self,
        txn: lmdb.Transaction,
        lease_id: str,
        *,
        requeue: bool,
        expired: bool = False,
        table: str | None = None,
        owner: str = "",
    ) -> int:
        """End a lease. With `table` (a caller's request), the lease must belong to that
        table and to the caller that took it."""
        if not lease_id:
            raise InvalidRequest("lease_id is empty")
        lease = _loads(txn.get(lease_id.encode(), db=self._db["leases"])) if len(lease_id) <= 64 else None
        if lease is None:
            raise NotFound(f"lease '{clip(lease_id)}' is unknown, already acked, or expired and requeued")
        if table is not None:
            table_id, _ = self._table(table)
            if lease["t"] != table_id:
                raise NotFound(f"lease '{clip(lease_id)}' is not a lease of table '{clip(table)}'")
            if lease.get("o", "") != owner:
                raise Forbidden(f"lease '{clip(lease_id)}' was taken with another token")
        txn.delete(lease_id.encode(), db=self._db["leases"])
        if lease["e"] is not None:
            txn.delete(_expiry_key(lease["e"], lease_id), db=self._db["lease_exp"])
        tt = self._table_txn_by_id(txn, lease["t"])
        if tt is None:  # the table was dropped
            return 0
        count = tt.end_lease(lease_id, lease["g"], requeue=requeue)
        if expired:
            tt.counters["leases_expired"] += 1
        tt.save()
        return count

    def _table_txn_by_id(self, txn: lmdb.Transaction, table_id: int) -> _TableTxn | None:
        for tid, config in self._tables.values():
            if tid == table_id:
                return _TableTxn(self, txn, table_id, config)
        return None

    # ---- admin -----------------------------------------------------------------------

    def get(self, table: str, uids: Sequence[str]) -> dict[str, bytes]:
        """Stored payloads of the live experiences among uids."""
        table_id, _ = self._table(table)
        prefix = _U32.pack(table_id)
        found = {}
        with self._read() as txn:
            for uid in uids:
                blob = txn.get(prefix + uid.encode(), db=self._db["blobs"])
                if blob is not None:
                    found[uid] = bytes(blob)
        return found

    def get_payload(self, table: str, uids: Sequence[str]) -> tuple[bytes, list[str]]:
        """A TRXP batch of the live experiences among uids (in their order), and the missing uids."""
        table_id, config = self._table(table)
        prefix = _U32.pack(table_id)
        blobs, advantages, missing, rows = [], [], [], []
        with self._read() as txn:
            for uid in uids:
                blob = txn.get(prefix + uid.encode(), db=self._db["blobs"])
                if blob is None:
                    missing.append(uid)
                    continue
                blobs.append(bytes(blob))
                rec = _loads(txn.get(prefix + uid.encode(), db=self._db["items"]))
                rows.append(rec)
                advantages.append(_advantage(txn, self._db["adv"], prefix + uid.encode(), rec))
        return batch_payload(blobs, finish_batch(config, rows, advantages)), missing

    def delete(self, table: str, uids: Sequence[str] = (), group_ids: Sequence[str] = ()) -> int:
        """Remove experiences (and their records, so they may be pushed again)."""
        table_id, config = self._table(table)

        def op(txn: lmdb.Transaction) -> int:
            tt = _TableTxn(self, txn, table_id, config)
            count = tt.delete(uids, group_ids)
            tt.save()
            return count

        return self._submit(op)

    def seal(self, table: str, group_id: str) -> int:
        """Complete a pending group now; returns its size."""
        table_id, config = self._table(table)
        return self._submit(lambda txn: _TableTxn(self, txn, table_id, config).seal(group_id))

    def stats(self, table: str) -> dict[str, Any]:
        """Counts by state, bytes, group counts, totals and the oldest live experience's age."""
        table_id, _ = self._table(table)
        prefix = _U32.pack(table_id)
        with self._read() as txn:
            counters = _fresh_counters()
            counters |= _loads(txn.get(prefix, db=self._db["counters"])) or {}
            with txn.cursor(db=self._db["order"]) as cur:
                oldest = 0.0
                if cur.set_range(prefix) and cur.key().startswith(prefix):
                    rec = _loads(txn.get(prefix + cur.value(), db=self._db["items"]))
                    oldest = max(0.0, self.clock() - rec["c"])
        counters["oldest_age_seconds"] = oldest
        return counters

    def storage_info(self) -> dict[str, float]:
        info, stat = self._env.info(), self._env.stat()
        used = (info["last_pgno"] + 1) * stat["psize"]
        return {"map_size": info["map_size"], "used_bytes": used, "map_used_ratio": used / info["map_size"]}

    # ---- maintenance -----------------------------------------------------------------

    def tick(self) -> dict[str, int]:
        """Requeue expired leases and release or drop timed-out incomplete groups.

        Each lease and each table's upkeep runs in its own nested transaction: a failure
        in one (a bad setting, a damaged record) is logged once, counted in
        `maintenance_failures` and skipped, and the others go on."""
        now = self.clock()

        def op(txn: lmdb.Transaction) -> dict[str, int]:
            done = dict.fromkeys(("leases_expired", "requeued", "groups_timed_out", "tombstones_pruned", "failed"), 0)
            expired = []
            with txn.cursor(db=self._db["lease_exp"]) as cur:
                for key, _ in cur:
                    if _expiry_of(key) > now:
                        break
                    expired.append(bytes(key))
            for key in expired:
                requeued = self._isolated(txn, f"lease {key[8:]!r}", lambda t, k=key: self._expire(t, k))
                done["failed"] += requeued is None
                done["leases_expired"] += requeued is not None
                done["requeued"] += requeued or 0
            for table_id, config in list(self._tables.values()):
                upkeep = self._isolated(
                    txn, f"table {config.name}", lambda t, i=table_id, c=config: self._upkeep(t, i, c, now)
                )
                if upkeep is None:
                    done["failed"] += 1
                    continue
                done["groups_timed_out"] += upkeep[0]
                done["tombstones_pruned"] += upkeep[1]
            return done

        return self._submit(op)

    def _expire(self, txn: lmdb.Transaction, key: bytes) -> int:
        lease_id = key[8:]
        if txn.get(lease_id, db=self._db["leases"]) is None:  # an expiry without its lease
            txn.delete(key, db=self._db["lease_exp"])
            return 0
        return self._end_lease(txn, lease_id.decode(), requeue=True, expired=True)

    def _upkeep(self, txn: lmdb.Transaction, table_id: int, config: TableConfig, now: float) -> tuple[int, int]:
        tt = _TableTxn(self, txn, table_id, config)
        timed_out = tt.expire_groups(now - config.group_timeout_seconds) if config.group_timeout_seconds > 0 else 0
        pruned = tt.prune_tombstones(now - config.tombstone_seconds) if config.tombstone_seconds > 0 else 0
        tt.save()
        return timed_out, pruned

    def _isolated(self, txn: lmdb.Transaction, what: str, fn: Callable[[lmdb.Transaction], T]) -> T | None:
        """Run one piece of upkeep in a nested transaction; on failure undo it, log it
        once per distinct reason, count it, and return None."""
        child = self._env.begin(write=True, parent=txn)
        try:
            result = fn(child)
        except lmdb.MapFullError:
            child.abort()
            raise
        except Exception as exc:
            child.abort()
            self.maintenance_failures += 1
            reason = f"{what}: {type(exc).__name__}: {exc}"
            if reason not in self._reported:
                self._reported.add(reason)
                log.error("maintenance skipped %s", clip(reason, 300))
            return None
        child.commit()
        return result

    # ---- advantages ------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Counts committed batches of requests; wait_for_change() waits for the next."""
        return self._generation

    def wait_for_change(self, generation: int, timeout: float) -> bool:
        return self._wait_for_change(generation, time.monotonic() + timeout)

    def compute_backlog(self, limit: int = 8192) -> list[ComputeJob]:
        """Completed groups waiting for advantages, oldest first, up to about `limit`
        experiences, as one job per table. Payloads are read only for estimators that
        need token-level data (reinforce); the others work from the item records."""
        jobs: dict[int, ComputeJob] = {}
        ids = {table_id: (name, config) for name, (table_id, config) in self._tables.items()}
        count = 0
        with self._read() as txn, txn.cursor(db=self._db["compute"]) as cur:
            for key, gkey in cur:
                if count >= limit:
                    break
                table_id = _U32.unpack(key[:4])[0]
                if table_id not in ids:
                    continue
                grp = _loads(txn.get(key[:4] + gkey, db=self._db["groups"]))
                name, config = ids[table_id]
                job = jobs.setdefault(table_id, ComputeJob(name, config, [], [], {}, {}))
                job.groups.append(gkey.decode())
                job.members.append(grp["m"])
                for uid in grp["m"]:
                    item_key = key[:4] + uid.encode()
                    job.records[uid] = _loads(txn.get(item_key, db=self._db["items"]))
                    if config.estimator in TOKEN_LEVEL:
                        job.blobs[uid] = bytes(txn.get(item_key, db=self._db["blobs"]))
                count += len(grp["m"])
        return list(jobs.values())

    def finish_compute(
        self,
        table: str,
        advantages: dict[str, float | bytes],
        ready: Sequence[str],
        dropped: Sequence[str] = (),
        failed: dict[str, str] | None = None,
    ) -> None:
        """Store computed advantages and release their groups; drop or fail the others.
        Groups deleted or evicted meanwhile are left alone."""
        table_id, config = self._table(table)

        def op(txn: lmdb.Transaction) -> None:
            tt = _TableTxn(self, txn, table_id, config)
            tt.finish_compute(advantages, ready, dropped, failed or {})
            tt.save()

        self._submit(op)

    def verify(self, table: str) -> list[str]:
        """Check every index and counter of a table against its items; [] when consistent."""
        table_id, config = self._table(table)
        with self._read() as txn:
            return _TableTxn(self, txn, table_id, config).verify()


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return -1


def _expiry_key(expiry: float, lease_id: str) -> bytes:
    return u64(int(expiry * 1e6)) + lease_id.encode()


def _expiry_of(key: bytes) -> float:
    return struct.unpack(">Q", key[:8])[0] / 1e6


class _TableTxn:
    """One table inside one write (or read) transaction: the rules of states and groups."""

    def __init__(self, store: Store, txn: lmdb.Transaction, table_id: int, config: TableConfig) -> None:
        self.store, self.txn, self.config = store, txn, config
        self.db = store._db
        self.table_id = table_id
        self.prefix = _U32.pack(table_id)
        self.counters: dict[str, Any] = _fresh_counters()
        self.counters |= _loads(txn.get(self.prefix, db=self.db["counters"])) or {}
        self.ready = ReadyIndex(store._ready_dbs, txn, self.prefix)
        self.now = store.clock()
        # Write-back caches: a record changed several times in one request is encoded and
        # written once, by save().
        self._items: dict[str, dict[str, Any] | None] = {}
        self._groups: dict[str, dict[str, Any] | None] = {}
        self._dirty_items: set[str] = set()
        self._dirty_groups: set[str] = set()

    def save(self) -> None:
        """Write changed records and the counters; every changing request ends with it."""
        for uid in self._dirty_items:
            self.txn.put(self._key(uid), _dumps(self._items[uid]), db=self.db["items"])
        for gkey in self._dirty_groups:
            self.txn.put(self._key(gkey), _dumps(self._groups[gkey]), db=self.db["groups"])
        self._dirty_items.clear()
        self._dirty_groups.clear()
        self.txn.put(self.prefix, _dumps(self.counters), db=self.db["counters"])

    # records
    def _key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def item(self, uid: str) -> dict[str, Any] | None:
        if uid not in self._items:
            self._items[uid] = _loads(self.txn.get(self._key(uid), db=self.db["items"]))
        return self._items[uid]

    def put_item(self, uid: str, rec: dict[str, Any]) -> None:
        self._items[uid] = rec
        self._dirty_items.add(uid)

    def forget_item(self, uid: str) -> None:
        self._items[uid] = None
        self._dirty_items.discard(uid)
        self.txn.delete(self._key(uid), db=self.db["items"])

    def group(self, gkey: str) -> dict[str, Any] | None:
        if gkey not in self._groups:
            self._groups[gkey] = _loads(self.txn.get(self._key(gkey), db=self.db["groups"]))
        return self._groups[gkey]

    def put_group(self, gkey: str, rec: dict[str, Any]) -> None:
        self._groups[gkey] = rec
        self._dirty_groups.add(gkey)

    def forget_group(self, gkey: str) -> None:
        self._groups[gkey] = None
        self._dirty_groups.discard(gkey)
        self.txn.delete(self._key(gkey), db=self.db["groups"])

    def _pending_key(self, gkey: str, grp: dict[str, Any]) -> bytes:
        return self.prefix + u64(int(grp["c"] * 1e6)) + gkey.encode()

    # push
    def put(self, entries: Sequence[Entry]) -> PutResult:
        if self.txn.get(self.config.name.encode(), db=self.db["tables"]) is None:
            raise NotFound(f"table '{self.config.name}' does not exist")
        result = PutResult()
        fresh: dict[str, Entry] = {}
        for entry in entries:
            known = fresh.get(entry.uid)
            rec = self.item(entry.uid) if known is None else {"d": known.digest}
            if rec is None:
                fresh[entry.uid] = entry
            elif rec["d"] == entry.digest:
                result.duplicates.append(entry.uid)
            else:
                raise Conflict(f"uid {entry.uid} already exists with different content")
        self._check_rewards(fresh.values())
        attr = GROUP_KEY_OF[self.config.group_by]
        by_group: dict[str, list[Entry]] = defaultdict(list)
        for entry in fresh.values():
            by_group[getattr(entry, attr)].append(entry)
        groups = {}
        size = self.config.group_size
        for gkey, members in by_group.items():
            grp = self.group(gkey)
            if grp is None:
                grp = {"s": PENDING, "n": 0, "c": self.now, "m": [], "x": False}
                self.counters["groups_pending"] += 1
                self.txn.put(self._pending_key(gkey, grp), b"", db=self.db["pending"])
            elif grp["s"] != PENDING:
                raise GroupClosed(f"group {gkey} is already complete ({grp['s']}); it takes no more experiences")
            if size and grp["n"] + len(members) > size:
                raise GroupClosed(
                    f"group {gkey} has {grp['n']} of {size} experiences; {len(members)} more would overfill it"
                )
            groups[gkey] = grp
        self._make_room(len(fresh), sum(len(e.blob) for e in fresh.values()), set(groups))
        for gkey, members in by_group.items():
            grp = groups[gkey]
            for entry in members:
                self._insert(entry, gkey)
                grp["m"].append(entry.uid)
            grp["n"] = len(grp["m"])
            if size == 0 or grp["n"] >= size:
                result.completed_groups.append(gkey)
                if not self._complete(gkey, grp, partial=False):
                    result.dropped_groups.append(gkey)
            else:
                self.put_group(gkey, grp)
        result.stored = list(fresh)
        self.counters["pushed"] += len(fresh)
        self.counters["duplicates"] += len(result.duplicates)
        self.save()
        return result

    def _check_rewards(self, entries: Iterable[Entry]) -> None:
        estimator = self.config.estimator
        for entry in entries:
            if entry.reward is not None or estimator == "none":
                continue
            if estimator in NEEDS_REWARD or not entry.has_token_rewards:
                raise InvalidRequest(
                    f"uid {entry.uid} has no reward; table '{self.config.name}' computes advantages "
                    f"with {estimator}, which needs one"
                    + (" (or token_level_reward)" if estimator not in NEEDS_REWARD else "")
                )

    def _insert(self, entry: Entry, gkey: str) -> None:
        seq = self.counters["next_seq"]
        self.counters["next_seq"] = seq + 1
        rec = {
            "s": PENDING,
            "g": gkey,
            "q": seq,
            "d": entry.digest,
            "n": len(entry.blob),
            "t": 0,
            "v": entry.version,
            "r": entry.reward,
            "p": entry.priority,
            "c": self.now,
            "tid": entry.tid,
            "rid": entry.rid,
            "sid": entry.sid,
            "k": entry.step,
            "L": entry.response_length,
            "G": entry.generated,
        }
        self.put_item(entry.uid, rec)
        self.txn.put(self._key(entry.uid), entry.blob, db=self.db["blobs"])
        self.txn.put(self.prefix + u64(seq), entry.uid.encode(), db=self.db["order"])
        self.counters[PENDING] += 1
        self.counters["bytes"] += rec["n"]
        self.counters["bytes_pushed"] += rec["n"]
        if entry.version is not None:
            low, high = self.counters["min_version"], self.counters["max_version"]
            self.counters["min_version"] = entry.version if low is None else min(low, entry.version)
            self.counters["max_version"] = entry.version if high is None else max(high, entry.version)

    def _make_room(self, count: int, nbytes: int, keep: set[str]) -> None:
        cfg = self.config

        def over() -> bool:
            live = sum(self.counters[s] for s in LIVE)
            return bool(
                (cfg.capacity_experiences and live + count > cfg.capacity_experiences)
                or (cfg.capacity_bytes and self.counters["bytes"] + nbytes > cfg.capacity_bytes)
            )

        if not over():
            return
        if (cfg.capacity_experiences and count > cfg.capacity_experiences) or (
            cfg.capacity_bytes and nbytes > cfg.capacity_bytes
        ):
            raise TooLarge(
                f"table '{cfg.name}': {count} experiences of {nbytes} bytes exceed its capacity "
                f"({cfg.capacity_experiences} experiences, {cfg.capacity_bytes} bytes) on their own"
            )
        if cfg.when_full == "evict":
            for gkey in self._oldest_groups():
                if gkey in keep:
                    continue
                grp = self.group(gkey)
                if grp["s"] != READY:  # a pending group still takes members; leased ones are out
                    continue
                self._retire_group(gkey, grp, EVICTED)
                self.counters["evicted_total"] += grp["n"]
                if not over():
                    return
        raise TableFull(
            f"table '{cfg.name}' is full ({cfg.capacity_experiences} experiences, {cfg.capacity_bytes} bytes)"
        )

    def _oldest_groups(self) -> Iterator[str]:
        """Groups of the live experiences, oldest first. The caller retires groups between
        steps, so each step opens a fresh cursor after the last key seen."""
        seen: set[str] = set()
        position = self.prefix
        while True:
            with self.txn.cursor(db=self.db["order"]) as cur:
                if not cur.set_range(position) or not cur.key().startswith(self.prefix):
                    return
                position = cur.key() + b"\0"
                gkey = self.item(cur.value().decode())["g"]
            if gkey not in seen:
                seen.add(gkey)
                yield gkey

    # group states
    def _complete(self, gkey: str, grp: dict[str, Any], *, partial: bool) -> bool:
        """A pending group becomes ready, or computing; False if the zero-variance filter dropped it."""
        recs = {uid: self.item(uid) for uid in grp["m"]}
        rewards = [rec["r"] for rec in recs.values()]
        grp["x"] = partial
        if self.config.drop_zero_variance and None not in rewards and len(set(rewards)) <= 1:
            self._retire_group(gkey, grp, DROPPED)
            self.counters["groups_dropped"] += 1
            self.counters["dropped_zero_variance"] += 1
            return False
        self.txn.delete(self._pending_key(gkey, grp), db=self.db["pending"])
        versions = [rec["v"] for rec in recs.values()]
        grp["v"] = None if None in versions or not versions else min(versions)
        grp["p"] = max((rec["p"] for rec in recs.values()), default=0.0)
        grp["q"] = self.counters["next_rseq"]
        self.counters["next_rseq"] += 1
        if self.config.estimator == "none":
            self._set_group_state(gkey, grp, recs, READY)
            self.ready.add(gkey.encode(), grp["q"], grp["p"])
        else:  # sampled only once its advantages are stored (finish_compute)
            self._set_group_state(gkey, grp, recs, COMPUTING)
            self.txn.put(self.prefix + u64(grp["q"]), gkey.encode(), db=self.db["compute"])
        return True

    def finish_compute(
        self,
        advantages: dict[str, float | bytes],
        ready: Sequence[str],
        dropped: Sequence[str],
        failed: dict[str, str],
    ) -> None:
        """One value per experience goes into its record (rewritten anyway to become ready);
        token-level advantages, being larger, into the adv database."""
        for gkey in [*ready, *dropped, *failed]:
            grp = self.group(gkey)
            if grp is None or grp["s"] != COMPUTING:
                continue
            if gkey in failed:
                self._retire_group(gkey, grp, FAILED)
                self.counters["groups_failed"] += 1
                self.counters["last_failure"] = f"group {gkey}: {failed[gkey]}"
            elif gkey in dropped:
                self._retire_group(gkey, grp, DROPPED)
                self.counters["groups_dropped"] += 1
                self.counters["dropped_std_threshold"] += 1
            else:
                self.txn.delete(self.prefix + u64(grp["q"]), db=self.db["compute"])
                recs = {uid: self.item(uid) for uid in grp["m"]}
                for uid, rec in recs.items():
                    value = advantages[uid]
                    if isinstance(value, float):
                        rec["a"] = value
                    else:
                        self.txn.put(self._key(uid), value, db=self.db["adv"])
                self._set_group_state(gkey, grp, recs, READY)
                self.ready.add(gkey.encode(), grp["q"], grp["p"])

    def _set_group_state(self, gkey: str, grp: dict[str, Any], recs: dict[str, dict], state: str) -> None:
        for uid, rec in recs.items():
            self.counters[rec["s"]] -= 1
            self.counters[state] += 1
            rec["s"] = state
            if state in RETIRED:  # a tombstone from now on, pruned after tombstone_seconds
                rec["rt"] = self.now
                self.txn.put(self._retired_key(uid, rec), b"", db=self.db["retired"])
            self.put_item(uid, rec)
        if grp["s"] in LIVE:
            self.counters["groups_" + grp["s"]] -= 1
        if state in LIVE:
            self.counters["groups_" + state] += 1
        grp["s"] = state
        self.put_group(gkey, grp)

    def _retired_key(self, uid: str, rec: dict[str, Any]) -> bytes:
        return self.prefix + u64(int(rec["rt"] * 1e6)) + uid.encode()

    def _forget_tombstone(self, uid: str, rec: dict[str, Any]) -> None:
        """Remove a retired experience's record (and a failed one's kept payload): its uid
        may then be pushed again."""
        self.forget_item(uid)
        self.txn.delete(self._key(uid), db=self.db["blobs"])
        self.counters[rec["s"]] -= 1
        self.txn.delete(self._retired_key(uid, rec), db=self.db["retired"])
        grp = self.group(rec["g"])
        if grp is not None and uid in grp["m"]:
            grp["m"].remove(uid)
            grp["n"] = len(grp["m"])
            if grp["m"]:
                self.put_group(rec["g"], grp)
            else:
                self.forget_group(rec["g"])

    def prune_tombstones(self, retired_before: float, limit: int = 10_000) -> int:
        """Forget tombstones retired before the cutoff (at most `limit` per call)."""
        cutoff = u64(int(retired_before * 1e6))
        expired = []
        with self.txn.cursor(db=self.db["retired"]) as cur:
            found = cur.set_range(self.prefix)
            while found and cur.key().startswith(self.prefix) and cur.key()[4:12] < cutoff and len(expired) < limit:
                expired.append(cur.key()[12:].decode())
                found = cur.next()
        for uid in expired:
            rec = self.item(uid)
            if rec is not None and rec["s"] in RETIRED:
                self._forget_tombstone(uid, rec)
        return len(expired)

    def _retire_group(self, gkey: str, grp: dict[str, Any], state: str) -> None:
        """Members leave the buffer (consumed, evicted, dropped): payloads go, records stay as
        tombstones so that a retried push of the same uid is still recognised as a duplicate."""
        if grp["s"] == READY:
            self.ready.remove(gkey.encode(), grp["q"], grp["p"])
        elif grp["s"] == PENDING:
            self.txn.delete(self._pending_key(gkey, grp), db=self.db["pending"])
        elif grp["s"] == COMPUTING:
            self.txn.delete(self.prefix + u64(grp["q"]), db=self.db["compute"])
        recs = {uid: self.item(uid) for uid in grp["m"]}
        keep = state == FAILED and self.config.keep_failed
        for uid, rec in recs.items():
            self._drop_payload(uid, rec, keep_blob=keep)
        self._set_group_state(gkey, grp, recs, state)

    def _drop_payload(self, uid: str, rec: dict[str, Any], *, keep_blob: bool = False) -> None:
        """The experience leaves the live data: its bytes, advantages and place in the
        insertion order go (`keep_blob` keeps the payload of a failed experience for Get)."""
        if not keep_blob:
            self.txn.delete(self._key(uid), db=self.db["blobs"])
        self.txn.delete(self._key(uid), db=self.db["adv"])
        self.txn.delete(self.prefix + u64(rec["q"]), db=self.db["order"])
        self.counters["bytes"] -= rec["n"]

    # sample
    def sample(
        self, spec: SampleSpec, allow_partial: bool, rng: random.Random, *, hold: bool, owner: str
    ) -> Sampled | None:
        chosen: list[tuple[str, dict[str, Any]]] = []
        total = 0
        min_version = spec.min_model_version
        with contextlib.closing(self.ready.candidates(spec.order, rng)) as candidates:
            for scanned, gkey_raw in enumerate(candidates):
                if scanned >= MAX_SCAN:  # the writer must not stall on a table of stale groups
                    break
                gkey = gkey_raw.decode()
                grp = self.group(gkey)
                if min_version is not None and (grp["v"] is None or grp["v"] < min_version):
                    continue
                chosen.append((gkey, grp))
                total += grp["n"]
                if (spec.num_groups and len(chosen) >= spec.num_groups) or (
                    spec.batch_size and total >= spec.batch_size
                ):
                    break
        enough = (spec.num_groups and len(chosen) >= spec.num_groups) or (spec.batch_size and total >= spec.batch_size)
        if not chosen or not (enough or allow_partial):
            return None
        batch = Sampled([], [], [], partial=not enough)
        delivery = "lease" if hold and spec.delivery == "consume" else spec.delivery
        expires = None
        if delivery == "lease":
            batch.lease_id = secrets.token_hex(8)
            if not hold:
                expires = batch.lease_expires = self.now + spec.lease_seconds
        rows = []
        for gkey, grp in chosen:
            recs = {uid: self.item(uid) for uid in grp["m"]}
            for uid in grp["m"]:
                rows.append(recs[uid])
                batch.uids.append(uid)
                batch.group_ids.append(gkey)
                batch.blobs.append(bytes(self.txn.get(self._key(uid), db=self.db["blobs"])))
                batch.versions.append(recs[uid]["v"])
                self.counters["bytes_sampled"] += recs[uid]["n"]
                batch.advantages.append(_advantage(self.txn, self.db["adv"], self._key(uid), recs[uid]))
                recs[uid]["t"] += 1
            if delivery == "consume" or (
                delivery == "replay"
                and self.config.max_times_sampled
                and max(r["t"] for r in recs.values()) >= self.config.max_times_sampled
            ):
                for uid, rec in recs.items():
                    self.put_item(uid, rec)
                self._retire_group(gkey, grp, CONSUMED)
            elif delivery == "lease":
                self.ready.remove(gkey.encode(), grp["q"], grp["p"])
                grp["l"] = batch.lease_id
                self._set_group_state(gkey, grp, recs, LEASED)
            else:
                for uid, rec in recs.items():
                    self.put_item(uid, rec)
        if delivery == "lease":
            lease = {"t": self.table_id, "g": [g for g, _ in chosen], "e": expires, "o": owner}
            self.txn.put(batch.lease_id.encode(), _dumps(lease), db=self.db["leases"])
            if expires is not None:
                self.txn.put(_expiry_key(expires, batch.lease_id), b"", db=self.db["lease_exp"])
        batch.advantages = finish_batch(self.config, rows, batch.advantages)
        self.counters["sampled"] += len(batch.uids)
        batch.newest_version = self.counters["max_version"]
        self.save()
        return batch

    def end_lease(self, lease_id: str, gkeys: list[str], *, requeue: bool) -> int:
        count = 0
        for gkey in gkeys:
            grp = self.group(gkey)
            if grp is None or grp["s"] != LEASED or grp.get("l") != lease_id:
                continue
            count += len(grp["m"])
            grp.pop("l")
            if requeue:
                recs = {uid: self.item(uid) for uid in grp["m"]}
                self._set_group_state(gkey, grp, recs, READY)
                self.ready.add(gkey.encode(), grp["q"], grp["p"])
            else:
                self._retire_group(gkey, grp, CONSUMED)
        return count

    # admin
    def seal(self, gkey: str) -> int:
        grp = self.group(gkey)
        if grp is None:
            raise NotFound(f"group {clip(gkey)} does not exist in table '{self.config.name}'")
        if grp["s"] != PENDING:
            raise GroupClosed(f"group {clip(gkey)} is already complete ({grp['s']})")
        self._complete(gkey, grp, partial=False)
        self.save()
        return grp["n"]

    def expire_groups(self, created_before: float) -> int:
        """Release (flagged partial) or drop incomplete groups created before the cutoff."""
        expired = []
        cutoff = u64(int(created_before * 1e6))
        with self.txn.cursor(db=self.db["pending"]) as cur:
            found = cur.set_range(self.prefix)
            while found and cur.key().startswith(self.prefix) and cur.key()[4:12] <= cutoff:
                expired.append(cur.key()[12:].decode())
                found = cur.next()
        for gkey in expired:
            grp = self.group(gkey)
            if self.config.on_group_timeout == "drop":
                self._retire_group(gkey, grp, DROPPED)
                self.counters["groups_dropped"] += 1
                self.counters["dropped_timeout"] += 1
            else:
                self._complete(gkey, grp, partial=True)
        return len(expired)

    def delete(self, uids: Sequence[str], group_ids: Sequence[str]) -> int:
        targets = list(uids)
        for gkey in group_ids:
            grp = self.group(gkey)
            if grp is not None:
                targets.extend(grp["m"])
        deleted = 0
        for uid in dict.fromkeys(targets):
            rec = self.item(uid)
            if rec is None:
                continue
            if rec["s"] not in LIVE:
                self._forget_tombstone(uid, rec)
                continue
            self.forget_item(uid)
            self.counters[rec["s"]] -= 1
            deleted += 1
            self._drop_payload(uid, rec)
            gkey = rec["g"]
            grp = self.group(gkey)
            grp["m"].remove(uid)
            grp["n"] = len(grp["m"])
            if grp["m"]:
                self.put_group(gkey, grp)
                continue
            if grp["s"] == READY:
                self.ready.remove(gkey.encode(), grp["q"], grp["p"])
            elif grp["s"] == PENDING:
                self.txn.delete(self._pending_key(gkey, grp), db=self.db["pending"])
            elif grp["s"] == COMPUTING:
                self.txn.delete(self.prefix + u64(grp["q"]), db=self.db["compute"])
            if grp["s"] in LIVE:
                self.counters["groups_" + grp["s"]] -= 1
            self.forget_group(gkey)
        return deleted

    # integrity
    def verify(self) -> list[str]:
        problems: list[str] = []
        p, txn = self.prefix, self.txn
        counts = defaultdict(int)
        groups: dict[str, dict[str, Any]] = {}
        with txn.cursor(db=self.db["groups"]) as cur:
            found = cur.set_range(p)
            while found and cur.key().startswith(p):
                groups[cur.key()[4:].decode()] = _loads(cur.value())
                found = cur.next()
        with txn.cursor(db=self.db["items"]) as cur:
            found = cur.set_range(p)
            while found and cur.key().startswith(p):
                uid, rec = cur.key()[4:].decode(), _loads(cur.value())
                counts[rec["s"]] += 1
                live = rec["s"] in LIVE
                blob = txn.get(cur.key(), db=self.db["blobs"])
                if live != (blob is not None) and not (rec["s"] == FAILED and self.config.keep_failed):
                    problems.append(f"item {uid} is {rec['s']} but its payload is {'missing' if live else 'present'}")
                if live:
                    counts["bytes"] += rec["n"]
                    trxp.parse(blob, trusted=True)
                    if txn.get(p + u64(rec["q"]), db=self.db["order"]) != uid.encode():
                        problems.append(f"item {uid} is missing from the insertion order")
                grp = groups.get(rec["g"])
                if grp is None or uid not in grp["m"]:
                    problems.append(f"item {uid} is not a member of its group {rec['g']}")
                elif grp["s"] != rec["s"]:
                    problems.append(f"item {uid} is {rec['s']} but its group {rec['g']} is {grp['s']}")
                found = cur.next()
        ready_groups = set()
        for gkey, grp in groups.items():
            if grp["n"] != len(grp["m"]):
                problems.append(f"group {gkey} counts {grp['n']} members but lists {len(grp['m'])}")
            if grp["s"] in LIVE:
                counts["groups_" + grp["s"]] += 1
            if grp["s"] == COMPUTING and txn.get(p + u64(grp["q"]), db=self.db["compute"]) != gkey.encode():
                problems.append(f"computing group {gkey} is missing from the compute queue")
            if grp["s"] == READY:
                ready_groups.add(gkey)
                if txn.get(p + u64(grp["q"]), db=self.db["ready"]) != gkey.encode():
                    problems.append(f"ready group {gkey} is missing from the ready index")
            if grp["s"] == PENDING and txn.get(self._pending_key(gkey, grp), db=self.db["pending"]) is None:
                problems.append(f"pending group {gkey} is missing from the timeout index")
        tombstones = sum(counts[state] for state in RETIRED)
        if self._prefix_count("retired") != tombstones:
            problems.append(f"the retired index holds {self._prefix_count('retired')} of {tombstones} tombstones")
        if self._prefix_count("compute") != counts["groups_computing"]:
            problems.append(f"the compute queue holds {self._prefix_count('compute')} groups")
        for db in ("ready", "prio", "slotof"):
            indexed = self._prefix_count(db)
            if indexed != len(ready_groups):
                problems.append(f"the {db} index holds {indexed} groups, {len(ready_groups)} are ready")
        if self.ready.count() != len(ready_groups):
            problems.append(f"{self.ready.count()} uniform slots for {len(ready_groups)} ready groups")
        for name in (*STATES, "bytes", *(f"groups_{state}" for state in LIVE)):
            if self.counters[name] != counts[name]:
                problems.append(f"counter {name} is {self.counters[name]} but {counts[name]} were found")
        live = sum(counts[state] for state in LIVE)
        if self._prefix_count("order") != live:
            problems.append(f"the insertion order holds {self._prefix_count('order')} of {live} live items")
        return problems

    def _prefix_count(self, db: str) -> int:
        n = 0
        with self.txn.cursor(db=self.db[db]) as cur:
            found = cur.set_range(self.prefix)
            while found and cur.key().startswith(self.prefix):
                n += len(cur.key()) > len(self.prefix)
                found = cur.next()
        return n
