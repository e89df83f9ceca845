"""One Sample stream: batches sent only when the client asks, delivered once it confirms.

The client's messages after the first are read by a thread of their own, so that the
server notices a confirmation, a stop, a closed side or a cancel while it waits for
data. The server sends a batch only while fewer than the stream's window (1 to
MAX_WINDOW, client/schema/call_limits.py) are unconfirmed, so at most that many per stream are ever on
their way, whatever gRPC's buffers would hold. Every batch is taken held (the store's
`hold`), whatever its delivery: invisible to others, and neither consumed, leased nor
counted as replayed until the client confirms it has it. Then it is consumed, or its
lease's clock starts, or its replay is counted (the store's `confirm`); every unconfirmed
batch returns to the buffer as if never taken if the stream breaks or stops first. The
expbuf clients confirm a batch as they hand it to their caller, so a leased batch waiting
in the client while the caller trains on the one before does not run down its lease.

A batch waits for its confirmation at most max_confirm_seconds, counted from the later of
its send and the client's confirmation of the batch before it: for the expbuf clients, the
caller's step. A client that hangs with its stream open (a stuck step) would otherwise hold
its window for ever. Past it the stream ends with DEADLINE_EXCEEDED naming the setting and
its unconfirmed batches return to the buffer, as on a broken stream; a confirmation sent
after that arrives at an ended call and delivers nothing. Each reply says how long its batch
may wait counted from the client's confirmation before it (`confirm_seconds`), an event
both sides see, so a client measures it on its own clock and never hands over a batch its
confirmation would reach too late (client/rpc/calls/sample_stream.py).

When the server stops, the stream ends between batches with UNAVAILABLE (rpc/draining.py): what the
client confirmed by then is delivered, and the rest returns to the buffer. A client that may be
handing a batch sent ahead to its caller just then would confirm it too late, and the batch would
be served again after the restart: so a client that says it answers (`answers_stopping`) is told
first (a reply with `stopping`), and the stream waits, within the stop's grace, for its count of
the batches it handed over; it hands over none after the message.

A client hands a batch over as it confirms it, and the server delivers it in a commit that comes
after: a confirmation lost with the connection or the server (a cut, a crash) left the batch both
trained on and back in the buffer. A client that consumes at most once says it awaits delivery
(`awaits_delivery`): the server tells it each time its count of batches delivered grows (a reply
of `delivered` alone), and the client hands a batch over only once it is told.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace
from typing import Any, NoReturn

import grpc

from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb

from ...store import Sampled, Store
from ...store.schema.errors import BatchStageFailed, InvalidRequest, StoreError
from ...store.schema.sample_spec import TakeSpec
from ..draining import Draining
from ..interceptors.base import refuse

log = logging.getLogger("expbuf.service")

# How long a client that closed its side has to show that it cancelled (see cancelled_within).
CANCEL_GRACE = 0.2


class Confirmations:
    """Which of a Sample client's messages move its stream on (stalled_sends.py's bound): one that
    confirms a batch not confirmed before, or that asks to stop. A message that confirms only what
    was confirmed already (a count sent again) says nothing of a client that reads, and a trainer
    that stopped reading but sends such messages now and then would otherwise keep its batch held
    and its reply's read snapshot open for as long as it sends them."""

    def __init__(self) -> None:
        self.received = 0

    def __call__(self, request: pb.SampleRequest) -> bool:
        news = request.stop or request.received > self.received
        self.received = max(self.received, request.received)
        return news


