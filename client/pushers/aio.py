"""AsyncPusher: the asyncio client's pipelined pushes, as Pusher (blocking.py) with the same window
rules (pipeline.py). Each stream's replies are read by a task of its own; one push's messages
are written at a time, so a payload's chunks are never interleaved with another's. How a stream
ended is its own status (aio_status.py), never a failed write's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Sequence
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio

from ..results import PushResult
from ..rpc import calls
from ..rpc.aio_status import StreamStatus
from .pipeline import Ordered, Pending, PushTarget, PushWindow, Stream


class _Open:
    """A PushStream in progress: its bookkeeping and its call."""

    def __init__(self, window: PushWindow, client: PushTarget, pushes: Sequence[Pending]) -> None:
        self.state = Stream(window.room_for(pushes))
        self.call = client.push_stream(window.stream_seconds, message_bytes=window.message_bytes(self.state.room))
        self.status = StreamStatus(self.call)
        self.closed = False
        self.connected = False  # its call's metadata went: a write no longer waits for the connection
        self.cancelled = False  # by the pusher, every push on it failed at its deadline (`_look_due`)
        self.watch: asyncio.TimerHandle | None = None  # the look at whether it has gone quiet (Stream.quiet)
        self.due: asyncio.TimerHandle | None = None  # the look at its pushes' deadlines (PushWindow.overdue)
        self.due_at = 0.0  # when that look is (monotonic clock)


W = TypeVar("W", bound=Ordered[Any])


def _nobody_reads(future: asyncio.Future[PushResult]) -> None:
    """The outcome of a push whose caller was cancelled before it got the push's future: read, so
    that asyncio logs no exception never retrieved."""
    if not future.cancelled():
        future.exception()


class AsyncOrderedFutures(Generic[W]):
    """An asyncio pusher's futures, one per push, completed in the order of the pushes."""

    def __init__(self, window: W) -> None:
        self._window = window
        self._changed = asyncio.Event()  # set whenever pushes are handed back
        self._futures: dict[int, asyncio.Future[PushResult]] = {}

    @property
    def in_flight(self) -> int:
        """Pushes made whose futures are not yet complete (at most the window)."""
        return len(self._window.pushes)

    async def _room(self) -> None:
        """Wait while the window is full."""
        while self._window.full:
            self._changed.clear()
            await self._changed.wait()

    async def flush(self) -> None:
        """Wait until every push made so far is durable or has failed."""
        while self._window.pushes:
            self._changed.clear()
            await self._changed.wait()

    def _settle(self) -> None:
        """Complete the futures of the pushes handed back, in order."""
        finished = self._window.finished()
        for push in finished:
            future = self._futures.pop(push.number)
            if future.done():  # cancelled by its caller
                continue
            if isinstance(push.outcome, PushResult):
                future.set_result(push.outcome)
            else:
                future.set_exception(push.outcome)
        if finished:
            self._changed.set()


