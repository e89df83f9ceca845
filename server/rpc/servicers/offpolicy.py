"""The off-policy bound's calls of the ExperienceBuffer servicer (SetTrainerVersion, Admit,
FinishGrant, ResetOffPolicy): the trainer's version a table measures staleness from, and
rollouts admitted under the table's bound (AReaL's) by grants their workers finish. The rules
are the storage engine's (store/tables/admission.py); here requests become its calls."""

from __future__ import annotations

import logging

import grpc

from expbuf.proto.v1 import buffer_pb2 as pb

from ...store.schema.sample_spec import MAX_WAIT_SECONDS, check_seconds
from ..call_context import ended, refusals, remaining
from ..interceptors.metrics import Metrics
from .base import ServicerBase

log = logging.getLogger("expbuf.service")


class OffPolicyServicer(ServicerBase):
    """SetTrainerVersion, Admit, FinishGrant and ResetOffPolicy."""

    metrics: Metrics
    max_wait_seconds: float

    @refusals
    def SetTrainerVersion(
        self, request: pb.SetTrainerVersionRequest, context: grpc.ServicerContext
    ) -> pb.SetTrainerVersionReply:
        version = self.store.set_trainer_version(request.table or "default", request.version)
        return pb.SetTrainerVersionReply(version=version)

    @refusals
    def Admit(self, request: pb.AdmitRequest, context: grpc.ServicerContext) -> pb.AdmitReply:
        table = request.table or "default"
        check_seconds("wait_seconds", request.wait_seconds, low=0.0, high=MAX_WAIT_SECONDS)  # as a claim's
        asked = min(request.wait_seconds, self.max_wait_seconds)  # a waiting Admit holds a worker thread
        wait = remaining(context, asked) if request.wait_seconds > 0 else 0.0
        seconds = request.grant_seconds or 300.0
        grant = self.store.admit(
            table,
            request.count,
            wait=wait,
            grant_seconds=seconds,
            holder=self._owner(context),
            stop=ended(context),
            grant_id=request.grant_id,
        )
        if grant.count and not context.is_active():  # its caller gone as it was granted: the room back at once
            self.store.finish_grant(table, grant.grant_id, 0, self._owner(context))
            return pb.AdmitReply()
        admitted = self.metrics.of_table(self.metrics.admission, table, "granted" if grant.count else "no_room")
        if admitted is not None:  # else dropped since
            admitted.inc()
        return pb.AdmitReply(granted=grant.count, grant_id=grant.grant_id, expires_unix=grant.expires)

    @refusals
    def FinishGrant(self, request: pb.FinishGrantRequest, context: grpc.ServicerContext) -> pb.FinishGrantReply:
        accepted = request.accepted if request.HasField("accepted") else None
        table, holder = request.table or "default", self._owner(context)
        returned = self.store.finish_grant(table, request.grant_id, accepted, holder)
        return pb.FinishGrantReply(returned=returned)

    @refusals
    def ResetOffPolicy(
        self, request: pb.ResetOffPolicyRequest, context: grpc.ServicerContext
    ) -> pb.ResetOffPolicyReply:
        table = request.table or "default"
        version = request.trainer_version if request.has_trainer_version else None
        stored, submitted = self.store.reset_offpolicy(table, version)
        log.info(
            "off-policy state of table %s reset: trainer version %s, %d rollouts counted", table, stored, submitted
        )
        return pb.ResetOffPolicyReply(trainer_version=-1 if stored is None else stored, submitted=submitted)
