"""The Sample stream's pieces both clients share, whose two loops are each client's own (client.py,
aio.py): a sample's order checked before its stream opens (`Orders`), a batch's confirmation, the
batch decoded from its reply, and handed to the caller unless asked for too late."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from ... import trxp
from ...columns import decode_columns
from ...errors import DataLossError, DeadlineExceededError
from ...results import Batch, Leases
from .. import wire
from ..declare import Unary
from ..sample_reply import SampleReplyParts

B = TypeVar("B", bound=Batch)
R = TypeVar("R")
# How long a stream the caller left may take to hand back the batches already on their way.
STOP_SECONDS = 5.0
# What the client keeps of a batch's confirm_seconds for its confirmation's way to the server:
# a tenth of it, at most this.
CONFIRM_MARGIN = 2.0


class Orders:
    """The orders a client's server samples in, for a check of a sample's order before its stream
    opens (both clients'): a built-in order is every server's; another name is looked up among
    the server's (ServerInfo's `orders`), asked once, and again for a name not among them (a
    server restarted since may have registered it)."""

    def __init__(self) -> None:
        self.known: frozenset[str] = frozenset(wire.ORDER)

    def check(self, order: str) -> Unary[None] | None:
        """The call that refuses `order`, ValueError naming the server's orders, when the server
        has no such order; None where there is nothing to ask. A server before this release names
        none: it checks the order itself, as the stream opens."""
        if order in self.known:
            return None

        def read(reply: pb.ServerInfoReply) -> None:
            if not reply.orders:
                return
            self.known = frozenset(reply.orders)
            if order not in self.known:
                raise ValueError(
                    f"sample: order is {order!r}; this server samples in the orders {', '.join(reply.orders)}"
                )

        return Unary("ServerInfo", pb.ServerInfoRequest(), read, retry=True)


async def finished(task: asyncio.Future[R]) -> R:
    """`task`'s result, waited for whatever cancels the waiter meanwhile: a batch's confirmation
    gone, its outcome is the caller's however it leaves (the asyncio clients' sample())."""
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
    return task.result()


class HeldBack:
    """A cancel a consumed batch's hand-over held back (the asyncio clients' sample(): the cancelled
    await is handed the batch, which nothing can put back), raised where it still stands at the
    caller's next step of the stream: a task cancelled as it took the batch (`task.cancel()`, a
    trainer's shutdown) went on with the stream for good. Only a cancel that came since the
    hand-over began (`begin`) is kept: under `asyncio.wait_for` or `asyncio.timeout` the cancel was
    the wait's own, over once the batch was returned, and a cancel the task stood under before (its
    own shutdown, draining) is its own. A stream the caller leaves before its next step (a `break`,
    `aclose()`) cancels the task again as it ends (`pass_on`), where that cancel was lost."""

    def __init__(self) -> None:
        self._held: tuple[asyncio.Task[Any] | None, int] | None = None

    @staticmethod
    def begin() -> int:
        """The cancels the current task has standing (`Task.cancelling`) as a hand-over begins, 0 outside a task."""
        task = asyncio.current_task()
        return 0 if task is None else task.cancelling()

    def hold(self, before: int) -> None:
        """The hand-over that began with `before` cancels standing was cancelled: its batch handed, the cancel kept."""
        self._held = (asyncio.current_task(), before)

    def raise_now(self) -> None:
        """At the caller's next step: the cancel kept, where it still stands."""
        if self._held is not None:
            _, before = self._held
            self._held = None
            if self.begin() > before:
                raise asyncio.CancelledError

    def pass_on(self) -> None:
        """As the stream ends before the caller's next step: the task the cancel came to cancelled
        again, where it still stands and the task runs (last in the stream's end, which a cancel of
        its own task would cut), its count of cancels left as it was (`uncancel`): the cancel is
        the one held back, not another, and an `asyncio.timeout`'s, counted twice, ended the task
        cancelled where its block raises TimeoutError."""
        if self._held is not None:
            task, before = self._held
            self._held = None
            if task is not None and not task.done() and task.cancelling() > before:
                task.cancel()
                task.uncancel()