class ClientSide:
    """What the client of one stream has said since its first message."""

    def __init__(self, requests: Iterator[pb.SampleRequest], context: grpc.ServicerContext) -> None:
        self.received = 0  # batches confirmed
        self.confirmed_at = time.monotonic()  # when `received` last grew (before any: the first message)
        self.stopped = False  # it asked to end the stream
        self.closed = False  # it closed its side without asking to stop
        self.broken = False  # cancelled, or the connection went
        self.error: InvalidRequest | None = None
        self.terminated = False  # the call ended (before the server finished: a cancel)
        self.interrupted = False  # the server is stopping
        self._sent = 0
        self._changed = threading.Condition()
        self._context: Any = context  # grpc's server context has code() and details(); its stubs name neither
        context.add_callback(self._wake)
        threading.Thread(target=self._read, args=(requests,), name="expbuf-sample-reader", daemon=True).start()

    def _wake(self) -> None:
        with self._changed:
            self.terminated = True
            self.broken = self.broken or not (self.stopped or self.closed)
            self._changed.notify_all()

    def _read(self, requests: Iterator[pb.SampleRequest]) -> None:
        try:
            for request in requests:
                with self._changed:
                    if request.received > self._sent:  # confirms nothing: the unconfirmed batch goes back
                        self.error = InvalidRequest(
                            f"a Sample message confirms {request.received} batches, but {self._sent} were sent; "
                            "the batch not confirmed before returns to the buffer"
                        )
                    elif request.received > self.received:
                        self.received, self.confirmed_at = request.received, time.monotonic()
                    self.stopped = request.stop or self.error is not None
                    self._changed.notify_all()
                if self.stopped:
                    return
            with self._changed:
                self.closed = True
                self._changed.notify_all()
        except grpc.RpcError:
            self._wake()
        except Exception:  # a message the request check refused (interceptors/unreadable.py): it ends the stream
            if self._context.code() is None:  # no refusal: this reader's own failure ends the stream as a break
                log.exception("a Sample stream's reader failed; the stream ends, its batches not confirmed go back")
                self._wake()
                return
            details = self._context.details()
            with self._changed:
                self.error = InvalidRequest(details.decode(errors="replace") if details else "a message does not parse")
                self.stopped = True
                self._changed.notify_all()

    def interrupt(self) -> None:
        """The server is stopping: a wait for a confirmation or for data ends now."""
        with self._changed:
            self.interrupted = True
            self._changed.notify_all()

    @property
    def done(self) -> bool:
        """Nothing more will be asked for."""
        return self.stopped or self.closed or self.broken

    def sending(self, count: int) -> None:
        """The server is about to send batch number `count`."""
        with self._changed:
            self._sent = count

    def cancelled_within(self, seconds: float) -> bool:
        """After the client closed its side: whether the call ends within `seconds`. gRPC may
        report a cancel as the end of the client's messages first and as the end of the call
        a moment later; while the server has not finished, an ended call is a cancel."""
        with self._changed:
            return self._changed.wait_for(lambda: self.terminated, seconds)

    def wait_done(self, seconds: float, sent: int) -> None:
        """Wait until the client asks for nothing more, goes, or has confirmed the `sent`
        batches (nothing is left that it could hand over), at most `seconds`."""
        with self._changed:
            self._changed.wait_for(lambda: self.done or self.received >= sent, seconds)

    def confirmed(self) -> tuple[int, float]:
        """The batches confirmed, and when the last confirmation came (monotonic clock)."""
        with self._changed:
            return self.received, self.confirmed_at

    def wait_confirmed(self, count: int, due: Callable[[], float]) -> bool:
        """Wait until the client confirms `count` batches; False if it never will, the server is
        stopping, or `due()` passes first (monotonic clock: the oldest unconfirmed batch's bound)."""
        with self._changed:
            while not (self.received >= count or self.done or self.interrupted):
                left = due() - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self.received >= count


