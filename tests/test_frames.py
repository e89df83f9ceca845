"""The requests the client writes by hand (client/rpc/frames.py) are the bytes protobuf makes of
the same messages, and a server reads them as such: pushes whole and in chunks, pushers' streams,
keyed values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expbuf.client import BufferClient, trxp
from expbuf.client.rpc import calls, frames
from expbuf.proto.v1 import buffer_pb2 as pb

from helpers import group_items

U64 = st.integers(min_value=0, max_value=2**64 - 1)
TEXT = st.text(max_size=40)


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=3000), table=TEXT, seq=U64, total=U64, offset=U64)
def test_a_push_request_is_protobufs_own_bytes(payload: bytes, table: str, seq: int, total: int, offset: int) -> None:
    message = pb.PushRequest(table=table, payload=payload, seq=seq, total_bytes=total, offset=offset)
    wire = message.SerializeToString()
    assert frames.push_request(payload, table, seq=seq, total_bytes=total, offset=offset) == wire
    assert frames.push_request(memoryview(payload), table, seq=seq, total_bytes=total, offset=offset) == wire


@settings(max_examples=300, deadline=None)
@given(table=TEXT, pairs=st.lists(st.tuples(TEXT, st.binary(max_size=300)), max_size=8))
def test_a_put_values_request_is_protobufs_own_bytes(table: str, pairs: list[tuple[str, bytes]]) -> None:
    keys, values = [key for key, _ in pairs], [value for _, value in pairs]
    message = pb.PutValuesRequest(table=table, keys=keys, values=values)
    assert frames.put_values_request(table, keys, values) == message.SerializeToString()


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**32, 2**63, 2**64 - 1])
def test_varints_read_back_as_written(value: int) -> None:
    message = pb.PushRequest.FromString(frames.varint(3 << 3) + frames.varint(value))
    assert message.seq == value


@pytest.mark.parametrize("value", [-1, 2**64])
def test_a_varint_out_of_range_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match="varint"):
        frames.varint(value)


def test_a_push_in_chunks_reads_back_as_the_payload() -> None:
    body = bytes(range(256)) * 40
    messages = [pb.PushRequest.FromString(request) for request in calls.push_requests(body, "t", 4096, seq=9)]
    assert [len(m.payload) for m in messages] == [4096, 4096, 2048]
    assert (messages[0].table, messages[0].seq, messages[0].total_bytes) == ("t", 9, len(body))
    assert all((m.table, m.seq, m.total_bytes) == ("", 0, 0) for m in messages[1:])
    assert b"".join(m.payload for m in messages) == body


def test_pushes_and_values_written_by_hand_are_stored(target: str) -> None:
    whole, piped = trxp.build(group_items(1, 0, 2)), trxp.build(group_items(1, 1, 2))
    with BufferClient(target, push_chunk_bytes=1 << 16) as client:
        client.create_table("framed", group_size=2, estimator="none")
        assert len(client.push(whole, table="framed").stored) == 2
        big = trxp.build(group_items(1, 2, 2, response=40_000))
        assert len(big) > 1 << 16  # goes in chunks
        assert len(client.push(big, table="framed").stored) == 2
        with client.pusher("framed", window=2) as pusher:
            assert len(pusher.push(piped).result().stored) == 2
        assert client.push(whole, table="framed").duplicates  # the same bytes again
        assert client.put_values(["a", "b"], [b"x" * 10, b""], table="framed") == 2
        assert client.get_values(["a", "b", "c"], table="framed") == [b"x" * 10, b"", None]
