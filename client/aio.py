"""AsyncBufferClient: the asyncio client of one expbuf server, with BufferClient's methods as coroutines.

It runs the calls declared once (rpc/api.py), as BufferClient (client.py) does, awaiting each;
its own here: the Sample stream (and its one batch held unconfirmed for a sharded client,
AsyncHeldBatch) and the pipelined pusher. How a stream it writes to ended is the
stream's own status (aio_status.py), never a failed write's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, TypeVar, Unpack, cast

import grpc
import grpc.aio

from .errors import ExpbufError
from .prefetch import Outcome, Prefetcher, undecoded
from .pushers.aio import AsyncPusher
from .results import AsyncBatch, Batch
from .rpc import aio_status, calls, declare
from .rpc.api import ServerCalls
from .rpc.connection import ClientBase
from .rpc.declare import Awaiting, Plan
from .rpc.sample_reply import Parts, SampleReplyParts
from .rpc.sample_spec import SampleOptions, SampleSpec

R = TypeVar("R")
T = TypeVar("T")


async def _drain(call: grpc.aio.StreamStreamCall) -> None:
    """Read a stream to its end (batches already on their way are dropped)."""
    while await call.read() is not grpc.aio.EOF:
        pass


async def _read_whole(call: grpc.aio.StreamStreamCall, parts: Parts) -> SampleReplyParts | None:
    """The next batch's reply of `call`, put together from its parts; None at the stream's end."""
    while (reply := await call.read()) is not grpc.aio.EOF:
        if (whole := parts.add(cast(SampleReplyParts, reply))) is not None:
            return whole
    parts.end()
    return None


def _reader(
    read: Callable[[], Coroutine[Any, Any, SampleReplyParts | None]], loop: asyncio.AbstractEventLoop
) -> Callable[[], SampleReplyParts | None]:
    """The prefetch thread's `read`: each runs on the event loop, the thread waits for it (and
    gives up once the loop is closed, so no thread outlives it)."""

    def wait() -> SampleReplyParts | None:
        future = asyncio.run_coroutine_threadsafe(read(), loop)
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if loop.is_closed():
                    raise RuntimeError("the event loop of this Sample stream is closed") from None

    return wait


def _deliverer(outcomes: asyncio.Queue[Outcome], loop: asyncio.AbstractEventLoop) -> Callable[[Outcome], None]:
    """Hands the prefetch thread's outcomes to the event loop."""

    def deliver(outcome: Outcome) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: no caller is left to take it
            loop.call_soon_threadsafe(outcomes.put_nowait, outcome)

    return deliver


async def _stop(call: grpc.aio.StreamStreamCall) -> None:
    """End a Sample stream whose batch the client has not confirmed: the batch returns to the
    buffer as if never taken (a stream that does not end within STOP_SECONDS is cancelled)."""
    with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
        await call.write(calls.confirmation(0, stop=True))
        await asyncio.wait_for(_drain(call), calls.STOP_SECONDS)
    call.cancel()


class AsyncHeldBatch:
    """The one batch of a Sample stream (`AsyncBufferClient._hold`), held unconfirmed: BufferClient's
    HeldBatch, whose `deliver` and `give_back` are coroutine functions."""

    def __init__(
        self,
        client: AsyncBufferClient,
        spec: SampleSpec,
        since: float,
        stream: tuple[grpc.aio.StreamStreamCall, aio_status.StreamStatus],
        batch: Batch,
    ) -> None:
        """`since`: when the stream's request went (time.monotonic()), which the batch's
        confirm_seconds counts from; `stream`: the call and how it ends, made with it."""
        self.batch, (self._call, self._status) = batch, stream
        self._client, self._lease_seconds, self._since = client, spec.lease_seconds, since
        self.due = calls.confirm_by(batch.confirm_seconds, since)  # past it, `deliver` gives it back

    async def deliver(self) -> Batch:
        """As HeldBatch.deliver: the batch, confirmed and delivered once its stream ended."""
        try:
            batch = calls.handed(self.batch, self._lease_seconds, self._since)
        except ExpbufError:
            await self.give_back()
            raise
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):  # how it ended is read below
            await self._call.write(calls.confirmation(1))
            await _drain(self._call)  # nothing more comes: the stream ends once the batch is delivered
        error = await self._status.error()
        if error is not None:
            raise self._client._error(error)
        return batch

    async def give_back(self) -> None:
        """End the stream unconfirmed: the batch returns to the buffer, not counted as sampled."""
        await _stop(self._call)


