"""A payload pushed in chunks over PushStream (total_bytes in its first chunk), read chunk by chunk:
gRPC's copies are then of one chunk at a time, and `max_message_bytes` bounds a chunk, not the
payload. One with an experience whose tensor data is larger than the store's chunk
(store/disk/chunked.py), whose head comes whole in its first chunk, is staged as it arrives
(ingest.Stager): each such experience's data goes to the store a chunk at a time, and the push
holds its head, its other experiences' data and a chunk of each large one, whatever its size. Any
other is put together here in memory of its own size.

It is admitted by what it will hold (all of it, or its staging) and a chunk as large as its first
on its way (a later chunk larger than its first is refused), reserving that once it fits beside
what is held under `max_inflight_bytes` (waiting up to the stream's wait, then refused), and
refused at once, naming both, when that is larger than the cap; its reservation, and what it staged
that its push did not store, is given back however the push ends. One larger than
`max_push_bytes` is refused at its first chunk: a staged push writes all of itself to disk before
its commit, whatever it holds in memory. For the same reason what a staged push stages must fit in
its table's capacity_bytes, beside what the table's other staged pushes announced, before any of it
is staged (store/services/staged.py: refused at once, or after a wait for room, naming the
setting). After its first `push_stream_idle_seconds` it must bring `push_min_mb_per_second` over
every `push_stream_idle_seconds`, or be refused (`Pace`): a chunk per idle period would otherwise
hold a worker, its reservation and what it staged for ever, and an allowance from the size it
announced would let a push that drips after most of its bytes keep them for hours.

The messages of the stream before a push's first chunk, and that first chunk itself, are admitted
by push_memory.PushMemory, which hands the rest of the push to `ChunkReader.read`.
"""

from __future__ import annotations

import collections
import mmap
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import grpc

from expbuf.client.schema.reasons import Reason

from ...store import Entry
from ...store.schema.errors import StoreError
from ..interceptors.limits import PROGRESS
from .inflight import InFlight
from .ingest import StagedPush, Stager
from .push_request import PushMessage, Refusal

T = TypeVar("T")


def remaining(context: grpc.ServicerContext) -> float:
    """How long a push may wait to be read: its deadline, less the time to send a refusal."""
    left = context.time_remaining()
    return 3600.0 if left is None else max(0.0, left - min(1.0, 0.1 * left))


