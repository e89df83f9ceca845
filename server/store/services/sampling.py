"""The sampling service of a Store: sample, ack, nack and renew, taking whole groups in the
writer's transaction, with the rate limit's waits, a stream's confirmations (`confirm`, in
the commit of the next take: a held batch consumed, its lease's clock started, or its replay
counted) and the end of leases (consumed, requeued, expired, or held by a stopped server).
The batch stage's clip counts of each table's samples are kept here, in memory (they go
with the batches' replies, not through the writer).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import lmdb

from ..core.ordering.ready import IndexBuilding
from ..core.table_state.state import TableState
from ..disk.environment import Environment
from ..disk.kinds import Sampled
from ..disk.stored_advantages import FinishBatch, StageCounts
from ..rules import staleness
from ..schema.errors import NotFound, SampleLimited, clip
from ..schema.sample_spec import TakeSpec
from ..schema.table_config import TableConfig
from ..tables.catalog import TableCatalog
from ..tables.leases import TableLeases
from ..tables.taking import could_fill, take, warm
from .index_builds import IndexBuilds

T = TypeVar("T")


@dataclass(frozen=True)
class _Refused:
    """A request refused inside a transaction that still commits (see Sampling._isolated)."""

    error: Exception


class Sampling:
    """Sampling and leases over a data directory's environment and table catalog; `finish` is
    the batch stage the server gave the store, bound to each batch taken (Sampled.stage)."""

    def __init__(
        self,
        environment: Environment,
        catalog: TableCatalog,
        rng: random.Random,
        finish: FinishBatch | None,
        builds: IndexBuilds,
        requeued: Callable[[int], None],
    ) -> None:
        self.environment, self.catalog, self.rng, self.finish, self.builds = environment, catalog, rng, finish, builds
        self.db = environment.db
        # a lease's life (tables/leases.py): this service asks it each step; `requeued`: upkeep.mark
        self.leases = TableLeases(catalog, requeued)
        self._batch_counts: dict[int, StageCounts] = {}  # by table id: the batch stage's clip counts

    def stage_counts(self, table_id: int) -> StageCounts:
        """Where the batch stage of the table's samples counts what its clip did."""
        return self._batch_counts.setdefault(table_id, StageCounts())

    def counted(self, table_id: int) -> StageCounts | None:
        """What the batch stage of the table's samples counted since the server started."""
        return self._batch_counts.get(table_id)

    def sample(
        self,
        spec: TakeSpec,
        *,
        timeout: float | None = None,
        hold: bool = False,
        owner: str = "",
        stop: Callable[[], bool] | None = None,
        confirm: str | Sequence[str] = "",
        table_id: int | None = None,
        delivered: Callable[[], None] | None = None,
    ) -> Sampled | None:
        """Select whole ready groups; None if not enough arrived within the wait.

        `timeout` bounds the wait (default: the spec's wait_seconds). With `hold` (a
        Sample stream's take), the batch is held under a lease without expiry, whatever
        its delivery, until the caller confirms its client has it (`confirm`) or gives it
        back (`nack`, as if never taken); holds left by a stopped server return to the
        buffer at the next start (`release_holds`). `owner` binds a lease to whoever took
        it. `stop` is polled while waiting (a cancelled RPC ends the wait early, with
        None). `confirm` names held leases (one or several) of this table and owner whose
        batches the client has, delivered first as the spec asks (TableLeases.confirm), in the same
        commit as the first attempt: one durable write for all, kept even if the attempt
        fails; if one cannot be delivered, none is and nothing is taken. A request in an order
        whose index the table is still building in the background (index_builds.py) waits for
        the build within the same deadline, then is tried again; past it, IndexNotReady (a rows
        table's build at the first request that reads its index is waited for whatever the deadline).
        `table_id`: the table a stream's batches came from (Sampled.table_id); NotFound once the
        table of the name is another, made again after a drop, which a stream never goes on to.
        `delivered` is called once the confirmations are committed, before the take's own refusal
        (the rate limit at its deadline) is raised: the caller must not confirm them again.
        """
        start = time.monotonic()
        deadline = start + (spec.wait_seconds if timeout is None else timeout)
        held = False  # whether the rate limit held this request
        confirms = tuple(lease for lease in ((confirm,) if isinstance(confirm, str) else confirm) if lease)
        while True:
            generation = self.environment.generation
            final = time.monotonic() >= deadline
            blocked = time.monotonic() - start if held else 0.0
            found, config = self.catalog.lookup(spec.table)  # at each attempt: it may have been dropped
            if table_id is not None and found != table_id:
                raise NotFound(
                    f"table '{clip(spec.table)}' was dropped since this stream's first batch; the table made again "
                    "under its name is another: open a stream on it"
                )

            def attempt(
                txn: lmdb.Transaction[bytes],
                f: bool = final,
                b: float = blocked,
                a: tuple[str, ...] = confirms,
                i: int = found,
                c: TableConfig = config,
            ) -> Sampled | SampleLimited | _Refused | None:
                def take_in(t: lmdb.Transaction[bytes]) -> Sampled | SampleLimited | None:
                    return self._take(t, self.catalog.state(t, i, c), spec, f, b, hold, owner)

                if not a:
                    return take_in(txn)
                for lease_id in a:
                    self.leases.confirm(txn, lease_id, spec, owner, self.rng)
                return self._isolated(txn, take_in)

            try:
                result = self.environment.submit(attempt)
            except IndexBuilding as building:  # nothing was kept: asked again once it is built
                if not self.builds.wait(building, deadline, stop):
                    return None
                continue
            if confirms and delivered is not None:  # committed, whatever the take's answer raises below
                delivered()
            confirms = ()
            if isinstance(result, _Refused) and isinstance(result.error, IndexBuilding):
                if not self.builds.wait(result.error, deadline, stop):  # the confirmations were kept
                    return None
                continue
            if isinstance(result, _Refused):
                raise result.error
            if isinstance(result, SampleLimited):
                if final:
                    raise result
                held = True
            elif result is not None or final:
                if result is not None:
                    result.table_id = found
                return result
            if stop is not None and stop():
                return None
            self.environment.wait_for_change(generation, deadline, poll=True)

    def _isolated(self, txn: lmdb.Transaction[bytes], fn: Callable[[lmdb.Transaction[bytes]], T]) -> T | _Refused:
        """`fn` in a transaction nested in txn: a refusal undoes only its own changes and is
        returned, so that the rest of txn still commits. A full map or an LMDB error fails
        the whole transaction, as anywhere else."""
        child = self.environment.env.begin(write=True, parent=txn)
        try:
            result = fn(child)
        except lmdb.Error:
            child.abort()
            raise
        except Exception as exc:
            child.abort()
            return _Refused(exc)
        child.commit()
        return result

    def _take(
        self,
        txn: lmdb.Transaction[bytes],
        tt: TableState,
        spec: TakeSpec,
        final: bool,
        blocked: float,
        hold: bool,
        owner: str,
    ) -> Sampled | SampleLimited | None:
        """One attempt. A request whose trainer version would move the table's (and evict
        what falls stale) takes in a nested transaction, kept only when a batch is taken:
        the version is stored with a batch, and a waiting request changes nothing; while the
        table holds too little ready data for any batch, it does not even try."""
        partial = spec.allow_partial and final
        warm(tt)  # replayed groups whose cooldown ended: takeable in this attempt

        def attempt(t: TableState) -> Sampled | SampleLimited | None:
            batch = take(
                t, spec, partial, self.rng, hold=hold, snapshot=self.environment.snapshot,
                finish=self.finish, counts=self.stage_counts(tt.table_id),
            )  # fmt: skip
            if isinstance(batch, Sampled) and batch.lease_id:
                self.leases.grant(t.txn, batch, t.table_id, hold=hold, owner=owner)
            return batch

        moves = staleness.next_version(tt, spec.trainer_version) is not None
        if not moves:
            result = attempt(tt)
        elif not could_fill(tt, spec, partial):
            result = None  # waiting for data: nothing is stored, nothing evicted
        else:
            child = self.environment.env.begin(write=True, parent=txn)
            try:
                result = attempt(self.catalog.state(child, tt.table_id, tt.config, tt.now))
            except BaseException:
                child.abort()
                raise
            if isinstance(result, Sampled):
                child.commit()
            else:
                child.abort()
        if blocked and (isinstance(result, Sampled) or final):
            tt = self.catalog.state(txn, tt.table_id, tt.config, tt.now)
            tt.counters.sample_blocked_seconds += blocked
            tt.save()
        return result

    def ack(self, lease_id: str, table: str | None = None, owner: str = "") -> int:
        """Consume the groups of a lease; returns the experiences acknowledged (again, for an ack
        made again after its reply was lost: TableLeases.end). With a table (a caller's request),
        the lease must be of that table and that owner."""
        return self.environment.submit(
            lambda txn: self.leases.end(txn, lease_id, requeue=False, table=table, owner=owner, said="acked")
        )

    def nack(self, lease_id: str, table: str | None = None, owner: str = "") -> int:
        """Return the groups of a lease to the buffer; returns the experiences requeued."""
        return self.environment.submit(
            lambda txn: self.leases.end(txn, lease_id, requeue=True, table=table, owner=owner, said="nacked")
        )

    def give_back(self, lease_id: str, table: str, owner: str = "") -> int:
        """A stream's held batch that its client did not confirm goes back to the buffer,
        uncounted as sampled (TableLeases.end); returns the experiences requeued."""
        return self.environment.submit(
            lambda txn: self.leases.end(txn, lease_id, requeue=True, unsent=True, table=table, owner=owner)
        )

    def fail_stage(self, lease_id: str, table: str, failed: dict[str, str], owner: str = "") -> int:
        """A stream's held batch whose batch stage raised goes back, the groups of `failed` (group ->
        why) failed (TableLeases.fail_stage); returns the experiences failed."""
        return self.environment.submit(
            lambda txn: self.leases.fail_stage(txn, lease_id, failed, table=table, owner=owner)
        )

    def confirm(self, lease_id: str, spec: TakeSpec, owner: str = "") -> int:
        """A stream's held batch that its client has (TableLeases.confirm); returns its experiences."""
        return self.environment.submit(lambda txn: self.leases.confirm(txn, lease_id, spec, owner, self.rng))

    def renew(self, lease_id: str, seconds: float, table: str, owner: str = "") -> tuple[float, int]:
        """The lease now ends `seconds` from now (a held one's clock starts); returns when it
        ends and the experiences it holds."""
        return self.environment.submit(lambda txn: self.leases.renew(txn, lease_id, seconds, table, owner))

    def release_holds(self) -> int:
        """Return every batch held for a stream of an earlier run of the server; the
        streams that held them are gone. Returns the experiences requeued."""
        return self.environment.submit(self.leases.release_holds)
