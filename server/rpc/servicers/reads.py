"""The service's reads of named experiences: Get, ReadFields (fields, shares of tokens, a rank's
part of a leased step, or the experiences whole, in parts) and ListExperiences, mixed into the
servicer (rpc/service.py), which provides the store, its largest message and the caller's token
fingerprint."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from expbuf.client.schema.balance import COSTS, MAX_RANKS, ModelShape
from expbuf.client.schema.call_limits import MAX_READ_UIDS
from expbuf.client.schema.reasons import Reason
from expbuf.client.trxp.stored.columns import PREFIX_FIELDS, Shares
from expbuf.proto.v1 import buffer_pb2 as pb

from ...store.schema.errors import DamagedPayload, InvalidRequest, SpecError, check_names, clip
from ...store.schema.sample_spec import check_fields
from ...store.schema.states import LIVE
from ..call_context import MIN_REPLY_BYTES, distinct, ids_of, refusals
from ..interceptors.base import refuse
from ..interceptors.reply_memory import held_whole
from ..sample.replies import ReplyTooLarge, fields_reply, payload_reply
from .base import ServicerBase

MAX_LIST_PAGE = 10_000  # experiences a ListExperiences page may ask for


class ReadServicer(ServicerBase):
    """Get, GetPartials, ReadPartials, ReadFields and ListExperiences."""

    def _refuse_damaged(self, context: grpc.ServicerContext, table: str, exc: DamagedPayload, then: str) -> None:
        """Quarantine an experience found damaged as a reply was built, and end the call
        DATA_LOSS naming it; `then` ends the message: what became of the rest, what to do next."""
        self.store.quarantine(table, [exc.uid])
        refuse(
            context,
            grpc.StatusCode.DATA_LOSS,
            f"table '{table}': {exc}: it is quarantined, never to be served (its group fails){then}",
            Reason.DAMAGED,
        )

    @refusals
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetReply:
        """The named experiences as one TRXP payload, within one message (ReadFields reads in parts)."""
        check_names(request.uids, "uids", "Get", MAX_READ_UIDS)  # before they are read
        uids = distinct(ids_of(request.uids, "uids"))
        limit = self.max_message_bytes - MIN_REPLY_BYTES
        payload, missing = self.store.get_payload(request.table or "default", uids, limit)
        return pb.GetReply(payload=payload, missing_uids=missing)

    @refusals
    def GetPartials(self, request: pb.GetPartialsRequest, context: grpc.ServicerContext) -> pb.GetReply:
        limit = self._reply_limit(request, "GetPartialsRequest")
        payload, rest = self._partials(request, limit, context, alone=False)
        return pb.GetReply(payload=payload, missing_uids=rest)

    @refusals
    def ReadPartials(self, request: pb.GetPartialsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """GetPartials' rollouts as one SampleReply, in parts when large: for a client that takes
        parts (max_reply_bytes), a rollout larger than its limit comes alone."""
        parts, limit = request.max_reply_bytes > 0, self._reply_limit(request, "GetPartialsRequest")
        payload, rest = self._partials(request, limit, context, alone=parts)
        give_back = held_whole(context, "ReadPartials", len(payload))
        try:
            yield from payload_reply(payload, rest, limit, parts)
        except ReplyTooLarge as exc:
            refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the rollouts read from table '{request.table or 'default'}' take {exc.args[0]} bytes, more than "
                f"one message (the server's max_message_bytes = {self.max_message_bytes}), and this client sent no "
                "max_reply_bytes, so it cannot take them in parts",
                Reason.TOO_LARGE,
            )
        finally:
            give_back()

    def _partials(
        self, request: pb.GetPartialsRequest, limit: int, context: grpc.ServicerContext, *, alone: bool
    ) -> tuple[bytes, list[str]]:
        """The payload of the rollouts held in pieces that a request names, as many as a reply of
        `limit` bytes holds (with `alone`, the first one whatever its size), and the uids of the
        others; with tokens on, a prompt's only to the token that holds its claim."""
        check_names(request.task_ids, "task_ids", "GetPartials", MAX_READ_UIDS)  # before they are read
        check_names(request.uids, "uids", "GetPartials", MAX_READ_UIDS)
        tids, uids = ids_of(request.task_ids, "task_ids"), ids_of(request.uids, "uids")
        table = request.table or "default"
        return self.store.get_partials(table, tids, uids, limit, alone=alone, holder=self._owner(context))

    def _reply_limit(self, request: pb.GetPartialsRequest | pb.ReadFieldsRequest, name: str) -> int:
        """The bytes a reply may take: the client's max_reply_bytes within the server's largest message."""
        if 0 < request.max_reply_bytes < MIN_REPLY_BYTES:
            raise InvalidRequest(
                f"{name}: max_reply_bytes = {request.max_reply_bytes}; it must be 0 (one message, at most the "
                f"server's max_message_bytes) or at least {MIN_REPLY_BYTES}"
            )
        return min(self.max_message_bytes, request.max_reply_bytes or self.max_message_bytes)

    @refusals
    def ReadFields(self, request: pb.ReadFieldsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Some fields of named experiences as one columnar SampleReply, or without fields the
        experiences' TRXP payload (as Get's), in parts when large."""
        table = request.table or "default"
        check_names(request.uids, "uids", "ReadFields", MAX_READ_UIDS)  # before they are read
        uids = distinct(ids_of(request.uids, "uids"))
        fields = tuple(request.fields)
        try:
            check_fields(fields)
            shares = Shares(request.shares, tuple(request.take)) if request.shares or request.take else None
        except (SpecError, ValueError) as exc:
            raise InvalidRequest(f"ReadFieldsRequest: {exc}") from None
        if shares is not None and not fields:
            raise InvalidRequest("ReadFieldsRequest: shares cut fields; name the fields to read in shares")
        if shares is not None and PREFIX_FIELDS & set(fields):
            raise InvalidRequest(
                f"ReadFieldsRequest: {', '.join(sorted(PREFIX_FIELDS & set(fields)))} read whole prompts and "
                "responses, not shares of them: read them without shares"
            )
        limit = self._reply_limit(request, "ReadFieldsRequest")
        cost = None
        step: list[str] = []
        gone: list[str] = []
        if request.lease_id:
            uids, step, gone, cost = self._part(table, request, uids, context)
        batch, missing = self.store.read_fields(table, uids, shares, whole=not fields, step=step)
        if request.lease_id and missing:  # a member found damaged failed its group: the part read again without it
            batch.release()
            uids, step, gone, cost = self._part(table, request, [], context)
            batch, missing = self.store.read_fields(table, uids, shares, whole=not fields, step=step)
        missing += gone
        batch.run_cost = cost
        try:
            yield from fields_reply(batch, fields, missing, limit, parts=request.max_reply_bytes > 0)
        except ReplyTooLarge as exc:
            refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the fields read from table '{table}' take {exc.args[0]} bytes, more than one message (the "
                f"server's max_message_bytes = {self.max_message_bytes}), and this client sent no max_reply_bytes, "
                "so it cannot take them in parts: read fewer experiences or fields, or set max_reply_bytes",
                Reason.TOO_LARGE,
            )
        except DamagedPayload as exc:  # found as its reply was built
            self._refuse_damaged(context, table, exc, "; read again for the others")

    def _part(
        self, table: str, request: pb.ReadFieldsRequest, uids: list[str], context: grpc.ServicerContext
    ) -> tuple[list[str], list[str], list[str], Callable[[int], int]]:
        """The uids of the rank's part of a leased step that a ReadFields names by lease, those of
        the whole step (over which a batch stage finishes the part), those of its groups that left
        the lease since it was split (missing), and the cost its split weighed a run of L tokens by."""
        if uids:
            raise InvalidRequest("ReadFieldsRequest: name uids or a lease's part (lease_id), not both")
        if not 1 <= request.ranks <= MAX_RANKS or request.rank >= request.ranks:
            raise InvalidRequest(
                f"ReadFieldsRequest: rank {request.rank} of {request.ranks} ranks; ranks is 1 to {MAX_RANKS} "
                "and a rank is numbered 0 to ranks - 1"
            )
        balance = request.balance or "tokens"
        if balance not in COSTS:
            raise InvalidRequest(f"ReadFieldsRequest: balance {clip(balance)!r} is not one of {', '.join(COSTS)}")
        model = None
        if request.HasField("model"):
            try:
                model = ModelShape(request.model.params, request.model.layers, request.model.hidden)
            except ValueError as exc:
                raise InvalidRequest(f"ReadFieldsRequest: model: {exc}") from None
        if balance == "flops" and model is None:
            raise InvalidRequest("ReadFieldsRequest: balance 'flops' needs the model's shape (params, layers, hidden)")
        owner = self._owner(context)
        uids, step, gone = self.store.lease_part(
            table, request.lease_id, request.rank, request.ranks, balance, model, owner, request.equal
        )
        cost = COSTS[balance]
        return uids, step, gone, lambda length: cost(length, model)

    @refusals
    def ListExperiences(
        self, request: pb.ListExperiencesRequest, context: grpc.ServicerContext
    ) -> pb.ListExperiencesReply:
        unknown = sorted(set(request.states) - set(LIVE))
        if unknown:
            raise InvalidRequest(f"states: {clip(unknown[0])!r} is not a live state ({', '.join(LIVE)})")
        if request.limit > MAX_LIST_PAGE:
            raise InvalidRequest(f"limit: {request.limit} is above the page limit of {MAX_LIST_PAGE}")
        found = self.store.list_experiences(
            request.table or "default",
            states=list(request.states),
            min_version=request.min_model_version if request.HasField("min_model_version") else None,
            max_version=request.max_model_version if request.HasField("max_model_version") else None,
            after=request.after,
            limit=request.limit or 1000,
        )
        listed = [
            pb.ListedExperience(
                uid=item.uid,
                group_id=item.group,
                state=item.state,
                model_version=item.version,
                reward=item.reward,
                times_sampled=item.times_sampled,
            )
            for item in found.items
        ]
        return pb.ListExperiencesReply(experiences=listed, next=found.next, done=found.done)
