"""ExpbufStalenessManager: AReaL's StalenessManager whose staleness bound is kept by an expbuf table.

AReaL's manager counts accepted and running rollouts in the rollout process, so a restarted
process starts from zero and bursts past its bound (AReaL#1388). Here the table counts them:
each rollout AReaL starts holds a grant of one from `admit`, finished as accepted or rejected
(`finish_grant`), so the table's `submitted` is AReaL's accepted + running, durable on the
server; the bound's version is the table's trainer version, which `set_version` sets. The
capacity is AReaL's formula over those counts, min the process's own concurrency limit:

    min(max_concurrent_rollouts - running, (max_staleness + version + 1) * batch_size - submitted)

The table's `max_staleness` and `batch_size` must equal AReaL's `max_head_offpolicyness` and
`consumer_batch_size`. Several rollout processes may share one table: the bound is then the
table's, over all of them. One grant is taken ahead, when capacity is asked for, so the rollout
AReaL submits on that answer has its room already.

A server that restarts is waited for, for the client's timeout, as Trinity-RFT's reader waits:
each call is made again while it is unavailable (an admit under the grant's name, so that made
again it takes no second grant), where an UnavailableError would end AReaL's rollout thread.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque

from areal.infra.staleness_manager import StalenessManager

from ..client import BufferClient, BufferError, Grant, TableStats
from ..kit.retry import retried
from ..kit.tables import close_made, connect, table_info
from ..rpc.calls.admission_calls import new_grant_id

log = logging.getLogger(__name__)


class Produced:
    """The groups a produce-only ExpbufWorkflow pushed, by table, not yet heard of as rejected:
    such a workflow returns None once its group is in the table (its process trains on nothing),
    which AReaL's executor counts as a rejected rollout, so the manager of that process finishes
    the rollout's grant as accepted, not rejected: its room gave back, the table's bound counted
    none of the groups produced, and production ran unbounded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, table: str) -> None:
        with self._lock:
            self._counts[table] += 1

    def take(self, table: str) -> bool:
        """Whether a rollout AReaL rejects was one produced into `table` (then counted off)."""
        with self._lock:
            if self._counts[table] <= 0:
                return False
            self._counts[table] -= 1
            return True


PRODUCED = Produced()


