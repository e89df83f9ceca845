"""Pushes larger than a client's push_chunk_bytes go in chunks over PushStream, from every client:
stored and answered as if sent whole, refused as if sent whole, and retried as duplicates."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from expbuf.client import AsyncBufferClient, BufferClient, InvalidArgumentError, PushResult, trxp
from expbuf.client.rpc.calls import push_calls
from expbuf.client.rpc.connection import DEFAULT_PUSH_CHUNK_BYTES
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer
from expbuf.server.rpc.interceptors.metrics import Metrics
from expbuf.server.rpc.service import ExperienceBufferService
from expbuf.server.store import Store

from conftest import Servers
from helpers import make_experience, scrape

CHUNK = 1 << 16


def calls(server: ExpbufServer, method: str) -> float:
    """Calls of `method` the server has answered, whatever their status."""
    return sum(
        value
        for (name, labels), value in scrape(server.metrics_port).items()
        if name == "expbuf_rpc_duration_seconds_count" and dict(labels)["method"] == method
    )


def large(batch: str, prompt_length: int = 3) -> bytes:
    """Two experiences of 20,000 response tokens: about 360 KB, five chunks of 64 KiB and more."""
    items = [trxp.from_experience(make_experience(batch, 0, run, response=20_000)) for run in range(2)]
    items[1].meta["prompt_length"] = prompt_length
    return trxp.build(items)


def run_sync(make: Callable[..., Any]) -> Callable[[str, Callable[[Any], Any]], Any]:
    def run(target: str, use: Callable[[Any], Any]) -> Any:
        with make(target) as client:
            return use(client)

    return run


def run_async(make: Callable[..., Any]) -> Callable[[str, Callable[[Any], Awaitable[Any]]], Any]:
    def run(target: str, use: Callable[[Any], Awaitable[Any]]) -> Any:
        async def body() -> Any:
            async with make(target) as client:
                return await use(client)

        return asyncio.run(body())

    return run


CLIENTS = {
    "blocking": run_sync(lambda target: BufferClient(target, push_chunk_bytes=CHUNK)),
    "asyncio": run_async(lambda target: AsyncBufferClient(target, push_chunk_bytes=CHUNK)),
    "sharded": run_sync(lambda target: ShardedBufferClient([target], push_chunk_bytes=CHUNK)),
    "sharded asyncio": run_async(lambda target: AsyncShardedBufferClient([target], push_chunk_bytes=CHUNK)),
}


@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_every_client_pushes_a_large_payload_in_chunks(server: ExpbufServer, kind: str) -> None:
    run, target = CLIENTS[kind], f"127.0.0.1:{server.port}"
    body = large(kind)
    pushed: PushResult = run(target, lambda client: client.push(body))
    assert len(pushed.stored) == 2 and pushed.duplicates == []
    assert calls(server, "PushStream") == 1 and calls(server, "Push") == 0
    again: PushResult = run(target, lambda client: client.push(body))
    assert again.duplicates == pushed.stored and again.stored == []
    with pytest.raises(InvalidArgumentError) as refused:
        run(target, lambda client: client.push(large(f"{kind}-bad", prompt_length=30_000)))
    assert refused.value.details.startswith(f"item 1 (uid {kind}-bad/0/1/0/r1s0): field 'prompt_length'")
    small = trxp.build([trxp.from_experience(make_experience(f"{kind}-small", 0, 0))])
    assert run(target, lambda client: client.push(small)).stored  # one message: Push
    refused_here = kind.startswith("sharded")  # a sharded client parses a payload to route it, and refuses it so
    assert calls(server, "PushStream") == (2 if refused_here else 3) and calls(server, "Push") == 1


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_chunks_as_large_as_a_message_fit_one_with_their_table(server: ExpbufServer, kind: str) -> None:
    """push_chunk_bytes equal to max_message_bytes (both taken) made every chunk's message larger
    than the client sends, by its table's name and numbers: each chunked push failed (a helper's
    audit). A chunk is cut to fit a message with them."""
    target, body, table = f"127.0.0.1:{server.port}", large(f"fit-{kind}"), "sixty-four-characters-" + "x" * 42
    with BufferClient(target) as admin:
        admin.create_table(table, estimator="none")
    settings = {"max_message_bytes": 1 << 17, "push_chunk_bytes": 1 << 17}
    make = run_sync(lambda t: BufferClient(t, **settings))
    if kind == "asyncio":
        make = run_async(lambda t: AsyncBufferClient(t, **settings))
    pushed: PushResult = make(target, lambda client: client.push(body, table=table))
    assert len(pushed.stored) == 2 and calls(server, "PushStream") == 1


def test_push_chunk_bytes_0_sends_every_push_whole_and_a_bad_value_is_refused(server: ExpbufServer) -> None:
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, push_chunk_bytes=0) as client:
        assert client.push(large("whole")).stored
    assert calls(server, "Push") == 1 and calls(server, "PushStream") == 0
    assert BufferClient(target).push_chunk_bytes == DEFAULT_PUSH_CHUNK_BYTES == 4 << 20
    for bad in (1000, (1 << 20) + 1):
        with pytest.raises(ValueError, match=r"push_chunk_bytes must be 0 \(no chunks\) or from 65536 to"):
            BufferClient(target, push_chunk_bytes=bad, max_message_bytes=1 << 20)
    # a message under the least chunk: pushes go whole, where the client was refused for a chunk it did not name
    assert BufferClient(target, max_message_bytes=32 << 10).push_chunk_bytes == 0


def test_a_push_in_chunks_waits_for_a_server_that_starts_late(start_server: Servers) -> None:
    port = start_server.reserve_port()
    later = threading.Timer(0.5, lambda: start_server(port=port))
    later.start()
    try:
        with BufferClient(f"127.0.0.1:{port}", timeout=20, wait_for_ready=True, push_chunk_bytes=CHUNK) as client:
            assert len(client.push(large("retried")).stored) == 2
    finally:
        later.join()


BIG_CHUNK = 1 << 18
RESTARTED_CLIENTS = {
    "blocking": run_sync(lambda target: BufferClient(target, wait_for_ready=True, push_chunk_bytes=BIG_CHUNK)),
    "asyncio": run_async(lambda target: AsyncBufferClient(target, wait_for_ready=True, push_chunk_bytes=BIG_CHUNK)),
}


@pytest.mark.parametrize("kind", sorted(RESTARTED_CLIENTS))
def test_a_push_in_chunks_that_a_stop_cuts_goes_again_whole_to_the_restarted_server(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A server that stops while a push in chunks is on its way ends it UNAVAILABLE, having stored
    nothing of it; the client sends it again, from its first chunk, to the server restarted on the
    port, which stores it once. The stop comes between two of its chunks (its chunks' iterator
    stops the server there, once, and starts it again on a thread of its own), so that the client
    has chunks still to send when the restarted server takes the push again: a replay of the
    chunks sent that let one of the later ones go unsent would reach that server cut short
    (INVALID_ARGUMENT, 'PushStream ended ... bytes into')."""
    server = start_server()
    port, made = server.port, push_calls.push_requests
    items = [trxp.from_experience(make_experience(kind, 0, run, response=600_000)) for run in range(2)]
    body = trxp.build(items)  # about 10.8 MB: 42 chunks of 256 KiB
    restart = threading.Thread(target=start_server, kwargs={"port": port})

    def chunks(*args: Any, **kwargs: Any) -> Iterator[bytes]:
        for index, message in enumerate(made(*args, **kwargs)):
            if index == 32 and restart.ident is None:
                start_server.stop(server)
                restart.start()
            yield message

    monkeypatch.setattr(push_calls, "push_requests", chunks)
    try:
        pushed: PushResult = RESTARTED_CLIENTS[kind](f"127.0.0.1:{port}", lambda client: client.push(body))
    finally:
        if restart.ident is not None:
            restart.join()
    assert restart.ident is not None
    assert sorted(pushed.stored) == sorted(item.uid for item in items) and pushed.duplicates == []
    with BufferClient(f"127.0.0.1:{port}") as client:
        stats = client.stats("default")["default"]
    assert (stats.pushed, stats.duplicates) == (2, 0)


@pytest.fixture
def servicer_alone(tmp_path: Path) -> Iterator[tuple[str, Store]]:
    """The servicer without the server's push reader, which puts chunks together: each PushStream
    message is a whole push to it, as to a server of 0.2.0."""
    with Store(tmp_path / "data") as store:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service = ExperienceBufferService(
            store, metrics=Metrics(store), max_message_bytes=16 << 20, advantage_device="cpu"
        )
        pb_grpc.add_ExperienceBufferServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            yield f"127.0.0.1:{port}", store
        finally:
            server.stop(None).wait()


def test_a_server_that_reads_no_chunks_refuses_a_chunked_push_and_stores_nothing(
    servicer_alone: tuple[str, Store],
) -> None:
    target, store = servicer_alone
    with (
        BufferClient(target, push_chunk_bytes=CHUNK, retries=0) as client,
        pytest.raises(InvalidArgumentError, match="shorter than the declared"),
    ):
        client.push(large("old"))  # its first chunk, read as a whole payload, is cut short
    assert store.stats("default")["pushed"] == 0
    with BufferClient(target, push_chunk_bytes=0) as client:
        assert len(client.push(large("old")).stored) == 2
