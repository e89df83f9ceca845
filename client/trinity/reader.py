"""Trinity-RFT's BufferReader over an expbuf table: the trainer's sample strategy reads batches of
whole groups through ExpbufReader, each leased until the next read, and reaches the end of data once
the table's writers are done. Trinity's interface is asyncio; the blocking client runs in a worker
thread, so either works from whichever event loop Trinity calls it on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import weakref
from collections import Counter
from typing import Any

import grpc
from trinity.buffer.buffer_reader import BufferReader
from trinity.common.config import StorageConfig
from trinity.common.experience import Experience

from expbuf.client.client import Batch, BufferError
from expbuf.client.kit.batches import take_one
from expbuf.client.kit.lease_keeper import RENEWALS_PER_LEASE, LeaseKeeper
from expbuf.client.kit.location import connect, parse
from expbuf.client.trxp.codec.gc_pause import collector_paused

from . import settings

log = logging.getLogger("expbuf.client.trinity.buffer")  # the name users' logging configs know (buffer.py)

# How long one wait for a batch lasts before the reader checks whether the table's writers are done.
POLL_SECONDS = 1.0


def _count_uses(experiences: list[Experience], times_sampled: list[int]) -> None:
    """Trinity's priority queue counts each read in `use_count`: the deliveries of each
    experience, this one included (one more than written, from a server that does not say)."""
    for i, exp in enumerate(experiences):
        uses = times_sampled[i] if len(times_sampled) == len(experiences) else int(exp.info.get("use_count", 0)) + 1
        exp.info["use_count"] = uses


class _Handoff:
    """A read's batches between its worker thread and its caller. A caller cancelled first
    (the trainer gave up on the read) stops the read, and what it took goes back instead of
    being renewed, unread, as long as the reader lives."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.batches: list[Batch] | None = None