def stream_batches(
    store: Store,
    spec: TakeSpec,
    requests: Iterator[pb.SampleRequest],
    context: grpc.ServicerContext,
    *,
    owner: str,
    timeout: Callable[[], float],
    reply: Callable[[Sampled, float], Iterator[bytes]],
    draining: Draining,
    confirm_seconds: float,
    bound: str = "",
    answers_stopping: bool = False,
    awaits_delivery: bool = False,
    delivered: Callable[[Sampled], None] | None = None,
) -> Iterator[bytes]:
    """The replies of one stream, each batch's messages made by `reply(batch, seconds)` (one, or
    its parts): `seconds` is how long
    the batch may wait for its confirmation, counted from the confirmation before it.
    `timeout()` is how long the next batch may wait for data; `bound` says what set it,
    when the server shortened what the client asked. `confirm_seconds` is the server's
    max_confirm_seconds. `delivered` hears of each batch once its client has confirmed it.

    Returns None through StopIteration when the stream ends; raises DEADLINE_EXCEEDED
    (through `context.abort`) when no batch could be made in time or a batch was not
    confirmed in time, UNAVAILABLE when the server stops (`draining`). A stream that finds no
    data for its next batch while batches it sent wait in the client ends only once those are
    confirmed (delivered) or the client is gone: the client hands a batch to its caller and
    confirms it without knowing whether the stream has ended, and one given back as the stream
    ended would be trained on and delivered again. For the same reason a client that
    `answers_stopping` is told of a stop before its stream ends (`_Window.end_at_stop`), and one
    that `awaits_delivery` of each delivery (`_Window.told`).
    """
    client = ClientSide(requests, context)
    window = _Window(store, spec, client, owner, confirm_seconds, answers_stopping, delivered)
    window.tells = awaits_delivery
    yield from window.told()  # 0 delivered: the client learns that the server tells
    deadline: float | None = None  # of the wait for the next batch's data
    try:
        with draining.watching(client.interrupt):
            while True:
                if deadline is None:
                    deadline = time.monotonic() + timeout()
                try:
                    batch = None if client.interrupted else window.take(deadline, context)
                except StoreError:  # the rate limit at its deadline, an index not built: the stream ends with it
                    yield from window.settle(draining, context)
                    raise
                yield from window.told()
                if isinstance(batch, DeliveryTold):  # a delivery told of while it waits for data: the wait goes on
                    continue
                deadline = None
                if batch is None:
                    if client.error is not None:
                        raise client.error
                    if client.stopped or client.broken or not context.is_active():
                        return
                    if client.interrupted:
                        yield from window.end_at_stop(draining, context)
                    if window.overdue():
                        window.end_overdue(context)
                    if window.unconfirmed:  # batches sent ahead: confirmed (delivered) before the stream ends
                        if (yield from window.settle(draining, context)):
                            continue  # the next batch's wait for data counts from the last confirmation
                        break
                    if spec.allow_partial:
                        return
                    refuse(
                        context,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"table '{spec.table}' did not have {spec.want} ready within {spec.wait_seconds:g}s{bound}",
                        Reason.NOT_READY,
                    )
                spec = window.spec = replace(spec, trainer_version=None)  # the first message's version is stored once
                sent = window.sent
                try:
                    yield from window.send(batch, reply)
                except BatchStageFailed:  # its groups it failed on failed, the others back: the next batch
                    if window.sent != sent:
                        raise
                    continue
                except StoreError:  # a damaged payload: the batch went back unsent, those before it settle
                    if window.sent == sent:
                        yield from window.settle(draining, context)
                    raise
                last = batch.partial or window.sent == spec.max_batches
                # room for one more batch in the window; after the last one, every confirmation,
                # each delivered as it comes (no take will commit it: a batch the client has is not
                # held while the client works on it before it confirms the next)
                if not (
                    (yield from window.confirm_each())
                    if last
                    else client.wait_confirmed(window.sent - spec.window + 1, window.due)
                ):
                    yield from window.unsettled(draining, context)
                    break
                if last or client.done:
                    break
        if client.error is not None:
            raise client.error
        window.deliver_confirmed()  # a failure (a full disk) ends the stream with its error
        yield from window.told()
    finally:
        window.close(context)


class DeliveryTold:
    """What `_Window.take` returns where it delivered batches a client that awaits delivery is to be told of."""


DELIVERY_TOLD = DeliveryTold()


