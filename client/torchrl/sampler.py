"""A TorchRL sampler that draws whole groups from an expbuf table, in the server's orders.

Each `ReplayBuffer.sample()` is one batch of whole groups, leased (by default): the batch
drawn before is acknowledged first, since a trainer asks for its next batch once the step
that used the last one has returned. A trainer that dies in the middle of a step never
acknowledges that step's batch: its lease, renewed in the background while the trainer
lives, ends within `lease_seconds` of the death, and the groups are drawn again. Nothing
pushed is lost, and a batch whose step finished is not drawn again.

A draw is taken only once the server has made its lease durable: the batch's stream ends
normally after the server committed the delivery. A draw that a server's crash interrupts
is given back (once the server answers again) and drawn anew, so a batch the trainer has
can never also be sitting in the table.

`for batch in rb:` runs, in TorchRL's `ReplayBuffer.__iter__`, until the sampler's `ran_out`,
which TorchRL reads right before each sample of the loop. A loop's first batch is drawn by
`sample()` (as `rb.sample()` draws, raising DeadlineExceededError when none comes within
`timeout`: TorchRL's samplers refuse an empty storage too); once a batch was handed out,
reading `ran_out` draws the next one (acknowledging the one before: the loop came back, so
its step returned), for the `sample()` that follows to hand over, and is True when none
came within `timeout`. The loop then ends with every batch it yielded acknowledged.

A buffer that prefetches (`ReplayBuffer(prefetch=N)`) is refused by name at its first sample,
before anything is drawn. TorchRL's prefetch runs the sampler on threads of the buffer's own,
ahead of the trainer, up to N draws at once in no fixed order, and the trainer's taking a batch
out of that queue reaches neither the sampler nor the storage; so no draw can tell which batch a
finished step trained. Leased, each draw would acknowledge a batch still queued or in its step,
which a crash then loses; consumed, the batches drawn ahead leave the table untrained, lost when
the run stops or crashes; replayed, nothing is lost, but a `for` loop's end (no batch within
`timeout`) can come out of a thread's draw as DeadlineExceededError, the batches queued behind it
never handed over.

Data-parallel ranks (`ranks=R, rank=r`, one sampler in each rank's process, under
torch.distributed): each `sample()` is one training step of all the ranks. Rank 0 leases the
step's whole groups (`batch_size` experiences a rank) and hands its lease to the others over the
process group (`broadcast_object_list`); every rank then reads its own part with `get_part`, the
groups split so that the ranks' tokens are as equal as whole groups allow (`balance`, `equal` as
read_part's), and the same part again should its process come back. Rank 0 renews the lease and
acknowledges the step at the next sample, when every rank has come back for the next one; the
ranks sample in lockstep, as their training steps do.

`state_dict()` names the lease of the batch drawn last; a checkpoint taken between steps
(after the step that used it) therefore holds it, and `load_state_dict` has it acknowledged at
the next sample, so a trainer restored from that checkpoint does not train that batch again.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Unpack

import grpc
import torch
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

from expbuf.client.errors import DeadlineExceededError, UnavailableError
from expbuf.client.kit.batches import take_one
from expbuf.client.kit.lease_keeper import LeaseKeeper
from expbuf.client.kit.retry import Retry
from expbuf.client.results import Batch
from expbuf.client.rpc.sample_spec import SampleOptions, SampleSpec

from .storage import ExpbufStorage, read_state, write_state

log = logging.getLogger(__name__)
UNDER_PREFETCH = {  # what goes wrong when TorchRL's prefetch threads draw (see the module's docstring)
    "lease": "each draw would acknowledge a batch still queued or in its step, lost if the trainer then dies",
    "consume": "the batches drawn ahead would leave the table untrained, lost when the run stops or crashes",
    "replay": "a for loop could end in DeadlineExceededError raised by a prefetch thread's draw",
}


def _partial_of(drop_last: Any, allow_partial: Any) -> bool:
    """allow_partial for TorchRL's `drop_last`: its opposite, and the same as one given with it."""
    if not isinstance(drop_last, bool):
        raise ValueError(f"ExpbufSampler: drop_last is {drop_last!r}; it must be True or False")
    if allow_partial is not None and allow_partial == drop_last:
        raise ValueError(
            f"ExpbufSampler: drop_last={drop_last} and allow_partial={allow_partial} disagree: drop_last=True "
            "(no short batch) is allow_partial=False, drop_last=False is allow_partial=True; give one of them"
        )
    return not drop_last


