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

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc

from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb

from ...store import Sampled, Store
from ...store.schema.errors import BatchStageFailed, NotFound, StoreError
from ...store.schema.sample_spec import TakeSpec
from ..draining import Draining
from ..interceptors.base import refuse
from .client_side import ClientSide
from .window import DeliveryTold, StreamWindow


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
    `answers_stopping` is told of a stop before its stream ends (`StreamWindow.end_at_stop`), and one
    that `awaits_delivery` of each delivery (`StreamWindow.told`).
    """
    client = ClientSide(requests, context)
    window = StreamWindow(store, spec, client, owner, confirm_seconds, answers_stopping, delivered)
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
                # The rate limit at its deadline, an index not built, its table dropped: the stream ends with it.
                except StoreError as refused:
                    try:
                        yield from window.settle(draining, context)
                    except NotFound:  # its table dropped: so are the leases of the batches sent, said as such
                        if not isinstance(refused, NotFound):
                            raise
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
