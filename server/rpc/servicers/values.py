"""The service's keyed values (TransferQueue's data): PutValues, GetValues and ClearValues, mixed
into the servicer (rpc/service.py), which provides the store, its largest message and the
caller's token fingerprint, the owner of what it writes."""

from __future__ import annotations

import grpc

from expbuf.client.schema.call_limits import MAX_KEYS_PER_CALL
from expbuf.proto.v1 import buffer_pb2 as pb

from ...store.schema.errors import check_names
from ..call_context import MIN_REPLY_BYTES, distinct, refusals
from .base import ServicerBase


class ValuesServicer(ServicerBase):
    """PutValues, GetValues and ClearValues."""

    @refusals
    def PutValues(self, request: pb.PutValuesRequest, context: grpc.ServicerContext) -> pb.PutValuesReply:
        check_names(request.keys, "keys", "PutValues", MAX_KEYS_PER_CALL)  # before they are read
        keys, values = list(request.keys), list(request.values)
        stored = self.store.put_values(request.table or "default", keys, values, self._owner(context))
        return pb.PutValuesReply(stored=stored)

    @refusals
    def GetValues(self, request: pb.GetValuesRequest, context: grpc.ServicerContext) -> pb.GetValuesReply:
        check_names(request.keys, "keys", "GetValues", MAX_KEYS_PER_CALL)  # before they are read
        keys = distinct(list(request.keys), "keys")
        owner = self._owner(context) if request.only_own else None
        found = self.store.get_values(request.table or "default", keys, self.max_message_bytes - MIN_REPLY_BYTES, owner)
        return pb.GetValuesReply(
            values=[value for value in found if value is not None],
            missing_keys=[key for key, value in zip(keys, found, strict=True) if value is None],
        )

    @refusals
    def ClearValues(self, request: pb.ClearValuesRequest, context: grpc.ServicerContext) -> pb.ClearValuesReply:
        check_names(request.keys, "keys", "ClearValues", MAX_KEYS_PER_CALL)  # before they are read
        cleared = self.store.clear_values(request.table or "default", list(request.keys), self._owner(context))
        return pb.ClearValuesReply(cleared=cleared)