def confirmation(received: int, *, stop: bool = False) -> pb.SampleRequest:
    """Tells the server that `received` batches arrived, which frees room in the window for
    more (or, with `stop`, asks for nothing more: batches already on their way return to
    the buffer)."""
    return pb.SampleRequest(received=received, stop=stop)


class Handing:
    """The batches a sample() stream's client has handed to its caller, each confirmed as it goes,
    and whether the server said it is stopping (SampleReply.stopping): the client answers that at
    once with the count handed over, and hands over none after it, so that no batch is both
    trained on and back in the buffer after the restart. Each client calls `hand` and `answer`
    under a lock of its own kind and sends what they return under it, so that no confirmation
    follows the answer."""

    def __init__(self) -> None:
        self.received = 0
        self.stopping = False

    def hand(self) -> pb.SampleRequest | None:
        """The confirmation of one more batch handed over; None once the server said it is
        stopping: the batch is not handed over (it returns to the buffer)."""
        if self.stopping:
            return None
        self.received += 1
        return confirmation(self.received)

    def answer(self) -> pb.SampleRequest | None:
        """The answer to the server's word that it is stopping (None after the first): the
        batches handed over, and nothing more asked for."""
        if self.stopping:
            return None
        self.stopping = True
        return confirmation(self.received, stop=True)