# A caller's step longer than this may have blocked the event loop (a step that does not await):
# before the next batch is handed over, the loop runs what gRPC received meanwhile (`_caught_up`),
# for at most CATCH_UP_SECONDS (1 % of such a step at most).
LONG_STEP = 1.0
CATCH_UP_SECONDS = 0.01


async def _caught_up(seen: Callable[[], bool]) -> None:
    """Give the event loop its turns, until `seen()` or CATCH_UP_SECONDS: a stop the server announced,
    or the stream's end, that came while a step blocked the loop is read before a batch decoded
    ahead is handed over (handed over, it was trained, and served again after the server's restart).
    A step that awaits left the loop free: what came is seen at once."""
    deadline = time.monotonic() + CATCH_UP_SECONDS
    turns = 0
    while not seen() and time.monotonic() < deadline:
        await asyncio.sleep(0 if turns < 8 else 0.001)  # the ready callbacks first, then gRPC's poller's
        turns += 1


class AsyncBufferClient(ServerCalls, Awaiting, ClientBase):
    """asyncio client with the methods of BufferClient, as coroutines:

    ```python
    async with AsyncBufferClient("127.0.0.1:50051") as client:
        async for batch in client.sample("grpo8", num_groups=4):
            await train(batch.experiences)
            await batch.ack()
    ```
    """

    _insecure_channel = staticmethod(grpc.aio.insecure_channel)
    _secure_channel = staticmethod(grpc.aio.secure_channel)

    async def close(self) -> None:
        """Close the channels; calls in flight are cancelled. A `sample()` stream still open ends
        first, as BufferClient.close ends one; a call after it raises ExpbufError (CANCELLED)
        naming the call."""
        running: set[asyncio.Future[None]] = set()
        for batches, stream in list(self._samples.items()):
            try:
                await batches.aclose()
            except RuntimeError:  # iterated now by another task: the channel's close ends it
                running |= set(stream)
        loop = asyncio.get_running_loop()
        ending = [done for done in self._streams - running if not done.done() and done.get_loop() is loop]
        if ending:  # streams their callers dropped, ended by the loop's finalizer: the batch handed over confirmed
            await asyncio.wait(ending, timeout=calls.STOP_SECONDS)
        self.closed = True
        await self._channel.close()
        await self._unretried_channel.close()
        await self._chunks_channel.close()

    async def __aenter__(self) -> AsyncBufferClient:
        return self

    @functools.cached_property
    def _orders(self) -> calls.Orders:
        """The orders of this client's server, as its samples have found them."""
        return calls.Orders()

    @functools.cached_property
    def _repeats(self) -> calls.Repeats:
        """The calls this client's server answers again as the first, once it has said."""
        return calls.Repeats()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, call: declare.Unary[R] | declare.Chunked[R]) -> R:
        """`call`'s result; made again after a pause where calls.Attempts says so."""
        attempts = calls.Attempts(call, self.timeout, self.retries)
        while True:
            try:
                return await self._attempt(attempts.call)
            except ExpbufError as exc:
                pause = attempts.after(exc)
                if pause is None:
                    raise attempts.answer(exc) from None
                await asyncio.sleep(pause)

    async def _perform(self, plan: Plan[T]) -> T:
        """A declared call's plan made: each call it asks for made in turn (`_run`), its result sent back."""
        turns, repeats = declare.Turns(declare.steps(plan)), self._repeats
        for call in turns:
            self._still_open(call.method)  # named by the call asked for, not the question asked before it
            if (ask := repeats.ask(call)) is not None:
                try:
                    await self._run(ask)
                except ExpbufError as exc:
                    repeats.unanswered(exc)
            try:
                turns.answer(await self._run(repeats.made(call)))
            except ExpbufError as exc:
                repeats.lost(exc)
                raise
        return turns.result

    async def _attempt(self, call: declare.Unary[R] | declare.Chunked[R]) -> R:
        method, keywords = self._method(call)
        try:
            if isinstance(call, declare.Chunked):
                reply = calls.one_reply(await aio_status.replies(method(call.requests(), **keywords)))
            elif call.parts:
                parts = Parts()
                whole = await aio_status.replies(method(call.request, **keywords), parts.add)
                parts.end()
                reply = calls.one_reply(whole, call.method)
            else:
                reply = await method(call.request, **keywords)
        except grpc.RpcError as exc:
            raise self._error(exc, keywords["wait_for_ready"]) from None
        return call.read(reply)

    def pusher(self, table: str = "default", *, window: int = 4, timeout: float | None = None) -> AsyncPusher:
        """Pipelined pushes to `table`, as BufferClient.pusher: `await pusher.push(items)` returns an
        asyncio Future of the PushResult once the push is on its way. See AsyncPusher."""
        return AsyncPusher(self, table, window, timeout)

    def sample(
        self,
        table: str = "default",
        batch_size: int | None = None,
        num_groups: int | None = None,
        **options: Unpack[SampleOptions],
    ) -> AsyncGenerator[Batch, None]:
        """Stream batches as BufferClient.sample does; leased batches' ack()/nack() are coroutines.
        The batches decoded ahead (`prefetch`) are decoded on a thread of the stream's own, off
        the event loop, so a trainer's coroutine runs while they are."""
        stream: list[asyncio.Future[None]] = []  # its future in `_streams`, once it has begun
        batches = self._batches(table, batch_size, num_groups, options, stream)
        self._samples[batches] = stream
        return batches

    @functools.cached_property
    def _samples(self) -> weakref.WeakKeyDictionary[AsyncGenerator[Batch, None], list[asyncio.Future[None]]]:
        """The streams of `sample()` made and not yet collected, which close() ends first."""
        return weakref.WeakKeyDictionary()

    @functools.cached_property
    def _streams(self) -> set[asyncio.Future[None]]:
        """One future a `sample()` stream in progress, done once it has ended: a stream its caller
        dropped (`return` from inside `async for`) is ended by the event loop's finalizer, which
        close() waits for before it closes the channel, else it cut the confirmation of the batch
        the caller has, and the server served that batch again. Not one that another task iterates
        as the client closes: the channel's close ends it."""
        return set()

    async def _batches(
        self,
        table: str,
        batch_size: int | None,
        num_groups: int | None,
        options: SampleOptions,
        stream: list[asyncio.Future[None]],
    ) -> AsyncGenerator[Batch, None]:
        """sample()'s stream (its settings checked at its first batch, as before)."""
        spec = SampleSpec(table, batch_size, num_groups, **options)
        order = self._orders.check(spec.order)
        if order is not None:  # a registered order's name: the server's orders are asked for first
            await self._run(order)
        confirmed = time.monotonic()  # the last confirmation sent (the request, before the first)
        call = self._sample(metadata=self._metadata)
        parts = Parts()
        status = aio_status.StreamStatus(call)
        outcomes: asyncio.Queue[Outcome] = asyncio.Queue()
        handing, writing = calls.Handing(), asyncio.Lock()
        # The confirmation of the batch handed over last, written on a task of its own: a batch is
        # handed over and yielded with no await between, so a cancel of the caller (asyncio.wait_for)
        # never lands after the confirmation went and before the caller has the batch, which was then
        # consumed (or leased) and never had; nor does it cut the write (grpc.aio ends a stream whose
        # write is cancelled, and the batch had would be served again).
        on_its_way: list[asyncio.Future[None]] = []
        held_back = calls.HeldBack()  # a cancel the last batch handed over held back (told)

        async def written() -> None:
            """The confirmation on its way written (under `writing`, before any other message)."""
            if on_its_way:
                await asyncio.shield(on_its_way[0])
                on_its_way.clear()

        def decode(reply: SampleReplyParts) -> AsyncBatch:
            return calls.batch(reply, table, self, AsyncBatch, columnar=bool(spec.fields))

        changed = asyncio.Event()
        deliveries = calls.Deliveries(changed.set)

        async def read() -> SampleReplyParts | None:
            try:
                while (reply := await _read_whole(call, parts)) is not None:
                    if deliveries.heard(reply.rest):
                        continue
                    if not reply.rest.stopping:
                        return reply
                    async with writing:  # the server is stopping: what was handed over, at once
                        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):  # ended: its end follows
                            await written()
                            if (answer := handing.answer()) is not None:
                                await call.write(answer)
            except BaseException:
                deliveries.end(False)
                raise
            deliveries.end(True)
            return None

        async def delivered(received: int) -> bool:
            """Whether the `received`-th batch, confirmed, may be handed over (calls.Deliveries)."""
            if ahead is None:  # a stream of one batch: read here to its end, which follows its delivery
                try:
                    while deliveries.delivered(received) is None and await read() is None:
                        pass
                except grpc.RpcError:  # after its word (a stop): the batch is handed over, the end raised next
                    if deliveries.delivered(received) is not True:
                        raise
            else:
                while deliveries.delivered(received) is None:  # the reader hears of it, on this loop
                    changed.clear()
                    await changed.wait()
            return deliveries.delivered(received) is True

        async def told(word: asyncio.Future[bool], batch: Batch) -> bool:
            """Whether `batch`, confirmed, may be handed over, as `word` says, whatever cancels the
            caller meanwhile: its confirmation gone, the server delivers it at the stream's end
            (a consumed batch is served once), so a cancel that cut the wait lost it, the caller
            without it and the buffer too. The cancelled await is handed a consumed one (`anext`
            returns it); a leased one delivered goes back at once (its nack: no caller has it to
            ack, and it was leased until its lease_seconds passed), a replayed one stays (its replay
            counted), and the cancel goes on, as the sharded client does."""
            before = calls.HeldBack.begin()
            try:
                return await asyncio.shield(word)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):  # the stream's end: the cancel is the caller's answer
                    if await calls.finished(word):
                        if spec.delivery == "consume":
                            held_back.hold(before)
                            return True
                        if spec.delivery == "lease" and isinstance(batch, AsyncBatch):
                            await asyncio.shield(batch.nack())
                raise

        async def next_batch() -> Batch | None:
            if ahead is None:
                reply = await read()
            elif spec.ahead:
                return ahead.take(await outcomes.get())
            else:
                reply = ahead.take(await outcomes.get())
            return None if reply is None else decode(reply)

        async def passed() -> None:  # the outcomes after the caller stopped, to the stream's end
            while ahead is not None and not ahead.ended:
                ahead.skip(await outcomes.get())

        ahead: Prefetcher | None = None
        seconds = 0.0  # the server's confirm bound, as its replies say
        streaming = asyncio.get_running_loop().create_future()
        self._streams.add(streaming)
        stream.append(streaming)
        try:
            await call.write(spec.request(self.max_message_bytes, answers_stopping=True))
            if spec.max_batches != 1:  # replies come ahead: read them as they come (prefetch.py)
                loop = asyncio.get_running_loop()
                decoding = decode if spec.ahead else undecoded
                ahead = Prefetcher(_reader(read, loop), decoding, spec.ahead, _deliverer(outcomes, loop))
                call.add_done_callback(ahead.call_done)
            while (batch := await next_batch()) is not None:
                seconds = batch.confirm_seconds
                batch = calls.handed(batch, spec.lease_seconds, confirmed)
                if time.monotonic() - confirmed > LONG_STEP:  # the loop perhaps blocked: what came meanwhile first
                    await _caught_up(lambda: call.done() or handing.stopping)
                if call.done():  # ended (the server gave the batch back): not handed over; the end follows
                    continue
                async with writing:
                    await written()
                    if (confirmation := handing.hand()) is not None:
                        on_its_way.append(asyncio.ensure_future(call.write(confirmation)))
                if confirmation is None:  # the server is stopping: not handed over; the end follows
                    continue
                if not await told(asyncio.ensure_future(delivered(handing.received)), batch):
                    continue  # not delivered, or its word lost: the end follows
                confirmed = time.monotonic()
                yield batch
                held_back.raise_now()
        except (grpc.RpcError, asyncio.InvalidStateError):  # the stream ended (a write after its end: the latter)
            error = await status.error()  # by its own status, raised unless OK
            if error is not None:
                raise calls.ended_late(error.code(), table, seconds, confirmed) or self._error(error) from None
        except (asyncio.CancelledError, concurrent.futures.CancelledError):  # the channel's close cut its read
            task = asyncio.current_task()
            if not self.closed or (task is not None and task.cancelling()):  # a cancel of the caller's own
                raise
            raise ExpbufError(
                grpc.StatusCode.CANCELLED, f"the client was closed while sample() of table '{table}' went on"
            ) from None
        finally:
            try:
                if ahead is not None:
                    ahead.stop()
                stopping = not call.done()  # the caller stopped early: end the stream cleanly

                async def end() -> None:
                    """The confirmation on its way written, and where the caller stopped early, the stop
                    and the stream read to its end; bounded whole (a write that never goes, as on a
                    call made for another event loop, waited for good)."""
                    async with writing:
                        await written()
                        if stopping and not call.done():
                            await call.write(calls.confirmation(handing.received, stop=True))
                    if stopping:
                        await (_drain(call) if ahead is None else passed())

                with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
                    await asyncio.wait_for(end(), calls.STOP_SECONDS)
                if stopping:
                    call.cancel()
                if ahead is not None:  # its thread reads the stream to its end
                    await passed()
                    ahead.join()
            finally:
                streaming.set_result(None)
                self._streams.discard(streaming)
                held_back.pass_on()  # the caller left before its next step (a break, aclose)

    async def _hold(self, spec: SampleSpec, within: float = 0.0) -> AsyncHeldBatch | None:
        """As BufferClient._hold: the one batch of `spec` held unconfirmed (AsyncHeldBatch) for at
        most `within` and twice the client's timeout, cancelled where no answer comes within the
        client's timeout; None where the stream ended without one."""
        order = self._orders.check(spec.order)
        if order is not None:
            await self._run(order)
        since = time.monotonic()
        call = self._sample(metadata=self._metadata, timeout=within + 2 * self.timeout)
        status = aio_status.StreamStatus(call)

        async def answered() -> SampleReplyParts | None:
            await call.write(spec.request(self.max_message_bytes))
            return await _read_whole(call, Parts())

        try:
            reply = await asyncio.wait_for(answered(), self.timeout)
        except TimeoutError:
            call.cancel()
            raise calls.unanswered(spec.table, self.timeout) from None
        except grpc.RpcError:  # the stream ended: by its own status
            error = await status.error()
            if error is None:
                return None
            raise self._error(error) from None
        except ExpbufError:
            await _stop(call)
            raise
        if reply is None:
            return None
        try:
            batch = calls.batch(reply, spec.table, self, AsyncBatch, columnar=bool(spec.fields))
        except ExpbufError:
            await _stop(call)
            raise
        return AsyncHeldBatch(self, spec, since, (call, status), batch)
