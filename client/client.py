"""BufferClient: the blocking client of one expbuf server.

Each call is declared once (rpc/api.py: its parameters, docstring, request and reply) and run
here, waiting in the calling thread; AsyncBufferClient (aio.py) runs the same declarations under
asyncio. Its own here: the Sample stream (and its one batch held unconfirmed for a sharded
client, HeldBatch) and the pipelined pusher. Errors are raised as ExpbufError (errors.py), of the
subclass of their gRPC status code.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import queue
import threading
import time
import weakref
from collections.abc import Generator
from typing import Any, TypeVar, Unpack, cast

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from .errors import BufferError as BufferError  # the old name, for code that imports it from here
from .errors import ExpbufError
from .prefetch import Outcome, Prefetcher, undecoded
from .pushers.blocking import Pusher
from .results import (
    AsyncBatch,
    Batch,
    BufferStats,
    ExperiencePage,
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

R = TypeVar("R")
T = TypeVar("T")
# Every client's sample() streams made and not yet collected, ended as the interpreter exits.
_OPEN_SAMPLES: weakref.WeakSet[Generator[Batch, None, None]] = weakref.WeakSet()


@atexit.register
def _end_open_samples() -> None:
    """End the sample() streams still open as the interpreter exits, as leaving their loops ends
    them: one left to the collector ran its end with the modules torn down, and printed "Exception
    ignored in ... TypeError: catching classes that do not inherit from BaseException is not
    allowed" for each (a script's `batches = client.sample(...)`, `next(batches)`, no close())."""
    for batches in list(_OPEN_SAMPLES):
        with contextlib.suppress(Exception):  # iterated on another thread: its own end follows
            batches.close()


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
        self.send(calls.confirmation(received, stop=stop))

    def send(self, request: pb.SampleRequest) -> None:
        self._queue.put(request)

    def close(self) -> None:
        self._queue.put(None)


def _stop(stream: Any, requests: SampleRequests) -> None:
    """End a Sample stream whose batch the client has not confirmed: the batch returns to the
    buffer as if never taken (a stream that does not end within STOP_SECONDS is cancelled)."""
    timer = threading.Timer(calls.STOP_SECONDS, stream.cancel)
    requests.confirm(0, stop=True)
    timer.start()
    with contextlib.suppress(grpc.RpcError):
        for _ in stream:
            pass
    timer.cancel()
    requests.close()


