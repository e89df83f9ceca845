"""What the client of one Sample stream has said since its first message, read by a thread of
its own (`ClientSide`): its confirmations, a stop, a closed side, a cancel; and which of its
messages move its stream on (`Confirmations`, for the stalled sends' bound)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from ...store.schema.errors import InvalidRequest

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
