"""A request that does not parse (a string field that is not UTF-8, a truncated message) is the
caller's fault: refused INVALID_ARGUMENT with reason invalid_request, naming the message and the
field (server/rpc/interceptors/unreadable.py), never INTERNAL; nothing is stored and the server goes on."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
from google.protobuf.message import Message

from expbuf.client import BufferClient, trxp
from expbuf.client.rpc.wire import reason_of
from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.app import ExpbufServer

from helpers import make_experience

MARK = "@@@@"  # written into a string field, then replaced by as many bytes that are not UTF-8
NOT_UTF8 = b"\xff\xfe\xc3\x28"


def broken(message: Message) -> bytes:
    """A request's wire bytes, the string field that holds MARK made invalid UTF-8 (same length)."""
    wire = message.SerializeToString()
    assert wire.count(MARK.encode()) == 1
    return wire.replace(MARK.encode(), NOT_UTF8)


# (method, shape, request, the field its refusal names)
CASES = [
    ("Seal", "unary", pb.SealRequest(table="t", group_id=MARK), "SealRequest: field 'group_id'"),
    ("FailRuns", "unary", pb.FailRunsRequest(table="t", uids=["0/0/0/0/a", MARK]), "FailRunsRequest: field 'uids'"),
    ("GetPartials", "unary", pb.GetPartialsRequest(table="t", task_ids=[MARK]), "GetPartialsRequest: field 'task_ids'"),
    ("ReadPartials", "reply stream", pb.GetPartialsRequest(table="t", uids=[MARK]), "GetPartialsRequest: field 'uids'"),
    ("Claim", "unary", pb.ClaimRequest(table="t", dataset=MARK, count=1), "ClaimRequest: field 'dataset'"),
    ("CreateTable", "unary", pb.CreateTableRequest(config=pb.TableConfig(name=MARK)), "field 'config.name'"),
    ("Push", "unary", pb.PushRequest(table=MARK), "PushRequest: field 'table'"),
    ("PushStream", "stream", pb.PushRequest(table=MARK), "PushRequest: field 'table'"),
    ("Sample", "stream", pb.SampleRequest(table=MARK, num_groups=1), "SampleRequest: field 'table'"),
    ("Delete", "unary", pb.DeleteRequest(table="t", uids=[MARK]), "DeleteRequest: field 'uids'"),
]


def call(channel: grpc.Channel, method: str, shape: str) -> Callable[[bytes], object]:
    """A raw call of `method` that sends bytes as they are."""
    path = f"/expbuf.v1.ExperienceBuffer/{method}"
    if shape == "unary":
        return lambda data: channel.unary_unary(path)(data, timeout=10)
    if shape == "reply stream":
        return lambda data: list(channel.unary_stream(path)(data, timeout=10))

    def stream(data: bytes) -> object:
        def requests() -> Iterator[bytes]:
            yield data

        return list(channel.stream_stream(path)(requests(), timeout=10))

    return stream


@pytest.mark.parametrize(("method", "shape", "request_", "field"), CASES, ids=[case[0] for case in CASES])
def test_a_string_that_is_not_utf8_is_refused_invalid_argument_naming_its_field(
    server: ExpbufServer, client: BufferClient, method: str, shape: str, request_: Message, field: str
) -> None:
    client.create_table("t", group_size=2)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, pytest.raises(grpc.RpcError) as refused:
        call(channel, method, shape)(broken(request_))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert f"{field} is not UTF-8" in (refused.value.details() or "")
    assert reason_of(refused.value.trailing_metadata()) == Reason.INVALID_REQUEST
    assert client.push([make_experience(0, 0, 0)], table="t").stored  # the server goes on
    assert client.stats("t")["t"].pushed == 1


def test_a_message_that_does_not_parse_is_refused_invalid_argument(server: ExpbufServer) -> None:
    truncated = pb.SealRequest(table="t", group_id="0/0").SerializeToString()[:-1]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, pytest.raises(grpc.RpcError) as refused:
        channel.unary_unary("/expbuf.v1.ExperienceBuffer/Seal")(truncated, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "SealRequest: the request is not a valid SealRequest message" in (refused.value.details() or "")
    assert reason_of(refused.value.trailing_metadata()) == Reason.INVALID_REQUEST


def test_a_later_message_of_a_stream_that_does_not_parse_ends_the_stream_invalid_argument(
    server: ExpbufServer, client: BufferClient
) -> None:
    """The first message of a PushStream is stored; the second, whose table is not UTF-8, ends it."""
    client.create_table("t", group_size=1, estimator="none")
    good = pb.PushRequest(table="t", payload=trxp.encode([make_experience(0, 0, 0)]), seq=1)
    bad = broken(pb.PushRequest(table=MARK, payload=trxp.encode([make_experience(0, 1, 0)]), seq=2))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stream = channel.stream_stream("/expbuf.v1.ExperienceBuffer/PushStream")
        replies = stream(iter([good.SerializeToString(), bad]), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            list(replies)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "PushRequest: field 'table' is not UTF-8" in (refused.value.details() or "")
    assert client.stats("t")["t"].pushed == 1
