"""One Sample stream: batches sent only when the client asks, delivered once it confirms.

The client's messages after the first are read by a thread of their own, so that the
server notices a confirmation, a stop, a closed side or a cancel while it waits for
data. The server sends a batch only while fewer than the stream's window (1 to
MAX_WINDOW, sample_spec.py) are unconfirmed, so at most that many per stream are ever on
their way, whatever gRPC's buffers would hold: a batch's consumption, or its lease,
stands only once the client has it, and every unconfirmed batch returns to the buffer if
the stream breaks or stops first. A lease is taken as its batch is sent, so its clock
starts then.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from .backend import Backend
from .errors import InvalidRequest, StoreError
from .sample_spec import SampleSpec
from .store import Sampled

# How long a client that closed its side has to show that it cancelled (see cancelled_within).
CANCEL_GRACE = 0.2


class ClientSide:
    """What the client of one stream has said since its first message."""

    def __init__(self, requests: Iterator[pb.SampleRequest], context: grpc.ServicerContext) -> None:
        self.received = 0  # batches confirmed
        self.stopped = False  # it asked to end the stream
        self.closed = False  # it closed its side without asking to stop
        self.broken = False  # cancelled, or the connection went
        self.error: InvalidRequest | None = None
        self.terminated = False  # the call ended (before the server finished: a cancel)
        self._sent = 0
        self._changed = threading.Condition()
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
                    else:
                        self.received = max(self.received, request.received)
                    self.stopped = request.stop or self.error is not None
                    self._changed.notify_all()
                if self.stopped:
                    return
            with self._changed:
                self.closed = True
                self._changed.notify_all()
        except grpc.RpcError:
            self._wake()

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

    def wait_confirmed(self, count: int) -> bool:
        """Wait until the client confirms `count` batches; False if it never will."""
        with self._changed:
            self._changed.wait_for(lambda: self.received >= count or self.done)
            return self.received >= count


def stream_batches(
    store: Backend,
    spec: SampleSpec,
    requests: Iterator[pb.SampleRequest],
    context: grpc.ServicerContext,
    *,
    owner: str,
    timeout: Callable[[], float],
    reply: Callable[[Sampled], bytes],
    bound: str = "",
) -> Iterator[bytes]:
    """The replies of one stream. `timeout()` is how long the next batch may wait for data;
    `bound` says what set it, when the server shortened what the client asked.

    Returns None through StopIteration when the stream ends; raises DEADLINE_EXCEEDED
    (through `context.abort`) when no batch could be made in time.
    """
    client = ClientSide(requests, context)
    window = _Window(store, spec, client, owner)
    try:
        while True:
            batch = window.take(timeout(), context)
            if batch is None:
                if client.error is not None:
                    raise client.error
                if client.stopped or client.broken or not context.is_active() or spec.allow_partial:
                    return
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"table '{spec.table}' did not have {spec.want} ready within {spec.wait_seconds:g}s{bound}",
                )
            spec = window.spec = replace(spec, trainer_version=None)  # the first message's version is stored once
            window.sending(batch)
            yield reply(batch)
            last = batch.partial or window.sent == spec.max_batches
            # room for one more batch in the window; after the last one, every confirmation
            if not client.wait_confirmed(window.sent if last else window.sent - spec.window + 1):
                break
            if last or client.done:
                break
        if client.error is not None:
            raise client.error
        window.consume_confirmed()  # a failure (a full disk) ends the stream with its error
    finally:
        window.close(context)


class _Window:
    """The batches of one stream sent and not yet consumed: the unconfirmed ones, in the
    order sent, and the confirmed held ones that the next take's commit consumes."""

    def __init__(self, store: Backend, spec: SampleSpec, client: ClientSide, owner: str) -> None:
        self.store, self.spec, self.client, self.owner = store, spec, client, owner
        self.sent = 0
        self.unconfirmed: deque[Sampled] = deque()
        self.confirmed: list[str] = []  # held leases the client has, to consume

    def sending(self, batch: Sampled) -> None:
        self.unconfirmed.append(batch)
        self.sent += 1
        self.client.sending(self.sent)

    def _collect(self) -> None:
        """Move the batches the client has confirmed out of the window."""
        while self.unconfirmed and self.sent - len(self.unconfirmed) < self.client.received:
            batch = self.unconfirmed.popleft()
            if self.spec.delivery == "consume":
                self.confirmed.append(batch.lease_id)

    def take(self, seconds: float, context: grpc.ServicerContext) -> Sampled | None:
        """The next batch, consuming the confirmed ones in its commit. A confirmation that
        arrives while it waits for data is consumed at once (the wait then goes on), so
        that a batch the client has is never held for the whole wait."""
        deadline = time.monotonic() + seconds
        client = self.client
        hold = self.spec.delivery == "consume"
        while True:
            self._collect()
            seen = client.received

            def stop(seen: int = seen) -> bool:
                return client.stopped or client.broken or not context.is_active() or (hold and client.received > seen)

            batch = self.store.sample(
                self.spec,
                timeout=max(0.0, deadline - time.monotonic()),
                hold=hold,
                owner=self.owner,
                stop=stop,
                ack=self.confirmed,
            )
            self.confirmed = []
            if batch is not None or not hold or client.received == seen or client.stopped or client.broken:
                return batch
            if not context.is_active() or time.monotonic() >= deadline:
                return None

    def consume_confirmed(self) -> None:
        """Consume the held batches the client confirmed. If that fails, they stay held, never
        given back: they return only when the server next starts (release_holds), rather than
        being delivered twice while the client has them."""
        self._collect()
        while self.confirmed:
            self.store.ack(self.confirmed[0], self.spec.table, self.owner)
            self.confirmed.pop(0)

    def close(self, context: grpc.ServicerContext) -> None:
        """The stream ended: consume what the client confirmed; the rest was delivered if the
        client closed its side normally, and otherwise returns to the buffer."""
        self._collect()
        for lease_id in self.confirmed:  # the take that was to consume them failed: consume them alone
            with contextlib.suppress(StoreError):
                self.store.ack(lease_id, self.spec.table, self.owner)
        if not self.unconfirmed:
            return
        client = self.client
        delivered = client.closed and not client.cancelled_within(CANCEL_GRACE) and context.is_active()
        for batch in self.unconfirmed:
            if delivered:  # it closed its side and did not cancel: the stream ends normally
                _confirm(self.store, self.spec, batch, self.owner)
            else:  # stopped, cancelled or broken before the client had it
                _give_back(self.store, self.spec, batch, self.owner)


def _confirm(store: Backend, spec: SampleSpec, batch: Sampled, owner: str) -> None:
    """The client has the batch: a consumed one leaves the buffer now (or, when the stream
    goes on, in the commit that takes the next batch: `ack` of Backend.sample). If that
    fails (a full disk), the batch stays held, never given back: it returns only when the
    server next starts (release_holds), rather than being delivered twice while the client
    has it."""
    if spec.delivery == "consume":
        store.ack(batch.lease_id, spec.table, owner)


def _give_back(store: Backend, spec: SampleSpec, batch: Sampled, owner: str) -> None:
    if spec.delivery in ("consume", "lease"):
        with contextlib.suppress(StoreError):  # acked meanwhile, expired, or the table was dropped
            store.nack(batch.lease_id, spec.table, owner)
