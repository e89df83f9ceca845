"""Get and `expbuf export` of experiences whose payloads add up to more than one message, or of
one experience larger than a message: read in parts (ReadFields without fields), whole and
checked, on a server whose max_message_bytes is small. A real server on loopback, real LMDB."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from expbuf.client import BufferClient, decode, trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

import cli_forks
from conftest import Servers
from helpers import make_experience, serving, wait_for

LIMIT = 4 << 20  # the server's max_message_bytes


def stored(start_server: Servers) -> tuple[str, list]:
    """A server of small messages holding one experience of about 18 MB (stored in chunks) and
    four of about 2.7 MB (stored whole), all in one table."""
    server = start_server(max_message_bytes=LIMIT)
    target = f"127.0.0.1:{server.port}"
    big = make_experience("g", 0, 0, response=2_000_000)
    mids = [make_experience("g", task, 0, response=300_000) for task in range(1, 5)]
    with BufferClient(target, timeout=120, push_chunk_bytes=1 << 20) as client:
        client.create_table("g", group_size=1, estimator="none")
        client.push([big], table="g")
        for mid in mids:
            client.push([mid], table="g")
    return target, [big, *mids]


def test_get_returns_experiences_larger_than_a_message_whole(start_server: Servers) -> None:
    target, made = stored(start_server)
    uids = [exp.eid.uid for exp in made]
    with BufferClient(target, timeout=120) as client:
        got = client.get([*reversed(uids), "g/9/0/0/absent"], table="g")
    assert [exp.eid.uid for exp in got] == list(reversed(uids)) and got.missing_uids == ["g/9/0/0/absent"]
    for exp, want in zip(got, reversed(made), strict=True):
        assert torch.equal(exp.tokens, want.tokens) and torch.equal(exp.logprobs, want.logprobs)
    with BufferClient(target, timeout=120) as client:
        twice = client.get([uids[1], uids[1]], table="g")  # as the unary Get answers a uid asked twice
    assert [exp.eid.uid for exp in twice] == [uids[1], uids[1]] and twice.missing_uids == []


def test_the_unary_get_refuses_what_one_message_cannot_hold_and_the_client_reads_it_in_parts(
    start_server: Servers,
) -> None:
    """The unary Get (an older client's) cannot answer with more than one message; the client's
    get() reads the same experience in parts no larger than its own receive limit."""
    target, made = stored(start_server)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Get(pb.GetRequest(table="g", uids=[made[0].eid.uid]), timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with BufferClient(target, timeout=120, max_message_bytes=1 << 20, push_chunk_bytes=0) as client:
        (got,) = client.get([made[0].eid.uid], table="g")  # in parts of at most the client's 1 MiB
    assert torch.equal(got.logprobs, made[0].logprobs)


def test_export_writes_experiences_larger_than_a_message(start_server: Servers, tmp_path: Path) -> None:
    target, made = stored(start_server)
    out = tmp_path / "g.trxp"
    done = cli_forks.run("export", "g", "--target", target, "--format", "trxp", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "exported 5 experiences of g"
    exported = decode(out.read_bytes())
    assert [exp.eid.uid for exp in exported] == [exp.eid.uid for exp in made]
    assert out.read_bytes() == trxp.encode(exported)
    for exp, want in zip(exported, made, strict=True):
        assert torch.equal(exp.tokens, want.tokens)


class OlderServer(pb_grpc.ExperienceBufferServicer):
    """A server of a release before ReadFields: Get alone answers (ReadFields is UNIMPLEMENTED)."""

    def __init__(self, experiences: list) -> None:
        self.payload = trxp.encode(experiences)
        self.asked: list[list[str]] = []

    def Get(self, request: pb.GetRequest, context: object) -> pb.GetReply:
        self.asked.append(list(request.uids))
        return pb.GetReply(payload=self.payload, missing_uids=request.uids[1:])


def test_get_from_a_server_without_read_fields_falls_back_to_the_unary_get() -> None:
    exp = make_experience("g", 0, 0)
    older = OlderServer([exp])
    with serving(older) as target, BufferClient(target, timeout=10) as client:
        got = client.get([exp.eid.uid, "g/1/0/0/absent"], table="g")
    assert [one.eid.uid for one in got] == [exp.eid.uid] and got.missing_uids == ["g/1/0/0/absent"]
    assert older.asked == [[exp.eid.uid, "g/1/0/0/absent"]]


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