class AsyncPusher(AsyncOrderedFutures[PushWindow]):
    """Up to `window` pushes in flight to one table over one PushStream, as Pusher: `await push()`
    returns an asyncio Future at once (waiting only while the window is full); futures complete
    in push order, each with its PushResult or its ExpbufError naming its uids:

    ```python
    async with client.pusher("grpo8", window=4) as pusher:
        futures = [await pusher.push(batch) for batch in batches]
    results = await asyncio.gather(*futures)
    ```
    """

    def __init__(self, client: PushTarget, table: str, window: int, timeout: float | None) -> None:
        super().__init__(PushWindow(table, window, client, timeout))
        self._client = client
        self._writing = asyncio.Lock()
        self._stream: _Open | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def push(self, items: calls.Items) -> asyncio.Future[PushResult]:
        """Push TRXP bytes, experiences or a ColumnBatch; the future completes when the push is durable or
        has failed."""
        return await self.push_part(calls.payload(items))

    async def push_part(self, body: bytes, number: int | None = None) -> asyncio.Future[PushResult]:
        """Push TRXP bytes as push `number`, as Pusher.push_part."""
        await self._room()
        pending = self._window.add(body, number)
        future: asyncio.Future[PushResult] = asyncio.get_running_loop().create_future()
        self._futures[pending.number] = future
        if pending.outcome is None:
            # the pusher's own task: a caller cancelled (asyncio.wait_for, a task's cancel) while its
            # message is written never cuts the stream, which grpc.aio cancels with an interrupted write
            sending = self._spawn(self._send([pending]))
            try:
                await asyncio.shield(sending)
            except asyncio.CancelledError:
                future.add_done_callback(_nobody_reads)  # the push goes on; its caller is gone
                raise
        self._settle()
        return future

    async def flush(self) -> None:
        """Wait until every push made so far is durable or has failed; the stream ends first where
        pushes are in flight (PushWindow.drains)."""
        if not self._window.drains():
            await super().flush()
            return
        with self._window.draining():
            async with self._writing:
                if self._stream is not None:
                    await self._end(self._stream)
            await super().flush()

    async def close(self) -> None:
        """Wait for every push, then end the stream."""
        await self.flush()
        async with self._writing:
            if self._stream is not None:
                await self._end(self._stream)
                self._stream = None
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> AsyncPusher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _end(self, stream: _Open) -> None:
        """No more pushes on `stream`: it answers those it has, then ends (under `_writing`). The
        end is written by the pusher's own task: grpc.aio cancels a call whose done_writing is
        cancelled, and a caller's cancel of flush() or close() (asyncio.wait_for) cut the stream,
        its pushes failed at their deadline."""
        if stream.watch is not None:
            stream.watch.cancel()
            stream.watch = None
        if not stream.closed:
            stream.closed = True
            await asyncio.shield(self._spawn(_done_writing(stream)))

    async def _send(self, pushes: list[Pending]) -> None:
        """Send pushes on the current stream, a new one if it takes no more. A stream's reader
        decides for every push on it once it ends, so they join it before any write. Pushes to
        send again after the client closed fail CANCELLED: no stream opens on a closed channel."""
        async with self._writing:
            if self._client.closed:
                why = ": whether it was stored is unknown"
                for pending in pushes:
                    pending.fail(grpc.StatusCode.CANCELLED, "the client was closed", why)
                self._settle()
                return
            stream = self._stream
            if stream is None or stream.closed or not self._window.takes(stream.state, pushes):
                if stream is not None:
                    await self._end(stream)
                stream = self._stream = _Open(self._window, self._client, pushes)
                self._spawn(self._read(stream))
            stream.state.sent.extend(pushes)
            self._watch_due(stream)
            try:
                if not stream.connected:  # a server away (wait_for_ready): no later than the first deadline
                    due = stream.state.first_due() or time.monotonic()
                    await asyncio.wait_for(stream.call.wait_for_connection(), max(0.0, due - time.monotonic()))
                    stream.connected = True
                for pending in pushes:
                    for request in pending.requests(self._window.chunk_bytes):
                        await stream.call.write(request)
            except TimeoutError:  # grpc.aio's write after a cancel would wait for the connection for good
                self._look_due(stream)
            except (grpc.RpcError, asyncio.InvalidStateError):  # the stream ended: its reader decides
                pass
            stream.state.last_sent = time.monotonic()
            if self._window.ends_streams:
                await self._end(stream)
            else:
                self._watch(stream)

    def _watch_due(self, stream: _Open) -> None:
        """Look at `stream`'s pushes when the earliest of their deadlines passes, sooner than the
        look set where a push sent again joins it with an earlier deadline."""
        due = stream.state.first_due()
        if due is None or (stream.due is not None and stream.due_at <= due):
            return
        if stream.due is not None:
            stream.due.cancel()
        loop = asyncio.get_running_loop()
        stream.due, stream.due_at = loop.call_later(max(0.0, due - time.monotonic()), self._look_due, stream), due

    def _look_due(self, stream: _Open) -> None:
        """Fail the pushes past their deadline; a stream left with nothing to wait for is
        cancelled (a server gone would hold it, and close() with it, until its own deadline)."""
        if stream.due is not None:
            stream.due.cancel()
            stream.due = None
        if self._window.overdue(stream.state) and stream.state.sent:
            stream.closed = stream.cancelled = True
            if self._stream is stream:
                self._stream = None
            stream.call.cancel()
        else:
            self._watch_due(stream)
        self._settle()

    def _watch(self, stream: _Open) -> None:
        """End `stream` once it has gone quiet (Stream.quiet), looking
        again as long as pushes go on it."""
        delay = stream.state.quiet()
        if delay is None or self._stream is not stream or stream.closed:
            return
        if delay == 0:
            self._spawn(self._end_quiet(stream))
        elif stream.watch is None:
            stream.watch = asyncio.get_running_loop().call_later(delay, self._look, stream)

    def _look(self, stream: _Open) -> None:
        stream.watch = None
        self._watch(stream)

    async def _end_quiet(self, stream: _Open) -> None:
        async with self._writing:
            await self._end(stream)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `work` as a task of the pusher's, which close() waits for."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _read(self, stream: _Open) -> None:
        try:
            with contextlib.suppress(grpc.RpcError):  # how the stream ended is read below
                while (reply := await stream.call.read()) is not grpc.aio.EOF:
                    again = self._window.answered(stream.state, reply)
                    self._settle()
                    if again:  # on a new stream: this one answers what it has, then ends
                        async with self._writing:
                            await self._end(stream)
                        await self._send(again)
        except asyncio.CancelledError:  # grpc.aio's read of a call cancelled: by the pusher, or the client's close
            if not (stream.cancelled or self._client.closed):
                raise
        stream.closed = True
        if stream.due is not None:
            stream.due.cancel()
            stream.due = None
        again, pause = self._window.ended(stream.state, await stream.status.error(), self._client.closed)
        if self._stream is stream:
            self._stream = None
        self._settle()
        if again:
            await asyncio.sleep(pause)
            await self._send(again)


async def _done_writing(stream: _Open) -> None:
    with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):  # it has ended already
        await stream.call.done_writing()
