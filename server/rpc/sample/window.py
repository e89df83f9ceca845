"""The batches of one Sample stream sent and not yet delivered (`StreamWindow`): each sent held, its
wait for its confirmation bounded, delivered in the next take's commit once confirmed (or alone),
told of to a client that awaits delivery, and given back when the stream ends without it."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import NoReturn

import grpc

from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb

from ...store import Sampled, Store
from ...store.schema.errors import BatchStageFailed, StoreError
from ...store.schema.sample_spec import TakeSpec
from ..draining import Draining
from ..interceptors.base import refuse
from .client_side import CANCEL_GRACE, ClientSide

log = logging.getLogger("expbuf.service")


class DeliveryTold:
    """What `StreamWindow.take` returns where it delivered batches a client that awaits delivery is to be told of."""


DELIVERY_TOLD = DeliveryTold()


class StreamWindow:
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
        # A reply cut short after its first message (a damaged payload met as it was sent): no other
        # message may follow, which the client would read as the next part of that reply.
        self.cut_short = False
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
        (too large for a client that cannot take parts), or whose reply the store refused after
        it (a damaged payload met as its parts were cut), never reached the client whole: it
        returns to the buffer at once, not with the stream, which would count it delivered to a
        client that had closed its side, and the batches before it settle (sample_stream.py)."""
        started = False
        try:
            for message in reply(batch, self.sending(batch)):
                started = True
                yield message
        except BaseException as exc:
            if not started or isinstance(exc, StoreError):
                self.cut_short = started
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
        if (
            self.answers
            and self.unconfirmed
            and seconds > 0
            and not self.cut_short
            and not self.client.done
            and context.is_active()
        ):
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
        if not self.unconfirmed:
            return True
        if self.cut_short and self.tells:  # the client hands over only batches it was told of: none was
            return False
        if (yield from self.confirm_each()):
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
            confirming = self.confirmed
            # Delivered in the take's first commit, which empties the list: told at once, not after
            # the wait for data.
            telling = self.tells and bool(confirming)

            def stop(seen: int = seen, confirming: list[str] = confirming, telling: bool = telling) -> bool:
                stopping = client.stopped or client.broken or client.interrupted or self.overdue()
                return stopping or not context.is_active() or client.received > seen or (telling and not confirming)

            batch = self.store.sample(
                self.spec,
                timeout=max(0.0, deadline - time.monotonic()),
                hold=True,
                owner=self.owner,
                stop=stop,
                confirm=confirming,
                table_id=self.table_id,
                delivered=confirming.clear,  # committed: not confirmed again where the take then raises
            )
            committed = telling and not confirming
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
