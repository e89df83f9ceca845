"""The calls of the ExperienceBuffer servicer over its tables and itself (CreateTable, ListTables,
DropTable, Stats, ServerInfo, Writers): a table's settings to and from the wire, its counters as
TableStats, and what the server says of itself."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

import grpc
from google.protobuf.unknown_fields import UnknownFieldSet

from expbuf.client import trxp
from expbuf.client.rpc import wire
from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb

from ... import __version__
from ...advantages.devices import check_device
from ...advantages.moments import RunningMoments
from ...store.schema import order_names
from ...store.schema.errors import ConfigError, NotFound, clip
from ...store.schema.table_config import TableConfig
from ..call_context import refusals
from ..interceptors.base import refuse
from ..interceptors.metrics import Metrics
from ..writers import Writers
from .base import ServicerBase

log = logging.getLogger("expbuf.service")

# The TableStats fields of the versions, by the counter each comes from (unknown: -1).
_VERSION_STATS = {
    "min_model_version": "min_version",
    "max_model_version": "max_version",
    "trainer_version": "trainer_version",
}
# TableStats fields that carry a store counter of another name: Stats.evicted is a total since the
# table was created (as expbuf_evicted_total), not the evicted tombstones it holds, which go in time.
_RENAMED_STATS = {"evicted": "evicted_total"}


def _unknown_fields(message: Any) -> list[int]:
    """The numbers of fields a newer client set that this server does not know."""
    fields = UnknownFieldSet(message)
    return [fields[i].field_number for i in range(len(fields))]


class TableServicer(ServicerBase):
    """CreateTable, ListTables, DropTable, Stats, ServerInfo and Writers."""

    metrics: Metrics
    writers: Writers
    started: float
    advantage_device: str
    advantage_worker_failure: str
    advantage_worker_state: str

    @refusals
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        if request.table:
            return pb.StatsReply(tables=[self._table_stats(request.table)])
        listed = (self._listed_stats(table.name) for table in self.store.list_tables())
        return pb.StatsReply(tables=[stats for stats in listed if stats is not None])

    def _listed_stats(self, name: str) -> pb.TableStats | None:
        """A listed table's TableStats; None where it was dropped since it was listed (a job's
        end while `expbuf stats --watch` reads every table), which is left out, not the call refused."""
        try:
            return self._table_stats(name)
        except NotFound:
            return None

    def _table_stats(self, name: str) -> pb.TableStats:
        """A table's counters as a TableStats: each field from the counter of its name, the
        versions as -1 while unknown, the reward normalisation as its mean and std."""
        s = self.store.stats(name)
        moments = RunningMoments.of(s["reward_moments"])
        stats = pb.TableStats(name=name, reward_running_mean=moments.mean, reward_running_std=moments.std)
        for field in pb.TableStats.DESCRIPTOR.fields:
            if field.name in _VERSION_STATS:
                version = s[_VERSION_STATS[field.name]]
                setattr(stats, field.name, -1 if version is None else version)
            elif field.name in _RENAMED_STATS:
                setattr(stats, field.name, s[_RENAMED_STATS[field.name]])
            elif field.name in s:
                setattr(stats, field.name, s[field.name])
        return stats

    @refusals
    def ServerInfo(self, request: pb.ServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfoReply:
        storage = self.store.storage_info()
        return pb.ServerInfoReply(
            version=__version__,
            trxp_version=str(trxp.VERSION),
            advantage_device=self.advantage_device,
            max_message_bytes=self.max_message_bytes,
            uptime_seconds=time.monotonic() - self.started,
            storage_bytes=int(storage["used_bytes"]),
            lmdb_map_used_ratio=storage["map_used_ratio"],
            scrub=pb.ScrubInfo(**asdict(self.store.scrub_status())),
            orders=list(order_names.NAMES),
            advantage_worker_failure=self.advantage_worker_failure,
            advantage_worker_state=self.advantage_worker_state,
            repeats_answered=wire.REPEATS_ANSWERED,
        )

    @refusals
    def CreateTable(self, request: pb.CreateTableRequest, context: grpc.ServicerContext) -> pb.CreateTableReply:
        # A setting refused for any cause is a table's settings' refusal (reason invalid_config),
        # whichever check finds it: the wire's (a field this server lacks, an enum's value) or the table's.
        unknown = _unknown_fields(request.config) + _unknown_fields(request.config.estimator)
        if unknown:
            raise ConfigError(
                f"table '{clip(request.config.name)}': unknown setting field(s) {unknown}; this server "
                f"(expbuf {__version__}) does not know them, so it refuses the table instead of dropping them"
            )
        try:
            settings = wire.table_from_proto(request.config)
        except wire.WireError as exc:
            raise ConfigError(f"table '{clip(request.config.name)}': {exc}") from None
        config = TableConfig.from_settings(settings)
        check_device(config)
        created = self.store.create_table(config, exist_ok=request.exist_ok)
        if created:
            log.info("table created: %s", config.described())
        return pb.CreateTableReply(
            config=wire.table_to_proto(self.store.table(config.name).settings()), created=created
        )

    @refusals
    def ListTables(self, request: pb.ListTablesRequest, context: grpc.ServicerContext) -> pb.ListTablesReply:
        return pb.ListTablesReply(tables=[wire.table_to_proto(t.settings()) for t in self.store.list_tables()])

    @refusals
    def DropTable(self, request: pb.DropTableRequest, context: grpc.ServicerContext) -> pb.DropTableReply:
        if request.name == "default":
            refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "the default table cannot be dropped",
                Reason.INVALID_REQUEST,
            )
        dropped = self.store.drop_table(request.name)
        self.writers.forget(request.name)
        self.metrics.forget_table(request.name)
        log.info("table dropped: %s (%d live experiences)", request.name, dropped)
        return pb.DropTableReply(dropped_experiences=dropped)

    @refusals
    def Writers(self, request: pb.WritersRequest, context: grpc.ServicerContext) -> pb.WritersReply:
        table = request.table or "default"
        table_id = self.store.table_id(table)  # NOT_FOUND for a table that does not exist
        count = self.writers.change(table, request.change, table_id, request.writer_id)
        return pb.WritersReply(open=count.open, done=count.done)
