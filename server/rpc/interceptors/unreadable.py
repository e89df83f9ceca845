"""Requests that do not parse, refused INVALID_ARGUMENT naming why (an interceptor).

gRPC parses a request with the method's deserializer before any handler runs, and a parse that
fails ends the call INTERNAL ("Exception deserializing request!"), as if the server were at
fault: a string field that is not UTF-8 (protobuf refuses it at the parse), a truncated message.
Here each method's deserializer hands such a request on as `Unreadable`, and the handler refuses
it INVALID_ARGUMENT (reason invalid_request) naming the message and, for a string that is not
UTF-8, the field, before anything reads it; the server is as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from expbuf.client.schema.reasons import Reason
from expbuf.client.trxp import varints
from expbuf.proto.v1 import buffer_pb2 as pb

from .base import ServiceInterceptor, refuse

_METHODS = pb.DESCRIPTOR.services_by_name["ExperienceBuffer"].methods_by_name


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A request message that did not parse, and why, as its refusal says it."""

    why: str


def bad_string(message: Descriptor, data: bytes | memoryview, within: str = "") -> str | None:
    """The first string field of a message's wire bytes whose value is not UTF-8, by its path
    (`config.name`); None if every one is (or the bytes stop being a message before one is found)."""
    at = 0
    while at < len(data):
        key = varints.read(data, at)
        if key is None:
            return None
        number, kind, at = key[0] >> 3, key[0] & 7, key[1]
        if kind == 0:
            value = varints.read(data, at)
            if value is None:
                return None
            at = value[1]
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
        elif kind == 2:
            length = varints.read(data, at)
            if length is None:
                return None
            start, at = length[1], length[1] + length[0]
            field = message.fields_by_number.get(number)
            if field is None:
                continue
            held = bytes(data[start:at])
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    held.decode("utf-8")
                except UnicodeDecodeError:
                    return within + field.name
            elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
                found = bad_string(field.message_type, held, f"{within}{field.name}.")
                if found is not None:
                    return found
        else:
            return None
    return None


def _why(method: str, data: bytes, exc: Exception) -> str:
    """What the refusal of a request of `method` that did not parse says."""
    found = _METHODS.get(method)
    if found is None:
        return f"{method}: the request does not parse: {exc}"
    message = found.input_type
    field = bad_string(message, data)
    if field is not None:
        return f"{message.name}: field '{field}' is not UTF-8; every string of a request is UTF-8 text"
    return f"{message.name}: the request is not a valid {message.name} message ({exc})"


class UnreadableRequests(ServiceInterceptor):
    """Each method's deserializer made to hand on a request that does not parse as `Unreadable`,
    and its handler to refuse one, INVALID_ARGUMENT (the requests of a stream as each is read)."""

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        parse = handler.request_deserializer
        if parse is None:
            return handler

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:
                return Unreadable(_why(method, data, exc))

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Unreadable):
                refuse(context, grpc.StatusCode.INVALID_ARGUMENT, request.why, Reason.INVALID_REQUEST)
            return request

        def each(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for request in requests:
                yield checked(request, context)

        def one(behavior: Callable[..., Any]) -> Callable[..., Any]:
            return lambda request, context: behavior(checked(request, context), context)

        def many(behavior: Callable[..., Any]) -> Callable[..., Any]:
            return lambda requests, context: behavior(each(requests, context), context)

        reply = handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(one(handler.unary_unary), deserialize, reply)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(one(handler.unary_stream), deserialize, reply)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(many(handler.stream_unary), deserialize, reply)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(many(handler.stream_stream), deserialize, reply)
        return handler