class Deliveries:
    """What the server said of its deliveries, on a stream that consumes and so awaits them
    (SampleRequest.awaits_delivery): whether it tells of them (its first message is a word of 0
    delivered; a server before it says nothing, and its batches are handed over as they come),
    how many it delivered, and how the stream ended. A batch is handed to the caller only once
    the server said it is delivered, or once the stream ended OK (which delivered every batch
    confirmed): a confirmation lost with the connection or the server (a cut, a crash) left a
    consumed batch both trained on and back in the buffer. Each client waits in its own way
    (`changed` tells it to look again), one thread or task reading the stream."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self.told = False
        self.count = 0
        self.ended: bool | None = None  # how the stream ended: OK or not; None while it runs
        self._changed = changed

    def heard(self, rest: pb.SampleReply) -> bool:
        """Whether `rest` (a reply without its payload) is a word of deliveries, taken in."""
        if not rest.HasField("delivered"):
            return False
        self.told, self.count = True, max(self.count, rest.delivered)
        self._changed()
        return True

    def end(self, ok: bool) -> None:
        """The stream ended (OK or not)."""
        self.ended = ok
        self._changed()

    def delivered(self, received: int) -> bool | None:
        """Whether the `received`-th batch may be handed over: True once delivered (or the server
        does not tell, or the stream ended OK), False where the stream ended otherwise (it went back
        to the buffer, or was consumed with its word lost: at most once), None while it may still be."""
        if not self.told or self.count >= received or self.ended:
            return True
        return None if self.ended is None else False


def batch(reply: SampleReplyParts, table: str, leases: Leases | None, kind: type[B], *, columnar: bool = False) -> B:
    """A sampled batch, decoded (the checks a reader relies on), that acknowledges, gives
    back and renews through `leases` (the client's). The client confirms a batch only once
    this returns: one it cannot decode raises DataLossError naming it, and goes back.
    `columnar`: the request named fields, so the reply must carry columns, not a payload."""
    rest = reply.rest
    try:
        if columnar and reply.payload:
            raise ValueError(
                "the request named fields, and the server sent a TRXP payload: it predates columnar batches "
                "(a server of this release or later sends them)"
            )
        made = kind(
            payload=trxp.attach_advantages(reply.payload, rest.advantages, rest.response_lengths),
            uids=list(rest.uids),
            group_ids=list(rest.group_ids),
            lease_id=rest.lease_id,
            lease_expires=rest.lease_expires_unix,
            partial=rest.partial,
            table=table,
            times_sampled=list(rest.times_sampled),
            advantage_values=list(rest.advantages),
            _leases=leases,
            confirm_seconds=rest.confirm_seconds,
            columns=(
                decode_columns(rest.columns, len(rest.uids), reply.values, rest.missing_fields)
                if rest.columns or rest.missing_fields
                else {}
            ),
        )
        if not made.columnar:
            _ = made.experiences  # decoded now, before it is confirmed
    except (trxp.TrxpError, ValueError, OverflowError) as exc:
        groups = list(dict.fromkeys(rest.group_ids))
        raise DataLossError(
            grpc.StatusCode.DATA_LOSS,
            f"a batch of table '{table}' ({len(rest.uids)} experiences, groups {', '.join(groups[:4])}"
            f"{', ...' if len(groups) > 4 else ''}) could not be decoded, so it was not confirmed and goes back "
            f"to the buffer: {type(exc).__name__}: {exc}",
        ) from exc
    return made


def confirm_by(seconds: float, since: float) -> float:
    """The last moment (time.monotonic()) a client may confirm a batch whose server waits `seconds`
    (a reply's confirm_seconds; 0: unknown, no bound) for its confirmation, counted from the
    confirmation before it, sent at `since`: a tenth of `seconds` (at most CONFIRM_MARGIN) before
    the server's bound, kept for the confirmation's way to the server."""
    return since + seconds - min(seconds / 10, CONFIRM_MARGIN) if seconds else math.inf


def late(table: str, seconds: float, since: float) -> DeadlineExceededError | None:
    """The error of a batch asked for too late for a server that waits `seconds` (a reply's
    confirm_seconds; 0: unknown) for its confirmation, counted from the confirmation before it, sent
    at `since` (see `handed`); None in time (`confirm_by`)."""
    now = time.monotonic()
    if now <= confirm_by(seconds, since):
        return None
    waited = now - since
    return DeadlineExceededError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"a batch of table '{table}' was asked for {waited:.1f}s after the batch before it (or the stream's "
        f"start), too late for the server, which waits {seconds:g}s for its confirmation (max_confirm_seconds, "
        "EXPBUF_MAX_CONFIRM_SECONDS): it was not handed over and goes back to the buffer with the batches after "
        "it. Open a new sample() to go on; a step this long needs a larger max_confirm_seconds",
    )


def unanswered(table: str, seconds: float) -> DeadlineExceededError:
    """The error of a held part (a sharded client's) its shard did not answer within `seconds`, the
    client's timeout: a shard that stopped answering, left out as one that is down."""
    return DeadlineExceededError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"no answer to a sample of table '{table}' within the client's timeout of {seconds:g}s: the stream was "
        "cancelled, and whatever the shard took for it goes back to its buffer",
    )


def ended_late(code: grpc.StatusCode, table: str, seconds: float, since: float) -> DeadlineExceededError | None:
    """What a Sample stream that ended with `code` was, when the server cancelled it because its
    client came late (`late`: the server ends a stream whose reply its client has not taken for
    max_confirm_seconds, a step that long with a batch too large to wait in the channel's
    buffers); None otherwise."""
    return late(table, seconds, since) if code == grpc.StatusCode.CANCELLED else None


def handed(made: B, lease_seconds: float, since: float) -> B:
    """The batch as the client hands it to its caller, confirming it: a lease's clock starts now.

    The server gives a batch back (and ends the stream) when its confirmation has not come
    `confirm_seconds` (the reply's) after the client's confirmation before it, sent at `since`
    (time.monotonic(); the stream's first request, for the first batch). A batch asked for
    past that, less a tenth (at most CONFIRM_MARGIN) for the confirmation's way, may be in the
    buffer again already: it is not handed over, so no batch is trained that another trainer
    may get, and DeadlineExceededError says why."""
    error = late(made.table, made.confirm_seconds, since)
    if error is not None:
        raise error
    if made.lease_id:
        made.lease_expires = time.time() + lease_seconds
    return made
