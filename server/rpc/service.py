"""The ExperienceBuffer gRPC servicer: translates between the wire and the store.

Nothing here decides anything about storage; it maps requests to the store's calls,
TRXP payloads through the codec, and refusals to gRPC status codes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc

from expbuf.client.rpc import wire
from expbuf.client.schema.call_limits import MAX_NAMES_PER_CALL
from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from ..store import PutResult, Sampled, Store
from ..store.schema.errors import (
    DamagedPayload,
    InsertLimited,
    InvalidRequest,
    SpecError,
    TableFull,
    check_names,
)
from ..store.schema.sample_spec import TakeSpec
from .call_context import (
    MIN_REPLY_BYTES,
    RefusalLog,
    ended,
    ids_of,
    max_wait_note,
    noted,
    refusals,
    remaining,
    room_wait,
)
from .draining import Draining
from .interceptors.base import CALL_TABLE, refuse
from .interceptors.limits import MAY_WAIT, Interrupted, TableStreams
from .interceptors.metrics import Metrics
from .push import push_stream
from .push.ingest import Ingest
from .push.push_request import PushMessage
from .sample.replies import ReplyTooLarge, sample_reply
from .sample.sample_stream import stream_batches
from .servicers.ledger import LedgerServicer
from .servicers.offpolicy import OffPolicyServicer
from .servicers.reads import ReadServicer
from .servicers.tables import TableServicer
from .servicers.values import ValuesServicer
from .writers import Writers

log = logging.getLogger("expbuf.service")


def sample_spec(request: pb.SampleRequest) -> TakeSpec:
    """The first message of a Sample stream as a checked TakeSpec."""
    try:
        order = request_order(request)
        delivery = wire.enum_name(wire.DELIVERY, "delivery", request.delivery, "consume")
    except wire.WireError as exc:
        raise SpecError(str(exc)) from None
    return TakeSpec(
        table=request.table or "default",
        num_groups=request.num_groups,
        batch_size=request.batch_size,
        order=order,
        delivery=delivery,
        lease_seconds=request.lease_seconds,
        wait_seconds=request.wait_seconds,
        allow_partial=request.allow_partial,
        max_batches=request.max_batches,
        min_model_version=request.min_model_version if request.has_min_model_version else None,
        trainer_version=request.trainer_version if request.has_trainer_version else None,
        window=request.window or 1,
        compact_advantages=request.compact_advantages,
        fields=tuple(request.fields),
    )


def first_request(requests: Iterator[pb.SampleRequest], seconds: float) -> pb.SampleRequest | None:
    """The first message of a Sample stream, None if its client closed its side first; TimeoutError
    if it sent none within `seconds` (read by a thread of its own: gRPC's reads have no timeout,
    and it ends with the call)."""
    read: list[pb.SampleRequest | Exception | None] = []
    came = threading.Event()

    def take() -> None:
        try:
            read.append(next(requests, None))
        except Exception as exc:  # a cancel (grpc.RpcError): raised where the call reads it
            read.append(exc)
        finally:
            came.set()

    threading.Thread(target=take, name="expbuf-sample-first", daemon=True).start()
    if not came.wait(seconds):
        raise TimeoutError
    (first,) = read
    if isinstance(first, Exception):
        raise first
    return first


def request_order(request: pb.SampleRequest) -> str:
    """The order a Sample request names: a registered order's `order_name`, or the enum."""
    if not request.order_name:
        return wire.enum_name(wire.ORDER, "order", request.order, "fifo")
    if request.order:
        raise InvalidRequest("set order or order_name, not both")
    return request.order_name


