"""One Sample stream: batches sent only when the client asks, delivered once it confirms.

The client's messages after the first are read by a thread of their own, so that the
server notices a confirmation, a stop, a closed side or a cancel while it waits for
data. The server sends the next batch only once the last one is confirmed, so at most
one batch per stream is ever on its way: its consumption, or its lease, stands only
once the client has it, and it returns to the buffer if the stream breaks first.
"""

from __future__ import annotations

import contextlib
import threading
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
    unconfirmed: Sampled | None = None
    confirmed = ""  # the held batch the client has, consumed in the commit that takes the next
    sent = 0
    try:
        while True:
            batch = store.sample(
                spec,
                timeout=timeout(),
                hold=spec.delivery == "consume",
                owner=owner,
                stop=lambda: client.stopped or client.broken or not context.is_active(),
                ack=confirmed,
            )
            confirmed = ""
            if batch is None:
                if client.error is not None:
                    raise client.error
                if client.stopped or client.broken or not context.is_active() or spec.allow_partial:
                    return
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"table '{spec.table}' did not have {spec.want} ready within {spec.wait_seconds:g}s{bound}",
                )
            unconfirmed = batch
            spec = replace(spec, trainer_version=None)  # the first message's version is stored once
            sent += 1
            client.sending(sent)
            yield reply(batch)
            if not client.wait_confirmed(sent):
                break
            unconfirmed = None  # the client has it: from here on it is never given back
            if batch.partial or sent == spec.max_batches or client.done:
                _confirm(store, spec, batch, owner)
                break
            confirmed = batch.lease_id if spec.delivery == "consume" else ""
        if client.error is not None:
            raise client.error
    finally:
        if confirmed:  # the sample that was to consume it failed: consume it alone, if it still can be
            with contextlib.suppress(StoreError):
                store.ack(confirmed, spec.table, owner)
        if unconfirmed is not None:
            if client.closed and not client.cancelled_within(CANCEL_GRACE) and context.is_active():
                # it closed its side and did not cancel: the stream ends normally
                _confirm(store, spec, unconfirmed, owner)
            else:  # stopped, cancelled or broken before the client had it
                _give_back(store, spec, unconfirmed, owner)


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
