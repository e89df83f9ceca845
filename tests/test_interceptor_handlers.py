"""The interceptors' handlers, made once for a method (interceptors/base.py: a push of one experience
does not pay for every interceptor's closures again), still decide each call by its own token,
its own declaration and its own outcome, against a real server on loopback."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest

from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server import app
from expbuf.server.rpc.interceptors.metrics import RpcMetrics

from conftest import Servers, payload

MESSAGE_BYTES = "expbuf-message-bytes"  # the call metadata in which a client declares its messages' largest size
TOKENS = {"pusher": frozenset({"push"}), "trainer": frozenset({"sample"})}


def test_each_push_is_let_in_refused_and_timed_by_its_own_call(start_server: Servers) -> None:
    """Pushes on one channel, one after another: each is let in or refused by its own token (none,
    one without the push scope, the pusher's) and its own declaration of its message's size, and
    the RPC metrics count each under its own status; a push let in after refusals is stored."""
    server = start_server(tokens=TOKENS)
    push = pb.PushRequest(payload=payload("single_turn.trxp"))
    size = push.ByteSize()

    def sent(token: str | None, declared: int | None = None) -> grpc.StatusCode:
        metadata = [] if token is None else [("authorization", f"Bearer {token}")]
        metadata += [] if declared is None else [(MESSAGE_BYTES, str(declared))]
        try:
            stub.Push(push, timeout=10, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        codes = [
            sent("pusher", size),
            sent(None),
            sent("trainer", size),
            sent("pusher", size - 1),
            sent("pusher"),
            sent("pusher", size),
        ]
    assert codes == [
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OK,
        grpc.StatusCode.OK,
    ]
    counted = {
        code: server.metrics.registry.get_sample_value(
            "expbuf_rpc_duration_seconds_count", {"method": "Push", "code": code}
        )
        for code in ("OK", "UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT")
    }
    assert counted == {"OK": 3.0, "UNAUTHENTICATED": 1.0, "PERMISSION_DENIED": 1.0, "INVALID_ARGUMENT": 1.0}
    assert server.store.stats("default")["pushed"] == 1


def test_an_interceptor_makes_a_methods_handler_once(start_server: Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tokens, the handler beneath each interceptor is the same on every call of a method:
    the RPC metrics wrap Push once for many pushes, and each push is still timed."""
    wrapped: Counter[str] = Counter()

    class Counting(RpcMetrics):
        def wrap(
            self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
        ) -> grpc.RpcMethodHandler:
            wrapped[method] += 1
            return super().wrap(method, handler, details)

    monkeypatch.setattr(app, "RpcMetrics", Counting)
    server = start_server()
    push = pb.PushRequest(payload=payload("single_turn.trxp"))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        for _ in range(5):
            stub.Push(push, timeout=10)
    assert wrapped["Push"] == 1
    assert (
        server.metrics.registry.get_sample_value("expbuf_rpc_duration_seconds_count", {"method": "Push", "code": "OK"})
        == 5.0
    )
