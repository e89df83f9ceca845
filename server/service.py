"""The ExperienceBuffer gRPC servicer: translates between the wire and the store.

Nothing here decides anything about storage; it maps requests to Store calls,
TRXP payloads through the codec, and refusals to gRPC status codes.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from expbuf.client import trxp, wire
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from .metrics import Metrics
from .store import Conflict, GroupClosed, InvalidRequest, NotFound, Sampled, StorageFull, Store, StoreError, TableFull
from .tables import ConfigError, TableConfig

log = logging.getLogger("expbuf.service")
VERSION = "0.1.0"

_STATUS = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}
# A consumed batch is held under this internal lease until the stream moves past it,
# so a batch lost with a broken stream returns to the buffer instead of vanishing.
_CONSUME_LEASE_SECONDS = 300.0


_REASONS = (
    (trxp.TrxpError, "invalid_payload"),
    (ConfigError, "invalid_config"),
    (InvalidRequest, "invalid_request"),
    (Conflict, "conflict"),
    (GroupClosed, "group_closed"),
    (TableFull, "table_full"),
    (StorageFull, "storage_full"),
    (NotFound, "not_found"),
)


def _reason(exc: Exception) -> str:
    return next((name for kind, name in _REASONS if isinstance(exc, kind)), "other")


def _refusals(method: Callable) -> Callable:
    """Map the store's and codec's refusals to status codes with their message; count and log them."""

    def abort(self: ExperienceBufferService, request: Any, context: grpc.ServicerContext, exc: Exception) -> None:
        code = grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(exc, StoreError):
            code = _STATUS.get(exc.code, grpc.StatusCode.INTERNAL)
        table = getattr(request, "table", "") or "default"
        reason = _reason(exc)
        self.metrics.refused.labels(table, reason).inc()
        log.info("refused %s on table %s: %s (%s): %s", method.__name__, table, code.name, reason, exc)
        context.abort(code, str(exc))

    if method.__name__ in ("Sample", "PushStream"):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except (StoreError, trxp.TrxpError, ConfigError) as exc:
                abort(self, request, context, exc)

        return stream

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except (StoreError, trxp.TrxpError, ConfigError) as exc:
            abort(self, request, context, exc)

    return unary


def _remaining(context: grpc.ServicerContext, limit: float | None = None) -> float:
    """Seconds left before the caller's deadline (bounded by limit)."""
    left = context.time_remaining()
    left = 3600.0 if left is None else max(0.0, left - 0.05)
    return left if limit is None else min(left, limit)