class _Window:
    """The batches of one stream sent and not yet delivered: the unconfirmed ones, in the
    order sent, and the confirmed ones that the next take's commit delivers."""

    def __init__(
        self,
        store: Store,
        spec: TakeSpec,
        client: ClientSide,
        owner: str,
        seconds: float,
        answers: bool,
        delivered: Callable[[Sampled], None] | None,
    ) -> None:
        self.store, self.spec, self.client, self.owner = store, spec, client, owner
        self.delivered = delivered
        self.seconds = seconds  # max_confirm_seconds
        self.answers = answers  # the client answers a reply that says the server is stopping
        self.sent = 0
        self.unconfirmed: deque[Sampled] = deque()
        self.sent_at: deque[float] = deque()  # when each unconfirmed batch was sent (monotonic clock)
        self.confirmed: list[str] = []  # held leases whose batches the client has, to deliver
        self.table_id: int | None = None  # the table its first batch came from: not another made under its name
        self.tells = False  # the client awaits delivery: told of each (`told`)
        self.said = -1  # the batches delivered that the client was told of (none yet: not 0)

    def sending(self, batch: Sampled) -> float:
        """The batch goes out now; returns how long it may wait for its confirmation, counted
        from the client's confirmation of the batch before it (its first message, for the
        first batch): max_confirm_seconds, and the time since that confirmation if it came
        before this send (the batch's wait starts at the later of the two, see `due`)."""
        now = time.monotonic()
        received, at = self.client.confirmed()
        seconds = self.seconds + (now - at if received == self.sent else 0.0)
        self.unconfirmed.append(batch)
        self.sent_at.append(now)
        self.sent += 1
        self.client.sending(self.sent)
        return seconds

    def send(self, batch: Sampled, reply: Callable[[Sampled, float], Iterator[bytes]]) -> Iterator[bytes]:
        """The messages of `batch` (`reply`'s). A batch whose first message could not be made
        (too large for a client that cannot take parts) was never sent: it returns to the
        buffer at once, not with the stream, which would count it delivered to a client that
        had closed its side."""
        started = False
        try:
            for message in reply(batch, self.sending(batch)):
                started = True
                yield message
        except BaseException as exc:
            if not started:
                self.unconfirmed.pop()
                self.sent_at.pop()
                self.sent -= 1
                self.client.sending(self.sent)
                with contextlib.suppress(StoreError):
                    if isinstance(exc, BatchStageFailed):
                        self._fail_stage(batch, exc)
                    else:
                        self.store.give_back(batch.lease_id, self.spec.table, self.owner)
            raise

    def _fail_stage(self, batch: Sampled, exc: BatchStageFailed) -> None:
        """The batch stage raised over `batch` before it went: the groups it raised on fail, never
        to be served, the others go back (Store.fail_stage), logged with what it raised; the
        stream goes on to its next batch."""
        log.error(
            "table %s: the batch stage raised over a sampled batch; group(s) %s fail, never to be served, "
            "and the rest of the batch goes back to the buffer",
            self.spec.table, ", ".join(list(exc.failed)[:8]), exc_info=exc.__cause__,
        )  # fmt: skip
        self.store.fail_stage(batch.lease_id, self.spec.table, exc.failed, self.owner)

    def told(self) -> Iterator[bytes]:
        """A reply of `delivered` alone, where the client awaits delivery and more batches are
        delivered than it was told of: those sent, less those not confirmed or confirmed and
        not yet committed."""
        delivered = self.sent - len(self.unconfirmed) - len(self.confirmed)
        if self.tells and delivered > self.said:
            self.said = delivered
            yield pb.SampleReply(delivered=delivered).SerializeToString()

    def _collect(self) -> None:
        """Move the batches the client has confirmed out of the window."""
        while self.unconfirmed and self.sent - len(self.unconfirmed) < self.client.received:
            batch = self.unconfirmed.popleft()
            self.confirmed.append(batch.lease_id)
            self.sent_at.popleft()
            if self.delivered is not None:
                self.delivered(batch)

    def due(self) -> float:
        """When the oldest batch the client has not confirmed is overdue (monotonic clock):
        max_confirm_seconds after the later of its send and the client's last confirmation;
        infinity while the client has confirmed every batch sent."""
        received, at = self.client.confirmed()
        oldest = received - (self.sent - len(self.unconfirmed))  # its place among the unconfirmed
        if oldest >= len(self.sent_at):
            return math.inf
        return max(self.sent_at[oldest], at) + self.seconds

    def overdue(self) -> bool:
        return time.monotonic() >= self.due()

    def end_overdue(self, context: grpc.ServicerContext) -> NoReturn:
        """End the stream: a batch was not confirmed in time. Its unconfirmed batches return to
        the buffer as the stream closes (`close`), before the client gets the status."""
        received, _ = self.client.confirmed()
        late = self.sent - received
        table = self.spec.table
        log.warning(
            "Sample stream on table %s: batch %d not confirmed within max_confirm_seconds = %gs; "
            "%d batches back to the buffer",
            table, received + 1, self.seconds, late,
        )  # fmt: skip
        refuse(
            context,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"batch {received + 1} of this Sample stream of table '{table}' was not confirmed within "
            f"{self.seconds:g}s of its send or of the confirmation before it (the server's max_confirm_seconds = "
            f"{self.seconds:g}, EXPBUF_MAX_CONFIRM_SECONDS): it and every batch sent after it ({late} in all) "
            "went back to the buffer, and a confirmation sent now delivers nothing; open a new stream",
            Reason.UNCONFIRMED,
        )

    def end_at_stop(self, draining: Draining, context: grpc.ServicerContext) -> Iterator[bytes]:
        """End the stream, the server stopping: UNAVAILABLE, its unconfirmed batches back in the
        buffer as it closes. A client that answers, with batches sent ahead unconfirmed, is told
        first (SampleReply.stopping, saying how long the stream waits) and hands over none of them
        after it; its answer confirms those it handed over before, which are then delivered. The
        wait ends too once every batch sent is confirmed: a client that reads its stream only when
        its caller asks (a stream of one batch) answers late, with nothing left to hand over."""
        seconds = draining.answer_seconds()
        if self.answers and self.unconfirmed and seconds > 0 and not self.client.done and context.is_active():
            yield pb.SampleReply(stopping=True, confirm_seconds=seconds).SerializeToString()
            self.client.wait_done(seconds, self.sent)
        if self.tells:  # what it confirmed delivered, and told of, before the end: it awaits that
            with contextlib.suppress(StoreError):  # held, then, until the next start gives it back
                self.deliver_confirmed()
            yield from self.told()
        draining.end("Sample", context)

    def settle(self, draining: Draining, context: grpc.ServicerContext) -> Generator[bytes, None, bool]:
        """Before the stream ends (no data for its next batch, or a refusal of it): the batches sent
        ahead confirmed (delivered) first; whether they were. Its client may be handing one over as
        the end travels, and confirms it without knowing the stream ended: given back at once, it was
        served again and trained twice. Where the client will not confirm them, `unsettled`."""
        if not self.unconfirmed or (yield from self.confirm_each()):
            return True
        yield from self.unsettled(draining, context)
        return False

    def unsettled(self, draining: Draining, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The client will not confirm every batch sent: the stream ends as the server stops, or as
        a batch is overdue (else as its caller ends it), those batches back in the buffer."""
        if self.client.interrupted and not self.client.done:
            yield from self.end_at_stop(draining, context)
        if self.overdue() and not self.client.done:
            self.end_overdue(context)

    def take(self, deadline: float, context: grpc.ServicerContext) -> Sampled | DeliveryTold | None:
        """The next batch, its wait for data ending at `deadline` (monotonic clock), delivering
        the confirmed ones in its commit. A confirmation that arrives while it waits for data is
        delivered at once (the wait then goes on): a batch the client has is never held for the
        whole wait, a lease's clock starts when it is confirmed, and a replayed group is back for
        the batch that waits. A client that awaits delivery is told of it first (DELIVERY_TOLD: the
        caller tells it, then takes again with the same deadline)."""
        client = self.client
        while True:
            self._collect()
            seen = client.received
            committed: list[bool] = []  # the confirmations delivered: told at once, not after the wait for data

            def delivered(committed: list[bool] = committed) -> None:
                self.confirmed.clear()  # committed: not confirmed again where the take then raises
                committed.append(True)

            def stop(seen: int = seen, committed: list[bool] = committed) -> bool:
                stopping = client.stopped or client.broken or client.interrupted or self.overdue()
                told = self.tells and bool(committed)
                return stopping or not context.is_active() or client.received > seen or told

            batch = self.store.sample(
                self.spec,
                timeout=max(0.0, deadline - time.monotonic()),
                hold=True,
                owner=self.owner,
                stop=stop,
                confirm=self.confirmed,
                table_id=self.table_id,
                delivered=delivered,
            )
            self.confirmed = []
            if batch is not None:
                self.table_id = batch.table_id
                return batch
            if client.stopped or client.broken or client.interrupted:
                return None
            if self.tells and (committed or client.received > seen):
                return DELIVERY_TOLD
            if client.received == seen or not context.is_active() or time.monotonic() >= deadline:
                return None

    def confirm_each(self) -> Generator[bytes, None, bool]:
        """Wait for the client to confirm every batch sent, delivering each confirmation as it
        comes (and telling a client that awaits it); False if the client never will (as
        ClientSide.wait_confirmed)."""
        while True:
            self.deliver_confirmed()  # those confirmed by now, the first ones perhaps before this began
            yield from self.told()
            delivered = self.sent - len(self.unconfirmed)  # not `received`: one may have come since
            if delivered >= self.sent:
                return True
            if not self.client.wait_confirmed(delivered + 1, self.due):
                return False

    def deliver_confirmed(self) -> None:
        """Deliver the held batches the client confirmed. If that fails, they stay held, never
        given back: they return only when the server next starts (release_holds), rather than
        being delivered twice while the client has them."""
        self._collect()
        while self.confirmed:
            self.store.confirm(self.confirmed[0], self.spec, self.owner)
            self.confirmed.pop(0)

    def close(self, context: grpc.ServicerContext) -> None:
        """The stream ended: deliver what the client confirmed; the rest was delivered if the
        client closed its side normally, and otherwise returns to the buffer."""
        self._collect()
        for lease_id in self.confirmed:  # the take that was to deliver them failed: deliver them alone
            with contextlib.suppress(StoreError):
                self.store.confirm(lease_id, self.spec, self.owner)
        if not self.unconfirmed:
            return
        client = self.client
        delivered = client.closed and not client.cancelled_within(CANCEL_GRACE) and context.is_active()
        for batch in self.unconfirmed:
            if delivered:  # it closed its side and did not cancel: the stream ends normally
                self.store.confirm(batch.lease_id, self.spec, self.owner)
                if self.delivered is not None:
                    self.delivered(batch)
            else:  # stopped, cancelled or broken before the client had it
                with contextlib.suppress(StoreError):  # acked meanwhile, or the table was dropped
                    self.store.give_back(batch.lease_id, self.spec.table, self.owner)
