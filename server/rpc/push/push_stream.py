"""A PushStream's pushes in a pipeline of two stages, so that one stream's pushes overlap.

The stream's reader (limits.IdleMessages) reads and parses the next pushes, up to
`push_stream_window` of them not yet answered, while the call stores those it has: each time,
every push parsed by then goes to the writer in one request (Store.put_in_order), in order. A
window of pushes thus shares the writer's commits (one fsync), and the parse of the next overlaps
the commit of the last. Each reply still goes out only once its push is durable, in the order of
the requests, with its seq.

A refused push, whether its message could not be read (push_request.Refusal), its payload not be
parsed, or the store refused it, ends the stream with its status after the replies of the pushes
before it, and nothing after it is stored: a client sends those again on a new stream
(client/pushers/pipeline.py), as if each push had waited for the reply of the one before.

Memory: each push holds its payload's bytes of `max_inflight_bytes` until it is stored or
refused, and the reader reads no more than the window ahead, so a client that stops reading
replies makes the stream stop reading its messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb

from ...store import Push, PutResult, Store
from ...store.schema.errors import InsertLimited, TableFull
from ..call_context import ended, noted, room_wait
from ..interceptors.base import CALL_TABLE, refuse
from ..interceptors.limits import IdleMessages
from .ingest import Ingest
from .push_request import PushMessage, Refusal

# A push's reply from its seq, table and result (the servicer's, shared with unary Push).
Reply = Callable[[int, str, PutResult], pb.PushReply]


@dataclass(slots=True)
class Parsed:
    """A push whose payload was parsed, holding its memory until it is stored. Its message is a
    PushMessage as the server reads it (push_memory.PushMemory), a PushRequest to the servicer alone."""

    message: PushMessage | pb.PushRequest
    push: Push

    def release(self) -> None:
        """Let the push's experiences go, then its share of max_inflight_bytes (once stored or
        refused): the last push in flight to give back its share hands freed memory back."""
        self.push.entries = []
        _release(self.message)


def _release(message: PushMessage | pb.PushRequest) -> None:
    if isinstance(message, PushMessage):
        message.release()


class Unparsed(Exception):
    """A push whose payload the codec refused, with the table it named (for the refusal's labels)."""

    def __init__(self, table: str, error: Exception) -> None:
        super().__init__(str(error))
        self.table, self.error = table, error


def parser(ingest: Ingest, holder: str) -> Callable[[PushMessage | pb.PushRequest], Parsed]:
    """What the stream's reader does with each push it reads: parse it, and let its payload go;
    `holder` is who pushes (kinds.Push)."""

    def parse(message: PushMessage | pb.PushRequest) -> Parsed:
        staged = message.entries if isinstance(message, PushMessage) else None
        if staged is not None:  # a push in chunks, its experiences made as it was read (ingest.Stager)
            return Parsed(message, Push(message.table or "default", staged, holder))
        try:
            entries = ingest.entries(message.payload)
        except Exception as exc:
            _release(message)
            raise Unparsed(message.table or "default", exc) from None
        if isinstance(message, PushMessage):
            message.drop_payload()
        return Parsed(message, Push(message.table or "default", entries, holder))

    return parse


def open_messages(
    requests: Iterator[Any], ingest: Ingest, idle_seconds: float, window: int, holder: str
) -> IdleMessages:
    """A PushStream's messages, read and parsed up to `window` ahead of its replies."""
    return IdleMessages(requests, idle_seconds, ahead=window, prepare=parser(ingest, holder), discard=Parsed.release)


def replies(
    store: Store, messages: IdleMessages, context: grpc.ServicerContext, reply: Reply, max_wait: float
) -> Iterator[pb.PushReply]:
    """Each push's reply, in order, once durable (each waiting for room at most `max_wait`, the
    server's max_wait_seconds); the stream's refusal in its turn (see the module)."""
    while True:
        try:
            first = messages.next()
        except TimeoutError:
            seconds = messages.seconds
            refuse(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"PushStream idle: no message for {seconds:g}s; the server ends idle streams after "
                f"push_stream_idle_seconds = {seconds:g} (EXPBUF_PUSH_STREAM_IDLE_SECONDS); open a new one",
                Reason.IDLE,
            )
        except Refusal as refusal:
            refusal.abort(context)
        except Unparsed as unparsed:
            CALL_TABLE.set(unparsed.table)
            raise unparsed.error from None
        if first is None:
            return
        yield from _store([first, *messages.ready()], store, messages, context, reply, max_wait)


def _store(
    pushes: list[Parsed],
    store: Store,
    messages: IdleMessages,
    context: grpc.ServicerContext,
    reply: Reply,
    max_wait: float,
) -> Iterator[pb.PushReply]:
    """Store pushes in one request to the writer; each one's reply once it is durable."""
    timeout, note = room_wait(context, max_wait)
    results = store.put_in_order([parsed.push for parsed in pushes], timeout=timeout, stop=ended(context))
    try:
        for parsed in pushes:
            CALL_TABLE.set(parsed.push.table)
            try:  # its refusal, raised after the replies of the pushes before it
                result = next(results)
            except (TableFull, InsertLimited) as exc:
                raise noted(exc, note) from None
            parsed.release()
            messages.done()
            yield reply(parsed.message.seq, parsed.push.table, result)
    finally:
        for parsed in pushes:
            parsed.release()
