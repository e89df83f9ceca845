"""BufferClient: the blocking client of one expbuf server.

Each call is described once in calls.py and run here, waiting in the calling thread;
AsyncBufferClient (aio.py) runs the same descriptions under asyncio. Errors are raised as
ExpbufError (errors.py), of the subclass of their gRPC status code.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Generator, Iterable
from typing import TypeVar, Unpack

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from .errors import BufferError as BufferError  # the old name, for code that imports it from here
from .errors import ExpbufError
from .prefetch import Outcome, Prefetcher
from .pushers.blocking import Pusher
from .results import (
    AsyncBatch,
    Batch,
    BufferStats,
    ExperiencePage,
    FailedRuns,
    GetResult,
    Grant,
    ListedExperience,
    PushResult,
    ServerInfo,
    TableInfo,
    TableStats,
)
from .rpc import calls, declare
from .rpc.api import ServerCalls
from .rpc.connection import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TARGET, ClientBase, Tls
from .rpc.declare import Blocking, Plan
from .rpc.sample_reply import Parts, SampleReplyParts
from .rpc.sample_spec import SampleOptions, SampleSpec
from .schema.table_settings import TableSettings

R = TypeVar("R")
T = TypeVar("T")

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TARGET",
    "AsyncBatch",
    "Batch",
    "BufferClient",
    "BufferError",
    "BufferStats",
    "ExperiencePage",
    "GetResult",
    "Grant",
    "ListedExperience",
    "PushResult",
    "ServerInfo",
    "TableInfo",
    "TableStats",
    "Tls",
]


class SampleRequests:
    """The request side of a blocking Sample stream: the request, then one confirmation
    per batch received, until closed."""

    def __init__(self, first: pb.SampleRequest) -> None:
        self._queue: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
        self._queue.put(first)

    def __iter__(self) -> SampleRequests:
        return self

    def __next__(self) -> pb.SampleRequest:
        request = self._queue.get()
        if request is None:
            raise StopIteration
        return request

    def confirm(self, received: int, *, stop: bool = False) -> None:
        self._queue.put(calls.confirmation(received, stop=stop))

    def close(self) -> None:
        self._queue.put(None)


class BufferClient(ServerCalls, Blocking, ClientBase):
    """Blocking client. Use as a context manager or call close():

    ```python
    with BufferClient("127.0.0.1:50051") as client:
        client.push(experiences, table="grpo8")
        for batch in client.sample("grpo8", num_groups=4):
            train(batch.experiences)
            batch.ack()
    ```
    """

    _insecure_channel = staticmethod(grpc.insecure_channel)
    _secure_channel = staticmethod(grpc.secure_channel)

    def close(self) -> None:
        """Close the channels; calls in flight are cancelled."""
        self._channel.close()
        self._unretried_channel.close()

    @functools.cached_property
    def _orders(self) -> calls.Orders:
        """The orders of this client's server, as its samples have found them."""
        return calls.Orders()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: calls.Unary[R] | calls.Chunked[R]) -> R:
        """`call`'s result; made again after a pause where calls.Attempts says so."""
        attempts = calls.Attempts(call, self.timeout)
        while True:
            try:
                return self._attempt(attempts.call)
            except ExpbufError as exc:
                pause = attempts.after(exc)
                if pause is None:
                    raise
                time.sleep(pause)

    def _perform(self, plan: Plan[T]) -> T:
        """A declared call's plan made: each call it asks for made in turn (`_run`), its result sent back."""
        turns = declare.Turns(declare.steps(plan))
        for call in turns:
            turns.answer(self._run(call))
        return turns.result

    def _run_several(self, several: calls.Several[R, T]) -> T:
        """The calls of `several` made in turn, their results joined."""
        return several.joined([self._run(call) for call in several.calls])

    def _attempt(self, call: calls.Unary[R] | calls.Chunked[R]) -> R:
        method, keywords = self._method(call)
        try:
            if isinstance(call, calls.Chunked):
                reply = calls.one_reply(list(method(call.requests(), **keywords)))
            elif call.parts:
                parts = Parts()
                whole = [made for part in method(call.request, **keywords) if (made := parts.add(part)) is not None]
                parts.end()
                reply = calls.one_reply(whole, call.method)
            else:
                reply = method(call.request, **keywords)
        except grpc.RpcError as exc:
            raise self._error(exc, keywords["wait_for_ready"]) from None
        return call.read(reply)

    def push(self, items: calls.Items, table: str = "default", *, timeout: float | None = None) -> PushResult:
        """Store TRXP bytes, experiences (expbuf's or Trinity-RFT's) or a ColumnBatch; durable when it returns.
        A retried push is safe: what was stored already comes back in `duplicates`. A payload
        larger than the client's `push_chunk_bytes` goes in chunks over one PushStream. A full table
        in block mode makes it wait for room until its deadline, asking again while the server has
        as many calls waiting as it lets (calls.Attempts)."""
        return self._run(calls.push(items, table, timeout, self.push_chunk_bytes))

    def pusher(self, table: str = "default", *, window: int = 4, timeout: float | None = None) -> Pusher:
        """Pipelined pushes to `table`: up to `window` (1 to 64) in flight over one PushStream, so
        the next payload is encoded while the server stores the last. `push()` returns a Future of
        the PushResult; futures complete in push order, each push durable or failed on its own (a
        failure names its uids, in the error's `uids`). The pusher holds up to `window` payloads;
        each push has `timeout` (the client's) as a push alone has. See Pusher."""
        return Pusher(self, table, window, timeout)

    def sample(
        self,
        table: str = "default",
        batch_size: int | None = None,
        num_groups: int | None = None,
        **options: Unpack[SampleOptions],
    ) -> Generator[Batch, None, None]:
        """Stream batches of whole groups; the options and their defaults are SampleSpec's.

        `timeout` is how long each batch may wait for data. Each batch is decoded, then
        confirmed to the server as it is handed to the caller, which also asks for more: the
        server keeps up to `window` batches on their way while the caller works on this one
        (a credit window: 1 to 8; 1 is one batch ahead, with a round trip per batch; 2, the
        default, hides that round trip). `prefetch` of them (1 by default, up to `window`;
        0: none) are received and decoded on a thread of the stream's own while the caller
        works, so its step and the decode overlap. A consumed batch leaves the buffer, and a
        leased batch's lease starts, once the caller has it; the batches still on their way
        or decoded ahead when the caller stops iterating return to the buffer, as does a
        batch that cannot be decoded (DataLossError, raised in its place). The server waits for
        a batch's confirmation at most its max_confirm_seconds from the one before: when the
        caller's step outlasts that, the next batch raises DeadlineExceededError naming the
        setting, the batches on their way went back to the buffer, and none is handed over.
        """
        spec = SampleSpec(table, batch_size, num_groups, **options)
        order = self._orders.check(spec.order)
        if order is not None:  # a registered order's name: the server's orders are asked for first
            self._run(order)
        requests = SampleRequests(spec.request(self.max_message_bytes))
        confirmed = time.monotonic()  # the last confirmation sent (the request, before the first)
        stream = self._sample(requests, metadata=self._metadata)
        outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        parts = Parts()

        def read() -> SampleReplyParts | None:
            while (reply := next(stream, None)) is not None:
                if (whole := parts.add(reply)) is not None:
                    return whole
            parts.end()
            return None

        def decode(reply: SampleReplyParts) -> Batch:
            return calls.batch(reply, table, self, Batch, columnar=bool(spec.fields))

        def next_batch() -> Batch | None:
            if ahead is not None:
                return ahead.take(outcomes.get())
            reply = read()
            return None if reply is None else decode(reply)

        ahead = None
        if spec.ahead:
            ahead = Prefetcher(read, decode, spec.ahead, outcomes.put)
            stream.add_done_callback(ahead.call_done)
        received, seconds = 0, 0.0  # seconds: the server's confirm bound, as its replies say
        try:
            while (batch := next_batch()) is not None:
                seconds = batch.confirm_seconds
                batch = calls.handed(batch, spec.lease_seconds, confirmed)
                received += 1
                confirmed = time.monotonic()
                requests.confirm(received)
                yield batch
        except grpc.RpcError as exc:
            raise calls.ended_late(exc.code(), table, seconds, confirmed) or self._error(exc) from None
        finally:
            if ahead is not None:
                ahead.stop()
            timer = threading.Timer(calls.STOP_SECONDS, stream.cancel)
            if stream.running():  # the caller stopped early: end the stream cleanly
                requests.confirm(received, stop=True)
                timer.start()
                if ahead is None:
                    with contextlib.suppress(grpc.RpcError):
                        for _ in stream:  # batches already on their way go back to the buffer
                            pass
            if ahead is not None:  # its thread reads the stream to its end
                while not ahead.ended:
                    ahead.skip(outcomes.get())
                ahead.join()
            timer.cancel()
            requests.close()

    def ack(self, lease_id: str, table: str = "default") -> int:
        """Consume the groups of a lease (of `table`, taken with this client's token).
        Returns the experiences it held."""
        return self._run(calls.ack(lease_id, table))

    def nack(self, lease_id: str, table: str = "default") -> int:
        """Return the groups of a lease to the buffer now. Returns the experiences it held."""
        return self._run(calls.nack(lease_id, table))

    def retire(self, groups: Iterable[str], table: str = "default") -> int:
        """Consume groups this trainer trained without a lease (a framework's own queue held them),
        as `ack` consumes a lease's: their payloads go and their tombstones stay, so a push of them
        again is a duplicate, and a prompt whose group it is is trained. Ready groups, and groups
        leased with this client's token, retire; absent or retired ones are skipped; an incomplete
        one is FailedPreconditionError (none of its call retires). Any number, in calls of at most
        MAX_NAMES_PER_CALL (expbuf.client.schema.call_limits). Returns the groups retired."""
        return self._run_several(calls.retire(groups, table))

    def renew(self, lease_id: str, seconds: float, table: str = "default") -> float:
        """Keep a lease for `seconds` more from now, for a step that outlasts the lease it took.
        Returns when the lease now ends (Unix time, the server's clock)."""
        return self._run(calls.renew(lease_id, seconds, table))

    def set_trainer_version(self, version: int, table: str = "default") -> int:
        """Tell the table the trainer's current policy version (staleness is measured from it).
        Returns the version stored: it only moves forward, so a lower one keeps the table's."""
        return self._run(calls.set_trainer_version(version, table))

    def reset_offpolicy(self, table: str = "default", trainer_version: int | None = None) -> dict[str, int]:
        """Admin: reset the table's off-policy state for a job that starts over: the trainer
        version becomes `trainer_version` (None: unset), backwards too, and admission counts
        only the rollouts of grants still open. Returns both (trainer_version -1 = unset)."""
        return self._run(calls.reset_offpolicy(table, trainer_version))

    def writers(self, table: str = "default", change: int = 0) -> tuple[int, bool]:
        """Open (+1) or close (-1) a writer of the table, or read (0): (writers open, done),
        done once every writer that opened has closed (the table's end of data)."""
        return self._run(calls.writers(table, change))

    def admit(self, table: str, count: int, *, wait: float = 0.0, grant_seconds: float = 300.0) -> Grant:
        """How many of `count` rollouts may start now under the table's staleness bound,
        waiting up to `wait` seconds for room (asking again while the server has as many admits
        waiting as it lets, as claim does). Finish the grant when the rollouts are done
        (`finish_grant`); a grant not finished within grant_seconds gives its room back."""
        return self._run(calls.admit(table, count, wait, grant_seconds, self.timeout))

    def finish_grant(self, grant: Grant, accepted: int | None = None) -> int:
        """End a grant: `accepted` rollouts (None: all) stay counted; the others' room comes back."""
        return self._run(calls.finish_grant(grant, accepted))

    def delete(self, uids: Iterable[str] = (), table: str = "default", *, groups: Iterable[str] = ()) -> int:
        """Remove experiences by uid and whole groups by id, with their records, so they may be pushed again
        (admin scope), in calls of at most MAX_NAMES_PER_CALL uids and as many groups
        (expbuf.client.schema.call_limits). Returns how many experiences were removed."""
        return self._run_several(calls.delete(uids, table, groups))

    def fail_runs(self, uids: Iterable[str], table: str = "default", *, reasons: Iterable[str] = ()) -> FailedRuns:
        """Report runs that will never be pushed (their rollouts failed), by the uids they would
        have had, with a reason each (kept in the group's record) or none. Each counts as one of
        its group's runs: a group whose runs are then all known completes short with the members
        present, its advantages computed over them, when at least the table's min_group_size
        succeeded; otherwise it is dropped. A run pushed later after all rejoins its group. Any
        number, in calls of at most MAX_NAMES_PER_CALL (expbuf.client.schema.call_limits)."""
        return self._run_several(calls.fail_runs(uids, reasons, table))

    def seal(self, group_id: str, table: str = "default") -> int:
        """Complete a pending group now, with the runs it has; its advantages are computed over them.
        Returns the group's size."""
        return self._run(calls.seal(group_id, table))

    def stats(self, table: str = "") -> BufferStats:
        """Counts by state, bytes, groups, totals, trainer version and shaping counts of one table,
        or of every table when `table` is empty, each a TableStats by table name:

        ```python
        ready = client.stats("grpo8")["grpo8"].ready
        ```
        """
        return self._run(calls.stats(table))

    def server_info(self) -> ServerInfo:
        """The server's version, uptime, storage and map use, and the device advantages run on."""
        return self._run(calls.server_info())

    def create_table(
        self, name: str, *, exist_ok: bool = False, preset: str | None = None, **settings: Unpack[TableSettings]
    ) -> TableInfo:
        """Create a table; settings use the names of a TOML `[[tables]]` block (group_by, group_size,
        estimator, capacity_experiences, capacity_bytes, when_full, shaping, ...):

        ```python
        client.create_table("grpo8", group_size=8, estimator="grpo", exist_ok=True)
        ```

        `preset` starts from a common table's settings (`queue`, `replay`, `trinity`: see
        docs/concepts/tables.md), the settings given over them; it is expanded here, so the
        server gets plain settings:

        ```python
        client.create_table("replay", preset="replay", capacity_experiences=100_000, min_size_to_sample=1024)
        ```

        With exist_ok, a table of the same settings is returned as it is, and one of other settings
        is refused (AlreadyExistsError) naming each setting that differs. An unknown preset, or one
        without the settings it needs, is a ValueError naming them. `capacity`, the old name of
        capacity_experiences, is still read in this release, with a FutureWarning."""
        return self._run(calls.create_table(name, exist_ok, settings, preset))

    def list_tables(self) -> list[TableInfo]:
        """Every table's settings, under the names of a TOML `[[tables]]` block."""
        return self._run(calls.list_tables())

    def drop_table(self, name: str) -> int:
        """Drop a table with every experience, group, lease and counter in it (admin scope).
        Returns how many experiences it held."""
        return self._run(calls.drop_table(name))
