"""The LMDB storage engine behind the expbuf server: one object that every caller uses.

It puts each request through the environment's writer thread (environment.py), as one
table's transaction (groups.py) with its deliveries and leases (sampling.py, leases.py), and answers
reads from read transactions. Nothing lives only in memory but the table list, so a
restart restores every table, group, lease and counter; a crash leaves the last
committed state (LMDB is copy-on-write).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import lmdb

from expbuf.client import trxp

from ..advantage_storage import StageCounts, batch_payload
from ..errors import Conflict, NotFound, TableFull, clip
from ..sample_spec import check_version
from ..tables import CONFIG_VERSION, TableConfig, default_table, estimator_of
from . import admission, browse, deliverable, integrity, layout, limiter, retirement, staleness
from .batch_rows import BatchRows
from .environment import Environment
from .groups import TableTxn, read_counters
from .integrity import verify
from .migrate import migrate
from .records import GroupRecord, ItemRecord, Lease
from .sampling import Sampling
from .types import ComputeJob, Entry, PutResult, ShapingUpdate
from .upkeep import Upkeep


class Store(Sampling):
    """The storage engine: tables, pushes, samples, leases, upkeep and advantages' I/O."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 1 << 30,
        max_map_size: int = 1 << 40,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
        batch_limit: int = 512,
        max_reply_bytes: int | None = None,
        check_at_open: str = "full",
    ) -> None:
        self.environment = Environment(
            path, map_size=map_size, max_map_size=max_map_size, batch_limit=batch_limit, migrate=migrate
        )
        try:
            with self.environment.read() as txn:  # a damaged directory is refused before it is served
                integrity.at_open(
                    txn, self.environment.db, self.environment.path, clock(), full=check_at_open == "full"
                )
        except BaseException:
            self.environment.close()
            raise
        self.path = self.environment.path
        self.max_map_size = max_map_size
        self.max_reply_bytes = max_reply_bytes  # a group that would not fit in one Sample reply is refused
        self.clock = clock
        self._rng = random.Random(seed)
        self._db = self.environment.db
        self._upkeep = Upkeep(self.environment.env, self._db)
        self._tables: dict[str, tuple[int, TableConfig]] = {}
        self._batch_counts: dict[int, StageCounts] = {}  # by table id: the batch stage's clip counts
        self._names: dict[int, str] = {}  # table id -> name
        self._last_computed = 0  # the table whose backlog was read last (tables take turns)
        with self.environment.read() as txn:
            for name, raw in txn.cursor(db=self._db["tables"]):
                record = json.loads(raw)
                config = TableConfig.from_stored(record["config"], record.get("v", 1))
                self._tables[name.decode()] = (record["id"], config)
                self._names[record["id"]] = name.decode()
        if "default" not in self._tables:
            self.create_table(default_table(), exist_ok=True)
        self._recount()

    def _recount(self) -> None:
        """Tables whose rate-limit counts an older build kept are counted again (limiter.py);
        a directory without such tables is not written."""
        with self.environment.read() as txn:
            due = [
                (table_id, config)
                for table_id, config in self._tables.values()
                if limiter.counted_before(txn, self._db["counters"], layout.table_prefix(table_id))
            ]

        def op(txn: lmdb.Transaction) -> None:
            for table_id, config in due:
                limiter.recount(TableTxn(txn, self._db, table_id, config, self.clock()))

        if due:
            self._submit(op)

    # ---- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Finish and commit every queued request, then close the environment."""
        self.environment.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, fn: Callable[[lmdb.Transaction], Any]) -> Any:
        return self.environment.submit(fn)

    def _in_table(self, table: str, fn: Callable[[TableTxn], Any]) -> Any:
        """Run `fn` on one table in the writer's next transaction."""
        table_id, config = self._table(table)

        def op(txn: lmdb.Transaction) -> Any:
            self._upkeep.mark(table_id)  # in the writer's transaction: never before an upkeep pass that misses it
            return fn(TableTxn(txn, self._db, table_id, config, self.clock()))

        return self._submit(op)

    @property
    def maintenance_failures(self) -> int:
        """Pieces of upkeep skipped because they failed (see upkeep.py)."""
        return self._upkeep.failures

    # ---- tables ------------------------------------------------------------------------

    def create_table(self, config: TableConfig, *, exist_ok: bool = False) -> bool:
        """Create a table; True if created. An identical existing table is fine with exist_ok."""

        def op(txn: lmdb.Transaction) -> tuple[bool, int]:
            raw = txn.get(config.name.encode(), db=self._db["tables"])
            if raw is not None:
                record = json.loads(raw)
                if exist_ok and TableConfig.from_stored(record["config"], record.get("v", 1)) == config:
                    return False, record["id"]
                raise Conflict(f"table '{config.name}' already exists")
            table_id = int(txn.get(b"next_table_id", b"1", db=self._db["meta"]))
            txn.put(b"next_table_id", str(table_id + 1).encode(), db=self._db["meta"])
            record = {"id": table_id, "config": config.to_dict(), "created": self.clock(), "v": CONFIG_VERSION}
            txn.put(config.name.encode(), json.dumps(record).encode(), db=self._db["tables"])
            return True, table_id

        created, table_id = self._submit(op)
        self._tables[config.name] = (table_id, config)
        self._names[table_id] = config.name
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

    def _by_id(self, txn: lmdb.Transaction, table_id: int) -> TableTxn | None:
        name = self._names.get(table_id)
        if name is None or name not in self._tables:
            return None
        return TableTxn(txn, self._db, table_id, self._tables[name][1], self.clock())

    def drop_table(self, name: str) -> int:
        """Delete a table and everything in it; returns the live experiences dropped."""
        table_id, _ = self._table(name)
        prefix = layout.table_prefix(table_id)

        def op(txn: lmdb.Transaction) -> int:
            counters = read_counters(txn, self._db["counters"], prefix)
            txn.delete(name.encode(), db=self._db["tables"])
            for db in layout.PER_TABLE:
                with txn.cursor(db=self._db[db]) as cur:
                    if cur.set_range(prefix):
                        while cur.key().startswith(prefix) and cur.delete():
                            pass
            # Leases are keyed by id, not table: a batch held by a stream of this table ends here.
            ended = [key for key, raw in txn.cursor(db=self._db["leases"]) if Lease.decode(raw).table_id == table_id]
            for key in ended:
                txn.delete(key, db=self._db["leases"])
            return sum(counters[s] for s in ("pending", "computing", "ready", "leased"))

        dropped = self._submit(op)
        self._tables.pop(name, None)
        self._names.pop(table_id, None)
        return dropped

    # ---- push --------------------------------------------------------------------------

    def put(self, table: str, items: Sequence[trxp.RawItem], *, timeout: float | None = None) -> PutResult:
        """Store validated items durably. A full table in block mode waits until timeout."""
        return self.put_entries(table, [Entry.of(item) for item in items], timeout=timeout)

    def put_entries(self, table: str, entries: Sequence[Entry], *, timeout: float | None = None) -> PutResult:
        _, config = self._table(table)
        limit = self.max_reply_bytes
        start = time.monotonic()
        deadline = start + (timeout if timeout is not None else 0.0)
        held = False  # whether the rate limit held this push
        while True:
            generation = self.environment.generation
            final = time.monotonic() >= deadline
            blocked = time.monotonic() - start if held else 0.0
            try:
                result = self._in_table(table, lambda tt, f=final, b=blocked: self._put(tt, entries, f, b, limit))
            except TableFull:
                if config.when_full != "block" or final:
                    raise
            else:
                if not isinstance(result, limiter.InsertLimited):
                    return result
                if final:
                    raise result
                held = True
            self.environment.wait_for_change(generation, deadline)

    @staticmethod
    def _put(
        tt: TableTxn, entries: Sequence[Entry], final: bool, blocked: float, reply_limit: int | None
    ) -> PutResult | limiter.InsertLimited:
        """Store entries, or the rate limit that holds them (with the time it held them,
        counted when it lets them go or at the deadline); refuse them if a group would not
        fit in one Sample reply of reply_limit bytes."""
        deliverable.check(tt, entries, reply_limit)
        held = limiter.insert_limit(tt, entries)
        if blocked and (held is None or final):
            tt.counters["insert_blocked_seconds"] += blocked
            tt.save()
        if held is not None:
            return held
        kept, stale = admission.screen(tt, entries)
        result = tt.put(kept)
        result.stale = stale
        return result

    # ---- admission -----------------------------------------------------------------------

    def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> admission.Grant:
        """How many of `count` rollouts may start now (admission.py), under a grant that
        expires after grant_seconds unless finished; waits up to `wait` for room."""
        deadline = time.monotonic() + wait
        while True:
            generation = self.environment.generation
            granted = self._in_table(table, lambda tt: admission.grant(tt, count, grant_seconds))
            if granted.count or time.monotonic() >= deadline:
                return granted
            self.environment.wait_for_change(generation, deadline)

    def finish_grant(self, table: str, grant_id: str, accepted: int | None = None) -> int:
        """End a grant: `accepted` rollouts stay counted (None: all); returns those given back."""
        table_id, _ = self._table(table)

        def op(tt: TableTxn) -> int:
            record = admission.read_grant(tt.txn, self._db, grant_id)
            if record is None or record["t"] != table_id:
                raise admission.unknown_grant(grant_id, table)
            return admission.finish(tt, grant_id, record, accepted)

        return self._in_table(table, op)

    def _expire_grant(self, txn: lmdb.Transaction, key: bytes) -> int:
        grant_id = key[8:].decode()
        record = admission.read_grant(txn, self._db, grant_id)
        tt = None if record is None else self._by_id(txn, record["t"])
        if tt is None:  # an expiry without its grant, or the grant of a dropped table
            txn.delete(key, db=self._db["grant_exp"])
            txn.delete(grant_id.encode(), db=self._db["grants"])
            return 0
        return admission.finish(tt, grant_id, record, 0, expired=True)

    def set_trainer_version(self, table: str, version: int) -> int:
        """Report the trainer's policy version for a table; returns the version stored,
        which is higher when the table's already was (it only moves forward, staleness.py).
        A table with evict_stale drops a first bounded batch of the groups that fell stale."""
        check_version("version", version)
        return self._in_table(table, lambda tt: staleness.report(tt, version))

    def reset_offpolicy(self, table: str, version: int | None = None) -> tuple[int | None, int]:
        """An admin's reset of a table's off-policy state, for a job that starts over: the
        trainer version becomes `version` (None: unset), even backwards or past the jump
        bound, and admission counts only the rollouts of grants still open. Returns the
        trainer version and the rollouts still counted."""
        if version is not None:
            check_version("version", version)

        def op(tt: TableTxn) -> tuple[int | None, int]:
            submitted = admission.reset(tt)
            staleness.reset(tt, version)
            return version, submitted

        return self._in_table(table, op)

    # ---- reads and admin ---------------------------------------------------------------

    def get(self, table: str, uids: Sequence[str]) -> dict[str, bytes]:
        """Stored payloads of the live experiences among uids."""
        prefix = layout.table_prefix(self._table(table)[0])
        found = {}
        with self.environment.read() as txn:
            for uid in uids:
                blob = txn.get(prefix + uid.encode(), db=self._db["blobs"])
                if blob is not None:
                    found[uid] = bytes(blob)
        return found

    def list_experiences(
        self,
        table: str,
        *,
        states: Sequence[str] = (),
        min_version: int | None = None,
        max_version: int | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> browse.Page:
        """A page of the table's live experiences in insertion order (see browse.py)."""
        prefix = layout.table_prefix(self._table(table)[0])
        with self.environment.read() as txn:
            return browse.page(
                txn, self._db, prefix,
                states=set(states), min_version=min_version, max_version=max_version, after=after, limit=limit,
            )  # fmt: skip

    def get_payload(self, table: str, uids: Sequence[str]) -> tuple[bytes, list[str]]:
        """A TRXP batch of the stored experiences among uids (in their order), and the missing uids."""
        table_id, config = self._table(table)
        prefix = layout.table_prefix(table_id)
        missing = []
        with self.environment.read(buffers=True) as txn:  # views, copied once: into the batch
            rows = BatchRows(txn, self._db["adv"], config)
            for uid in uids:
                key = prefix + uid.encode()
                blob = txn.get(key, db=self._db["blobs"])
                if blob is None:
                    missing.append(uid)
                    continue
                rows.add(key, ItemRecord.decode(txn.get(key, db=self._db["items"])), blob)
            stage = rows.stage(None)  # a Get is not a sample: its clip is not counted
            advantages = rows.advantages if stage is None else stage.run(rows.advantages)
            return batch_payload(rows.blobs, advantages), missing

    def delete(self, table: str, uids: Sequence[str] = (), group_ids: Sequence[str] = ()) -> int:
        """Remove experiences (and their records, so they may be pushed again)."""

        def op(tt: TableTxn) -> int:
            count = retirement.delete(tt, uids, group_ids)
            tt.save()
            return count

        return self._in_table(table, op)

    def seal(self, table: str, group_id: str) -> int:
        """Complete a pending group now; returns its size."""
        return self._in_table(table, lambda tt: tt.seal(group_id))

    def stats(self, table: str) -> dict[str, Any]:
        """Counts by state, bytes, group counts, totals and the oldest live experience's age."""
        table_id = self._table(table)[0]
        prefix = layout.table_prefix(table_id)
        oldest = 0.0
        with self.environment.read() as txn:
            counters = read_counters(txn, self._db["counters"], prefix)
            with txn.cursor(db=self._db["order"]) as cur:
                if cur.set_range(prefix) and cur.key().startswith(prefix):
                    rec = ItemRecord.decode(txn.get(prefix + cur.value(), db=self._db["items"]))
                    oldest = max(0.0, self.clock() - rec.created)
        counters["oldest_age_seconds"] = oldest
        batch = self._batch_counts.get(table_id)
        if batch is not None:  # the batch stage's clip, counted in memory since the server started
            counters["advantages_seen"] += batch.advantages_seen
            counters["advantages_clipped"] += batch.advantages_clipped
        return counters

    def _stage_counts(self, table_id: int) -> StageCounts:
        """Where the batch stage of the table's samples counts what its clip did."""
        return self._batch_counts.setdefault(table_id, StageCounts())

    def storage_info(self) -> dict[str, float]:
        return self.environment.storage_info()

    def verify(self, table: str) -> list[str]:
        """Check every index and counter of a table against its items; [] when consistent."""
        table_id, config = self._table(table)
        with self.environment.read() as txn:
            return verify(TableTxn(txn, self._db, table_id, config, self.clock()))

    # ---- upkeep ------------------------------------------------------------------------

    def tick(self) -> dict[str, int]:
        """Requeue expired leases, release or drop timed-out incomplete groups, evict stale
        ready groups, forget old tombstones; each lease and each table isolated from the
        others (upkeep.py)."""
        now = self.clock()

        def end_lease(txn: lmdb.Transaction, lease_id: str) -> int:
            return self._end_lease(txn, lease_id, requeue=True, expired=True)

        return self._submit(
            lambda txn: self._upkeep.run(txn, now, list(self._tables.values()), end_lease, self._expire_grant)
        )

    # ---- advantages ------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Counts committed batches of requests; wait_for_change() waits for the next."""
        return self.environment.generation

    def wait_for_change(self, generation: int, timeout: float) -> bool:
        return self.environment.wait_for_change(generation, time.monotonic() + timeout)

    def wake(self) -> None:
        """End every wait_for_change() now (a stopping server's advantage worker need not wait out its timeout)."""
        self.environment.wake()

    def compute_backlog(self, limit: int = 8192) -> list[ComputeJob]:
        """Completed groups waiting for advantages, oldest first within each table, up to
        about `limit` experiences, as one job per table. Tables take turns being first, so a
        table with a long backlog cannot keep the others waiting. The compute index is read
        from table to table with a backlog, never over the tables without one. Payloads are read
        only for estimators that need token-level data; the others work from the item records."""
        jobs: list[ComputeJob] = []
        count = 0
        seen: set[int] = set()
        with self.environment.read() as txn, txn.cursor(db=self._db["compute"]) as cur:
            found = cur.set_range(layout.table_prefix(self._last_computed + 1)) or cur.first()
            while found and count < limit:
                table_id = layout.table_of(cur.key())
                if table_id in seen:  # around to the first table again
                    break
                seen.add(table_id)
                prefix = layout.table_prefix(table_id)
                name = self._names.get(table_id)
                if name is not None and name in self._tables:
                    config = self._tables[name][1]
                    moments = read_counters(txn, self._db["counters"], prefix)["reward_moments"]
                    job = ComputeJob(name, config, [], [], {}, {}, moments)
                    while found and cur.key().startswith(prefix) and count < limit:
                        gkey = cur.value()
                        grp = GroupRecord.decode(txn.get(prefix + gkey, db=self._db["groups"]))
                        job.groups.append(gkey.decode())
                        job.members.append(grp.members)
                        for uid in grp.members:
                            item_key = prefix + uid.encode()
                            job.records[uid] = ItemRecord.decode(txn.get(item_key, db=self._db["items"]))
                            if estimator_of(config).token_level:
                                job.blobs[uid] = bytes(txn.get(item_key, db=self._db["blobs"]))
                        count += len(grp.members)
                        found = cur.next()
                    jobs.append(job)
                    self._last_computed = table_id
                found = cur.set_range(layout.table_prefix(table_id + 1)) or cur.first()
        return jobs

    def finish_compute(
        self,
        table: str,
        advantages: dict[str, float | bytes],
        ready: Sequence[str],
        dropped: Sequence[str] = (),
        failed: dict[str, str] | None = None,
        shaping: ShapingUpdate | None = None,
    ) -> None:
        """Store computed advantages and release their groups; drop or fail the others.
        Groups deleted or evicted meanwhile are left alone. What reward shaping did (its
        counts and running moments) is saved in the same transaction."""

        def op(tt: TableTxn) -> None:
            tt.finish_compute(advantages, ready, dropped, failed or {}, shaping)
            tt.save()

        self._in_table(table, op)