class HeldBatch:
    """The one batch of a Sample stream (`BufferClient._hold`), received and decoded but not
    confirmed: the server holds it, neither consumed, leased nor counted as replayed, until
    `deliver` confirms it, or `give_back` ends the stream and it returns to the buffer uncounted.
    A sharded client holds each shard's part so until the whole batch is in hand."""

    def __init__(
        self, client: BufferClient, spec: SampleSpec, since: float, stream: Any, requests: SampleRequests, batch: Batch
    ) -> None:
        """`since`: when the stream's request went (time.monotonic()), which the batch's
        confirm_seconds counts from."""
        self.batch, self._stream, self._requests = batch, stream, requests
        self._client, self._lease_seconds, self._since = client, spec.lease_seconds, since
        self.due = calls.confirm_by(batch.confirm_seconds, since)  # past it, `deliver` gives it back
        weakref.finalize(self, requests.close)  # one dropped unended (its caller interrupted) frees gRPC's reader

    def deliver(self) -> Batch:
        """The batch, confirmed and, once its stream ended, delivered as the stream asked
        (consumed, its lease's clock started, or its replay counted). Raises the error the stream
        ended with where it did not deliver it (the server ended it first, or went away), and
        DeadlineExceededError where the confirmation would reach the server too late for its
        max_confirm_seconds (`calls.handed`; the batch given back)."""
        try:
            batch = calls.handed(self.batch, self._lease_seconds, self._since)
        except ExpbufError:
            self.give_back()
            raise
        self._requests.confirm(1)
        try:
            for _ in self._stream:  # nothing more comes: the stream ends once the batch is delivered
                pass
        except grpc.RpcError as exc:
            raise self._client._error(exc) from None
        finally:
            self._requests.close()
        return batch

    def give_back(self) -> None:
        """End the stream unconfirmed: the batch returns to the buffer, not counted as sampled."""
        _stop(self._stream, self._requests)


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
        """Close the channels; calls in flight are cancelled. A `sample()` stream still open (its
        generator kept) ends first as leaving its loop ends it: the batch handed over is delivered,
        those on their way go back to the buffer. Its confirmation was still to be sent, and the
        cancel gave the batch back: it was served again while its caller trained on it. A call
        after it, a batch's ack too, raises ExpbufError (CANCELLED) naming the call."""
        for batches in list(self._samples):
            with contextlib.suppress(ValueError):  # iterated on another thread now: the cancel ends it
                batches.close()
        self.closed = True
        self._channel.close()
        self._unretried_channel.close()
        self._chunks_channel.close()

    @functools.cached_property
    def _samples(self) -> weakref.WeakSet[Generator[Batch, None, None]]:
        """The streams of `sample()` made and not yet collected, which close() ends first."""
        return weakref.WeakSet()

    @functools.cached_property
    def _orders(self) -> calls.Orders:
        """The orders of this client's server, as its samples have found them."""
        return calls.Orders()

    @functools.cached_property
    def _repeats(self) -> calls.Repeats:
        """The calls this client's server answers again as the first, once it has said."""
        return calls.Repeats()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: declare.Unary[R] | declare.Chunked[R]) -> R:
        """`call`'s result; made again after a pause where calls.Attempts says so."""
        attempts = calls.Attempts(call, self.timeout, self.retries)
        while True:
            try:
                return self._attempt(attempts.call)
            except ExpbufError as exc:
                pause = attempts.after(exc)
                if pause is None:
                    raise attempts.answer(exc) from None
                time.sleep(pause)

    def _perform(self, plan: Plan[T]) -> T:
        """A declared call's plan made: each call it asks for made in turn (`_run`), its result sent back."""
        turns, repeats = declare.Turns(declare.steps(plan)), self._repeats
        for call in turns:
            self._still_open(call.method)  # named by the call asked for, not the question asked before it
            if (ask := repeats.ask(call)) is not None:
                try:
                    self._run(ask)
                except ExpbufError as exc:
                    repeats.unanswered(exc)
            try:
                turns.answer(self._run(repeats.made(call)))
            except ExpbufError as exc:
                repeats.lost(exc)
                raise
        return turns.result

    def _attempt(self, call: declare.Unary[R] | declare.Chunked[R]) -> R:
        method, keywords = self._method(call)
        try:
            if isinstance(call, declare.Chunked):
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
        batches = self._batches(table, batch_size, num_groups, options)
        self._samples.add(batches)
        _OPEN_SAMPLES.add(batches)
        return batches

    def _batches(
        self, table: str, batch_size: int | None, num_groups: int | None, options: SampleOptions
    ) -> Generator[Batch, None, None]:
        """sample()'s stream (its settings checked at its first batch, as before)."""
        spec = SampleSpec(table, batch_size, num_groups, **options)
        order = self._orders.check(spec.order)
        if order is not None:  # a registered order's name: the server's orders are asked for first
            self._run(order)
        requests = SampleRequests(spec.request(self.max_message_bytes, answers_stopping=True))
        confirmed = time.monotonic()  # the last confirmation sent (the request, before the first)
        stream = self._sample(requests, metadata=self._metadata)
        outcomes: queue.SimpleQueue[Outcome[Any]] = queue.SimpleQueue()
        parts = Parts()
        handing, sending = calls.Handing(), threading.Lock()
        changed = threading.Condition()

        def tell() -> None:
            with changed:
                changed.notify_all()

        deliveries = calls.Deliveries(tell)

        def read() -> SampleReplyParts | None:
            try:
                while (reply := next(stream, None)) is not None:
                    if (whole := parts.add(reply)) is None or deliveries.heard(whole.rest):
                        continue
                    if not whole.rest.stopping:
                        return whole
                    with sending:  # the server is stopping: what was handed over, at once
                        if (answer := handing.answer()) is not None:
                            requests.send(answer)
                parts.end()
            except BaseException:
                deliveries.end(False)
                raise
            deliveries.end(True)
            return None

        def delivered(received: int) -> bool:
            """Whether the `received`-th batch, confirmed, may be handed over (calls.Deliveries)."""
            if ahead is None:  # a stream of one batch: read here to its end, which follows its delivery
                try:
                    while deliveries.delivered(received) is None and read() is None:
                        pass
                except grpc.RpcError:  # after its word (a stop): the batch is handed over, the end raised next
                    if deliveries.delivered(received) is not True:
                        raise
            else:  # the reader's thread hears of it
                with changed:
                    changed.wait_for(lambda: deliveries.delivered(received) is not None)
            return deliveries.delivered(received) is True

        def decode(reply: SampleReplyParts) -> Batch:
            return calls.batch(reply, table, self, Batch, columnar=bool(spec.fields))

        def next_batch() -> Batch | None:
            if ahead is None:
                reply = read()
            elif spec.ahead:
                return cast(Batch | None, ahead.take(outcomes.get()))
            else:
                reply = ahead.take(outcomes.get())
            return None if reply is None else decode(reply)

        ahead: Prefetcher[Any] | None = None
        try:
            if spec.ahead:
                ahead = Prefetcher(read, decode, spec.ahead, outcomes.put)
            elif spec.max_batches != 1:  # replies come ahead: read them as they come (prefetch.py)
                ahead = Prefetcher(read, undecoded, 0, outcomes.put)
        except BaseException:  # an interrupt as its threads start: the stream ends, they with it
            stream.cancel()
            requests.close()
            raise
        if ahead is not None:
            stream.add_done_callback(ahead.call_done)
        seconds = 0.0  # the server's confirm bound, as its replies say
        try:
            while (batch := next_batch()) is not None:
                seconds = batch.confirm_seconds
                batch = calls.handed(batch, spec.lease_seconds, confirmed)
                with sending:
                    if (confirmation := handing.hand()) is not None:
                        requests.send(confirmation)
                if confirmation is None:  # the server is stopping: not handed over; the end follows
                    continue
                if not delivered(handing.received):  # not delivered, or its word lost: the end follows
                    continue
                confirmed = time.monotonic()
                yield batch
        except grpc.RpcError as exc:
            raise calls.ended_late(exc.code(), table, seconds, confirmed) or self._error(exc) from None
        finally:
            if ahead is not None:
                ahead.stop()
            timer = threading.Timer(calls.STOP_SECONDS, stream.cancel)
            if stream.running():  # the caller stopped early: end the stream cleanly
                with sending:
                    requests.confirm(handing.received, stop=True)
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

    def _hold(self, spec: SampleSpec, within: float = 0.0) -> HeldBatch | None:
        """The one batch of `spec` (`max_batches=1`: a sharded client's part), held unconfirmed
        (HeldBatch); None where the stream ended without one (allow_partial, none ready). A batch
        that cannot be decoded raises DataLossError and goes back to the buffer uncounted.
        `within`: how long it may be held before it is delivered or given back; its stream ends
        (DEADLINE_EXCEEDED) past that and twice the client's timeout (its answer, its delivery),
        and it is cancelled where no answer comes within the client's timeout (calls.unanswered),
        so a shard that stops answering holds the call no longer (the part is then left out)."""
        order = self._orders.check(spec.order)
        if order is not None:
            self._run(order)
        requests = SampleRequests(spec.request(self.max_message_bytes))
        since = time.monotonic()
        stream = self._sample(requests, metadata=self._metadata, timeout=within + 2 * self.timeout)
        parts, reply = Parts(), None
        silent = threading.Event()

        def cancel() -> None:
            silent.set()
            stream.cancel()

        waiting = threading.Timer(self.timeout, cancel)
        waiting.start()
        try:
            while reply is None and (message := next(stream, None)) is not None:
                reply = parts.add(message)
            waiting.cancel()
            if reply is None:
                parts.end()
                requests.close()
                return None
            batch = calls.batch(reply, spec.table, self, Batch, columnar=bool(spec.fields))
            return HeldBatch(self, spec, since, stream, requests, batch)
        except grpc.RpcError as exc:
            waiting.cancel()
            requests.close()
            raise (calls.unanswered(spec.table, self.timeout) if silent.is_set() else self._error(exc)) from None
        except ExpbufError:
            _stop(stream, requests)
            raise
