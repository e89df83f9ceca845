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
from helpers import make_experience, wait_for

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


def test_get_values_past_one_message_is_refused_by_the_server_naming_why(start_server: Servers) -> None:
    """GetValues checks its reply against max_message_bytes by the values' bytes alone; the reply
    also frames each value (2 bytes for one of 15), so 65,536 values of 15 bytes (983,040 bytes, under
    the 1 MiB - 1 KiB the server allows) make a reply of 1,114,112 bytes. The server's own refusal
    (RESOURCE_EXHAUSTED: "... ask for fewer keys at a time") should come, not gRPC's "Sent message
    larger than max" after the reply was built."""
    server = start_server(max_message_bytes=1 << 20)
    keys = [str(index) for index in range(65_536)]
    options = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="t")), timeout=10)
        for at in range(0, len(keys), 16_384):
            part = keys[at : at + 16_384]
            stub.PutValues(pb.PutValuesRequest(table="t", keys=part, values=[b"v" * 15] * len(part)), timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetValues(pb.GetValuesRequest(table="t", keys=keys), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ask for fewer keys" in refused.value.details(), refused.value.details()
        assert len(stub.GetValues(pb.GetValuesRequest(table="t", keys=keys[:1000]), timeout=30).values) == 1000


def test_get_past_one_message_once_advantages_are_added_is_refused_by_the_server_naming_why(
    start_server: Servers,
) -> None:
    """Get checks its reply against max_message_bytes by the experiences' stored sizes; the reply adds
    each one's advantages and returns (8 bytes a response token), so five experiences of 180 KB stored
    (903 KB, under the limit) make a 1.7 MB reply. The server's own refusal (RESOURCE_EXHAUSTED naming
    ReadFields, which reads in parts) should come, not gRPC's "Sent message larger than max"."""
    server = start_server(max_message_bytes=1 << 20)
    options = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="t", group_size=1)), timeout=10)
        made = [make_experience(0, task, 0, response=20_000) for task in range(5)]
        for one in made:
            assert stub.Push(pb.PushRequest(table="t", payload=trxp.encode([one])), timeout=10).stored_uids
        uids = [one.eid.uid for one in made]
        with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
            wait_for(lambda: client.stats("t")["t"].ready == 5, "the groups to be ready", 10)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Get(pb.GetRequest(table="t", uids=uids), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ReadFields" in refused.value.details(), refused.value.details()
        assert len(trxp.parse(stub.Get(pb.GetRequest(table="t", uids=uids[:2]), timeout=30).payload)) == 2
