"""Review of the input handling for large experiences, pushes in chunks and columnar batches:
each test asserts what a user should get from a bad or unlucky input (a clear refusal naming the
problem, nothing stored, the server healthy: no leaked max_inflight_bytes, nothing left staged).
A real server on loopback (port 0), real LMDB in a temporary directory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from expbuf.client import BufferClient, trxp
from expbuf.client.schema.experience import EID, Experience
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer

from conftest import Servers

CHUNK = 1 << 20  # the client's chunks: smaller than the store's (4 MiB)


def large(task: str, run: int = 0, response: int = 700_000) -> Experience:
    """An experience of about 6 MB of tensors: more than a chunk of the store, so a push in chunks stages it."""
    prompt = 3
    return Experience(
        eid=EID(batch=0, task=task, run=run),
        tokens=torch.arange(prompt + response, dtype=torch.int32),
        prompt_length=prompt,
        logprobs=torch.full((response,), -0.5),
        action_mask=torch.ones(response, dtype=torch.bool),
        reward=1.0,
    )


def chunks(payload: bytes, size: int = CHUNK, *, table: str = "", seq: int = 0) -> list[pb.PushRequest]:
    first = pb.PushRequest(table=table, seq=seq, payload=payload[:size], total_bytes=len(payload))
    return [first, *(pb.PushRequest(payload=payload[at : at + size]) for at in range(size, len(payload), size))]


def held_drops_to_zero(server: ExpbufServer, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while server.inflight.held and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.inflight.held == 0


def test_a_staged_push_whose_table_is_dropped_meanwhile_gives_back_its_reservation(start_server: Servers) -> None:
    """A push in chunks whose large experience is staged as it arrives, its table dropped while it is
    read: the push is refused NOT_FOUND naming the table, and what it reserved of max_inflight_bytes is
    given back. (StagedPush.drop, run first when the push's message is released, looks the table up
    to drop its staged sets; the table is gone, so it raises NotFound, and the reservation that was to
    be released after it never is: max_inflight_bytes shrinks for good, each time.)"""
    server = start_server()
    body = trxp.encode([large("dropped")])
    parted = chunks(body, table="t")
    half = threading.Event()
    go_on = threading.Event()

    def messages() -> Iterator[pb.PushRequest]:
        yield from parted[:6]  # 6 MiB: the first chunk of the store staged
        half.set()
        go_on.wait(30)
        yield from parted[6:]

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="t")), timeout=10)
        call = stub.PushStream(messages(), timeout=60)
        assert half.wait(10)
        time.sleep(1.0)  # the chunks sent are read and the first staged
        stub.DropTable(pb.DropTableRequest(name="t"), timeout=10)
        go_on.set()
        with pytest.raises(grpc.RpcError) as ended:
            list(call)
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND, ended.value.details()
        assert "'t'" in ended.value.details()
    assert held_drops_to_zero(server), f"{server.inflight.held} bytes of max_inflight_bytes still held"
