"""What pushes hold in memory: their payloads read without a copy (push_request.py), counted
against `max_inflight_bytes` (inflight.py) while they are decoded and stored, and given back after.

A payload sent in chunks over PushStream (total_bytes) is admitted by its first chunk and
read, staged and paced by push_chunks.ChunkReader, whose docstring says how.

A message's size is known only once gRPC has received all of it, and a read, once begun, takes
in the whole message. So a call whose client declared the most a message of it will be (call
metadata `expbuf-message-bytes`, wire.MESSAGE_BYTES: expbuf's clients declare a push's or a put's
own size, a push in chunks the most a chunk's message takes, and a pusher's PushStream the most
its pushes' messages take, rounded up: pipeline.PushWindow.room_for) reserves that (at most
`max_message_bytes` and the cap) before each read, once it fits beside the payloads held by pushes
in progress under `max_inflight_bytes`, and its message holds its own size in its place once read;
a message larger than its call declared is refused INVALID_ARGUMENT naming both, and a stream
open but silent holds its declaration until its message comes, it ends or its idle timeout ends
it (a pusher's stream between pushes: a chunk's message, for which it then finds room). A call
that declared nothing (a raw gRPC client, an older one) begins its read while what is held is
below the cap, so such calls that arrive together may pass it by a message each. Either waits, up
to its deadline, then is refused RESOURCE_EXHAUSTED naming the setting. The server takes in no
more of a call's messages unasked than its gRPC options let (inflight.receive_window). A push sent
whole that is larger than the cap still goes through when nothing else is in flight. When the
last push in flight ends, memory freed by large pushes is handed back to the system.

A PushStream reads its next messages while its earlier pushes are stored (rpc/push/push_stream.py): each
message carries what it holds, given back once its push is stored or refused, and the stream's
wait for room is not timed while its own earlier pushes hold memory, which they give back. Its
refusals are raised as a `Refusal`, which the stream gives as its status in its turn, after the
replies of the pushes before it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc

from expbuf.client.rpc.wire import MESSAGE_BYTES
from expbuf.client.schema.reasons import Reason

from ..call_context import ended
from ..interceptors.base import CALL_TABLE, ServiceInterceptor, refuse
from ..interceptors.limits import MAY_WAIT
from .inflight import InFlight
from .ingest import Stager
from .push_chunks import ChunkReader, remaining
from .push_request import PushMessage, Refusal, read_push_request
from .slow_reads import SlowReads

T = TypeVar("T")


_SIZE = re.compile(r"[0-9]{1,19}")


def declared_bytes(metadata: Iterable[tuple[str, Any]] | None) -> int | Refusal | None:
    """What a call declared of its messages (MESSAGE_BYTES: the most one will be, in bytes); None
    where it declared nothing, a Refusal where the declaration is not one positive size."""
    found = [value for key, value in metadata or () if key == MESSAGE_BYTES]
    if not found:
        return None
    if len(found) == 1 and isinstance(found[0], str) and _SIZE.fullmatch(found[0]) and int(found[0]) > 0:
        return int(found[0])
    return Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"call metadata {MESSAGE_BYTES} = {(found[0] if len(found) == 1 else found)!r}: it declares the most a "
        "message of the call will be, once, a whole number of bytes from 1",
        Reason.INVALID_REQUEST,
    )


def _orphan(last: int, offset: int) -> Refusal:
    """The refusal of a chunk of a push whose first message never came (lost on its way): one
    whose offset says so (a chunk's `offset`, past 0), or, after a push of seq `last`, a message
    with neither table, seq nor total_bytes, as a stream that numbers its pushes numbers each.
    The client sends that push again."""
    after = f"after the push of seq {last}" if last else "as the first message of the stream"
    what = f"a chunk at offset {offset}" if offset else "a message with neither table, seq nor total_bytes, so a chunk"
    return Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"PushRequest {after}: {what} of the next push, whose first message never came: nothing of it is stored",
        Reason.CUT_SHORT,
    )


def _larger(what: str, size: int, declared: int) -> Refusal:
    """The refusal of a message of `size` bytes whose call declared at most `declared`."""
    return Refusal(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{what}: a message of {size} bytes, larger than its call declared ({MESSAGE_BYTES} = {declared}, the most "
        "a message of the call may be, which max_inflight_bytes held room for before it was read): nothing of it "
        "is stored",
        Reason.INVALID_REQUEST,
    )


class PushMemory(ServiceInterceptor):
    """Push and PushStream read their messages with read_push_request, once InFlight admits them;
    PushStream puts the chunks of a payload together before the servicer sees it. A message that
    cannot be read raises a Refusal: Push gives it as its status, PushStream in its turn. PutValues
    is read once admitted too, and its values counted while they are stored."""

    def __init__(
        self,
        inflight: InFlight,
        stream_wait: float = 3600.0,
        min_mb_per_second: float = 0.1,
        grace: float = 120.0,
        stager: Stager | None = None,
        max_push_bytes: int = 16 << 30,
        max_message_bytes: int = 256 << 20,
    ) -> None:
        self.inflight = inflight
        self.chunks = ChunkReader(inflight, stager, stream_wait, min_mb_per_second, grace, max_push_bytes)
        self.slow_reads = SlowReads()  # a unary call's read, ended where its message does not come
        self.max_message_bytes = max_message_bytes  # the most a declared message's read reserves
        self.stream_wait = stream_wait  # below a PushStream's idle timeout, so the refusal says why
        # A push in chunks brings min_mb_per_second over every `grace` (push_stream_idle_seconds) after its first.
        self.min_mb_per_second, self.grace = min_mb_per_second, grace

    def _read(
        self,
        requests: Iterator[Any],
        context: grpc.ServicerContext,
        declared: int | None,
        most: float = 3600.0,
        owner: object = None,
    ) -> PushMessage | None:
        """The next message, admitted (what its call `declared`, waiting at most `most`) and held (by
        `owner`: a stream); None at the end of the client's messages."""
        reading = self._admit(context, declared, most, owner)
        try:
            # A Push's message must come in time (a stream's are read by IdleMessages).
            request = self._read_unary(requests, context, declared, "Push") if owner is None else next(requests, None)
            if request is not None:  # its own size held before the read's reservation goes
                request.held.append(self.inflight.hold(len(request.payload), owner))
        finally:
            reading()
        if request is None:
            return None
        size = len(request.payload)
        if declared is not None and request.wire_bytes > declared:
            request.release()
            raise _larger("PushRequest", request.wire_bytes, declared)
        if request.total_bytes and request.total_bytes < size:
            request.release()
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"PushRequest: total_bytes = {request.total_bytes} is less than the {size} bytes of its payload",
                Reason.INVALID_REQUEST,
            )
        if request.offset and (request.table or request.seq or request.total_bytes or not size):
            request.release()
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"PushRequest: offset = {request.offset} marks a chunk after a push's first, which carries a payload "
                "and nothing else (table, seq and total_bytes unset)",
                Reason.INVALID_REQUEST,
            )
        return request

    def _read_unary(
        self, requests: Iterator[T], context: grpc.ServicerContext, declared: int | None, what: str
    ) -> T | None:
        """A unary call's message, which must come within push_stream_idle_seconds and the time
        its declared size takes at push_min_mb_per_second: the bound a push in chunks has. One that
        declared none has push_stream_idle_seconds alone: bounded by max_message_bytes, a call that
        sent nothing held its worker for 47 minutes (256 MiB at 0.1 MB/s), and 48 of them locked every
        rollout worker out. Past it the call ends DEADLINE_EXCEEDED, reason idle."""
        size = declared or 0
        seconds = self.grace + size / (self.min_mb_per_second * 1e6)
        with self.slow_reads.bounded(context, seconds) as key:
            try:
                return next(requests, None)
            except grpc.RpcError:
                if not self.slow_reads.expired(key):
                    raise  # the client's cancel
        raise Refusal(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{what}: its message did not come within {seconds:g}s (push_stream_idle_seconds = {self.grace:g}, and "
            + (
                f"its {size} bytes at push_min_mb_per_second = {self.min_mb_per_second:g}"
                if declared is not None
                else "no more: the call declared no size in expbuf-message-bytes"
            )
            + "); the call was ended, and the room its read held was given back",
            Reason.IDLE,
        )

    def _admit(
        self, context: grpc.ServicerContext, declared: int | None, most: float = 3600.0, owner: object = None
    ) -> Callable[[], None]:
        """Wait until a message may be read (at most `most`): what its call `declared` (at most
        max_message_bytes and the cap) fits beside what is held, reserved until the message holds
        its own size (the function returned gives it back); or, declared nothing, what is held is
        below the cap. A Refusal if not in time. A unary call (no `owner`: a Push, a PutValues) that
        finds no room becomes a call that waits idle: it waits only where the call limits let it
        (limits.MAY_WAIT), and is otherwise refused at once as busy, having done nothing, so that
        such calls never take the workers kept for the calls that answer at once (a Seal, a ClearValues)."""
        inflight = self.inflight
        expect = None if declared is None else min(declared, self.max_message_bytes, inflight.limit)
        full = inflight.held >= inflight.limit if expect is None else not inflight.fits(expect)
        may_wait = MAY_WAIT.get() if owner is None and full else None
        busy = None if may_wait is None else may_wait()
        if busy is not None:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{inflight.holders()}, leaving no room under max_inflight_bytes = {inflight.limit} for this call's "
                f"message, and it may not wait for room: {busy}",
                Reason.BUSY,
            )
        wait, stop = min(most, remaining(context)), ended(context)  # a call gone waits no more
        if expect is None:
            refused = inflight.admit(wait, owner, stop)
            if refused is not None:
                raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, refused, Reason.INFLIGHT_FULL)
            return _nothing
        held = inflight.reserve(expect, wait, owner, reading=True, stop=stop)
        if isinstance(held, str):
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, held, Reason.INFLIGHT_FULL)
        return held

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if method == "Push" and handler.unary_unary:
            behavior = handler.unary_unary

            def push(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                try:
                    request = self._read(requests, context, _declared(context))
                except Refusal as refusal:
                    refusal.abort(context)
                if request is None:
                    refuse(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "Push: the call carried no message",
                        Reason.INVALID_REQUEST,
                    )
                CALL_TABLE.set(request.table or "default")
                try:
                    if request.total_bytes > len(request.payload) or request.offset:
                        refuse(
                            context,
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"Push: total_bytes = {request.total_bytes} and offset = {request.offset} with a payload "
                            f"of {len(request.payload)} bytes: a payload in chunks goes over PushStream",
                            Reason.INVALID_REQUEST,
                        )
                    return behavior(request, context)
                finally:
                    request.release()

            # A unary request is framed as a stream of one: taken as a stream, it is read only when asked for.
            return grpc.stream_unary_rpc_method_handler(push, read_push_request, handler.response_serializer)
        if method == "PushStream" and handler.stream_stream:
            behavior = handler.stream_stream

            def admitted(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                """The stream's messages, each holding its memory until the servicer releases it."""
                owner = object()  # this stream, whose own pushes in progress free the room it waits for
                size = _declared(context)
                last = 0  # the seq of the stream's last push
                while True:
                    request = self._read(requests, context, size, self.stream_wait, owner)
                    if request is None:
                        return
                    if request.offset or (last and not (request.seq or request.table or request.total_bytes)):
                        request.release()
                        raise _orphan(last, request.offset)
                    last = request.seq
                    if request.total_bytes > len(request.payload):
                        try:
                            request = yield from self.chunks.read(request, requests, context, owner)
                        except Refusal as refusal:  # read on the stream's reader thread: counted on its table
                            refusal.table = request.table or "default"
                            raise
                    yield request

            def push_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                yield from behavior(admitted(requests, context), context)

            return grpc.stream_stream_rpc_method_handler(push_stream, read_push_request, handler.response_serializer)
        if method == "PutValues" and handler.unary_unary:
            parse = handler.request_deserializer

            def sized(data: bytes) -> tuple[int, Any]:
                """The request and the size of its message, which its call's declaration bounds."""
                return len(data), parse(data) if parse is not None else data

            return grpc.stream_unary_rpc_method_handler(
                self._held_values(handler.unary_unary), sized, handler.response_serializer
            )
        return handler

    def _held_values(self, behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
        """PutValues read once InFlight admits it (as a Push is), its values counted until they are
        stored: keyed values (TransferQueue's tensors) come as large as pushes, from as many writers
        at once."""

        def held(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            try:
                size = _declared(context)
                reading = self._admit(context, size)
            except Refusal as refusal:
                refusal.abort(context)
            try:
                request = self._read_unary(requests, context, size, "PutValues")
                release = self.inflight.hold(0 if request is None else sum(map(len, request[1].values)))
            except Refusal as refusal:
                refusal.abort(context)
            finally:
                reading()
            try:
                if request is None:
                    refuse(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "PutValues: the call carried no message",
                        Reason.INVALID_REQUEST,
                    )
                if size is not None and request[0] > size:
                    _larger("PutValuesRequest", request[0], size).abort(context)
                return behavior(request[1], context)
            finally:
                release()

        return held


def _declared(context: grpc.ServicerContext) -> int | None:
    """What a call declared of its messages (declared_bytes, from its own metadata: the handler
    serves every call of its method), raised where it is not one."""
    declared = declared_bytes(context.invocation_metadata())
    if isinstance(declared, Refusal):
        raise declared
    return declared


def _nothing() -> None:
    """What an undeclared message's read gives back: it reserved nothing."""
