"""A Sample stream's batches decoded ahead of the caller (tf.data's prefetch).

While the caller trains on one batch, a thread of the stream's own reads the next replies as
they come, and another decodes each (calls.batch: the checks a reader relies on), so the
caller's step, the receive and the decode run at once. At most `depth` decoded batches wait for
the caller; the reader reads on meanwhile (what the server sends ahead, at most its window), so
that the stream's end is seen as soon as it comes, however many batches wait.

What counts as received does not change: the client confirms a batch (the server's
Store.confirm; a lease's clock starts) when its caller takes it, never when it was decoded
here. A batch waiting here is one of the stream's credit window (the server sends at most
`window` batches not confirmed), so `depth` is at most the window (SampleSpec checks it); it
is neither leased nor consumed, and returns to the buffer when the stream ends or the process
dies. A batch that cannot be decoded waits in its place as its DataLossError. Once the stream
has ended, the batches still waiting here went back with it (the server ends a stream
normally with batches unconfirmed only when it found no more data for an `allow_partial`
stream, and otherwise ends it with an error: a server gone, a deadline, a cancel): the caller
gets the end or the error, not them, so no batch is trained that the buffer holds again.

Both clients use it. The blocking client's `read` is its stream's next reply; the asyncio
client's reads on its event loop, so there only the decode runs on this thread. Each client
hands the outcomes to `take` in the order `deliver` got them, confirming each batch it returns.

Both clients read ahead even with prefetch=0 (`depth` 0: the reader alone, the replies decoded
on the caller's thread, `undecoded`) on any stream of more than one batch, where the server sends
one ahead while the caller works (with a window of 1 too): a gRPC stream tells of its end only
once every reply before it was read, so a caller that asks for a reply sent ahead would otherwise
get it after the server had ended the stream and given it back, and train on a batch the buffer
holds again; and the reader answers at once a server's word that it is stopping
(calls.Handing), whatever the caller is doing.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .results import Batch
from .rpc.sample_reply import SampleReplyParts

THREAD_NAME = "expbuf-prefetch"
READER_NAME = "expbuf-sample-reader"  # the thread that reads a stream's replies as they come
T = TypeVar("T", Batch, SampleReplyParts)


def undecoded(reply: SampleReplyParts) -> SampleReplyParts:
    """A reply read ahead with prefetch=0, handed on to be decoded on the caller's thread."""
    return reply


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """One step of the stream, in its order: a batch decoded (or a reply, read ahead undecoded),
    a batch's DataLossError, or the end of the stream (`last`, with the error that ended it, if
    one did)."""

    batch: T | None = None
    error: BaseException | None = None
    last: bool = False


class Prefetcher(Generic[T]):
    """Reads replies with `read` (None at the stream's end) on a thread of its own (READER_NAME),
    as they come, and decodes each with `decode` on another (THREAD_NAME), up to `depth` ahead of
    the caller; passes each Outcome to `deliver`, in order, the last one included whatever ends
    the stream. With `depth` 0 the reader passes each reply to `decode` as it reads it (which
    then only hands it on), and no other thread starts.

    The reader reads on while the decodes wait for room, so the stream's end is known as soon
    as it comes: a reply read but not yet taken is one the server sent ahead unconfirmed (at
    most the window), and once the server has ended the stream it went back to the buffer,
    however many wait before it."""

    def __init__(
        self,
        read: Callable[[], SampleReplyParts | None],
        decode: Callable[[SampleReplyParts], T],
        depth: int,
        deliver: Callable[[Outcome[T]], None],
    ) -> None:
        self.depth = depth
        self.ended = False  # the caller has had the last outcome
        self._read = read
        self._decode: Callable[[SampleReplyParts], T] = decode
        self._deliver: Callable[[Outcome[T]], None] = deliver
        self._room = threading.Condition()
        self._replies: deque[SampleReplyParts] = deque()  # read, not yet decoded (depth > 0)
        self._waiting = 0  # decoded (or being decoded) and not yet taken: at most depth
        self._stopping = False
        self._call_done = False
        self._finished = False  # the stream has ended: what waits went back to the buffer
        self._error: BaseException | None = None  # what ended it, if not its normal end
        self._threads = [threading.Thread(target=self._read_all, name=READER_NAME, daemon=True)]
        if depth:
            self._threads.append(threading.Thread(target=self._run, name=THREAD_NAME, daemon=True))
        for thread in self._threads:
            thread.start()

    def _read_all(self) -> None:
        error: BaseException | None = None
        try:
            while (reply := self._read()) is not None:
                if not self.depth:
                    self._deliver(self._decoded(reply))
                    continue
                with self._room:
                    self._replies.append(reply)
                    self._room.notify_all()
        except Exception as exc:  # the stream broke or was cancelled
            error = exc
        finally:
            with self._room:
                self._finished, self._error = True, error
                self._room.notify_all()
            if not self.depth:
                self._deliver(Outcome(error=error, last=True))

    def _run(self) -> None:
        """The decodes (depth > 0): each reply read, once there is room, until the stream's end."""
        while True:
            with self._room:
                self._room.wait_for(lambda: self._replies or self._finished)
                if not self._replies:
                    error = self._error
                    break
                reply = self._replies.popleft()
            if self._make_room():
                self._deliver(self._decoded(reply))
        self._deliver(Outcome(error=error, last=True))

    def _make_room(self) -> bool:
        """Wait until fewer than `depth` batches wait for the caller, and count one more. False
        once the caller stopped, the call ended or the stream did: the rest of the stream is
        read (so it ends cleanly, or the error that ended it is seen), not decoded."""
        with self._room:
            self._room.wait_for(lambda: self._waiting < self.depth or self._undecoded())
            if self._undecoded():
                return False
            self._waiting += 1
            return True

    def _undecoded(self) -> bool:
        """Whether the replies left are read, not decoded (the lock held)."""
        return self._stopping or self._call_done or self._finished

    def _decoded(self, reply: SampleReplyParts) -> Outcome[T]:
        try:
            return Outcome(batch=self._decode(reply))
        except Exception as exc:  # a DataLossError waits in its batch's place
            return Outcome(error=exc)

    def take(self, outcome: Outcome[T]) -> T | None:
        """The batch to hand the caller next, None at the stream's end. Raises a batch's
        DataLossError in its place. Once the stream has ended, raises the error that ended it
        or returns None, whatever still waits: it went back to the buffer with the stream."""
        with self._room:
            if outcome.last:
                self.ended = True
            elif self.depth:
                self._waiting -= 1
                self._room.notify()
            finished, error = self._finished, self._error
        if error is not None:
            raise error
        if finished:
            return None
        if outcome.error is not None:
            raise outcome.error
        return outcome.batch

    def skip(self, outcome: Outcome[Any]) -> None:
        """An outcome after the caller stopped: dropped (a batch in it goes back with the stream)."""
        self.ended = outcome.last

    def stop(self) -> None:
        """The caller is done: nothing more is decoded, and the reader reads on to the stream's
        end (the client ends the stream, and what is on its way goes back to the buffer)."""
        with self._room:
            self._stopping = True
            self._room.notify_all()

    def call_done(self, *_: object) -> None:
        """The call ended (a done callback: an error, a cancel, the channel closed), perhaps while
        a decode waits for room: the reader reads on, to the stream's end or error, and then ends."""
        with self._room:
            self._call_done = True
            self._room.notify_all()

    def join(self) -> None:
        """Wait for the threads, once the last outcome has been delivered (they end right after)."""
        for thread in self._threads:
            thread.join()