class ExpbufReader(BufferReader):
    """Reads batches of whole groups, never more than `batch_size` experiences, and ends at end of data.

    With the default delivery (`lease`) a batch is acknowledged only once the trainer asks
    for the next one, i.e. after the training step that used it; if the trainer dies first,
    the lease expires and the batch goes back to the buffer. The lease is short and renewed
    while the reader lives (leases.py), so a step may take any time and a dead trainer's batch
    returns within one lease. `state_dict()` holds the open leases: a trainer restarted from a
    checkpoint acknowledges them on its first read, since that batch is in the checkpoint.
    """

    def __init__(self, config: StorageConfig) -> None:
        self.location = parse(config.path)
        settings.refuse_taskset(config)
        settings.refuse_dataset(self.location, config.name)
        self._replay = settings.priority_replay(config)
        reuse = self._replay is not None and self._replay.reuse
        if self._replay is not None:
            if (
                self.location.order != "fifo"
                or self.location.delivery == "replay"
                or (reuse and self.location.delivery != "lease")
            ):
                raise ValueError(
                    "experience buffer replay_buffer reads in the table's priority order, replaying with "
                    "reuse_cooldown_time and once each without: leave the path's order and delivery options out"
                )
            delivery = "replay" if reuse else self.location.delivery
            self.location = dataclasses.replace(self.location, order="priority", delivery=delivery)
        self.batch_size = config.batch_size
        self.timeout = config.max_read_timeout
        self._client = connect(self.location)
        table = settings.table_settings(self._client, self.location)
        self._group = settings.fixed_group_size(table)
        self._capacity = table.capacity_experiences if table else 0
        if self.batch_size:
            settings.check_batch_size(self.batch_size, self._group, self._capacity, self.location.table)
        if self.location.delivery == "replay" and not self._group:
            what = "replay_buffer reuse_cooldown_time" if reuse else "path option delivery=replay"
            raise ValueError(
                f"expbuf {what}: table '{self.location.table}' has groups of varying size "
                "(group_size 0), which a replayed batch cannot be fitted to; use a table with a fixed group_size"
            )
        if reuse and self._replay is not None:
            settings.check_reuse(self._replay, table)
        self._leases: list[str] = []
        self._restored: set[str] = set()  # the leases a loaded checkpoint named
        renewals = self._client.clone(timeout=self.location.lease_seconds / RENEWALS_PER_LEASE)
        self._keeper = LeaseKeeper(self._client, self.location.table, self.location.lease_seconds, renewals=renewals)
        weakref.finalize(self, self._keeper.close)  # a reader dropped unclosed renews nothing more
        self._sees_writers = True  # False once the token proved unable to ask (no push scope)
        self._experiences_read = 0
        self._batches_read = 0

    async def read(self, batch_size: int | None = None, **kwargs: Any) -> list[Experience]:
        """The next batch: whole groups, at most `batch_size` experiences, with advantages.

        Exactly `batch_size` when the table's groups have a fixed size (which the reader checked
        divides it), waited for while a writer is open; fewer only once the writers are done.
        With groups of varying size (group_size 0) as many whole groups as fit.
        `min_model_version` (Trinity's staleness-control sample strategy) keeps only groups
        whose every experience is at least that fresh. `model_version`, the policy version the
        trainer holds (the `expbuf` sample strategy gives it), is the table's trainer version.
        When the table's last writer has closed and no batch is left, StopAsyncIteration, as
        with Trinity's queue; no batch within `max_read_timeout` is a TimeoutError.
        """
        unknown = set(kwargs) - {"min_model_version", "model_version"}
        if unknown:
            raise TypeError(f"ExpbufReader.read() got unexpected argument(s): {', '.join(sorted(unknown))}")
        if self._client.closed:  # not gRPC's bare ValueError of a closed channel
            raise RuntimeError(
                f"the expbuf reader of table '{self.location.table}' was closed (close()): make a new one"
            )
        size = self.batch_size if batch_size is None else batch_size
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"batch_size must be a positive number of experiences, got {size!r}")
        settings.check_batch_size(size, self._group, self._capacity, self.location.table)
        min_version = kwargs.get("min_model_version")
        min_version = int(min_version) if min_version is not None and min_version > 0 else None
        version = kwargs.get("model_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"model_version must be a non-negative integer, got {str(version)[:40]!r}")
        handoff = _Handoff()
        try:
            batches = await asyncio.to_thread(self._read, size, min_version, version, handoff)
        except asyncio.CancelledError:
            with handoff.lock:
                handoff.cancelled = True
                left = handoff.batches or []
            if left:
                threading.Thread(target=self._give_back, args=(left,), daemon=True).start()
            raise
        if batches is None:
            raise StopAsyncIteration(f"expbuf table '{self.location.table}': its writers are done and it is empty")
        experiences = []
        for batch in batches:
            with collector_paused():  # Trinity's decode makes and drops objects as expbuf's does
                read = Experience.deserialize_many(batch.payload)
            if self._replay is not None:
                _count_uses(read, batch.times_sampled)
            experiences += read
        self._leases = [batch.lease_id for batch in batches if batch.lease_id]
        self._batches_read += 1
        self._experiences_read += len(experiences)
        return experiences

    def _read(self, size: int, min_version: int | None, version: int | None, handoff: _Handoff) -> list[Batch] | None:
        """Whole groups up to `size` experiences, handed off; None at the end of data or when
        the caller was cancelled. What a read took and does not hand off goes back."""
        self._acknowledge()
        taken: list[Batch] = []
        try:
            self._gather(size, min_version, version, handoff, taken)
        except BaseException:
            self._give_back(taken)
            raise
        with handoff.lock:
            if not handoff.cancelled:
                handoff.batches = taken
                return taken or None
        self._give_back(taken)
        return None

    def _gather(
        self, size: int, min_version: int | None, version: int | None, handoff: _Handoff, taken: list[Batch]
    ) -> None:
        """Take whole groups up to `size` experiences into `taken`, which holds them if this raises.

        Groups of varying size are taken a few at a time: first one, then as many as the
        groups seen so far suggest fit in what is left. A take that does not fit goes back
        whole; after that, one group at a time until the next one does not fit.
        """
        reuse = self.location.delivery == "replay" and self._replay is not None
        done = reuse and self._writers_done()  # reuse never runs dry: ask before taking
        delivery = self._delivery(done)
        deadline = time.monotonic() + self.timeout
        total, single = 0, False
        while total < size and not handoff.cancelled:
            wait = 0.0 if done else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            groups = size // self._group if self._group else 1
            if taken and not single and not self._group:
                seen = sum(len(b.groups) for b in taken)
                groups = max(1, (size - total) * seen // total)
            # A fixed-size read waits for all its groups (a partial take would return what is there
            # after one poll); it takes fewer only at the end of data. Varying sizes take what fits.
            partial = done or (groups > 1 and not self._group)
            batch = self._take(delivery, groups, wait, partial, min_version, version, deadline)
            if batch is None:
                if done or self._full(taken):
                    break
                done = self._writers_done()
                delivery = self._delivery(done)
                if not done and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"expbuf table '{self.location.table}': no {size} experiences of whole groups "
                        f"within {self.timeout} s (max_read_timeout)"
                    )
                continue
            if total + len(batch.uids) > size:  # groups of varying size: this take does not fit
                self._give_back([batch])
                if len(batch.groups) > 1:
                    single = True
                    continue
                if not taken:
                    raise ValueError(
                        f"expbuf table '{self.location.table}': group {batch.groups[0]} has {len(batch.uids)} "
                        f"experiences, more than batch_size {size}; raise buffer.train_batch_size"
                    )
                break
            taken.append(batch)
            total += len(batch.uids)
            if self._group:
                break
        if taken and delivery == "consume" and not self._group and not handoff.cancelled:
            for i, batch in enumerate(taken):  # taken under a lease, to give back a group that does not fit
                self._keeper.ack(batch.lease_id)
                taken[i] = dataclasses.replace(batch, lease_id="")

    def _full(self, taken: list[Batch]) -> bool:
        """Whether groups of varying size that a read holds leave no room in a table of bounded
        capacity for another group as small as the smallest of them: none can be pushed until the
        read ends (block) or evicts them (it never evicts a held group), so the read returns what it
        holds, as one whose next group does not fit does, where it waited for its timeout, gave them
        back and took them again, the explorer blocked all the while."""
        if not taken or self._group or not self._capacity:
            return False
        table = self.location.table
        stats = self._client.stats(table)[table]
        held = stats.pending + stats.computing + stats.ready + stats.leased
        smallest = min(count for batch in taken for count in Counter(batch.group_ids).values())
        return held + smallest > self._capacity

    def _delivery(self, done: bool) -> str:
        """How to take: as the path says, but once the writers are done Trinity's priority queue
        puts nothing back and ends when empty, so reuse consumes what is ready, each read once more."""
        if done and self.location.delivery == "replay" and self._replay is not None:
            return "consume"
        return self.location.delivery

    def _take(
        self,
        delivery: str,
        groups: int,
        wait: float,
        partial: bool,
        min_version: int | None,
        version: int | None,
        deadline: float,
    ) -> Batch | None:
        """One batch of `groups` whole groups (fewer with `partial`), or None if none came in `wait` s.
        A server that cannot be reached is tried again for the client's timeout, and no longer than
        the read's `deadline` (max_read_timeout): a reader that cannot reach it ends by its timeout."""
        if delivery == "consume" and not self._group:
            delivery = "lease"
        try:  # None: a partial request ends its stream empty when nothing is left
            batch = take_one(
                self._client,
                self.location.table,
                lambda broken: self._give_back([broken]),
                num_groups=groups,
                # a server that restarts is waited for, as the writers wait for it
                retry_for=min(self._client.timeout, max(0.0, deadline - time.monotonic())),
                order=self.location.order,
                delivery=delivery,
                lease_seconds=self.location.lease_seconds,
                timeout=wait,
                min_model_version=min_version,
                allow_partial=partial,
                trainer_version=version,
            )
        except BufferError as exc:
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return None
            raise
        if batch is not None and batch.lease_id:
            self._keeper.hold(batch.lease_id, batch.lease_expires)
        return batch

    def _writers_done(self) -> bool:
        """Whether every writer of the table has closed and no group they completed is still having
        its advantages computed (the end of data: the last step's groups, computing as its writer
        closed, were left untrained where the read ended on an empty take); False where the token
        may not ask (push scope), and the reader then ends by max_read_timeout."""
        if not self._sees_writers:
            return False
        table = self.location.table
        try:
            return self._client.writers(table)[1] and not self._client.stats(table)[table].groups_computing
        except BufferError as exc:
            if exc.code != grpc.StatusCode.PERMISSION_DENIED:
                raise
            log.warning("expbuf: this token cannot see the table's writers (push scope); reads end by their timeout")
            self._sees_writers = False
            return False

    def _give_back(self, batches: list[Batch]) -> None:
        """Return leased batches now; one that cannot be (the server unreachable) is no longer
        renewed, so it returns when its lease ends."""
        for batch in batches:
            if batch.lease_id:
                self._keeper.give_back(batch.lease_id)

    def _acknowledge(self) -> None:
        """Acknowledge the batch handed out last: the training step that used it is over."""
        while self._leases:
            lease = self._leases[0]
            tried = lease in self._restored  # a checkpoint's may have been acked since
            self._keeper.ack(lease, retry_for=self._client.timeout, tried=tried)
            self._restored.discard(lease)
            self._leases.pop(0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "current_index": self._experiences_read,
            "batches_read": self._batches_read,
            "lease_ids": list(self._leases),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the counts and take over the open leases, to acknowledge them on the next read."""
        self._experiences_read = int(state_dict.get("current_index", 0))
        self._batches_read = int(state_dict.get("batches_read", 0))
        leases = state_dict.get("lease_ids", [state_dict.get("lease_id") or ""])
        self._leases = [str(lease) for lease in leases if lease]
        self._restored = set(self._leases)
        for lease in self._leases:  # kept while the restarted trainer loads its model
            self._keeper.hold(lease)

    def close(self) -> None:
        """Stop renewing the leases held (they end within one lease) and close the connection.
        Trinity's trainer never calls it: the renewals also stop when the reader is collected,
        and with its process."""
        self._keeper.close()
        self._client.close()
