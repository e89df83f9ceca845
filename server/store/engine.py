"""The LMDB storage engine behind the expbuf server: one object that every caller uses.

`Store` is a façade. It composes the environment (environment.py: the LMDB environment and
its writer thread), the table catalog (catalog.py), the table extensions (extensions.py:
the compute queue and stale-group eviction, and any registered), the sampling service
(sampling.py) and the upkeep service (upkeep.py), and puts each request through the writer as
one table's transaction: a table's state (table_state.py) changed by the rules (groups.py,
capacity.py, retirement.py, leases.py, limiter.py, admission.py, staleness.py). Reads are
answered from read transactions. Nothing lives only in memory but the table list, so a
restart restores every table, group, lease and counter; a crash leaves the last committed
state (LMDB is copy-on-write).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import lmdb

from expbuf.client import trxp

from ..advantage_storage import batch_payload
from ..errors import InsertLimited, TableFull
from ..sample_spec import SampleSpec, check_version
from ..tables import TableConfig, default_table
from . import (
    admission,
    browse,
    deliverable,
    groups,
    integrity,
    layout,
    limiter,
    pushed_advantages,
    retirement,
    staleness,
)
from .batch_rows import BatchRows
from .catalog import TableCatalog
from .claims import Claims, PromptPage
from .compute_queue import ComputeQueue, backlog
from .counters import read_counters
from .environment import Environment
from .extensions import Extensions
from .integrity import verify
from .kinds import Ahead, Compute, ComputeJob, Entry, PutResult, Sampled, ShapingUpdate
from .ledger import Claimed, Ledger
from .ledger_records import DatasetRecord
from .migrate import migrate
from .read_check import serve_problem
from .records import ItemRecord
from .sampling import Sampling
from .staleness import StaleEviction
from .table_state import TableState, stored
from .upkeep import Upkeep

log = logging.getLogger("expbuf.store")
T = TypeVar("T")


class Store:
    """The storage engine: tables, pushes, samples, leases, upkeep and advantages' I/O; the
    prompt ledger's datasets and claims are its `claims` service (claims.py)."""

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
        self.db = self.environment.db
        # What runs at every table's events: the store's own, then any a caller registers.
        self.ledger = Ledger()
        self.extensions = Extensions([ComputeQueue(), StaleEviction(), self.ledger])
        self.catalog = TableCatalog(self.environment, self.extensions, clock)
        self.sampling = Sampling(self.environment, self.catalog, random.Random(seed))
        self.upkeep = Upkeep(self.environment.env, self.catalog)
        self.claims = Claims(self.environment, self.catalog, self.ledger, self.upkeep.mark)
        self._last_computed = 0  # the table whose backlog was read last (tables take turns)
        # The advantage computation a push runs for a table's groups in its own transaction
        # (pushed_advantages.py), or None where the worker computes them; the server sets
        # it (advantages.py), so the storage engine itself imports no estimator.
        self.in_push: Callable[[TableConfig], Compute | None] | None = None
        if not self.catalog.has("default"):
            self.create_table(default_table(), exist_ok=True)
        self._recount()

    def _recount(self) -> None:
        """Tables whose rate-limit counts an older build kept are counted again (limiter.py);
        a directory without such tables is not written."""
        with self.environment.read() as txn:
            due = [
                (table_id, config)
                for table_id, config in self.catalog.entries()
                if limiter.counted_before(txn, self.db["counters"], layout.table_prefix(table_id))
            ]

        def op(txn: lmdb.Transaction[bytes]) -> None:
            for table_id, config in due:
                limiter.recount(self.catalog.state(txn, table_id, config))

        if due:
            self.environment.submit(op)

    # ---- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Finish and commit every queued request, then close the environment."""
        self.environment.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _in_table(self, table: str, fn: Callable[[TableState], T]) -> T:
        """Run `fn` on one table in the writer's next transaction."""
        table_id, config = self.catalog.lookup(table)

        def op(txn: lmdb.Transaction[bytes]) -> T:
            self.upkeep.mark(table_id)  # in the writer's transaction: never before an upkeep pass that misses it
            return fn(self.catalog.state(txn, table_id, config))

        return self.environment.submit(op)

    @property
    def maintenance_failures(self) -> int:
        """Pieces of upkeep skipped because they failed (see upkeep.py)."""
        return self.upkeep.failures

    # ---- tables ------------------------------------------------------------------------

    def create_table(self, config: TableConfig, *, exist_ok: bool = False) -> bool:
        """Create a table; True if created. An identical existing table is fine with exist_ok."""
        return self.catalog.create(config, exist_ok=exist_ok)

    def list_tables(self) -> list[TableConfig]:
        return self.catalog.configs()

    def has_table(self, name: str) -> bool:
        return self.catalog.has(name)

    def table(self, name: str) -> TableConfig:
        return self.catalog.lookup(name)[1]

    def drop_table(self, name: str) -> int:
        """Delete a table and everything in it; returns the live experiences dropped."""
        return self.catalog.drop(name)

    # ---- push --------------------------------------------------------------------------

    def put(self, table: str, items: Sequence[trxp.RawItem], *, timeout: float | None = None) -> PutResult:
        """Store validated items durably. A full table in block mode waits until timeout."""
        return self.put_entries(table, [Entry.of(item) for item in items], timeout=timeout)

    def put_entries(self, table: str, entries: Sequence[Entry], *, timeout: float | None = None) -> PutResult:
        _, config = self.catalog.lookup(table)
        limit = self.max_reply_bytes
        compute = self.in_push(config) if self.in_push is not None else None
        ahead = pushed_advantages.compute_ahead(config, entries, compute) if compute is not None else None
        start = time.monotonic()
        deadline = start + (timeout if timeout is not None else 0.0)
        held = False  # whether the rate limit held this push
        while True:
            generation = self.environment.generation
            final = time.monotonic() >= deadline
            blocked = time.monotonic() - start if held else 0.0
            try:
                put = functools.partial(
                    self._put,
                    entries=entries,
                    final=final,
                    blocked=blocked,
                    reply_limit=limit,
                    in_push=self.in_push,
                    ahead=ahead,
                )
                result = self._in_table(table, put)
            except TableFull:
                if config.when_full != "block" or final:
                    raise
            else:
                if not isinstance(result, InsertLimited):
                    return result
                if final:
                    raise result
                held = True
            self.environment.wait_for_change(generation, deadline)

    @staticmethod
    def _put(
        tt: TableState,
        entries: Sequence[Entry],
        final: bool,
        blocked: float,
        reply_limit: int | None,
        in_push: Callable[[TableConfig], Compute | None] | None,
        ahead: Ahead | None,
    ) -> PutResult | InsertLimited:
        """Store entries, or the rate limit that holds them (with the time it held them,
        counted when it lets them go or at the deadline); refuse them if a group would not
        fit in one Sample reply of reply_limit bytes. With `in_push`, the groups the push
        completes get their advantages in its transaction where it gives the table a computation
        (`ahead`: computed before it, for the groups the push was expected to complete)."""
        deliverable.check(tt, entries, reply_limit)
        held = limiter.insert_limit(tt, entries)
        if blocked and (held is None or final):
            tt.counters.insert_blocked_seconds += blocked
            tt.save()
        if held is not None:
            return held
        kept, stale = admission.screen(tt, entries)
        tt.compute = in_push(tt.config) if in_push is not None else None
        tt.ahead = ahead
        result = groups.put(tt, kept)
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
        table_id, _ = self.catalog.lookup(table)

        def op(tt: TableState) -> int:
            record = admission.read_grant(tt.txn, self.db, grant_id)
            if record is None or record["t"] != table_id:
                raise admission.unknown_grant(grant_id, table)
            return admission.finish(tt, grant_id, record, accepted)

        return self._in_table(table, op)

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

        def op(tt: TableState) -> tuple[int | None, int]:
            submitted = admission.reset(tt)
            staleness.reset(tt, version)
            return version, submitted

        return self._in_table(table, op)

    # ---- reads and admin ---------------------------------------------------------------

    def get(self, table: str, uids: Sequence[str]) -> dict[str, bytes]:
        """Stored payloads of the live experiences among uids."""
        prefix = layout.table_prefix(self.catalog.lookup(table)[0])
        found = {}
        with self.environment.read() as txn:
            for uid in uids:
                blob = txn.get(prefix + uid.encode(), db=self.db["blobs"])
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
        prefix = layout.table_prefix(self.catalog.lookup(table)[0])
        with self.environment.read() as txn:
            return browse.page(
                txn, self.db, prefix,
                states=set(states), min_version=min_version, max_version=max_version, after=after, limit=limit,
            )  # fmt: skip

    def get_payload(self, table: str, uids: Sequence[str]) -> tuple[bytes, list[str]]:
        """A TRXP batch of the stored experiences among uids (in their order), and the missing
        uids. An experience that cannot be served (read_check.py) is never returned: it is
        logged and listed as missing."""
        table_id, config = self.catalog.lookup(table)
        prefix = layout.table_prefix(table_id)
        missing = []
        with self.environment.read(buffers=True) as txn:  # views, copied once: into the batch
            rows = BatchRows(txn, self.db["adv"], config)
            for uid in uids:
                key = prefix + uid.encode()
                blob = txn.get(key, db=self.db["blobs"])
                if blob is None:
                    missing.append(uid)
                    continue
                rec = ItemRecord.decode(stored(txn, key, self.db["items"], "experience"))
                problem = serve_problem(uid, rec, blob)
                if problem is not None:
                    log.error("table %s: Get found %s; it is not served", table, problem)
                    missing.append(uid)
                    continue
                rows.add(key, rec, blob)
            stage = rows.stage(None)  # a Get is not a sample: its clip is not counted
            advantages = rows.advantages if stage is None else stage.run(rows.advantages)
            return batch_payload(rows.blobs, advantages), missing

    def delete(self, table: str, uids: Sequence[str] = (), group_ids: Sequence[str] = ()) -> int:
        """Remove experiences (and their records, so they may be pushed again)."""

        def op(tt: TableState) -> int:
            count = retirement.delete(tt, uids, group_ids)
            tt.save()
            return count

        return self._in_table(table, op)

    def retire(self, table: str, group_ids: Sequence[str], owner: str = "") -> int:
        """Consume groups a trainer trained by their ids, as an ack would (retirement.retire_trained);
        returns the groups retired."""

        def op(tt: TableState) -> int:
            count = retirement.retire_trained(tt, group_ids, owner)
            tt.save()
            return count

        return self._in_table(table, op)

    def seal(self, table: str, group_id: str) -> int:
        """Complete a pending group now; returns its size."""
        return self._in_table(table, lambda tt: groups.seal(tt, group_id))

    def stats(self, table: str) -> dict[str, Any]:
        """The table's counters by name (counters.Counters), with the oldest live experience's age."""
        table_id = self.catalog.lookup(table)[0]
        prefix = layout.table_prefix(table_id)
        oldest = 0.0
        with self.environment.read() as txn:
            counters = read_counters(txn, self.db["counters"], prefix)
            with txn.cursor(db=self.db["order"]) as cur:
                if cur.set_range(prefix) and cur.key().startswith(prefix):
                    rec = ItemRecord.decode(stored(txn, prefix + cur.value(), self.db["items"], "experience"))
                    oldest = max(0.0, self.clock() - rec.created)
        batch = self.sampling.counted(table_id)
        if batch is not None:  # the batch stage's clip, counted in memory since the server started
            counters.advantages_seen += batch.advantages_seen
            counters.advantages_clipped += batch.advantages_clipped
        return counters.to_dict() | {"oldest_age_seconds": oldest}

    def storage_info(self) -> dict[str, float]:
        return self.environment.storage_info()

    def verify(self, table: str) -> list[str]:
        """Check every index and counter of a table against its items; [] when consistent."""
        table_id, config = self.catalog.lookup(table)
        with self.environment.read() as txn:
            return verify(self.catalog.state(txn, table_id, config))

    # ---- upkeep ------------------------------------------------------------------------

    def tick(self) -> dict[str, int]:
        """Requeue expired leases, release or drop timed-out incomplete groups, evict stale
        ready groups, forget old tombstones; each lease and each table isolated from the
        others (upkeep.py)."""
        now = self.clock()

        def end_lease(txn: lmdb.Transaction[bytes], lease_id: str) -> int:
            return self.sampling.end_lease(txn, lease_id, requeue=True, expired=True)

        return self.environment.submit(lambda txn: self.upkeep.run(txn, now, end_lease))

    # ---- sampling (sampling.py) ----------------------------------------------------------------

    def sample(
        self,
        spec: SampleSpec,
        *,
        timeout: float | None = None,
        hold: bool = False,
        owner: str = "",
        stop: Callable[[], bool] | None = None,
        confirm: str | Sequence[str] = "",
    ) -> Sampled | None:
        """Select whole ready groups; None if not enough arrived within the wait (Sampling.sample)."""
        return self.sampling.sample(spec, timeout=timeout, hold=hold, owner=owner, stop=stop, confirm=confirm)

    def ack(self, lease_id: str, table: str | None = None, owner: str = "") -> int:
        """Consume the groups of a lease; returns the experiences acknowledged."""
        return self.sampling.ack(lease_id, table, owner)

    def nack(self, lease_id: str, table: str | None = None, owner: str = "") -> int:
        """Return the groups of a lease to the buffer; returns the experiences requeued."""
        return self.sampling.nack(lease_id, table, owner)

    def confirm(self, lease_id: str, spec: SampleSpec, owner: str = "") -> int:
        """A stream's held batch that its client has, delivered as the stream asked (Sampling.confirm_in)."""
        return self.sampling.confirm(lease_id, spec, owner)

    def renew(self, lease_id: str, seconds: float, table: str, owner: str = "") -> tuple[float, int]:
        """The lease now ends `seconds` from now; returns when, and the experiences it holds."""
        return self.sampling.renew(lease_id, seconds, table, owner)

    def release_holds(self) -> int:
        """Return every batch held for a stream of an earlier run of the server."""
        return self.sampling.release_holds()

    # ---- the prompt ledger (claims.py) ------------------------------------------------------

    def create_dataset(
        self, table: str, ds: DatasetRecord, *, exist_ok: bool = False, stop: Callable[[], bool] | None = None
    ) -> tuple[DatasetRecord, bool]:
        """A dataset of prompts on the table, or a shard's part of one; (record, created)."""
        return self.claims.create(table, ds, exist_ok=exist_ok, stop=stop)

    def datasets(self, table: str, name: str = "", *, by_epoch: bool = True) -> list[DatasetRecord]:
        """The table's datasets (or the one named), with their cursors and totals, and each
        epoch's prompts owned and counts unless not `by_epoch`."""
        return self.claims.datasets(table, name, by_epoch=by_epoch)

    def claim(
        self,
        table: str,
        name: str,
        count: int,
        *,
        seconds: float,
        owner: str = "",
        holder: str = "",
        wait: float = 0.0,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[list[Claimed], bool]:
        """Up to `count` prompts under claims that end `seconds` from now; and whether the dataset is done."""
        return self.claims.claim(table, name, count, seconds=seconds, owner=owner, holder=holder, wait=wait, stop=stop)

    def renew_claims(
        self, table: str, name: str, prompts: Sequence[tuple[int, int, int]], seconds: float, *, holder: str = ""
    ) -> tuple[float, list[tuple[int, int, int]]]:
        """Claims (epoch, index, attempt) now end `seconds` from now; when, and those that had ended."""
        return self.claims.renew(table, name, prompts, seconds, holder)

    def release_claims(
        self, table: str, name: str, prompts: Sequence[tuple[int, int, int]], *, holder: str = ""
    ) -> int:
        """Claims given back now: their prompts go out again with attempt + 1."""
        return self.claims.release(table, name, prompts, holder)

    def list_prompts(
        self,
        table: str,
        name: str,
        *,
        states: Sequence[str] = (),
        after: tuple[int, int] | None = None,
        limit: int = 1000,
    ) -> PromptPage:
        """A page of the dataset's prompts handed out at least once."""
        return self.claims.prompts(table, name, states=states, after=after, limit=limit)

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

        def table_of(table_id: int) -> tuple[str, TableConfig] | None:
            return self.catalog.by_id(table_id)

        with self.environment.read() as txn:
            jobs, self._last_computed = backlog(txn, self.db, table_of, self._last_computed, limit)
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

        self._in_table(table, lambda tt: groups.finish_compute(tt, advantages, ready, dropped, failed or {}, shaping))
