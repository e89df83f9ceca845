"""Pusher: the blocking client's pipelined pushes, up to a window of them in flight over PushStream.

The window's rules are pipeline.py's; here each stream's replies are read by a thread of its
own, and the futures are completed outside the pusher's lock, so a callback may push again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import grpc

from ..results import PushResult
from ..rpc import calls
from .pipeline import Ordered, Pending, PushTarget, PushWindow, Stream


class _Requests:
    """A stream's messages as gRPC sends them: each push's, made when gRPC asks for them."""

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk_bytes = chunk_bytes
        self._queue: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()

    def __iter__(self) -> Any:
        while (pending := self._queue.get()) is not None:
            yield from pending.requests(self._chunk_bytes)

    def send(self, pending: Pending) -> None:
        self._queue.put(pending)

    def close(self) -> None:
        self._queue.put(None)


class _Open:
    """A PushStream in progress: its bookkeeping, its messages and its replies."""

    def __init__(self, window: PushWindow, client: PushTarget, pushes: Sequence[Pending]) -> None:
        self.state = Stream(window.room_for(pushes))
        self.requests = _Requests(window.chunk_bytes)
        self.replies = client.push_stream(
            window.stream_seconds, iter(self.requests), window.message_bytes(self.state.room)
        )
        self.watch: threading.Timer | None = None  # the look at whether it has gone quiet (Stream.quiet)
        self.due: threading.Timer | None = None  # the look at its pushes' deadlines (PushWindow.overdue)
        self.due_at = 0.0  # when that look is (monotonic clock)


def _started(delay: float, look: Callable[[_Open], None], stream: _Open) -> threading.Timer | None:
    """A look at `stream` in `delay` seconds, on a timer's thread; None where no thread can start
    (the next push looks again)."""
    timer = threading.Timer(delay, look, (stream,))
    timer.daemon = True
    try:
        timer.start()
    except RuntimeError:  # can't start new thread
        return None
    return timer


W = TypeVar("W", bound=Ordered[Any])


class OrderedFutures(Generic[W]):
    """A pusher's futures, one per push, completed in the order of the pushes outside its lock,
    by one thread at a time: a callback that pushes again only queues what it hands back."""

    def __init__(self, window: W) -> None:
        self._window = window
        self._changed = threading.Condition()
        self._futures: dict[int, Future[PushResult]] = {}
        self._ready: deque[tuple[Any, Future[PushResult]]] = deque()  # handed back, futures to complete
        self._completing = threading.Lock()

    @property
    def in_flight(self) -> int:
        """Pushes made whose futures are not yet complete (at most the window)."""
        return len(self._window.pushes)

    def flush(self) -> None:
        """Wait until every push made so far is durable or has failed."""
        with self._changed:
            self._changed.wait_for(lambda: not self._window.pushes)

    def _settle(self) -> None:
        """Complete the futures of the pushes handed back, in order, outside the lock."""
        with self._changed:
            finished = self._window.finished()
            self._ready.extend((push, self._futures.pop(push.number)) for push in finished)
            if finished:
                self._changed.notify_all()
        while self._ready and self._completing.acquire(blocking=False):
            try:
                while self._ready:
                    push, future = self._ready.popleft()
                    if isinstance(push.outcome, PushResult):
                        future.set_result(push.outcome)
                    else:
                        future.set_exception(push.outcome)
            finally:
                self._completing.release()


class Pusher(OrderedFutures[PushWindow]):
    """Up to `window` pushes in flight to one table over one PushStream: `push()` returns a
    Future at once (waiting only while the window is full), so the next payload is encoded
    while the server stores the last. Each future holds its push's PushResult once durable,
    or its ExpbufError naming its uids; they complete in the order of the pushes. Made by
    `BufferClient.pusher()`; close it (or leave its `with`) to wait for every push:

    ```python
    with client.pusher("grpo8", window=4) as pusher:
        futures = [pusher.push(batch) for batch in batches]
    results = [f.result() for f in futures]
    ```
    """

    def __init__(self, client: PushTarget, table: str, window: int, timeout: float | None) -> None:
        super().__init__(PushWindow(table, window, client, timeout))
        self._client = client
        self._stream: _Open | None = None
        self._readers: list[threading.Thread] = []

    def push(self, items: calls.Items) -> Future[PushResult]:
        """Push TRXP bytes, experiences or a ColumnBatch; the future completes when the push is durable or
        has failed."""
        return self.push_part(calls.payload(items))

    def push_part(self, body: bytes, number: int | None = None) -> Future[PushResult]:
        """Push TRXP bytes as push `number`, by default one more than the last: a sharded
        pusher's parts go so, each numbered as the push it is a part of (named so in its
        refusal, and sent as its seq)."""
        future: Future[PushResult] = Future()
        with self._changed:
            self._changed.wait_for(lambda: not self._window.full)
            pending = self._window.add(body, number)
            self._futures[pending.number] = future
            if pending.outcome is None:
                self._send([pending])
        self._settle()
        return future

    def flush(self) -> None:
        """Wait until every push made so far is durable or has failed; the stream ends first where
        pushes are in flight (PushWindow.drains)."""
        with self._changed:
            window = self._window
            if not window.drains():
                return
            with window.draining():
                if self._stream is not None:
                    self._end(self._stream)
                self._changed.wait_for(lambda: not window.pushes)

    def close(self) -> None:
        """Wait for every push, then end the stream."""
        self.flush()
        with self._changed:
            if self._stream is not None:
                self._end(self._stream)
            readers, self._readers = self._readers, []
        for reader in readers:
            reader.join()

    def __enter__(self) -> Pusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _end(self, stream: _Open) -> None:
        """No more pushes on `stream`: it answers what it has, then ends (under the lock)."""
        stream.requests.close()
        if stream.watch is not None:
            stream.watch.cancel()
            stream.watch = None
        if self._stream is stream:
            self._stream = None

    def _watch(self, stream: _Open) -> None:
        """End `stream` once it has gone quiet (Stream.quiet), looking
        again as long as pushes go on it (under the lock)."""
        delay = stream.state.quiet()
        if delay is None or self._stream is not stream:
            return
        if delay == 0:
            self._end(stream)
            return
        if stream.watch is None:
            stream.watch = _started(delay, self._look, stream)

    def _look(self, stream: _Open) -> None:
        with self._changed:
            stream.watch = None
            self._watch(stream)

    def _watch_due(self, stream: _Open) -> None:
        """Look at `stream`'s pushes when the earliest of their deadlines passes, sooner than the
        look set where a push sent again joins it with an earlier deadline (under the lock)."""
        due = stream.state.first_due()
        if due is None or (stream.due is not None and stream.due_at <= due):
            return
        if stream.due is not None:
            stream.due.cancel()
        stream.due, stream.due_at = _started(max(0.0, due - time.monotonic()), self._look_due, stream), due

    def _look_due(self, stream: _Open) -> None:
        """Fail the pushes past their deadline; a stream left with nothing to wait for is
        cancelled (a server gone would hold it, and close() with it, until its own deadline)."""
        with self._changed:
            stream.due = None
            if self._window.overdue(stream.state) and stream.state.sent:
                self._end(stream)
                stream.replies.cancel()
            else:
                self._watch_due(stream)
        self._settle()

    def _send(self, pushes: list[Pending]) -> None:
        """Send pushes on the current stream, a new one if it takes no more (under the lock).
        Pushes to send again after the client closed fail CANCELLED: no stream opens on a closed
        channel (its reader thread died opening one, the pushes left to no one)."""
        if self._client.closed:
            why = ": whether it was stored is unknown"
            for pending in pushes:
                pending.fail(grpc.StatusCode.CANCELLED, "the client was closed", why)
            return
        reader = None
        if self._stream is None or not self._window.takes(self._stream.state, pushes):
            if self._stream is not None:
                self._end(self._stream)
            self._stream = _Open(self._window, self._client, pushes)
            reader = threading.Thread(target=self._read, args=(self._stream,), name="expbuf-pusher", daemon=True)
            self._readers = [r for r in self._readers if r.is_alive()] + [reader]
        try:
            for pending in pushes:
                self._stream.state.sent.append(pending)
                self._stream.requests.send(pending)
            self._stream.state.last_sent = time.monotonic()
            self._watch_due(self._stream)
        finally:  # the pushes the stream's and their deadlines watched, whatever interrupts (Ctrl-C,
            if reader is not None:  # ray.cancel) a thread's start: a push left sent by none, failed by
                reader.start()  # none, held every later future, flush() and close() for good
        if self._window.ends_streams:
            self._end(self._stream)
        else:
            self._watch(self._stream)

    def _read(self, stream: _Open) -> None:
        error: grpc.RpcError | None = None
        try:
            for reply in stream.replies:
                with self._changed:
                    again = self._window.answered(stream.state, reply)
                    if again:  # on a new stream: this one answers what it has, then ends
                        self._end(stream)
                        self._send(again)
                self._settle()
        except grpc.RpcError as exc:
            error = exc
        stream.requests.close()  # gRPC's thread that sends them may be waiting for one
        with self._changed:
            again, pause = self._window.ended(stream.state, error, self._client.closed)
            if self._stream is stream:
                self._stream = None
            if stream.due is not None:
                stream.due.cancel()
                stream.due = None
        self._settle()
        if again:
            time.sleep(pause)
            with self._changed:
                self._send(again)
            self._settle()
