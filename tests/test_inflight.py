"""PushRequest read by hand, its payload uncopied, reads what protobuf reads; InFlight counts
what pushes hold and makes new ones wait past its cap."""

from __future__ import annotations

import threading

import pytest
from google.protobuf.message import DecodeError

from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.inflight import InFlight, read_push_request

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