class ChunkReader:
    """Reads the rest of a push whose first chunk announced total_bytes: reserves what it will
    hold, then stages its chunks or puts them together, paced."""

    def __init__(
        self,
        inflight: InFlight,
        stager: Stager | None,
        stream_wait: float,
        min_mb_per_second: float,
        grace: float,
        max_push_bytes: int,
    ) -> None:
        self.inflight, self.stager, self.stream_wait = inflight, stager, stream_wait
        self.min_mb_per_second, self.grace, self.max_push_bytes = min_mb_per_second, grace, max_push_bytes
        self._waiting = threading.Lock()  # held by the one push in chunks that waits for room (`_reserve`)

    def read(
        self, first: PushMessage, requests: Iterator[Any], context: grpc.ServicerContext, owner: object
    ) -> Generator[Any, None, PushMessage]:
        """The payload whose first chunk is `first`, reserved (`_reserve`) and read from the chunks
        that follow it: staged as it comes where the stager takes it (its message then carries its
        experiences, ingest.Stager), else put together in memory of its own and returned as one
        message; PROGRESS after each chunk but the last, so that the stream is not taken for idle. A
        staged push that does not fit in its table's capacity_bytes is refused before it stages
        anything. A stream that ends before the last chunk, begins its next push there, or sends a
        chunk whose offset is past the chunks read (cut short, Reason.CUT_SHORT: a chunk lost on its
        way, which the client sends again, pushers/pipeline.py),
        or whose chunks come slower than min_mb_per_second over a grace's time once the grace is over
        (`Pace`), is refused: nothing of the push is stored, and what it reserved and staged is given
        back."""
        total = first.total_bytes
        if total > self.max_push_bytes:
            first.release()
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"PushRequest: a payload in chunks of total_bytes = {total} is larger than max_push_bytes = "
                f"{self.max_push_bytes}, the largest push this server takes (raise it with EXPBUF_MAX_PUSH_BYTES "
                "or in the config file, or push fewer experiences at once): nothing of it is stored",
                Reason.TOO_LARGE,
            )
        staged = None if self.stager is None else self.stager.open(first.table or "default", first.payload, total)
        try:
            if staged is not None:
                wait = min(self.stream_wait, remaining(context))
                _refused_by_store(lambda: staged.open(wait))  # what it stages, within capacity_bytes
            chunk = len(first.payload)  # the largest chunk of the push: one is on its way while it is read
            self._reserve(first, context, owner, (total if staged is None else staged.holds) + chunk)
        except BaseException:
            first.release()
            if staged is not None:
                staged.drop()  # nothing staged yet: its share of the table's staging alone
            raise
        message = PushMessage(first.table, memoryview(b""), first.seq, held=first.held)
        try:
            if staged is None:
                whole = memoryview(mmap.mmap(-1, total, mmap.MAP_PRIVATE))  # anonymous: given back whole once let go
                message.payload = whole
                del whole  # the message alone holds the payload, which the servicer lets go once decoded
                take = _into(message)
            else:
                message.held.append(staged.drop)
                take = _staging(staged)
            yield from self._pieces(first, requests, take)
            if staged is not None:
                message.entries = _staged(staged)
        except BaseException:
            message.release()  # what the message holds: first's list
            raise
        return message

    def _reserve(self, first: PushMessage, context: grpc.ServicerContext, owner: object, size: int) -> None:
        """Hold what a push in chunks will hold at most (`size`: what it announces, total_bytes, or
        what staging it holds, and a chunk on its way), its first chunk counted in it all along:
        at once where it fits beside what pushes in progress hold; else one such push at a time
        waits for room (as a message's read does), and another is refused at once as busy, having
        done nothing (its client sends it again after a pause). Each one that waited did so with
        its first chunk read and given back uncounted, so that many of them held a chunk each
        beyond the cap. Refused at once when larger than the cap, which it could never fit under."""
        total, limit = first.total_bytes, self.inflight.limit
        if size > limit:
            first.release()
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"PushRequest: a payload in chunks of total_bytes = {total} holds {size} bytes as it is read, "
                f"more than max_inflight_bytes = {limit}, the payload bytes pushes in progress may hold together "
                "(raise it with EXPBUF_MAX_INFLIGHT_BYTES or in the config file, or push less at once)",
                Reason.TOO_LARGE,
            )
        counted = min(len(first.payload), size)
        kept = self.inflight.hold(counted)  # not its stream's: a stream's own holds stop its wait's clock
        first.release()
        first.held.append(kept)
        held = self.inflight.hold_now(size - counted, owner)
        if held is None:
            if not self._waiting.acquire(blocking=False):
                raise Refusal(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a push in chunks of total_bytes = {total} holds {size} bytes as it is read, which do not fit "
                    f"beside what pushes in progress hold ({self.inflight.holders()}, max_inflight_bytes = {limit}), "
                    "and another push in chunks already waits for room: nothing of it was stored; send it again "
                    "after a pause (expbuf's clients do so within its deadline)",
                    Reason.BUSY,
                    busy=True,
                )
            try:
                what = f"a push in chunks of total_bytes = {total} waited for room: "
                waited = self.inflight.reserve(size - counted, min(self.stream_wait, remaining(context)), owner, what)
            finally:
                self._waiting.release()
            if isinstance(waited, str):
                raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, waited, Reason.INFLIGHT_FULL)
            held = waited
        first.held.append(held)

    def _pieces(
        self, first: PushMessage, requests: Iterator[Any], take: Callable[[int, memoryview], None]
    ) -> Generator[Any, None, None]:
        """Hand each chunk of the push whose first chunk is `first` to `take` (where it starts in
        the payload, its bytes), checked as `read` says; PROGRESS between chunks."""
        total, got = first.total_bytes, len(first.payload)
        largest = got  # the first chunk's size bounds the others: its reservation holds one on its way
        where = f"the push of seq {first.seq} in chunks (total_bytes = {total})"
        pace = Pace(self.grace, time.monotonic())
        take(0, first.payload)
        first.drop_payload()
        while got < total:
            yield PROGRESS
            chunk = next(requests, None)
            if chunk is None:
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"PushStream ended {got} bytes into {where}: nothing of it is stored",
                    Reason.CUT_SHORT,
                )
            if chunk.seq or chunk.total_bytes:  # the first message of the next push
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"PushRequest {got} bytes into {where}: the next push began (seq {chunk.seq}), so a chunk of "
                    "this one never came: nothing of it is stored",
                    Reason.CUT_SHORT,
                )
            if chunk.table or not chunk.payload:
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"PushRequest {got} bytes into {where}: a chunk after the first carries a payload and "
                    "nothing else (table, seq and total_bytes unset)",
                    Reason.INVALID_REQUEST,
                )
            if chunk.offset and chunk.offset != got:
                raise _misplaced(chunk.offset, got, where)
            if len(chunk.payload) > largest:
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"PushRequest {got} bytes into {where}: a chunk of {len(chunk.payload)} bytes, larger than the "
                    f"push's first ({largest} bytes), which no later chunk may pass (max_inflight_bytes holds room "
                    "for one of its size on its way)",
                    Reason.INVALID_REQUEST,
                )
            end = got + len(chunk.payload)
            if end > total:
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"PushRequest {got} bytes into {where}: its chunks add up to {end} bytes, past total_bytes",
                    Reason.INVALID_REQUEST,
                )
            now = time.monotonic()
            recent, needed = pace.recent(now, end), self.min_mb_per_second * 1e6 * self.grace
            if end < total and now - pace.started > self.grace and recent < needed:
                raise Refusal(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"PushStream {end} bytes into {where} after {now - pace.started:.1f}s: a push in chunks must "
                    f"bring push_min_mb_per_second = {self.min_mb_per_second:g} over every "
                    f"push_stream_idle_seconds = {self.grace:g} after its first, {needed:.0f} bytes, and it "
                    f"brought {recent} in its last {self.grace:g}s (EXPBUF_PUSH_MIN_MB_PER_SECOND): "
                    "nothing of it is stored",
                    Reason.TOO_SLOW,
                )
            take(got, chunk.payload)
            chunk.drop_payload()
            got = end


