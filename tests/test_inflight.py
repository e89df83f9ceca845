"""PushRequest read by hand, its payload uncopied, reads what protobuf reads; InFlight counts
what pushes hold and makes new ones wait past its cap."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.protobuf.message import DecodeError

from expbuf.client import trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.inflight import InFlight, read_push_request

from conftest import BAD_DIR, Servers
from helpers import group_items

UNKNOWN_FIELDS = (
    b"\x20\x96\x01"  # field 4, varint
    b"\x29"
    + bytes(8)  # field 5, 64-bit
    + b"\x35"
    + bytes(4)  # field 6, 32-bit
    + b"\x3a\x03abc"  # field 7, length-delimited
)


@pytest.mark.parametrize(
    "message",
    [
        pb.PushRequest(),
        pb.PushRequest(table="grpo8", payload=b"TRXP" + bytes(range(256)) * 40, seq=2**64 - 1),
        pb.PushRequest(table="tâble", payload=b"x"),
    ],
    ids=["empty", "full", "utf8"],
)
@pytest.mark.parametrize("extra", [b"", UNKNOWN_FIELDS, b"\x12\x02zz\x18\x05"], ids=["plain", "unknown", "repeated"])
def test_reads_what_protobuf_reads(message: pb.PushRequest, extra: bytes) -> None:
    data = message.SerializeToString() + extra
    want = pb.PushRequest.FromString(data)
    got = read_push_request(data)
    assert (got.table, bytes(got.payload), got.seq) == (want.table, want.payload, want.seq)


@pytest.mark.parametrize(
    "data",
    [b"\x12\x05abc", b"\x18", b"\x18\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0b", b"\x0a\x01\xff", b"\x00"],
    ids=["truncated", "no-varint", "long-varint", "group", "bad-utf8", "field-0"],
)
def test_refuses_what_protobuf_refuses(data: bytes) -> None:
    with pytest.raises(DecodeError):
        pb.PushRequest.FromString(data)
    with pytest.raises(ValueError):
        read_push_request(data)


def test_a_push_past_the_cap_waits_until_the_held_bytes_drop() -> None:
    inflight = InFlight(100)
    release = inflight.hold(150)  # one push may pass the cap alone
    assert inflight.held == 150
    refusal = inflight.admit(0.05)
    assert refusal is not None and "max_inflight_bytes = 100" in refusal and "EXPBUF_MAX_INFLIGHT_BYTES" in refusal
    admitted: list[str | None] = []
    waiter = threading.Thread(target=lambda: admitted.append(inflight.admit(30)))
    waiter.start()
    release()
    release()  # a second call changes nothing
    waiter.join(30)
    assert admitted == [None] and inflight.held == 0


def test_pushes_give_back_what_they_held_however_they_end(start_server: Servers) -> None:
    server = start_server()
    good = trxp.build(group_items(0, 0, 2))
    bad = (BAD_DIR / "prompt_longer_than_tokens.bin").read_bytes()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        assert stub.Push(pb.PushRequest(payload=good), timeout=10).stored_uids
        with pytest.raises(grpc.RpcError) as refused:
            stub.Push(pb.PushRequest(payload=bad), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stream = stub.PushStream(iter([pb.PushRequest(payload=good, seq=1), pb.PushRequest(payload=bad, seq=2)]))
        with pytest.raises(grpc.RpcError) as ended:
            list(stream)
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 10
    while server.inflight.held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.inflight.held == 0
