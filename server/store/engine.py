"""The LMDB storage engine behind the expbuf server: one object that every caller uses.

`Store` is a façade. It composes the environment (disk/environment/: the LMDB environment and
its writer thread), the table catalog (catalog.py) with each table's extensions (extensions.py:
the store's own its settings call for, and the kinds it names), and its services: pushes
(pushing.py), reads (reads.py), sampling (sampling.py), the prompt ledger's claims (claims.py),
upkeep (upkeep.py), the advantages' backlog and results (computing.py), the scrub (scrub.py) and
the background builds of the indexes a table lacks (index_builds.py). It puts each request through the writer as
one table's transaction: a table's state (core/table_state/state.py) changed by the rules (pushes.py, groups.py,
capacity.py, leases.py, limiter.py, admission.py, staleness.py) through the table core's verbs
(core/: the only code that writes a table's records). Reads are
answered from read transactions. Nothing lives only in memory but the table list, so a
restart restores every table, group, lease and counter; a crash leaves the last committed
state (LMDB is copy-on-write).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import lmdb

from expbuf.client.schema.call_limits import MAX_NAMES_PER_CALL
from expbuf.client.trxp.codec.common import RawItem

from .core.table_state import rate_counts
from .core.table_state.counters import Counters, read_counters
from .core.table_state.events import TableExtension
from .core.table_state.state import TableState
from .core.verbs import retire
from .core.whole_table import reading
from .core.whole_table.migrate import migrate
from .disk import chunked, layout, residency
from .disk.environment import Environment, Writer
from .disk.kinds import Compute, Entry, FailResult, PutResult
from .disk.stored_advantages import FinishBatch
from .forward import Forwarded
from .ledger.rules import Ledger
from .rules import groups, partial_holds, staleness
from .rules.extensions import ExtensionKinds
from .rules.quarantine import quarantine_found
from .rules.trained import retire_trained
from .schema.clock import SteadyClock
from .schema.errors import InvalidRequest, NotFound, check_names
from .schema.sample_spec import check_version
from .schema.table_config import TableConfig, default_table
from .service_calls import ServiceCalls
from .services.claims import Claims
from .services.computing import Computing
from .services.index_builds import IndexBuilds
from .services.pushing import Pushing
from .services.reads import Reads
from .services.sampling import Sampling
from .services.scrub import Scrub
from .services.staged import StagedPushes
from .services.upkeep import Upkeep
from .services.values import Values
from .tables import admission, integrity
from .tables.catalog import EveryTable, TableCatalog
from .tables.ended import RecentEnds
from .tables.integrity import verify

log = logging.getLogger("expbuf.store")
T = TypeVar("T")


class Store(ServiceCalls):
    """The storage engine: tables, pushes, upkeep and advantages' I/O; its samples and leases,
    its reads of named experiences and keyed values and the prompt ledger's datasets and claims
    are its services' calls (ServiceCalls, service_calls.py), as are the façade's calls below
    that a service answers as it is (forward.py)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 1 << 30,
        max_map_size: int = 1 << 40,
        clock: Callable[[], float] | None = None,
        seed: int | None = None,
        batch_limit: int = 512,
        check_at_open: str = "quick",
        scrub_mb_per_second: float = 0.0,
        scrub_interval_seconds: float = 86400.0,
        batch_stage: FinishBatch | None = None,
        extensions: Mapping[str, type[TableExtension]] | None = None,
        max_push_bytes: int = 16 << 30,
    ) -> None:
        """`batch_stage` finishes the advantages of a table with a batch stage over each batch
        taken, where the reply is built (server/batch_stage.finish_batch, which the server
        gives): the storage engine computes with no torch. A store without one refuses to
        take a batch of such a table. `extensions` registers table extension kinds by name
        before the tables are read (`register_extension`): a stored table naming a kind not
        registered fails the open, naming the table and the kind. `max_push_bytes` is the largest
        push the server takes: a rollout held in pieces takes no more (rules/partials.py). `clock`
        gives the store's time (schema/clock.SteadyClock unless given: a step of the wall clock
        moves no deadline)."""
        clock = clock or SteadyClock()
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
        residency.release(self.environment.path / "data.mdb")  # the pages the check read: page cache, not RSS
        self.path = self.environment.path
        self.max_map_size = max_map_size
        self.clock = clock
        self.db = self.environment.db
        # The extension kinds tables may name; a table's extensions are made by the catalog.
        self.extension_kinds = ExtensionKinds()
        self.ledger = Ledger()
        try:
            for name, kind in (extensions or {}).items():
                self.extension_kinds.register(name, kind)
            self.catalog = TableCatalog(self.environment, self.extension_kinds, self.ledger, clock)
        except BaseException:
            self.environment.close()
            raise
        self.extensions = EveryTable(self.catalog)
        # The lazy indexes a table lacks, built in the background from here (index_builds.py).
        self.builds = IndexBuilds(self.environment, self.catalog)
        self.ended_grants = RecentEnds[admission.EndedGrant]()  # a finish made again answers as the first
        self.upkeep = Upkeep(self.environment.env, self.catalog, self.ended_grants)
        self.sampling = Sampling(
            self.environment, self.catalog, random.Random(seed), batch_stage, self.builds, self.upkeep.mark
        )
        self.claims = Claims(self.environment, self.catalog, self.ledger, self.upkeep.mark)
        self.pushing = Pushing(
            self.environment, self.catalog, self._state_in, self.builds, self._quarantine_found, max_push_bytes
        )
        self.reads = Reads(self.environment, self.catalog, self.quarantine, batch_stage)
        self.values = Values(self.environment, self.catalog)
        self.computing = Computing(self.environment, self.catalog, self._in_table, self._quarantine_found)
        if not self.catalog.has("default"):
            self.create_table(default_table(), exist_ok=True)
        self._recount()
        self.values.recount()
        self._sweep_staged()
        self.builds.start()
        # The check of every payload that a quick open leaves out, in the background (scrub.py).
        self.scrub = Scrub(
            self.environment, self.catalog, self._quarantine_found,
            mb_per_second=scrub_mb_per_second, interval_seconds=scrub_interval_seconds, clock=clock,
        )  # fmt: skip
        self.scrub.start()

    def _recount(self) -> None:
        """Tables whose rate-limit counts an older build kept are counted again (core/table_state/rate_counts.py);
        a directory without such tables is not written."""
        with self.environment.read() as txn:
            due = [
                (table_id, config)
                for table_id, config in self.catalog.entries()
                if rate_counts.counted_before(txn, self.db, layout.table_prefix(table_id))
            ]

        def op(txn: lmdb.Transaction[bytes]) -> None:
            for table_id, config in due:
                rate_counts.recount(self.catalog.state(txn, table_id, config))

        if due:
            self.environment.submit(op)

    def _sweep_staged(self) -> None:
        """The chunk sets that pushes in chunks were staging when the last server stopped go:
        those pushes never completed (chunked.py)."""
        with self.environment.read() as txn:
            staged = chunked.staged_sets(txn, self.db)
        if staged:
            self.environment.submit(lambda txn: chunked.sweep_staged(txn, self.db))
            log.info("dropped the sections of %d push(es) in chunks that a stop cut short", staged)

    # ---- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the scrub and the index builds (each goes on from its cursor at the next open),
        finish and commit every queued request, then close the environment."""
        if hasattr(self, "scrub"):
            self.scrub.stop()
        if hasattr(self, "builds"):
            self.builds.stop()
        self.environment.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _in_table(self, table: str, fn: Callable[[TableState], T]) -> T:
        """Run `fn` on one table in the writer's next transaction (once an index it needs that
        the table does not keep yet is built in the background: index_builds.py)."""
        table_id, config = self.catalog.lookup(table)

        def op(txn: lmdb.Transaction[bytes]) -> T:
            return fn(self._state_in(txn, table_id, config))

        return self.builds.submit(op)

    def _state_in(self, txn: lmdb.Transaction[bytes], table_id: int, config: TableConfig) -> TableState:
        """A table's state in the writer's transaction, the table marked for the next upkeep pass."""
        self.upkeep.mark(table_id)  # in the writer's transaction: never before an upkeep pass that misses it
        return self.catalog.state(txn, table_id, config)

    @property
    def broken(self) -> str | None:
        """Why the store can take no more writes (LMDB's panic, a map it could not grow), which
        only a restart mends; None while it can."""
        return self.environment.writer.broken

    @property
    def maintenance_failures(self) -> int:
        """Pieces of upkeep skipped because they failed (see upkeep.py)."""
        return self.upkeep.failures

    # ---- tables ------------------------------------------------------------------------

    create_table = Forwarded("catalog", TableCatalog.create)
    create_tables = Forwarded("catalog", TableCatalog.create_all)
    list_tables = Forwarded("catalog", TableCatalog.configs)
    has_table = Forwarded("catalog", TableCatalog.has)

    def table(self, name: str) -> TableConfig:
        return self.catalog.lookup(name)[1]

    def table_id(self, name: str) -> int:
        """The id of the table of that name now (NotFound): another once it is dropped and made again."""
        return self.catalog.lookup(name)[0]

    drop_table = Forwarded("catalog", TableCatalog.drop)

    def register_extension(self, name: str, kind: type[TableExtension], *, replace: bool = False) -> None:
        """Let tables run the table extension `kind` by naming it (`TableConfig.extensions`),
        each table an instance of its own, made with no arguments (extensions.py). Tables the
        data directory holds already that name a kind need it registered before the open:
        `Store(extensions={name: kind})`."""
        self.extension_kinds.register(name, kind, replace=replace)

    extensions_of = Forwarded("catalog", TableCatalog.extensions_of)

    # ---- push --------------------------------------------------------------------------

    def put(self, table: str, items: Sequence[RawItem], *, timeout: float | None = None) -> PutResult:
        """Store validated items durably. A full table in block mode waits until timeout."""
        return self.put_entries(table, [Entry.of(item) for item in items], timeout=timeout)

    put_entries = Forwarded("pushing", Pushing.put)
    new_chunk_set = Forwarded("pushing", Pushing.new_chunk_set)
    zstd_level = Forwarded("pushing", Pushing.zstd_level)
    stage = Forwarded("pushing", Pushing.stage)
    drop_staged = Forwarded("pushing", Pushing.drop_staged)
    open_staged = Forwarded("pushing.staged", StagedPushes.open)
    put_in_order = Forwarded("pushing", Pushing.put_in_order)

    @property
    def in_push(self) -> Callable[[TableConfig], Compute | None] | None:
        """The advantage computation a push runs for a table's groups in its own transaction
        (pushed_advantages.py), or None where the worker computes them; the server sets it
        (advantages/start.py), so the storage engine itself imports no estimator."""
        return self.pushing.in_push

    @in_push.setter
    def in_push(self, compute: Callable[[TableConfig], Compute | None] | None) -> None:
        self.pushing.in_push = compute

    @property
    def on_stored(self) -> Callable[[TableConfig], None] | None:
        """Told of each push that stored experiences (or pieces of rollouts) once it is durable,
        with its table's settings; the server sets it (advantages/start.py: the first push that
        needs advantages computed loads torch), and a push that stores nothing is not told of."""
        return self.pushing.on_stored

    @on_stored.setter
    def on_stored(self, hear: Callable[[TableConfig], None] | None) -> None:
        self.pushing.on_stored = hear

    # ---- admission -----------------------------------------------------------------------

    def admit(
        self,
        table: str,
        count: int,
        *,
        wait: float = 0.0,
        grant_seconds: float = 300.0,
        holder: str = "",
        stop: Callable[[], bool] | None = None,
        grant_id: str = "",
    ) -> admission.RolloutGrant:
        """How many of `count` rollouts may start now (admission.py), under a grant that
        expires after grant_seconds unless finished (by `holder` alone: the caller's token
        fingerprint with tokens on); waits up to `wait` for room, or until `stop()` says the call
        ended (none granted then: a rollout worker gone takes no room that comes back).
        `grant_id`: the client's name for the grant (admission.grant: made again, the same one)."""
        deadline = time.monotonic() + wait
        while True:
            generation = self.environment.generation
            granted = self._in_table(table, lambda tt: admission.grant(tt, count, grant_seconds, holder, grant_id))
            if granted.count or time.monotonic() >= deadline or (stop is not None and stop()):
                return granted
            self.environment.wait_for_change(generation, deadline, poll=stop is not None)
            if stop is not None and stop():  # ended as it waited: the commit that woke it made room for others
                return granted

    def finish_grant(self, table: str, grant_id: str, accepted: int | None = None, holder: str = "") -> int:
        """End a grant: `accepted` rollouts stay counted (None: all); returns those given back.
        Forbidden when another token than `holder`'s took it."""
        table_id, _ = self.catalog.lookup(table)

        def op(tt: TableState) -> int:
            record = admission.read_grant(tt.txn, self.db, grant_id)
            if record is None or record["t"] != table_id:
                ended = self.ended_grants.get(grant_id)
                return admission.finished_again(ended, grant_id, table, table_id, accepted, holder)
            owner = record.get("o", "")
            admission.check_owner(owner, grant_id, holder)
            returned = admission.finish(tt, grant_id, record, accepted)
            self.ended_grants.add(grant_id, admission.EndedGrant(False, table_id, owner, accepted, returned))
            return returned

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

    # ---- admin (reads of named experiences and keyed values: reading.py) ----------------

    def quarantine(self, table: str, uids: Sequence[str]) -> int:
        """Quarantine those of uids whose stored payload is damaged, and drop those held in pieces
        one of whose pieces is, each checked again in the writer's transaction (quarantine.py,
        partial_holds.drop_damaged); returns how many were."""

        def op(tt: TableState) -> int:
            count = quarantine_found(tt, uids) + partial_holds.drop_damaged(tt, uids)
            if count:
                tt.save()
            return count

        return self._in_table(table, op)

    def _quarantine_found(self, table: str, uids: list[str]) -> int:
        """`quarantine`, for the scrub: a table dropped meanwhile has nothing to quarantine."""
        try:
            return self.quarantine(table, uids)
        except NotFound:
            return 0

    scrub_status = Forwarded("scrub", Scrub.status)

    def delete(self, table: str, uids: Sequence[str] = (), group_ids: Sequence[str] = ()) -> int:
        """Remove experiences (and their records, so they may be pushed again), at most
        MAX_NAMES_PER_CALL uids and as many group ids a call."""
        check_names(uids, "uids", "Delete", MAX_NAMES_PER_CALL)
        check_names(group_ids, "group_ids", "Delete", MAX_NAMES_PER_CALL)

        def op(tt: TableState) -> int:
            count = retire.delete(tt, uids, group_ids)
            tt.save()
            return count

        return self._in_table(table, op)

    def retire(self, table: str, group_ids: Sequence[str], owner: str = "") -> int:
        """Consume groups a trainer trained by their ids, as an ack would (rules/trained.py),
        at most MAX_NAMES_PER_CALL a call; returns the groups retired."""
        check_names(group_ids, "group_ids", "Retire", MAX_NAMES_PER_CALL)

        def op(tt: TableState) -> int:
            count = retire_trained(tt, group_ids, owner)
            tt.save()
            return count

        return self._in_table(table, op)

    def fail_runs(self, table: str, uids: Sequence[str], reasons: Sequence[str], holder: str = "") -> FailResult:
        """Record runs their workers report failed; groups whose runs are all known complete
        short or are dropped (groups.fail_runs), at most MAX_NAMES_PER_CALL a call. `holder` is who
        reports (as a push's)."""
        check_names(uids, "uids", "FailRuns", MAX_NAMES_PER_CALL)
        if len(reasons) not in (0, len(uids)):
            raise InvalidRequest(f"{len(uids)} uids for {len(reasons)} reasons: one reason a uid, or none")
        failures = list(zip(uids, reasons or [""] * len(uids), strict=True))

        def op(tt: TableState) -> FailResult:
            return groups.fail_runs(tt, failures, holder)

        return self._in_table(table, op)

    def seal(self, table: str, group_id: str, holder: str = "") -> int:
        """Complete a pending group now; returns its size. `holder` is who seals (as a push's: only
        a prompt's claimant completes its group)."""

        def op(tt: TableState) -> int:
            return groups.seal(tt, group_id, holder)

        return self._in_table(table, op)

    def counters(self, table: str) -> Counters:
        """The table's stored counters alone: what `stats` reports of them, without what it reads
        beside them (the oldest live experience's age, the bytes staged, the batch stage's counts
        since the start)."""
        with self.environment.read() as txn:
            return read_counters(txn, self.db, layout.table_prefix(self.catalog.lookup(table)[0]))

    def stats(self, table: str) -> dict[str, Any]:
        """The table's counters by name (counters.Counters), with the oldest live experience's age."""
        table_id = self.catalog.lookup(table)[0]
        prefix = layout.table_prefix(table_id)
        with self.environment.read() as txn:
            counters = read_counters(txn, self.db, prefix)
            oldest = reading.oldest_age(txn, self.db, prefix, self.clock())
        batch = self.sampling.counted(table_id)
        if batch is not None:  # the batch stage's clip, counted in memory since the server started
            counters.advantages_seen += batch.advantages_seen
            counters.advantages_clipped += batch.advantages_clipped
        staged = self.pushing.staged.staged_bytes(table_id)
        return counters.to_dict() | {"oldest_age_seconds": oldest, "staged_bytes": staged}

    storage_info = Forwarded("environment", Environment.storage_info)
    index_builds = Forwarded("builds", IndexBuilds.status)

    def verify(self, table: str) -> list[str]:
        """Check every index and counter of a table against its items; [] when consistent."""
        table_id, config = self.catalog.lookup(table)
        with self.environment.read() as txn:
            return verify(self.catalog.state(txn, table_id, config))

    # ---- upkeep ------------------------------------------------------------------------

    def tick(self) -> dict[str, int]:
        """Requeue expired leases, release or drop timed-out incomplete groups, evict stale
        ready groups, forget old tombstones; each lease and each table isolated from the
        others (upkeep.py). Free the reader slots of processes that ended holding one."""
        now = self.clock()
        if cleared := self.environment.clear_stale_readers():
            log.warning("freed %d reader slot(s) of processes that ended while reading (a backup cut short)", cleared)

        def end_lease(txn: lmdb.Transaction[bytes], lease_id: str) -> int:
            return self.sampling.leases.end(txn, lease_id, requeue=True, expired=True)

        try:
            done = self.environment.submit(lambda txn: self.upkeep.run(txn, now, end_lease))
        except BaseException:
            self.upkeep.settled(committed=False)
            raise
        self.upkeep.settled(committed=True)
        for building in self.upkeep.take_builds():  # an index a table's upkeep needs: used once built
            self.builds.want(building)
        return done

    def upkeep_by_table(self) -> dict[str, dict[str, int]]:
        """What the last `tick` did, by table, then by what (leases_expired, requeued,
        rollouts_returned, groups_timed_out, groups_stale_evicted; a count of 0 left out): the
        log names the tables, as an operator asks which trainer's leases expired."""
        return self.upkeep.by_table

    # ---- advantages ------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Counts committed batches of requests; wait_for_change() waits for the next."""
        return self.environment.generation

    def wait_for_change(self, generation: int, timeout: float) -> bool:
        return self.environment.wait_for_change(generation, time.monotonic() + timeout)

    wake = Forwarded("environment.writer", Writer.wake)

    compute_backlog = Forwarded("computing", Computing.compute_backlog)
    finish_compute = Forwarded("computing", Computing.finish_compute)