class ExperienceBufferService(
    LedgerServicer, OffPolicyServicer, ReadServicer, TableServicer, ValuesServicer, pb_grpc.ExperienceBufferServicer
):
    def __init__(
        self,
        store: Store,
        *,
        metrics: Metrics,
        max_message_bytes: int,
        advantage_device: str,
        bind_leases: bool = False,
        ingest: Ingest | None = None,
        table_streams: TableStreams | None = None,
        push_stream_idle_seconds: float = 120.0,
        push_stream_window: int = 8,
        max_wait_seconds: float = 600.0,
        max_confirm_seconds: float = 600.0,
    ) -> None:
        self.store = store
        self.ingest = ingest or Ingest()
        self.table_streams = table_streams or TableStreams(1 << 30)
        self.bind_leases = bind_leases
        self.refusal_log = RefusalLog()
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.advantage_device = advantage_device
        self.advantage_worker_state = ""  # not_needed, loading, running or failed (advantages/start.py)
        self.advantage_worker_failure = ""  # why advantages cannot be computed (advantages/start.py)
        self.push_stream_idle_seconds = push_stream_idle_seconds
        self.push_stream_window = push_stream_window
        self.max_wait_seconds = max_wait_seconds
        self.max_confirm_seconds = max_confirm_seconds
        self.started = time.monotonic()  # uptime: never stepped back
        self.writers = Writers()
        self.draining = Draining()

    # ---- push --------------------------------------------------------------------

    def _push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushReply:
        table = request.table or "default"
        CALL_TABLE.set(table)
        entries = self.ingest.entries(request.payload)
        if isinstance(request, PushMessage):
            request.drop_payload()
        timeout, note = room_wait(context, self.max_wait_seconds)
        try:  # a push that finds it must wait for room is a call that waits idle (rpc/interceptors/limits.py)
            holder, may_wait = self._owner(context), MAY_WAIT.get()
            result = self.store.put_entries(
                table, entries, timeout=timeout, holder=holder, may_wait=may_wait, stop=ended(context)
            )
        except (TableFull, InsertLimited) as exc:
            raise noted(exc, note) from None
        return self._reply(request.seq, table, result)

    def _reply(self, seq: int, table: str, result: PutResult) -> pb.PushReply:
        """A stored push's reply (its groups dropped as they completed are logged)."""
        for gkey in result.dropped_groups:
            log.info("group dropped: table %s, group %s, reason zero_variance", table, gkey)
        return pb.PushReply(
            seq=seq,
            stored_uids=result.stored,
            duplicate_uids=result.duplicates,
            completed_groups=result.completed_groups,
            stale_uids=result.stale,
            partial_uids=result.partial,
        )

    @refusals
    def Push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushReply:
        return self._push(request, context)

    @refusals
    def PushStream(self, request_iterator: Iterator[pb.PushRequest], context: grpc.ServicerContext) -> Iterator:
        """Pushes as they come, up to push_stream_window of them at once, each answered in order once
        durable (rpc/push/push_stream.py); a stream that sends nothing for push_stream_idle_seconds ends
        with DEADLINE_EXCEEDED naming the setting (it holds a worker thread while it waits). When
        the server stops, it ends with UNAVAILABLE once it has answered every push it read (rpc/draining.py)."""
        messages = push_stream.open_messages(
            request_iterator, self.ingest, self.push_stream_idle_seconds, self.push_stream_window, self._owner(context)
        )
        try:
            with self.draining.watching(messages.interrupt):
                yield from push_stream.replies(self.store, messages, context, self._reply, self.max_wait_seconds)
        except Interrupted:
            self.draining.end("PushStream", context)
        finally:
            messages.close()

    # ---- sample ------------------------------------------------------------------

    @refusals
    def Sample(self, requests: Iterator[pb.SampleRequest], context: grpc.ServicerContext) -> Iterator[bytes]:
        """Batches sent as the client asks for them (see rpc/sample/sample_stream.py). A stream
        whose first message does not come within max_wait_seconds ends DEADLINE_EXCEEDED naming
        it: it holds a worker and one of max_sample_streams while it waits."""
        try:
            first = first_request(requests, remaining(context, self.max_wait_seconds))
        except grpc.RpcError:  # cancelled before it asked for anything
            return
        except TimeoutError:
            refuse(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the Sample stream sent no SampleRequest within the server's max_wait_seconds = "
                f"{self.max_wait_seconds:g} (EXPBUF_MAX_WAIT_SECONDS): a stream's first message asks for its "
                "batches, and the server waits for it no longer; open a new stream and send it at once",
                Reason.IDLE,
            )
        if first is None:
            return
        CALL_TABLE.set(first.table or "default")
        spec = sample_spec(first)
        bound = ""
        if spec.wait_seconds > self.max_wait_seconds:
            spec = replace(spec, wait_seconds=self.max_wait_seconds)
            bound = max_wait_note(self.max_wait_seconds)

        if 0 < first.max_reply_bytes < MIN_REPLY_BYTES:
            refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"SampleRequest: max_reply_bytes = {first.max_reply_bytes}; it must be 0 (one message a batch) "
                f"or at least {MIN_REPLY_BYTES}",
                Reason.INVALID_REQUEST,
            )
        limit = min(self.max_message_bytes, first.max_reply_bytes or self.max_message_bytes)

        def reply(batch: Sampled, confirm_seconds: float) -> Iterator[bytes]:
            try:
                yield from sample_reply(batch, spec, confirm_seconds, limit, parts=first.max_reply_bytes > 0)
            except ReplyTooLarge as exc:
                refuse(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a batch of table '{spec.table}' takes {exc.args[0]} bytes, more than one message (the "
                    f"server's max_message_bytes = {self.max_message_bytes}), and this client sent no "
                    "max_reply_bytes, so it cannot take the batch in parts: it returns to the buffer. Sample with "
                    "an expbuf client of this release or later (or set SampleRequest.max_reply_bytes)",
                    Reason.TOO_LARGE,
                )

        refused = self.table_streams.enter(spec.table)
        if refused is not None:
            refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refused, Reason.STREAMS_FULL)
        try:
            yield from stream_batches(
                self.store,
                spec,
                requests,
                context,
                owner=self._owner(context),
                timeout=lambda: remaining(context, spec.wait_seconds),
                reply=reply,
                draining=self.draining,
                bound=bound,
                confirm_seconds=self.max_confirm_seconds,
                answers_stopping=first.answers_stopping,
                awaits_delivery=first.awaits_delivery,
                delivered=lambda batch: self._observe_staleness(spec.table, batch),  # from the take's transaction
            )
        except DamagedPayload as exc:  # found as its reply was built: the batch went back unsent
            self._refuse_damaged(
                context, spec.table, exc, ", and the rest of its batch went back to the buffer; sample again"
            )
        finally:
            self.table_streams.leave(spec.table)

    def _observe_staleness(self, table: str, batch: Sampled) -> None:
        """Trainer version (else the newest pushed) minus each experience's version; an
        experience newer than the trainer counts as 0."""
        latest = batch.trainer_version if batch.trainer_version is not None else batch.newest_version
        if latest is None:
            return
        histogram = self.metrics.of_table(self.metrics.staleness, table)
        if histogram is None:  # dropped since the take
            return
        for version in batch.versions:
            if version is not None:
                histogram.observe(max(0, latest - version))

    @refusals
    def Ack(self, request: pb.AckRequest, context: grpc.ServicerContext) -> pb.AckReply:
        table = request.table or "default"
        return pb.AckReply(acked=self.store.ack(request.lease_id, table, self._owner(context)))

    @refusals
    def Nack(self, request: pb.NackRequest, context: grpc.ServicerContext) -> pb.NackReply:
        table = request.table or "default"
        return pb.NackReply(requeued=self.store.nack(request.lease_id, table, self._owner(context)))

    @refusals
    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewReply:
        table = request.table or "default"
        expires, leased = self.store.renew(request.lease_id, request.lease_seconds, table, self._owner(context))
        return pb.RenewReply(lease_expires_unix=expires, leased=leased)

    @refusals
    def Retire(self, request: pb.RetireRequest, context: grpc.ServicerContext) -> pb.RetireReply:
        check_names(request.group_ids, "group_ids", "Retire", MAX_NAMES_PER_CALL)  # before they are read
        groups = ids_of(request.group_ids, "group_ids")
        return pb.RetireReply(retired=self.store.retire(request.table or "default", groups, self._owner(context)))

    # ---- admin -------------------------------------------------------------------

    @refusals
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteReply:
        table = request.table or "default"
        check_names(request.uids, "uids", "Delete", MAX_NAMES_PER_CALL)  # before they are read
        check_names(request.group_ids, "group_ids", "Delete", MAX_NAMES_PER_CALL)
        deleted = self.store.delete(table, ids_of(request.uids, "uids"), ids_of(request.group_ids, "group_ids"))
        return pb.DeleteReply(deleted=deleted)

    @refusals
    def FailRuns(self, request: pb.FailRunsRequest, context: grpc.ServicerContext) -> pb.FailRunsReply:
        check_names(request.uids, "uids", "FailRuns", MAX_NAMES_PER_CALL)  # before they are read
        uids = ids_of(request.uids, "uids")
        done = self.store.fail_runs(request.table or "default", uids, list(request.reasons), self._owner(context))
        return pb.FailRunsReply(
            recorded_uids=done.recorded, completed_groups=done.completed_groups, dropped_groups=done.dropped_groups
        )

    @refusals
    def Seal(self, request: pb.SealRequest, context: grpc.ServicerContext) -> pb.SealReply:
        (group_id,) = ids_of([request.group_id], "group_id")
        return pb.SealReply(size=self.store.seal(request.table or "default", group_id, self._owner(context)))