class ExpbufSampler(Sampler):
    """Draws each batch from the table of the `ExpbufStorage` it samples.

    `rb.sample(batch_size)` asks for `batch_size` experiences filled with whole groups (a batch
    may end one group past it: a multiple of the table's group size is exactly that many
    groups). The options are `sample()`'s: order (fifo, lifo, uniform, priority or a registered
    order), delivery (lease, consume or replay), lease_seconds, timeout (how long a batch may
    wait for ready groups; then DeadlineExceededError, or the end of a `for batch in rb:` loop
    past its first batch), min_model_version, trainer_version, allow_partial. TorchRL's
    `drop_last` (SamplerWithoutReplacement's) is allow_partial turned over: True (expbuf's
    default) never hands out a short batch, so a `for` loop ends without the last incomplete one,
    which waits in the table; False hands it out, short, once `timeout` has passed.
    """

    def __init__(
        self,
        *,
        ranks: int = 1,
        rank: int = 0,
        process_group: Any = None,
        balance: str = "tokens",
        equal: bool = False,
        drop_last: bool | None = None,
        **options: Unpack[SampleOptions],
    ) -> None:
        for fixed in ("max_batches", "window"):
            if fixed in options:
                raise ValueError(f"ExpbufSampler: {fixed} is not an option (each sample() is one batch)")
        if drop_last is not None:
            options["allow_partial"] = _partial_of(drop_last, options.get("allow_partial"))
        SampleSpec("default", 1, **options)  # refuses a bad value now, naming it
        self.options: dict[str, Any] = {"delivery": "lease", **options}
        if not 0 <= rank < ranks:
            raise ValueError(f"ExpbufSampler: rank {rank} of {ranks} ranks (a rank is 0 to ranks - 1)")
        if ranks > 1 and self.options["delivery"] != "lease":
            raise ValueError(
                f"ExpbufSampler(ranks={ranks}) leases each step for its ranks to read their parts of, so "
                f"delivery={self.options['delivery']!r} is not one it takes"
            )
        self.ranks, self.rank, self.process_group = ranks, rank, process_group
        self.split: dict[str, Any] = {"balance": balance, "equal": equal}
        self._last: Batch | None = None  # the batch drawn last, not yet acknowledged
        self._trained = False  # its step returned: its ack was tried, and failed (it is made again, never given back)
        self._given_back: list[str] = []  # leases of interrupted draws, to give back once the server answers
        self._restored: str | None = None  # the lease a loaded checkpoint named, to acknowledge
        self._keeper: LeaseKeeper | None = None
        self._keeper_table = ""  # the table and target its keeper keeps leases of: "table@target"
        self._source: ExpbufStorage | None = None  # the storage sampled last
        self._batch_size = 0  # and the batch size asked for
        self._next: Batch | None = None  # drawn by a read of `ran_out`, for the next sample()
        self._handed = False  # a batch was handed out since the sampler last ran out
        self._ran_out = False
        self._lock = threading.Lock()

    @property
    def leases(self) -> bool:
        return bool(self.options["delivery"] == "lease")

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        if not isinstance(storage, ExpbufStorage):
            raise TypeError(f"ExpbufSampler draws from an ExpbufStorage, not {type(storage).__name__}")
        self._refuse_prefetch(storage)
        with self._lock:
            batch = self._next
            self._next = None
            if batch is not None and (storage is not self._source or batch_size != self._batch_size):
                self._put_back(batch)  # drawn for another storage or size than this sample asks
                batch = None
            if batch is None:
                batch = self._next_batch(storage, batch_size)
            try:
                count = storage.hold(batch)
            except Exception:
                self._put_back(batch)  # a batch that cannot be handed over goes back now
                raise
            if self.leases and batch.lease_id:  # a rank past 0 holds a part of rank 0's lease
                self._last = batch
            self._handed, self._ran_out = True, False
        # tensors only: TensorDictReplayBuffer writes the info into the batch (the uids are in it already)
        return torch.arange(count), {"times_sampled": torch.tensor(batch.times_sampled)}

    def _refuse_prefetch(self, storage: ExpbufStorage) -> None:
        """A buffer drawing ahead on threads: the trainer's take of a batch never reaches this
        sampler, so its draws cannot follow the trainer (TorchRL names the setting `_prefetch_cap`)."""
        for buffer in storage.readers():
            ahead = getattr(buffer, "_prefetch_cap", 0)
            if ahead and getattr(buffer, "_sampler", None) is self:
                delivery = self.options["delivery"]
                raise ValueError(
                    f"ExpbufSampler(delivery={delivery!r}) does not work with prefetch={ahead}: TorchRL's "
                    "prefetch draws batches on threads before the trainer asks and never says which batch a "
                    f"step took, so {UNDER_PREFETCH[delivery]}; build the buffer without prefetch"
                )

    @property
    def ran_out(self) -> bool:
        """Whether no batch came within `timeout` (see the module's docstring): read while a loop
        runs, it draws the batch the next `sample()` hands over."""
        with self._lock:
            if self._ran_out or self._next is not None or not self._handed or self._source is None:
                return self._ran_out
            try:
                self._next = self._next_batch(self._source, self._batch_size)
            except DeadlineExceededError:
                self._handed, self._ran_out = False, True
            return self._ran_out

    @ran_out.setter
    def ran_out(self, value: bool) -> None:
        """TorchRL clears it when a loop begins after one that ran out."""
        with self._lock:
            self._ran_out = value

    def _next_batch(self, storage: ExpbufStorage, batch_size: int) -> Batch:
        """The next batch (leases renewed), after acknowledging the one drawn before."""
        self._source, self._batch_size = storage, batch_size
        if self.ranks == 1:
            self._ack_last(storage)
            batch = self._draw(storage, batch_size)
        else:
            batch = self._draw_part(storage, batch_size)
        if self.leases and batch.lease_id:
            self._keeper_of(storage).hold(batch.lease_id, batch.lease_expires)
        return batch

    def _draw_part(self, storage: ExpbufStorage, batch_size: int) -> Batch:
        """This rank's part of a step rank 0 leased (see the module's docstring): a batch whose
        experiences are this rank's, under rank 0's lease on rank 0 and under none on the others."""
        import torch.distributed as dist

        shared: list[Any] = [None]
        failed: Exception | None = None
        if self.rank == 0:  # whatever fails here is told to the other ranks, which would wait for the step
            try:
                self._ack_last(storage)
                whole = self._draw(storage, batch_size * self.ranks, fields=["reward"])  # the lease, not the data
            except DeadlineExceededError as exc:
                failed, shared = exc, [("deadline", exc.details)]
            except Exception as exc:
                failed, shared = exc, [("failed", f"{type(exc).__name__}: {exc}")]
            else:
                runs = dict(zip(whole.uids, zip(whole.group_ids, whole.times_sampled, strict=True), strict=True))
                shared = [(whole.lease_id, whole.lease_expires, runs)]
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        dist.broadcast_object_list(shared, src=src, group=self.process_group)
        if failed is not None:
            raise failed
        if len(shared[0]) == 2:
            kind, why = shared[0]
            if kind == "deadline":
                raise DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, why)
            raise RuntimeError(f"expbuf table {storage.table}: rank 0 could not draw the step: {why}")
        lease_id, expires, runs = shared[0]
        got = storage.client.get_part(lease_id, self.rank, self.ranks, storage.table, **self.split)
        uids = [exp.eid.uid for exp in got]
        part = Batch(
            payload=b"",
            uids=uids,
            group_ids=[runs[uid][0] for uid in uids],
            lease_id=lease_id if self.rank == 0 else "",
            lease_expires=expires,
            partial=False,
            table=storage.table,
            times_sampled=[runs[uid][1] for uid in uids],
        )
        part.__dict__["experiences"] = list(got)  # decoded already: what storage.hold reads
        return part

    def _put_back(self, batch: Batch) -> None:
        """Give back a batch no step trained (an unleased one is gone already: nothing to do)."""
        if self._keeper is not None and batch.lease_id:
            self._keeper.give_back(batch.lease_id)

    def _keeper_of(self, storage: ExpbufStorage) -> LeaseKeeper:
        """The renewer of this sampler's leases on the storage's table (its own channel); its acks
        go over the storage's client, whichever it holds now (opened again after a close)."""
        if self._keeper is not None and self._keeper_table != f"{storage.table}@{storage.target}":
            self._keeper.close()
            self._keeper = None
        if self._keeper is not None:
            self._keeper.settle_over(storage.client)
        if self._keeper is None:
            seconds = float(self.options.get("lease_seconds", SampleSpec.lease_seconds))
            keeper = LeaseKeeper(storage.client, storage.table, seconds, renewals=storage.connect())
            self._keeper, self._keeper_table = keeper, f"{storage.table}@{storage.target}"
            weakref.finalize(self, self._keeper.close)  # a sampler dropped unclosed renews nothing more
        return self._keeper

    def _draw(self, storage: ExpbufStorage, batch_size: int, **more: Any) -> Batch:
        """One batch whose delivery the server has committed (see the module's docstring); `more`
        sample options over the sampler's."""
        retry = Retry(storage.client.timeout)  # given up once the server is unavailable that long
        while True:
            try:
                batch = take_one(
                    storage.client, storage.table, lambda broken: self._given_back.append(broken.lease_id),
                    batch_size=batch_size, **{**self.options, **more},
                )  # fmt: skip
            except UnavailableError as exc:
                pause = retry.pause()
                if pause is None:
                    raise
                log.warning("expbuf table %s: a draw was interrupted (%s); drawing again", storage.table, exc.details)
                time.sleep(pause)
                continue
            while self._given_back:  # one not found was never committed: it went back when the server started
                lease = self._given_back.pop(0)
                log.info("expbuf table %s: giving back lease %s of an interrupted draw", storage.table, lease)
                self._keeper_of(storage).give_back(lease)
            if batch is None:  # allow_partial, and nothing was ready
                raise DeadlineExceededError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"expbuf table {storage.table}: no ready groups to draw"
                )
            return batch

    def _ack_last(self, storage: ExpbufStorage) -> None:
        """Acknowledge the batch drawn last (the step that used it has returned), and the lease a
        loaded checkpoint named."""
        if self._restored is not None:  # the checkpoint's: it may have been acknowledged already
            self._keeper_of(storage).ack(self._restored, retry_for=storage.client.timeout, tried=True)
            self._restored = None
        if self._last is None:
            return
        tried, self._trained = self._trained, True
        self._keeper_of(storage).ack(self._last.lease_id, retry_for=storage.client.timeout, tried=tried)
        self._last, self._trained = None, False

    def ack(self) -> None:
        """Acknowledge the batch drawn last now: after the last step, when no sample follows."""
        with self._lock:
            if self._source is not None:
                self._ack_last(self._source)

    def close(self) -> None:
        """Stop renewing. The batch drawn last goes back to the table now (its step is not known to
        have finished: call `ack` first when it has); one whose ack was tried and failed is acked
        (made again while the server is unavailable, for the client's timeout), never given back."""
        with self._lock:
            try:
                if self._last is not None and self._trained and self._source is not None:
                    self._ack_last(self._source)
                for batch in (self._last, self._next):
                    if batch is not None:
                        self._put_back(batch)
            finally:
                self._last = self._next = None
                if self._keeper is not None:
                    self._keeper.close()
                    self._keeper = None

    # ------------------------------------------------------------------ TorchRL's sampler interface

    def state_dict(self) -> dict[str, Any]:
        """The lease of the batch drawn last (None: nothing unacknowledged)."""
        return {"lease_id": self._last.lease_id if self._last is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The lease a checkpoint names is acknowledged at the next sample: the checkpoint holds
        the step that trained it (it may have been acknowledged already, which is as well)."""
        self._restored = state_dict.get("lease_id") or None

    def _empty(self) -> None:
        return None

    def dumps(self, path: str | Path) -> None:
        write_state(self.state_dict(), path)

    def loads(self, path: str | Path) -> None:
        self.load_state_dict(read_state(path))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # a process group is its process's: an unpickled sampler of several ranks uses the default group
        state.update(_last=None, _next=None, _keeper=None, _source=None, _given_back=[], _lock=None, process_group=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options})"