class ExperienceBufferService(pb_grpc.ExperienceBufferServicer):
    def __init__(self, store: Store, *, metrics: Metrics, max_message_bytes: int, advantage_device: str) -> None:
        self.store = store
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.advantage_device = advantage_device
        self.started = time.time()

    # ---- push --------------------------------------------------------------------

    def _push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushReply:
        items = trxp.parse(request.payload)
        table = request.table or "default"
        result = self.store.put(table, items, timeout=_remaining(context))
        for gkey in result.dropped_groups:
            log.info("group dropped: table %s, group %s, reason zero_variance", table, gkey)
        return pb.PushReply(
            seq=request.seq,
            stored_uids=result.stored,
            duplicate_uids=result.duplicates,
            completed_groups=result.completed_groups,
        )

    @_refusals
    def Push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushReply:
        return self._push(request, context)

    @_refusals
    def PushStream(self, request_iterator: Iterator[pb.PushRequest], context: grpc.ServicerContext) -> Iterator:
        for request in request_iterator:
            yield self._push(request, context)

    # ---- sample ------------------------------------------------------------------

    @_refusals
    def Sample(self, request: pb.SampleRequest, context: grpc.ServicerContext) -> Iterator[pb.SampleReply]:
        table = request.table or "default"
        delivery = wire.enum_name(wire.DELIVERY, request.delivery, "consume")
        wait = request.wait_seconds
        sent = 0
        held = ""  # the internal lease of the last consumed batch, acked once the stream moves on
        try:
            while request.max_batches == 0 or sent < request.max_batches:
                batch = self.store.sample(
                    table,
                    num_groups=request.num_groups,
                    batch_size=request.batch_size,
                    order=wire.enum_name(wire.ORDER, request.order, "fifo"),
                    delivery="lease" if delivery == "consume" else delivery,
                    lease_seconds=request.lease_seconds if delivery == "lease" else _CONSUME_LEASE_SECONDS,
                    timeout=_remaining(context, wait),
                    allow_partial=request.allow_partial,
                    min_model_version=request.min_model_version if request.has_min_model_version else None,
                    stop=lambda: not context.is_active(),
                )
                if held:
                    self.store.ack(held)
                    held = ""
                if batch is None:
                    if not context.is_active() or request.allow_partial:
                        return
                    want = f"{request.num_groups} groups" if request.num_groups else f"{request.batch_size} experiences"
                    context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"table '{table}' did not have {want} ready within {wait:g}s",
                    )
                if delivery == "consume":
                    held = batch.lease_id
                self._observe_staleness(table, batch)  # from the sample's own transaction
                yield self._reply(batch, lease=delivery == "lease")
                sent += 1
                if batch.partial:
                    return
        finally:
            if held:  # the stream broke before moving past this batch: it returns to the buffer
                self.store.nack(held)

    def _observe_staleness(self, table: str, batch: Sampled) -> None:
        latest = batch.newest_version
        if latest is None:
            return
        histogram = self.metrics.staleness.labels(table)
        for version in batch.versions:
            if version is not None:
                histogram.observe(latest - version)

    @staticmethod
    def _reply(batch: Sampled, *, lease: bool) -> pb.SampleReply:
        return pb.SampleReply(
            payload=batch.payload,
            uids=batch.uids,
            group_ids=batch.group_ids,
            lease_id=batch.lease_id if lease else "",
            lease_expires_unix=batch.lease_expires if lease else 0.0,
            partial=batch.partial,
        )

    @_refusals
    def Ack(self, request: pb.AckRequest, context: grpc.ServicerContext) -> pb.AckReply:
        return pb.AckReply(acked=self.store.ack(request.lease_id))

    @_refusals
    def Nack(self, request: pb.NackRequest, context: grpc.ServicerContext) -> pb.NackReply:
        return pb.NackReply(requeued=self.store.nack(request.lease_id))

    # ---- admin -------------------------------------------------------------------

    @_refusals
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetReply:
        payload, missing = self.store.get_payload(request.table or "default", list(request.uids))
        return pb.GetReply(payload=payload, missing_uids=missing)

    @_refusals
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteReply:
        deleted = self.store.delete(request.table or "default", list(request.uids), list(request.group_ids))
        return pb.DeleteReply(deleted=deleted)

    @_refusals
    def Seal(self, request: pb.SealRequest, context: grpc.ServicerContext) -> pb.SealReply:
        return pb.SealReply(size=self.store.seal(request.table or "default", request.group_id))

    @_refusals
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        names = [request.table] if request.table else [t.name for t in self.store.list_tables()]
        return pb.StatsReply(tables=[self._table_stats(name) for name in names])

    def _table_stats(self, name: str) -> pb.TableStats:
        s = self.store.stats(name)
        return pb.TableStats(
            name=name,
            pending=s["pending"],
            ready=s["ready"],
            leased=s["leased"],
            consumed=s["consumed"],
            bytes=s["bytes"],
            groups_pending=s["groups_pending"],
            groups_ready=s["groups_ready"],
            groups_leased=s["groups_leased"],
            groups_dropped=s["groups_dropped"],
            groups_failed=s["groups_failed"],
            computing=s["computing"],
            groups_computing=s["groups_computing"],
            last_failure=s["last_failure"],
            oldest_age_seconds=s["oldest_age_seconds"],
            min_model_version=s["min_version"] if s["min_version"] is not None else -1,
            max_model_version=s["max_version"] if s["max_version"] is not None else -1,
            evicted=s["evicted"],
            pushed=s["pushed"],
            duplicates=s["duplicates"],
            sampled=s["sampled"],
            leases_expired=s["leases_expired"],
        )

    @_refusals
    def ServerInfo(self, request: pb.ServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfoReply:
        storage = self.store.storage_info()
        return pb.ServerInfoReply(
            version=VERSION,
            trxp_version=str(trxp.VERSION),
            advantage_device=self.advantage_device,
            max_message_bytes=self.max_message_bytes,
            uptime_seconds=time.time() - self.started,
            storage_bytes=int(storage["used_bytes"]),
            lmdb_map_used_ratio=storage["map_used_ratio"],
        )

    @_refusals
    def CreateTable(self, request: pb.CreateTableRequest, context: grpc.ServicerContext) -> pb.CreateTableReply:
        config = TableConfig.from_dict(wire.table_from_proto(request.config))
        created = self.store.create_table(config, exist_ok=request.exist_ok)
        if created:
            log.info("table created: %s", config.to_dict())
        return pb.CreateTableReply(config=wire.table_to_proto(self.store.table(config.name).to_dict()), created=created)

    @_refusals
    def ListTables(self, request: pb.ListTablesRequest, context: grpc.ServicerContext) -> pb.ListTablesReply:
        return pb.ListTablesReply(tables=[wire.table_to_proto(t.to_dict()) for t in self.store.list_tables()])

    @_refusals
    def DropTable(self, request: pb.DropTableRequest, context: grpc.ServicerContext) -> pb.DropTableReply:
        if request.name == "default":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the default table cannot be dropped")
        dropped = self.store.drop_table(request.name)
        log.info("table dropped: %s (%d live experiences)", request.name, dropped)
        return pb.DropTableReply(dropped_experiences=dropped)
