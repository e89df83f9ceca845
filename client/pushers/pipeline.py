"""What the blocking and the asyncio pusher share: the window of pushes in flight, the messages
each push sends, and what the end of a stream means for each push on it. No I/O here: each
pusher (blocking.py, aio.py) only sends, reads and waits.

A pusher's pushes go over PushStream, each with its number as its seq, up to `window` of them
not yet handed back. The server stores a stream's pushes in order, several in one commit, and
answers each once it is durable. So when a stream ends with a refusal, the refusal is its oldest
unanswered push's, and the server stored none after it: that push fails alone, and the others
go again on a new stream. A stream the server ended as idle (push_stream_idle_seconds, Reason.IDLE)
read nothing after its last answered push: a push sent on it as it ended, before the pusher saw
the end, goes again on a new stream at once. A refusal that says the push did nothing (wire.BUSY:
the server lets only so many calls wait at once, and refused the stream as it opened) is not its
answer: every push unanswered on the stream goes again after a pause, until its deadline, as a
push alone does (calls.Attempts). When a stream breaks (UNAVAILABLE: the server went away), the push it was on
may or may not be stored: every push unanswered on it goes again (a push is idempotent; what was
stored comes back as duplicates) while the client's retries and the push's deadline last, then
fails UNAVAILABLE naming its uids. A stream that reaches its deadline (DEADLINE_EXCEEDED with no
reason of the server's: the client's own, or a proxy's) is no push's refusal: the server may
have read and stored any push unanswered on it, and go on storing them after the call ended, so
each goes again while its deadline lasts and then fails saying that whether it was stored is
unknown, never that it was not. A push still unanswered at its own deadline fails so then,
whatever its stream does (PushWindow.overdue): a stream may run on for as long again. The server
answers a stream's pushes in order, so an answer to a later push than the oldest unanswered says
the server never got those before it: their messages
were lost on the way (gRPC's transparent retry can report a message sent that never went:
connection.RETRIED_METHODS). So was a chunk of a push in chunks that the server refuses as cut
short (Reason.CUT_SHORT: it read the push's next push, or the stream's end, before its last chunk,
or a chunk whose offset says one before it never came). So were the pushes unanswered on a stream
the server ended without an error: it ends one so only once the pusher ended its side, and answers
every push it read first. They go again at once on a new stream, while the client's retries and
their deadlines last, then fail UNAVAILABLE, not stored. Futures complete in push order.

The server learns that a stream's last push was cut short, or never came, only from what follows
it: the next push, or the stream's end. So a pusher that waits for its pushes with no push to
send after them (flush(), close()) ends its stream first, and each stream opened while it waits
(to send a push again) once its pushes are sent: a loss there is known at once, not at the
stream's deadline. A caller may wait otherwise (a future's result, or room in a window of 1), so a
stream on which no push went for QUIET while some are unanswered ends too (Stream.quiet); so does
one with none unanswered, which would hold the server's room for its next message while it idles.

Both resends are made here, by hand. gRPC's retry policy retries a stream only until its first
reply, and sends again everything the stream carried: a pusher's stream has answered pushes
before it breaks, and only those unanswered may go again. So a pusher's streams go over the
client's channel without the policy (connection.py), and their pushes are sent again here, with
the client's `retries` and the policy's backoff (connection.BACKOFF).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from .. import trxp
from ..errors import ExpbufError
from ..results import PushResult
from ..rpc import calls, frames
from ..rpc.connection import BACKOFF, CLOSED_BEFORE, busy, past_the_servers_limit
from ..rpc.wire import reason_of
from ..schema.reasons import Reason

MAX_PUSHES_AHEAD = 64  # the most pushes a pipeline keeps in flight (its window)
# How long a stream may go with no push sent on it before the pusher ends it (Stream.quiet): an
# answer comes in milliseconds, and the next push after it opens a stream of its own, which costs
# it about a round trip.
QUIET = 1.0
# The least payload a stream declares room for (PushWindow.room_for): pushes of about the same size
# share a stream, and a few hundred busy pushers of small pushes hold a few MiB of the server's room.
LEAST_ROOM = 1 << 16
NAMED_UIDS = 32  # the uids an error names; past them, how many more


def check_window(window: Any) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= MAX_PUSHES_AHEAD:
        raise ValueError(f"window must be an integer from 1 to {MAX_PUSHES_AHEAD}, got {window!r}")
    return window


@dataclass(eq=False)
class Pending:
    """One push of a pusher, from push() until its future is completed."""

    number: int  # 1 for the pusher's first push; its seq on the wire
    table: str
    body: bytes
    deadline: float  # monotonic: no retry starts after it
    attempts: int = 0  # sends after the first, of a push whose stream broke or that the server never got
    kept_out: int = 0  # sends after the first, of a push the server refused as having done nothing
    refusal: ExpbufError | None = None  # what kept it out last (PushWindow._kept_out)
    outcome: PushResult | ExpbufError | None = None

    def requests(self, chunk_bytes: int) -> Iterator[bytes]:
        """Its messages; none once it has failed (at its deadline, `PushWindow.overdue`) before
        they went: its body is gone, and the server, answering the pushes after it, shows it
        never came. The body is read before the outcome, which `fail` sets before it drops it."""
        body = self.body
        if self.outcome is not None:
            return iter(())
        return calls.push_requests(body, self.table, chunk_bytes, self.number)

    def fail(self, code: grpc.StatusCode, details: str, why: str = "", reason: str | None = None) -> None:
        """Fail with the error of `code`, naming the push and its uids (read from its payload only now)."""
        try:
            uids = calls.payload_uids(self.body)
        except trxp.TrxpError:
            uids, named = (), "its payload is neither TRXP nor columns, so its uids are unknown"
        else:
            shown = ", ".join(uids[:NAMED_UIDS])
            more = f" and {len(uids) - NAMED_UIDS} more" if len(uids) > NAMED_UIDS else ""
            named = f"uids {shown}{more}"
        error = ExpbufError(code, f"{details} (push {self.number} of this pusher{why}; {named})", reason)
        error.uids = uids
        self.outcome = error
        self.body = b""

    def unanswered(self, details: str, why: str) -> None:
        """Fail unanswered at its deadline (DEADLINE_EXCEEDED, `details`), whether it was stored
        unknown; but for a push the server kept out and that went again, with the refusal that
        kept it out, as a push alone (calls.Attempts.answer): how much of its deadline its last
        attempt had is down to where the pauses fell and how loaded the machines are."""
        if self.refusal is None:
            self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, details, why)
        else:
            refusal = self.refusal
            self.fail(refusal.code, refusal.details, f": {calls.LAST_UNANSWERED}", refusal.reason)


@dataclass(eq=False)
class Stream:
    """One PushStream's bookkeeping: when it opened, when a push last went on it, and its pushes
    not yet answered, oldest first."""

    room: int | None = None  # the payload a message on it may carry (PushWindow.room_for); None: any
    opened: float = field(default_factory=time.monotonic)
    sent: deque[Pending] = field(default_factory=deque)
    last_sent: float = 0.0  # monotonic

    def first_due(self) -> float | None:
        """The earliest deadline of a push unanswered on the stream that has no outcome yet
        (monotonic clock); None where there is none."""
        return min((pending.deadline for pending in self.sent if pending.outcome is None), default=None)

    def quiet(self) -> float | None:
        """How long until the stream has had no push sent on it for QUIET (0: it has, and ends
        now): with pushes unanswered, so that its last push's loss is known while its caller waits
        for it however it waits (a future's result, not flush()); with none, so that it gives back
        what the server holds for its next message (the most a chunk's, max_inflight_bytes: a few
        hundred idle pushers' streams held all of it, and every other push waited for room). None
        before any push went on it."""
        if not self.last_sent:
            return None
        return max(0.0, self.last_sent + QUIET - time.monotonic())


class Numbered(Protocol):
    number: int
    outcome: Any  # None until the push has one


P = TypeVar("P", bound=Numbered)


class Ordered(Generic[P]):
    """Pushes in the order pushed, up to `size` of them not yet handed back, each handed back
    once it and every push before it have an outcome."""

    def __init__(self, size: int) -> None:
        self.size = check_window(size)
        self.pushes: deque[P] = deque()
        self._numbers = 0

    @property
    def full(self) -> bool:
        return len(self.pushes) >= self.size

    def number(self, given: int | None = None) -> int:
        """The next push's number: `given` (greater than the last), or one more than the last."""
        self._numbers = self._numbers + 1 if given is None else given
        return self._numbers

    def drains(self) -> bool:
        """Whether a wait for every push sent to be answered (flush(), close()) must end the
        streams they are on: the server learns that a push was cut short only from the message
        after it, or from the stream's end, and none follows the last push sent while the pusher
        waits. A wait for room (in a window of 1, for the one push in flight) leaves its stream open
        for the next push, a loss there known once the stream has gone quiet (Stream.quiet): a
        stream a push would cost each push its round trip."""
        return bool(self.pushes)

    def finished(self) -> list[P]:
        """The pushes handed back now: those with an outcome with none unfinished before them."""
        done = []
        while self.pushes and self.pushes[0].outcome is not None:
            done.append(self.pushes.popleft())
        return done


class PushTarget(Protocol):
    """What a pusher needs of the client that made it (BufferClient, AsyncBufferClient): its
    settings and a PushStream of its own (ClientBase.push_stream)."""

    timeout: float
    retries: int
    push_chunk_bytes: int
    max_message_bytes: int
    closed: bool  # its close() began

    def push_stream(
        self, seconds: float, requests: Iterator[Any] | None = None, message_bytes: int | None = None
    ) -> Any: ...


class PushWindow(Ordered[Pending]):
    """A pusher's pushes in the order pushed, up to `size` of them not yet handed back."""

    def __init__(self, table: str, size: int, client: PushTarget, timeout: float | None) -> None:
        super().__init__(size)
        self.table = table
        self.chunk_bytes: int = client.push_chunk_bytes
        self.max_message_bytes: int = client.max_message_bytes
        self.timeout: float = timeout or client.timeout
        self.retries: int = client.retries
        self._client = client
        self._waiting = 0  # callers waiting for every push sent to be answered (`draining`)

    def room_for(self, pushes: Sequence[Pending]) -> int | None:
        """The payload a message of a stream opened for `pushes` may carry: the largest of their
        messages' (a push sent whole, or a chunk), rounded up to a power of two of at least
        LEAST_ROOM, at most a chunk; None where every push goes whole (push_chunk_bytes = 0), which
        max_message_bytes alone bounds. The server holds what a stream declares for its next message
        while it is open: a chunk's (4 MiB) for every busy pusher of small pushes held 128 MiB with
        the server's default max_push_streams (32), all of max_inflight_bytes with it raised for
        a few hundred rollout workers."""
        if not self.chunk_bytes:
            return None
        largest = max((len(pending.body) for pending in pushes), default=0)
        return min(self.chunk_bytes, max(LEAST_ROOM, 1 << (largest - 1).bit_length()))

    def message_bytes(self, room: int | None) -> int | None:
        """What a stream with `room` declares of its messages (wire.MESSAGE_BYTES)."""
        return None if room is None else frames.most_push_request(room, self.table)

    @property
    def stream_seconds(self) -> float:
        """A stream's deadline: a push joins one only in its first `timeout` seconds, so each
        push has at least the client's timeout, as a push alone has. A push unanswered at its own
        deadline fails then, not at its stream's (`overdue`)."""
        return 2 * self.timeout

    def overdue(self, stream: Stream) -> bool:
        """Fail each push unanswered on `stream` whose deadline has passed, DEADLINE_EXCEEDED and
        whether it was stored unknown, as a push alone is at its deadline: its stream may run on
        for as long again (a push joins one up to `timeout` after it opened), and a stream that
        waits for a server that went away (wait_for_ready) waits out its whole deadline. Whether
        every push sent on `stream` has an outcome now: nothing is left to wait for on it."""
        now = time.monotonic()
        for pending in stream.sent:
            if pending.outcome is None and now >= pending.deadline:
                pending.unanswered(
                    f"not answered within the pusher's timeout of {self.timeout:g}s",
                    ": whether it was stored is unknown, and pushing it again is safe",
                )
        return all(pending.outcome is not None for pending in stream.sent)

    @contextlib.contextmanager
    def draining(self) -> Iterator[None]:
        """While a caller waits as `drains` says: each stream ends once its pushes are sent
        (`ends_streams`), so that one sent again meanwhile, on a new stream, is not left waiting."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    @property
    def ends_streams(self) -> bool:
        return self._waiting > 0

    def takes(self, stream: Stream | None, pushes: Sequence[Pending]) -> bool:
        """Whether `pushes` may go on `stream`: it opened less than `timeout` ago, and has room for
        each of their messages (a larger one goes on a stream of its own, which declares it)."""
        if stream is None or time.monotonic() - stream.opened >= self.timeout:
            return False
        room = stream.room
        return room is None or all(min(len(pending.body), self.chunk_bytes) <= room for pending in pushes)

    def add(self, body: bytes, number: int | None = None) -> Pending:
        """The next push, of a payload the pusher encoded while earlier ones were on their way;
        `number`, when given, is its number (a sharded pusher's, whose push this is a part of).
        One no message could carry fails at once, and so does one made after the client's close()."""
        pending = Pending(self.number(number), self.table, body, time.monotonic() + self.timeout)
        if self._client.closed:
            pending.fail(grpc.StatusCode.CANCELLED, CLOSED_BEFORE % "Push", ": nothing was sent")
        elif self.chunk_bytes == 0 and len(body) > self.max_message_bytes:
            pending.fail(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a payload of {len(body)} bytes is larger than max_message_bytes = {self.max_message_bytes} "
                "and push_chunk_bytes = 0 sends it whole",
            )
        self.pushes.append(pending)
        return pending

    def answered(self, stream: Stream, reply: pb.PushReply) -> list[Pending]:
        """The server answered a push unanswered on `stream`: it is durable. It answers them in
        order, so an answer to a later push than the oldest says the server never got those before
        it (their messages lost on the way): they are returned, to go again on a new stream at once
        while the pusher's retries and their deadlines last; the others fail, not stored."""
        numbers = [pending.number for pending in stream.sent]
        skipped = numbers.index(reply.seq) if reply.seq in numbers else 0
        lost = [pending for pending in (stream.sent.popleft() for _ in range(skipped)) if pending.outcome is None]
        if not stream.sent:
            return []
        pending = stream.sent.popleft()
        if pending.outcome is not None:  # failed at its deadline (`overdue`), its caller told so
            pass
        elif reply.seq != pending.number:
            pending.fail(grpc.StatusCode.INTERNAL, f"PushStream answered seq {reply.seq}, not {pending.number}")
        else:
            pending.outcome = calls.push_result(reply)
            pending.body = b""
        return self._lost(lost, f"PushStream answered seq {reply.seq} first: the server never got this push")

    def ended(self, stream: Stream, exc: grpc.RpcError | None, closed: bool) -> tuple[list[Pending], float]:
        """`stream` ended (with `exc`, or without an error): the pushes to send again, in order,
        after the pause returned; the others unanswered on it have failed. `closed`: the client's
        close() began, so a CANCELLED is its own; otherwise the server's (a stream that arrived as
        its stop began), which is taken as UNAVAILABLE."""
        sent = [pending for pending in stream.sent if pending.outcome is None]  # not failed at their deadline
        stream.sent = deque()
        if not sent:
            return [], 0.0
        if exc is None:  # the server answers every push it read before it ends a stream ended by the pusher
            return self._lost(sent, "PushStream ended without answering it: the server never got this push"), 0.0
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.CANCELLED and closed:  # on this side: the channel closed
            for pending in sent:
                pending.fail(code, details, ": the pusher's call was cancelled, whether it was stored is unknown")
            return [], 0.0
        if code == grpc.StatusCode.CANCELLED:  # the server's: it cancels calls that arrive as its stop begins
            code = grpc.StatusCode.UNAVAILABLE
        reason = reason_of(exc.trailing_metadata())
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and reason == Reason.IDLE:
            return self._in_time(sent, code, details), 0.0  # pushes sent as the server ended the idle stream
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and reason is None:  # the call's deadline, no refusal
            return self._in_time(sent, code, details, read=True), 0.0
        if code != grpc.StatusCode.UNAVAILABLE and busy(exc):
            return self._kept_out(sent, code, details, reason)
        if reason == Reason.CUT_SHORT:  # a chunk of the oldest lost on its way; none after it read
            return self._lost(sent[:1], details) + self._in_time(sent[1:], code, details), 0.0
        if code != grpc.StatusCode.UNAVAILABLE:
            sent.pop(0).fail(code, past_the_servers_limit(details, "the server"), reason=reason)
            return self._in_time(sent, code, details), 0.0
        pause = BACKOFF.pause(max(pending.attempts for pending in sent))

        def fail(push: Pending) -> None:
            why = f", not answered after {push.attempts - 1} retries: whether it was stored is unknown"
            push.fail(code, details, f"{why}, and pushing it again is safe")

        return self._retried(sent, pause, fail), pause

    def _lost(self, pushes: list[Pending], details: str) -> list[Pending]:
        """Pushes the server never got whole (their messages, or a chunk of one, lost on the way):
        those to go again at once on a new stream, within the pusher's retries and their deadlines;
        each of the others fails UNAVAILABLE, not stored."""
        return self._retried(pushes, 0.0, lambda push: push.fail(grpc.StatusCode.UNAVAILABLE, details, ", not stored"))

    def _retried(self, pushes: list[Pending], pause: float, fail: Callable[[Pending], None]) -> list[Pending]:
        """Of pushes to go again after `pause`, those within the pusher's retries and their
        deadlines; each of the others fails (`fail`)."""
        again = []
        for pending in pushes:
            pending.attempts += 1
            if pending.attempts > self.retries or time.monotonic() + pause >= pending.deadline:
                fail(pending)
            else:
                again.append(pending)
        return again

    def _kept_out(
        self, pushes: list[Pending], code: grpc.StatusCode, details: str, reason: str | None
    ) -> tuple[list[Pending], float]:
        """The server refused the oldest of `pushes` as having done nothing, as many calls as it
        lets wait doing so already (wire.BUSY; a stream refused as it opened), and read none after
        it: each goes again after the pause returned, as a push alone would (calls.Attempts), and
        one whose deadline comes first fails with the refusal, not stored."""
        pause = BACKOFF.pause(max(pending.kept_out for pending in pushes))
        again = []
        for pending in pushes:
            pending.kept_out += 1
            pending.refusal = ExpbufError(code, details, reason)
            if time.monotonic() + pause >= pending.deadline:
                pending.fail(code, details, ", refused until its deadline: not stored", reason)
            else:
                again.append(pending)
        return again, pause

    def _in_time(self, pushes: list[Pending], code: grpc.StatusCode, details: str, read: bool = False) -> list[Pending]:
        """Of pushes the server did not read, those with time left; the others fail, not stored.
        With `read`, pushes the server may have read and stored, unanswered when the stream's
        deadline ended it: those with time left go again (a push is idempotent), and the others
        fail saying that whether they were stored is unknown."""
        now = time.monotonic()
        for pending in pushes:
            if now < pending.deadline:
                continue
            if read:
                pending.unanswered(
                    f"not answered in time: the stream it was on reached its deadline ({code.name}: {details})",
                    ": whether it was stored is unknown, and pushing it again is safe",
                )
            else:
                pending.fail(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"not sent in time: the stream it was on ended ({code.name}: {details})",
                    ", not stored",
                )
        return [pending for pending in pushes if pending.outcome is None]
