"""A Sample stream's batches decoded ahead of the caller (tf.data's prefetch).

While the caller trains on one batch, a thread of the stream's own reads the next replies
and decodes each (calls.batch: the checks a reader relies on), so the caller's step, the
receive and the decode run at once. At most `depth` decoded batches wait for the caller.

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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from .results import Batch
from .rpc.sample_reply import SampleReplyParts

THREAD_NAME = "expbuf-prefetch"


@dataclass(frozen=True)
class Outcome:
    """One step of the stream, in its order: a batch decoded, a batch's DataLossError, or the
    end of the stream (`last`, with the error that ended it, if one did)."""

    batch: Batch | None = None
    error: BaseException | None = None
    last: bool = False


class Prefetcher:
    """Reads replies with `read` (None at the stream's end) and decodes each with `decode` on
    a thread of its own, up to `depth` ahead of the caller; passes each Outcome to `deliver`,
    in order, the last one included whatever ends the stream."""

    def __init__(
        self,
        read: Callable[[], SampleReplyParts | None],
        decode: Callable[[SampleReplyParts], Batch],
        depth: int,
        deliver: Callable[[Outcome], None],
    ) -> None:
        self.depth = depth
        self.ended = False  # the caller has had the last outcome
        self._read, self._decode, self._deliver = read, decode, deliver
        self._room = threading.Condition()
        self._waiting = 0  # decoded (or being decoded) and not yet taken: at most depth
        self._stopping = False
        self._call_done = False
        self._finished = False  # the stream has ended: what waits went back to the buffer
        self._error: BaseException | None = None  # what ended it, if not its normal end
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            while (reply := self._read()) is not None:
                if self._make_room():
                    self._deliver(self._decoded(reply))
        except Exception as exc:  # the stream broke or was cancelled
            error = exc
        finally:
            with self._room:
                self._finished, self._error = True, error
            self._deliver(Outcome(error=error, last=True))

    def _make_room(self) -> bool:
        """Wait until fewer than `depth` batches wait for the caller, and count one more. False
        once the caller stopped or the call ended: the rest of the stream is read (so it ends
        cleanly, or the error that ended it is seen), not decoded."""
        with self._room:
            self._room.wait_for(lambda: self._waiting < self.depth or self._stopping or self._call_done)
            if self._stopping or self._call_done:
                return False
            self._waiting += 1
            return True

    def _decoded(self, reply: SampleReplyParts) -> Outcome:
        try:
            return Outcome(batch=self._decode(reply))
        except Exception as exc:  # a DataLossError waits in its batch's place
            return Outcome(error=exc)

    def take(self, outcome: Outcome) -> Batch | None:
        """The batch to hand the caller next, None at the stream's end. Raises a batch's
        DataLossError in its place. Once the stream has ended, raises the error that ended it
        or returns None, whatever still waits: it went back to the buffer with the stream."""
        with self._room:
            if outcome.last:
                self.ended = True
            else:
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

    def skip(self, outcome: Outcome) -> None:
        """An outcome after the caller stopped: dropped (a batch in it goes back with the stream)."""
        self.ended = outcome.last

    def stop(self) -> None:
        """The caller is done: nothing more is decoded, and the thread reads on to the stream's
        end (the client ends the stream, and what is on its way goes back to the buffer)."""
        with self._room:
            self._stopping = True
            self._room.notify()

    def call_done(self, *_: object) -> None:
        """The call ended (a done callback: an error, a cancel, the channel closed), perhaps while
        the thread waits for room: it reads on, to the stream's end or error, and then ends."""
        with self._room:
            self._call_done = True
            self._room.notify()

    def join(self) -> None:
        """Wait for the thread, once its last outcome has been delivered (it ends right after)."""
        self._thread.join()