class ExpbufStalenessManager(StalenessManager):
    """A drop-in for AReaL's StalenessManager (WorkflowExecutor(..., staleness_manager=...)).

    `grant_seconds` must exceed the longest rollout: a grant not finished by then (a crashed
    process) gives its room back. `admit_wait` is how long a submitted rollout waits for room
    when another process took the room it was counted on."""

    def __init__(
        self,
        client: BufferClient | str,
        table: str,
        *,
        max_concurrent_rollouts: int,
        consumer_batch_size: int,
        max_staleness: int,
        token: str | None = None,
        grant_seconds: float = 3600.0,
        admit_wait: float = 30.0,
    ) -> None:
        super().__init__(self, max_concurrent_rollouts, consumer_batch_size, max_staleness)
        self.client = connect(client, token)
        self._given = client
        self.table = table
        self.grant_seconds = grant_seconds
        self.admit_wait = admit_wait
        config = table_info(self.client, table)
        if config.max_staleness != max_staleness or config.batch_size != consumer_batch_size:
            raise ValueError(
                f"expbuf table '{table}' has max_staleness {config.max_staleness} and batch_size "
                f"{config.batch_size}; AReaL's max_head_offpolicyness is {max_staleness} and "
                f"consumer_batch_size {consumer_batch_size}: set the table's to them"
            )
        self._spare: Grant | None = None
        self._running: deque[Grant | None] = deque()

    def _room(self) -> int:
        """The table's room under the bound, counting the grant held ahead as room of ours."""
        stats = self._stats()
        version = max(0, stats.trainer_version)
        spare = 1 if self._spare is not None else 0
        return (self.max_staleness + version + 1) * max(1, self.consumer_batch_size) - stats.submitted + spare

    def get_capacity(self) -> int:
        with self.lock:
            concurrency = max(1, self.max_concurrent_rollouts) - self.rollout_stat.running
            room = self._room()
            if room > 0 and concurrency > 0 and self._spare is None:
                grant = self._admit()
                if grant.count:
                    self._spare = grant
                else:  # another process took the room meanwhile
                    room = self._room()
            return min(concurrency, room)

    def get_version(self) -> int:
        """The table's trainer version, which the bound counts from (-1 before any was set)."""
        return self._stats().trainer_version

    def set_version(self, version: int) -> None:
        """Tell the table the trainer's version: room for one more batch per version."""
        retried(lambda: self.client.set_trainer_version(version, self.table), self.client.timeout)

    def _stats(self) -> TableStats:
        return retried(lambda: self.client.stats(self.table), self.client.timeout)[self.table]

    def _admit(self, wait: float = 0.0) -> Grant:
        """A grant of one rollout, made again under its name while the server is unavailable."""
        name, seconds = new_grant_id(), self.grant_seconds
        return retried(
            lambda: self.client.admit(self.table, 1, wait=wait, grant_seconds=seconds, grant_id=name),
            self.client.timeout,
        )

    def on_version_recovered(self, version: int) -> None:
        """Nothing to adjust where the table's counters came through the restart with the server. A
        checkpoint recovered from further back than the bound is said, with the way out: the table's
        trainer version only moves forward, so its pushes are dropped as stale, and the trainer
        waits, until it passes the version the table holds (a reset takes the admin scope)."""
        held = self.get_version()
        if version < held - self.max_staleness:
            log.warning(
                "expbuf table '%s' is at trainer version %d and AReaL recovered version %d: its pushes are dropped "
                "as stale until the trainer passes %d; reset the table's version with `expbuf table "
                "reset-offpolicy %s --version %d` (admin scope)",
                self.table, held, version, held - self.max_staleness, self.table, version,
            )  # fmt: skip

    def on_rollout_submitted(self) -> None:
        with self.lock:
            grant, self._spare = self._spare, None
            if grant is None:
                grant = self._admit(self.admit_wait)
            if not grant.count:
                log.warning("expbuf table '%s' had no room for a rollout AReaL started; it runs uncounted", self.table)
            self._running.append(grant if grant.count else None)
            self.rollout_stat.enqueued -= 1
            self.rollout_stat.running += 1

    def _finish(self, accepted: int) -> None:
        """The oldest running rollout's grant finished, made again while the server is unavailable;
        where that still fails the grant stays running (the error is raised), not forgotten with
        its room held until it expires."""
        grant = self._running.popleft() if self._running else None
        if grant is None:
            return
        try:  # a finish made again after its reply was lost answers as the first (the server remembers it)
            retried(lambda: self.client.finish_grant(grant, accepted=accepted), self.client.timeout)
        except BufferError as exc:
            if exc.code.name != "NOT_FOUND":
                self._running.appendleft(grant)
                raise
            log.warning("expbuf grant of table '%s' not finished (%s); raise grant_seconds", self.table, exc)

    def on_rollout_accepted(self) -> None:
        with self.lock:
            self._finish(1)
            self.rollout_stat.running -= 1
            self.rollout_stat.accepted += 1

    def on_rollout_rejected(self) -> None:
        with self.lock:
            self._finish(1 if PRODUCED.take(self.table) else 0)  # a produce-only group is in the table
            self.rollout_stat.running -= 1
            self.rollout_stat.rejected += 1

    def close(self) -> None:
        """Give back the grant held ahead (a process that stops for good). A client made from a
        target string is closed; one given stays open."""
        with self.lock:
            grant, self._spare = self._spare, None
            try:
                if grant is not None:
                    self.client.finish_grant(grant, accepted=0)
            finally:
                close_made(self._given, self.client)
