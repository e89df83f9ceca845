"""A newcomer's first mistakes with a client: each a clear error naming what to change, in the
blocking and the asyncio client alike (both open their channels in ClientBase, and every push,
pusher and sharded push encodes through calls.payload)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from concurrent import futures

import grpc
import prometheus_client
import pytest
import torch

from expbuf.client import EID, AsyncBufferClient, BufferClient, Experience, UnavailableError

from helpers import make_experience

CLIENTS = [BufferClient, AsyncBufferClient]


def made(kind: type, target: str) -> str:
    """The target of a client of `kind` made for `target` (the asyncio one within its loop), closed."""
    if kind is BufferClient:
        with BufferClient(target) as client:
            return client.target

    async def run() -> str:
        async with AsyncBufferClient(target) as client:
            return client.target

    return asyncio.run(run())


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("target", ["localhost", "127.0.0.1", "dns:///localhost", "[::1]", "localhost:"])
def test_a_target_without_a_port_is_refused_saying_to_add_one(kind: type, target: str) -> None:
    """gRPC takes a target without a port as port 443, where no expbuf listens."""
    with pytest.raises(ValueError, match=r"has no port.*add the server's.*:50051 \(expbuf's default\)"):
        made(kind, target)


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("target", ["http://127.0.0.1:50051", "https://buffer.example:443/", "grpc://h:1"])
def test_a_target_with_a_url_scheme_is_refused_saying_to_drop_it(kind: type, target: str) -> None:
    """gRPC resolves `http://host:port` as a host name ("Misformatted domain name")."""
    host = target.split("://")[1].rstrip("/")
    with pytest.raises(ValueError, match=rf"drop the scheme: '{host}'"):
        made(kind, target)


@pytest.mark.parametrize("kind", CLIENTS)
@pytest.mark.parametrize("target", [("127.0.0.1", 50051), 50051])
def test_a_target_that_is_not_a_str_is_a_type_error_naming_what_it_takes(kind: type, target: object) -> None:
    """A (host, port) tuple or a port alone was an AttributeError from inside ('tuple' object has no
    attribute 'partition')."""
    with pytest.raises(TypeError, match=rf"^target must be a 'HOST:PORT' str, got {type(target).__name__} "):
        made(kind, target)


@pytest.mark.parametrize("kind", CLIENTS)
def test_targets_grpc_takes_are_left_as_they_are(kind: type) -> None:
    taken = ["127.0.0.1:50051", "[::1]:50051", "dns:///localhost:50051", "unix:/tmp/expbuf.sock", "ipv4:1.2.3.4:5"]
    for target in taken:
        assert made(kind, target) == target


@pytest.fixture
def http_port() -> Iterator[int]:
    """A real HTTP/1.1 server on a port of its own: expbuf's metrics port is one (prometheus_client's)."""
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1")
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_call_to_an_http_server_says_it_is_not_an_expbuf_grpc_server(http_port: int) -> None:
    """The metrics port answers HTTP/1.1, which gRPC reports as a failed HTTP/2 frame."""
    target = f"127.0.0.1:{http_port}"
    with BufferClient(target, retries=0, timeout=10) as client, pytest.raises(UnavailableError) as raised:
        client.stats()
    assert f"{target} answered in HTTP/1, not gRPC: it is not an expbuf gRPC server" in raised.value.details

    async def run() -> str:
        async with AsyncBufferClient(target, retries=0, timeout=10) as client:
            try:
                await client.stats()
            except UnavailableError as error:
                return error.details
        raise AssertionError("the call did not fail")

    assert "it is not an expbuf gRPC server" in asyncio.run(run())


WRONG = [
    ({"tokens": torch.arange(4)}, "got dict"),
    ([{"tokens": torch.arange(4)}], "item 0 is a dict"),
    ([make_experience(0, 0, 0), "x"], "item 1 is a str"),
    (Experience(tokens=torch.arange(4), eid=EID(batch=0, task=0)), "got one Experience: push a list of it"),
    ("0/0/0/0/", "got str"),
    (7, "got int"),
]


@pytest.mark.parametrize(("items", "said"), WRONG, ids=[said for _, said in WRONG])
def test_a_push_of_what_push_does_not_take_is_a_type_error_naming_what_it_takes(
    client: BufferClient, items: object, said: str
) -> None:
    """A dict raised AttributeError ('str' object has no attribute 'eid') from inside the codec."""
    takes = "push takes TRXP bytes, a ColumnBatch or a list of experiences (expbuf's Experience or Trinity-RFT's)"
    with pytest.raises(TypeError, match=rf"{re.escape(takes)}[,;] {said}"):
        client.push(items)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=said), client.pusher() as pusher:
        pusher.push(items)  # type: ignore[arg-type]

    async def run() -> None:
        async with AsyncBufferClient(client.target) as aio:
            await aio.push(items)  # type: ignore[arg-type]

    with pytest.raises(TypeError, match=said):
        asyncio.run(run())
    assert client.stats("default")["default"].pushed == 0


def test_a_connection_ended_for_too_many_pings_says_to_upgrade_the_server() -> None:
    """A server before this client's keepalive pings ends a connection that pings every 20 s with an
    open call (GOAWAY too_many_pings): a trainer waiting for data died with gRPC's words alone, which
    name neither the versions nor the fix (a helper's audit). A gRPC server on loopback answers as
    gRPC reports such an end."""

    def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAVAILABLE, "Too many pings")

    class Every(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(refuse)

    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[Every()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with BufferClient(f"127.0.0.1:{port}", retries=0) as client, pytest.raises(UnavailableError) as raised:
            client.stats()
        assert "predates the keepalive pings of this client" in raised.value.details
        assert "upgrade the server to this client's release, servers before clients" in raised.value.details
    finally:
        server.stop(0)
