"""Bearer-token authentication with scopes, as a gRPC server interceptor.

A request carries one `authorization: Bearer TOKEN` header. A missing, malformed,
repeated or unknown one is UNAUTHENTICATED; a known token without the method's scope is
PERMISSION_DENIED. The decision is made from the headers alone: a refused call is ended
before its request message is read, so an unauthenticated sender cannot make the server
hold a large message. Health checking and reflection stay open, so load balancers and
grpcurl work.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping

import grpc

from expbuf.client.schema.reasons import Reason

from .base import ServiceInterceptor, refuse

log = logging.getLogger("expbuf.auth")
SCOPE_OF_METHOD = {
    "Push": "push",
    "PushStream": "push",
    "Seal": "push",
    "FailRuns": "push",
    "GetPartials": "push",
    "ReadPartials": "push",
    "PutValues": "push",
    "ClearValues": "push",
    "GetValues": "sample",
    "Admit": "push",
    "FinishGrant": "push",
    "Writers": "push",
    "Claim": "push",
    "RenewClaims": "push",
    "ReleaseClaims": "push",
    "ReportPrompts": "push",
    "Sample": "sample",
    "Ack": "sample",
    "Nack": "sample",
    "Renew": "sample",
    "Retire": "sample",
    "Get": "sample",
    "ReadFields": "sample",
    "ListExperiences": "sample",
    "Stats": "sample",
    "ServerInfo": "sample",
    "ListTables": "sample",
    "SetTrainerVersion": "sample",
    "ListDatasets": "sample",
    "ListPrompts": "sample",
    "Delete": "admin",
    "CreateTable": "admin",
    "DropTable": "admin",
}


# The calls any known token may make, whatever its scopes, besides those of its scopes: a client
# asks its server's info before a claim, an admit or a writer's open (which calls the server
# answers again as the first, client/rpc/calls/repeats.py), with a rollout worker's push token too.
ANY_TOKEN = frozenset({"ServerInfo"})


def scope_of(method: str) -> str:
    """The scope a token needs for `method` (an ExperienceBuffer method's name): every method not
    named above is an admin one."""
    return SCOPE_OF_METHOD.get(method, "admin")


def _refuse(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that aborts without reading the request.

    It takes the request as a stream whatever the method's shape (gRPC frames a single
    request and a stream alike), and a streamed request is read only when iterated.
    """

    reason = Reason.FORBIDDEN if code == grpc.StatusCode.PERMISSION_DENIED else Reason.UNAUTHENTICATED

    def abort(requests: object, context: grpc.ServicerContext) -> None:
        refuse(context, code, message, reason)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    return grpc.stream_unary_rpc_method_handler(abort)


class TokenAuth(ServiceInterceptor):
    per_call = True  # each call's own token

    def __init__(self, tokens: Mapping[str, frozenset[str]]) -> None:
        self._tokens = {token.encode(): scopes for token, scopes in tokens.items()}

    def _scopes(self, token: str) -> frozenset[str] | None:
        candidate = token.encode()
        found = None
        for known, scopes in self._tokens.items():  # compare all, in constant time each
            if hmac.compare_digest(known, candidate):
                found = scopes
        return found

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        scope = scope_of(method)
        headers = [value for key, value in details.invocation_metadata or () if key == "authorization"]
        if not headers:
            log.info("refused %s: no bearer token", method)
            return _refuse(handler, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token (authorization metadata)")
        if len(headers) > 1:
            log.info("refused %s: %d authorization headers", method, len(headers))
            return _refuse(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{len(headers)} authorization headers; send exactly one 'authorization: Bearer TOKEN'",
            )
        header = headers[0]
        if not isinstance(header, str) or not header.startswith("Bearer ") or not header[7:]:
            log.info("refused %s: malformed authorization header", method)
            return _refuse(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                "malformed authorization header: expected 'Bearer TOKEN'",
            )
        scopes = self._scopes(header[7:])
        if scopes is None:
            log.info("refused %s: unknown token", method)
            return _refuse(handler, grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
        if scope not in scopes and method not in ANY_TOKEN:
            log.info("refused %s: token lacks scope %s", method, scope)
            return _refuse(handler, grpc.StatusCode.PERMISSION_DENIED, f"{method} needs the '{scope}' scope")
        return handler