def _misplaced(offset: int, got: int, where: str) -> Refusal:
    """The refusal of a chunk whose offset is not where the chunks read end: past it, a chunk
    before it never came (cut short, and the client sends the push again); before it, the
    chunks overlap."""
    if offset > got:
        return Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"PushRequest {got} bytes into {where}: a chunk at offset {offset}, so the chunk at offset {got} never "
            "came: nothing of it is stored",
            Reason.CUT_SHORT,
        )
    return Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"PushRequest {got} bytes into {where}: a chunk at offset {offset}, inside the chunks before it",
        Reason.INVALID_REQUEST,
    )


class Pace:
    """What a push in chunks brought in its last `window` seconds: the bytes received since a
    mark at least `window` old (at most MARKS marks a window, so a push of many tiny chunks keeps
    few), so a push that slows to a drip after most of its bytes is ended a window later, whatever
    it announced."""

    MARKS = 16

    def __init__(self, window: float, started: float) -> None:
        self.window, self.started = window, started
        self._marks: collections.deque[tuple[float, int]] = collections.deque([(started, 0)])

    def recent(self, now: float, got: int) -> int:
        """The bytes received since the newest mark at least a window before `now`, `got` (all it
        received) counted at `now`."""
        while len(self._marks) > 1 and self._marks[1][0] <= now - self.window:
            self._marks.popleft()
        if now - self._marks[-1][0] >= self.window / self.MARKS:
            self._marks.append((now, got))
        return got - self._marks[0][1]


def _into(message: PushMessage) -> Callable[[int, memoryview], None]:
    """What puts a push's chunks together in its message's payload."""

    def take(at: int, data: memoryview) -> None:
        message.payload[at : at + len(data)] = data

    return take


def _staging(staged: StagedPush) -> Callable[[int, memoryview], None]:
    """What takes a staged push's chunks: its bytes after its head, each refusal of the store's
    (a table gone, a full disk) the push's, as the stream's status."""

    def take(at: int, data: memoryview) -> None:
        skip = max(0, staged.payload.head_length - at)
        if skip < len(data):
            _refused_by_store(lambda: staged.feed(data[skip:]))

    return take


def _staged(staged: StagedPush) -> list[Entry]:
    return _refused_by_store(staged.entries)


def _refused_by_store(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except StoreError as exc:
        raise Refusal(getattr(grpc.StatusCode, exc.status), str(exc), exc.reason) from None
