"""PushRequest read by hand, its payload uncopied, reads what protobuf reads; InFlight counts
what pushes hold and makes new ones wait past its cap."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError

from expbuf.client import AsyncBufferClient, BufferClient, trxp
from expbuf.client.rpc.wire import BUSY, reason_of
from expbuf.client.schema.reasons import Reason
from expbuf.client.shards.blocking import ShardedBufferClient
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server import app
from expbuf.server.app import ExpbufServer
from expbuf.server.rpc.push.inflight import TRIM_AFTER, TRIM_IDLE, InFlight
from expbuf.server.rpc.push.push_memory import PushMemory
from expbuf.server.rpc.push.push_request import read_push_request

from conftest import BAD_DIR, Servers
from helpers import group_items, make_experience

UNKNOWN_FIELDS = (
    b"\x40\x96\x01"  # field 8, varint
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
        pb.PushRequest(
            table="grpo8", payload=b"TRXP" + bytes(range(256)) * 40, seq=2**64 - 1, total_bytes=2**40, offset=2**33
        ),
        pb.PushRequest(table="tâble", payload=b"x"),
    ],
    ids=["empty", "full", "utf8"],
)
@pytest.mark.parametrize(
    "extra", [b"", UNKNOWN_FIELDS, b"\x12\x02zz\x18\x05\x20\x07"], ids=["plain", "unknown", "repeated"]
)
def test_reads_what_protobuf_reads(message: pb.PushRequest, extra: bytes) -> None:
    data = message.SerializeToString() + extra
    want = pb.PushRequest.FromString(data)
    got = read_push_request(data)
    assert (got.table, bytes(got.payload), got.seq, got.total_bytes, got.offset) == (
        want.table,
        want.payload,
        want.seq,
        want.total_bytes,
        want.offset,
    )


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


def test_a_stream_waits_for_room_its_own_pushes_hold_without_being_refused() -> None:
    """A stream reads its next push while its earlier ones are stored: room they hold is waited
    for without the refusal's timer, which starts only once the stream holds nothing."""
    inflight = InFlight(100)
    stream = object()
    release = inflight.hold(150, stream)
    refusal = inflight.admit(0.05)  # another stream's push: refused in its time
    assert refusal is not None and "max_inflight_bytes = 100" in refusal
    admitted: list[str | None] = []
    waiter = threading.Thread(target=lambda: admitted.append(inflight.admit(0.05, stream)))
    waiter.start()
    time.sleep(0.3)  # six times its timeout: it would have been refused, had the timer run
    assert admitted == []
    other = inflight.hold(150)  # now the room is held by another stream's push alone
    release()
    waiter.join(10)
    assert admitted and admitted[0] is not None and "max_inflight_bytes = 100" in admitted[0]
    other()
    assert inflight.admit(0.05, stream) is None and inflight.held == 0


def test_the_heap_is_handed_back_once_pushes_pause_not_between_the_pushes_of_a_stream() -> None:
    """A lone pusher's pushes hold nothing between them for a moment: a trim there gave its heap
    back every TRIM_AFTER bytes and each next push faulted its pages in again. The trim waits
    until no push has held memory for TRIM_IDLE, and comes once."""
    trims: list[float] = []
    inflight = InFlight(1 << 40, trim=lambda: trims.append(time.monotonic()))
    size = TRIM_AFTER // 4
    began = ended = time.monotonic()
    stall = 0.0
    while ended - began < 3 * TRIM_IDLE:  # a stream: each push ends before the next begins
        release = inflight.hold(size)
        stall, ended = max(stall, time.monotonic() - ended), time.monotonic()  # then the release's quiet starts
        release()
        time.sleep(TRIM_IDLE / 20)
    if stall >= TRIM_IDLE:
        pytest.skip(f"this thread stood still {stall:.2f} s between two pushes: they were no stream")
    assert trims == [], "trimmed while the pushes went on"
    deadline = ended + 10 * TRIM_IDLE
    while not trims and time.monotonic() < deadline:
        time.sleep(TRIM_IDLE / 10)
    assert len(trims) == 1 and trims[0] - ended >= TRIM_IDLE, (trims, ended)
    inflight.hold(TRIM_AFTER // 2)()  # less than TRIM_AFTER since: no trim due
    time.sleep(3 * TRIM_IDLE)
    assert len(trims) == 1


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


def chunks(payload: bytes, size: int, *, seq: int = 0, table: str = "") -> list[pb.PushRequest]:
    """A payload in chunks of `size` bytes, as a client sends it over PushStream."""
    first = pb.PushRequest(table=table, seq=seq, payload=payload[:size], total_bytes=len(payload))
    return [first, *(pb.PushRequest(payload=payload[at : at + size]) for at in range(size, len(payload), size))]


def held_drops_to_zero(server: ExpbufServer) -> bool:
    deadline = time.monotonic() + 10
    while server.inflight.held and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.inflight.held == 0


def test_a_push_in_chunks_is_stored_and_answered_once_as_if_sent_whole(start_server: Servers) -> None:
    server = start_server()
    whole, parted, last = (trxp.build(group_items(batch, 0, 2)) for batch in ("whole", "parted", "last"))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="t")), timeout=10)
        messages = [pb.PushRequest(payload=whole, seq=1), *chunks(parted, 100, seq=2, table="t")]
        replies = list(stub.PushStream(iter([*messages, pb.PushRequest(payload=last, seq=3)]), timeout=30))
        assert [reply.seq for reply in replies] == [1, 2, 3]
        assert [len(reply.stored_uids) for reply in replies] == [2, 2, 2]
        assert stub.Stats(pb.StatsRequest(table="t"), timeout=10).tables[0].pushed == 2
        # The same payload sent whole, or in other chunks: the same stored bytes, so duplicates.
        again = list(stub.PushStream(iter(chunks(parted, 37, seq=4, table="t")), timeout=30))
        assert [(reply.seq, list(reply.duplicate_uids)) for reply in again] == [(4, list(replies[1].stored_uids))]
        whole_again = stub.Push(pb.PushRequest(table="t", payload=parted), timeout=10)
        assert list(whole_again.duplicate_uids) == list(replies[1].stored_uids)
    assert held_drops_to_zero(server)


def refusal(stub: pb_grpc.ExperienceBufferStub, messages: list[pb.PushRequest]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.PushStream(iter(messages), timeout=30))
    return refused.value


def test_chunks_that_do_not_make_their_push_are_refused_naming_why_and_store_nothing(start_server: Servers) -> None:
    server = start_server(max_message_bytes=1 << 20)
    body = trxp.build(group_items("c", 0, 2))
    parted = chunks(body, 200, seq=5)
    bad = (BAD_DIR / "prompt_longer_than_tokens.bin").read_bytes()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        ended = refusal(stub, parted[:-1])
        assert ended.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ended.details() == (
            f"PushStream ended {200 * (len(parted) - 1)} bytes into the push of seq 5 in chunks "
            f"(total_bytes = {len(body)}): nothing of it is stored"
        )
        assert reason_of(ended.trailing_metadata()) == Reason.CUT_SHORT
        # the next push began before the last chunk: one of its chunks never came
        cut = refusal(stub, [*parted[:2], *parted[3:], pb.PushRequest(table="t", seq=6, payload=body)])
        assert (cut.code(), reason_of(cut.trailing_metadata())) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.CUT_SHORT)
        assert cut.details() == (
            f"PushRequest {len(body) - 200} bytes into the push of seq 5 in chunks (total_bytes = {len(body)}): the "
            "next push began (seq 6), so a chunk of this one never came: nothing of it is stored"
        )
        stray = pb.PushRequest(table="default", payload=body[200:400])
        misfit = refusal(stub, [parted[0], stray])
        assert "a chunk after the first carries a payload and nothing else" in misfit.details()
        assert reason_of(misfit.trailing_metadata()) == Reason.INVALID_REQUEST
        tail = parted[-1].payload
        assert len(tail) < 200
        assert "past total_bytes" in refusal(stub, [*parted[:-1], pb.PushRequest(payload=tail + b"x")]).details()
        larger = refusal(stub, [parted[0], pb.PushRequest(payload=body[200:601])])
        assert larger.details() == (
            f"PushRequest 200 bytes into the push of seq 5 in chunks (total_bytes = {len(body)}): a chunk of 401 "
            "bytes, larger than the push's first (200 bytes), which no later chunk may pass (max_inflight_bytes "
            "holds room for one of its size on its way)"
        ), larger.details()
        short = refusal(stub, [pb.PushRequest(payload=body, total_bytes=10)])
        assert short.details() == f"PushRequest: total_bytes = 10 is less than the {len(body)} bytes of its payload"
        # max_message_bytes bounds a chunk, not the push: one of 2 MiB is read on, to its end
        beyond = refusal(stub, [pb.PushRequest(payload=body[:200], total_bytes=2 << 20)])
        assert beyond.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert beyond.details().startswith("PushStream ended 200 bytes into the push"), beyond.details()
        with pytest.raises(grpc.RpcError) as unary:
            stub.Push(parted[0], timeout=10)
        assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "a payload in chunks goes over PushStream" in unary.value.details()
        invalid = refusal(stub, chunks(bad, 100))  # refused as it is sent whole, naming the field
        assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_length" in invalid.details()
        assert stub.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 0
        assert stub.Push(pb.PushRequest(payload=body), timeout=10).stored_uids
    assert held_drops_to_zero(server)


def test_a_chunk_with_no_first_message_after_a_numbered_push_is_refused_as_cut_short(start_server: Servers) -> None:
    """A push in chunks whose first message never came (lost on its way) reached the servicer as
    a push of its second chunk, refused as not a TRXP payload. After a push numbered by seq, a
    message with neither table, seq nor total_bytes is refused cut_short, nothing of it stored; the
    push before it is stored."""
    server = start_server()
    body = trxp.build(group_items("o", 0, 2))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        whole = pb.PushRequest(table="default", seq=4, payload=trxp.build(group_items("o", 1, 2)))
        orphan = refusal(stub, [whole, *chunks(body, 200, seq=5)[1:]])
        assert (orphan.code(), reason_of(orphan.trailing_metadata())) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            Reason.CUT_SHORT,
        )
        assert orphan.details() == (
            "PushRequest after the push of seq 4: a message with neither table, seq nor total_bytes, so a chunk "
            "of the next push, whose first message never came: nothing of it is stored"
        )
        assert stub.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 2
    assert held_drops_to_zero(server)


def test_a_chunk_whose_offset_says_a_chunk_before_it_never_came_is_refused_as_cut_short(
    start_server: Servers,
) -> None:
    """A chunk after a push's first carries its offset: one read as the stream's first message (the
    first chunk of the stream's first push lost on its way), or past where the chunks read end (one
    before it lost), is refused cut_short, nothing of the push stored, so a pusher sends it again;
    the first failed INVALID_ARGUMENT as a payload that is not TRXP, which the pusher could not tell
    from a malformed push. A chunk inside those read, an offset beside table, seq or total_bytes, or
    a first message of a raw client that is no payload at all are refused as malformed, naming why.
    None of it is stored, and the server stores the next push."""
    server = start_server()
    body = trxp.build(group_items("off", 0, 2))
    parted = chunks(body, 200, seq=5)
    at = [pb.PushRequest(payload=body[start : start + 200], offset=start) for start in range(0, len(body), 200)]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        cut_short = (grpc.StatusCode.INVALID_ARGUMENT, Reason.CUT_SHORT)
        first_lost = refusal(stub, at[1:])
        assert (first_lost.code(), reason_of(first_lost.trailing_metadata())) == cut_short
        assert first_lost.details() == (
            "PushRequest as the first message of the stream: a chunk at offset 200 of the next push, whose first "
            "message never came: nothing of it is stored"
        )
        skipped = refusal(stub, [parted[0], *at[2:]])
        assert (skipped.code(), reason_of(skipped.trailing_metadata())) == cut_short
        assert skipped.details() == (
            f"PushRequest 200 bytes into the push of seq 5 in chunks (total_bytes = {len(body)}): a chunk at offset "
            "400, so the chunk at offset 200 never came: nothing of it is stored"
        )
        again = refusal(stub, [parted[0], at[1], at[1]])
        assert reason_of(again.trailing_metadata()) == Reason.INVALID_REQUEST
        assert "a chunk at offset 200, inside the chunks before it" in again.details()
        numbered = refusal(stub, [pb.PushRequest(payload=body[:200], seq=5, offset=200)])
        assert numbered.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason_of(numbered.trailing_metadata()) == Reason.INVALID_REQUEST
        assert numbered.details().startswith("PushRequest: offset = 200 marks a chunk after a push's first")
        garbage = refusal(stub, [pb.PushRequest(payload=body[200:400])])
        assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason_of(garbage.trailing_metadata()) != Reason.CUT_SHORT
        assert "TRXP" in garbage.details(), garbage.details()
        assert stub.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 0
        assert [reply.seq for reply in stub.PushStream(iter(parted), timeout=30)] == [5]
        assert stub.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 2
    assert held_drops_to_zero(server)


def test_a_stream_broken_between_chunks_stores_nothing_of_that_push(start_server: Servers) -> None:
    server = start_server()
    body = trxp.build(group_items("broken", 0, 2))
    parted = chunks(body, 100)
    sent = threading.Event()
    end = threading.Event()

    def messages() -> Iterator[pb.PushRequest]:
        yield from parted[:2]
        sent.set()
        end.wait(30)

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        call = stub.PushStream(messages(), timeout=30)
        assert sent.wait(10)
        deadline = time.monotonic() + 10
        announced = len(body) + 100  # what its first chunk announced, and a chunk on its way
        while server.inflight.held != announced and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.inflight.held == announced
        call.cancel()
        end.set()
        assert held_drops_to_zero(server)
        assert stub.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 0
        assert stub.Push(pb.PushRequest(payload=body), timeout=10).stored_uids


def test_a_push_in_chunks_slower_than_the_idle_timeout_goes_on_while_chunks_come(start_server: Servers) -> None:
    """Each chunk counts as a message for push_stream_idle_seconds: the push as a whole may take
    longer, as long as it comes at push_min_mb_per_second on average (here 100 bytes a second)."""
    server = start_server(push_stream_idle_seconds=3, push_min_mb_per_second=0.0001)
    body = trxp.build(group_items("slow", 0, 2))
    parted = chunks(body, len(body) // 10 + 1)

    def messages() -> Iterator[pb.PushRequest]:
        for message in parted:  # 10 chunks, 0.5 s apart: 5 s in all
            yield message
            time.sleep(0.5)

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        replies = list(pb_grpc.ExperienceBufferStub(channel).PushStream(messages(), timeout=60))
    assert len(parted) == 10 and [len(reply.stored_uids) for reply in replies] == [2]


def held_back(stub: pb_grpc.ExperienceBufferStub, parted: list[pb.PushRequest], go: threading.Event) -> Any:
    """A PushStream of one push in chunks that sends its first chunk, then the rest once `go` is set."""

    def messages() -> Iterator[pb.PushRequest]:
        yield parted[0]
        go.wait(60)
        yield from parted[1:]

    return stub.PushStream(messages(), timeout=60)


PART = 64 << 10  # the chunks of the pushes held back below


def reserved(server: ExpbufServer, size: int) -> None:
    """Wait until the pushes in progress hold `size` bytes: a push in chunks reserved what it announced."""
    deadline = time.monotonic() + 30
    while server.inflight.held != size:
        assert time.monotonic() < deadline, f"the pushes in progress hold {server.inflight.held} bytes, not {size}"
        time.sleep(0.02)


@contextlib.contextmanager
def cap_held(stub: pb_grpc.ExperienceBufferStub, server: ExpbufServer, body: bytes) -> Iterator[None]:
    """While the block runs, a push in chunks of `body` holds what it announced and a chunk on its
    way (`held_back`); then its other chunks go, and it is stored."""
    go = threading.Event()
    holding = held_back(stub, chunks(body, PART), go)
    try:
        reserved(server, len(body) + PART)
        yield
    finally:
        go.set()
    assert [len(reply.stored_uids) for reply in holding] == [1]


def test_pushes_in_chunks_are_admitted_by_the_total_they_announce(start_server: Servers) -> None:
    """Four pushes in chunks, each announcing more than half of max_inflight_bytes: the first to
    come reserves what it announces (and a chunk on its way); one other waits with its first chunk
    counted, and the other two are refused at once as busy, having stored nothing (a client sends
    them again). Each that waited gave its first chunk back uncounted while it sat in memory: four
    pushes of 68 MB in chunks of 24 MiB under a cap of 96 MiB grew a server 698 MiB."""
    cap = 1 << 20
    server = start_server(max_inflight_bytes=cap)
    bodies = [trxp.build(group_items(f"b{n}", 0, 1, response=70_000)) for n in range(4)]
    assert all(cap // 2 < len(body) + PART < cap for body in bodies)
    go = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        calls = [held_back(stub, chunks(body, PART, seq=n), go) for n, body in enumerate(bodies)]
        try:
            deadline = time.monotonic() + 30
            totals = {len(body) + PART for body in bodies}
            while not (
                server.inflight.held - PART in totals
                and server.inflight.waiting == 1
                and sum(call.done() for call in calls) == 2
            ):
                assert time.monotonic() < deadline, (
                    f"pushes in chunks hold {server.inflight.held} bytes, {server.inflight.waiting} waiting, "
                    f"{sum(call.done() for call in calls)} ended"
                )
                time.sleep(0.02)
            refused = [call for call in calls if call.done()]
        finally:
            go.set()
        stored = [[len(reply.stored_uids) for reply in call] for call in calls if call not in refused]
    assert stored == [[1]] * 2
    for call in refused:
        assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "already waits for room" in call.details()
        assert dict(call.trailing_metadata() or ()).get(BUSY) == "1"
    assert held_drops_to_zero(server)


def test_pushes_in_chunks_past_max_inflight_bytes_are_each_stored_once_by_their_clients(start_server: Servers) -> None:
    """Six clients push in chunks at once, each push more than half of max_inflight_bytes: those
    refused as busy are sent again by their clients, and every one is stored once."""
    cap = 1 << 20
    server = start_server(max_inflight_bytes=cap)
    bodies = [trxp.build(group_items(f"c{n}", 0, 1, response=70_000)) for n in range(6)]

    def push(body: bytes) -> list[str]:
        with BufferClient(f"127.0.0.1:{server.port}", timeout=60, push_chunk_bytes=PART) as client:
            return client.push(body).stored

    with futures.ThreadPoolExecutor(len(bodies)) as pool:
        stored = list(pool.map(push, bodies))
    assert [len(uids) for uids in stored] == [1] * 6
    assert held_drops_to_zero(server)


def test_a_push_in_chunks_waits_for_room_then_is_refused_naming_what_it_announced(start_server: Servers) -> None:
    cap = 1 << 20
    # It waits for room 1 s at most; the push holding the room, held back near the idle time, is not ended as slow.
    server = start_server(max_inflight_bytes=cap, push_stream_idle_seconds=2, push_min_mb_per_second=0.001)
    first, second = (trxp.build(group_items(f"w{n}", 0, 1, response=70_000)) for n in range(2))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        with cap_held(stub, server, first):
            ended = refusal(stub, chunks(second, PART, seq=7))
    assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"total_bytes = {len(second)}" in ended.details(), ended.details()
    assert f"max_inflight_bytes = {cap}" in ended.details(), ended.details()
    assert held_drops_to_zero(server)


def test_a_push_in_chunks_larger_than_max_inflight_bytes_is_refused_naming_both(start_server: Servers) -> None:
    cap = 1 << 20
    server = start_server(max_inflight_bytes=cap)
    body = trxp.build(group_items("huge", 0, 1, response=150_000))
    assert cap < len(body) < server.config.max_message_bytes
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        ended = refusal(stub, chunks(body, PART))
        assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"total_bytes = {len(body)}" in ended.details(), ended.details()
        assert f"max_inflight_bytes = {cap}" in ended.details(), ended.details()
        assert stub.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 0
    assert held_drops_to_zero(server)


def test_a_push_in_chunks_slower_than_push_min_mb_per_second_is_refused_naming_it(start_server: Servers) -> None:
    """Each chunk comes within push_stream_idle_seconds, so the stream is never idle; the push as a
    whole comes at far less than the bound on its average rate (after a grace of the idle time)."""
    server = start_server(push_stream_idle_seconds=2, push_min_mb_per_second=0.001)
    body = trxp.build(group_items("trickle", 0, 1))
    parted = chunks(body, 16)

    def messages() -> Iterator[pb.PushRequest]:
        for message in parted:
            yield message
            time.sleep(0.2)

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.PushStream(messages(), timeout=120))
        assert stub.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 0
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, refused.value.details()
    assert "push_min_mb_per_second = 0.001" in refused.value.details(), refused.value.details()
    assert "EXPBUF_PUSH_MIN_MB_PER_SECOND" in refused.value.details()
    assert held_drops_to_zero(server)


def test_a_put_of_keyed_values_waits_for_room_as_a_push_does(start_server: Servers) -> None:
    """PutValues (TransferQueue's tensors, as large as pushes and from as many writers) is read
    only while the payloads in progress are below max_inflight_bytes: past it, it waits up to its
    deadline and is refused naming the setting, nothing stored; once the push holding the room is
    stored, it is, and what it held is given back."""
    body = trxp.build(group_items("w", 0, 1, response=150_000))
    cap = len(body) + PART
    server = start_server(max_inflight_bytes=cap)  # the push in chunks below holds all of it
    value = bytes(range(256)) * 4096
    put = pb.PutValuesRequest(keys=["k"], values=[value])
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        with cap_held(stub, server, body):
            with pytest.raises(grpc.RpcError) as refused:
                stub.PutValues(put, timeout=1.5)
            assert stub.GetValues(pb.GetValuesRequest(keys=["k"]), timeout=10).missing_keys == ["k"]
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"max_inflight_bytes = {cap}" in refused.value.details(), refused.value.details()
        assert stub.PutValues(put, timeout=30).stored == 1
        assert list(stub.GetValues(pb.GetValuesRequest(keys=["k"]), timeout=10).values) == [value]
    assert held_drops_to_zero(server)


@pytest.mark.parametrize("method", ["PutValues", "Push"])
def test_calls_waiting_for_room_leave_the_reserve_to_calls_that_answer_at_once(
    start_server: Servers, method: str
) -> None:
    """A Push or a PutValues that finds max_inflight_bytes reached waits only where the call limits
    let calls wait idle (they leave `reserved_workers` to the calls that answer at once); the others
    are refused busy at once, having done nothing, and a ClearValues is still answered (it was
    refused busy, every worker held by a waiting call). Once room is made, those that waited go in.
    On a loaded machine the calls may all arrive before the first is refused: the last then finds
    no worker its scope may take and is refused as it arrives, with the workers named instead; one
    of those let in is always refused for want of room (no more than the waiting share may wait)."""
    body = trxp.build(group_items("w", 0, 1, response=150_000))
    server = start_server(max_inflight_bytes=len(body) + PART, workers=8, reserved_workers=2)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        with cap_held(stub, server, body):
            requests = [
                pb.PutValuesRequest(keys=[f"k{n}"], values=[b"x"])
                if method == "PutValues"
                else pb.PushRequest(payload=trxp.build(group_items(f"p{n}", 0, 1)))
                for n in range(6)
            ]
            calls = [getattr(stub, method).future(request, timeout=60) for request in requests]
            deadline = time.monotonic() + 30
            while sum(call.done() for call in calls) + server.inflight.waiting < len(calls):
                assert time.monotonic() < deadline, "the calls neither waited for room nor were refused"
                time.sleep(0.02)
            assert stub.ClearValues(pb.ClearValuesRequest(keys=["z"]), timeout=10).cleared == 0
            refused = [call.exception() for call in calls if call.done()]
            assert refused and all(error is not None for error in refused)
            assert all(error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for error in refused)  # type: ignore[union-attr]
            details = [error.details() for error in refused]  # type: ignore[union-attr]
            no_room = [detail for detail in details if "may not wait for room" in detail]
            no_worker = [d for d in details if "calls are in progress" in d and "may not wait" not in d]
            assert no_room and len(no_room) + len(no_worker) == len(details), details
            assert all("EXPBUF_WORKERS" in detail for detail in details), details
        went_in = [call.result() for call in calls if call.exception() is None]
        assert len(went_in) == len(calls) - len(refused)
    assert held_drops_to_zero(server)


def test_a_staged_push_whose_table_is_dropped_meanwhile_gives_back_its_reservation(start_server: Servers) -> None:
    """A push in chunks whose large experience is staged as it arrives, its table dropped while it is
    read: the push is refused NOT_FOUND naming the table, and what it reserved of max_inflight_bytes is
    given back. (StagedPush.drop, run first when the push's message is released, looks the table up
    to drop its staged sets; the table is gone, so it raises NotFound, and the reservation that was to
    be released after it never is: max_inflight_bytes shrinks for good, each time.)"""
    server = start_server()
    body = trxp.encode([make_experience(0, "dropped", 0, response=700_000)])  # about 6 MB: a store's chunk staged
    parted = chunks(body, 1 << 20, table="t")
    half = threading.Event()
    go_on = threading.Event()

    def messages() -> Iterator[pb.PushRequest]:
        yield from parted[:6]  # 6 MiB: the store's first chunk (4 MiB) staged
        half.set()
        go_on.wait(30)
        yield from parted[6:]

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        stub.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="t")), timeout=10)
        call = stub.PushStream(messages(), timeout=60)
        assert half.wait(10)
        deadline = time.monotonic() + 30
        while not server.store.stats("t")["staged_bytes"]:  # the chunks sent are read and the first staged
            assert time.monotonic() < deadline, "the push staged nothing"
            time.sleep(0.02)
        stub.DropTable(pb.DropTableRequest(name="t"), timeout=10)
        go_on.set()
        with pytest.raises(grpc.RpcError) as ended:
            list(call)
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND, ended.value.details()
        assert "'t'" in ended.value.details()
    assert held_drops_to_zero(server), f"{server.inflight.held} bytes of max_inflight_bytes still held"


MESSAGE_BYTES = "expbuf-message-bytes"  # the call metadata in which a client declares its messages' largest size


def declaring(size: int) -> tuple[tuple[str, str], ...]:
    return ((MESSAGE_BYTES, str(size)),)


ARRIVING = 8  # Pushes or PutValues let in together


class Counted(InFlight):
    """The server's InFlight, keeping the most it held at once (payload and reservations for reads)."""

    most = 0

    def hold(self, size: int, owner: object = None) -> Callable[[], None]:
        with self._changed:  # the lock hold() takes (reentrant), so that no change is missed
            release = super().hold(size, owner)
            self.most = max(self.most, self.held)
        return release


def gated(server: ExpbufServer, monkeypatch: pytest.MonkeyPatch) -> threading.Semaphore:
    """Passes for the server's pushes and PutValues to store: each call, its message read and held,
    takes one before the store writes it, and waits for it."""
    passes = threading.Semaphore(0)
    for name in ("put_entries", "put_values"):
        stores = getattr(server.store, name)

        def gate(*args: Any, _stores: Callable[..., Any] = stores, **kwargs: Any) -> Any:
            assert passes.acquire(timeout=60), "the test gave no pass"
            return _stores(*args, **kwargs)

        monkeypatch.setattr(server.store, name, gate)
    return passes


@pytest.mark.parametrize("method", ["Push", "PutValues"])
def test_declared_calls_let_in_together_hold_no_more_than_max_inflight_bytes(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """Eight Pushes or PutValues of 450 KB, each declaring its message's size (expbuf-message-bytes),
    wait for room behind a PutValues that holds all of max_inflight_bytes (room for two of them),
    and are let in together once it is stored; each, its message read, waits for the test to let
    the store write it. Each began its read while what was held was below the cap, so they read
    whole messages until what they held passed it: at least three, six to eight of the eight in
    runs, 2.7-3.6 MB under a cap of 1.1 MB, by the server's own count (InFlight.held). A read now
    reserves what its call declared once it fits: two are read, the other six wait for room, and
    the most held at any time is the cap and the message being read. Then all are stored."""
    monkeypatch.setattr(app, "InFlight", Counted)
    bodies = [trxp.build(group_items(f"p{n}", 0, 1, response=50_000)) for n in range(ARRIVING)]
    size = len(bodies[0])  # what each holds once read: a push's payload, a put's value
    assert {len(body) for body in bodies} == {size}
    requests: list[Any] = [
        pb.PushRequest(payload=body) if method == "Push" else pb.PutValuesRequest(keys=[f"k{n}"], values=[body])
        for n, body in enumerate(bodies)
    ]
    message = max(request.ByteSize() for request in requests)
    cap = 2 * message + message // 2  # room for two of them, not three
    server = start_server(max_inflight_bytes=cap)
    inflight = server.inflight
    assert isinstance(inflight, Counted)
    passes = gated(server, monkeypatch)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        holder = stub.PutValues.future(pb.PutValuesRequest(keys=["holder"], values=[bytes(cap)]), timeout=60)
        deadline = time.monotonic() + 30
        while inflight.held != cap:
            assert time.monotonic() < deadline, f"the holder holds {inflight.held} bytes, not {cap}"
            time.sleep(0.02)
        calls = [
            getattr(stub, method).future(request, timeout=60, metadata=declaring(request.ByteSize()))
            for request in requests
        ]
        while inflight.waiting != ARRIVING:
            assert time.monotonic() < deadline, f"{inflight.waiting} calls wait for room, not {ARRIVING}"
            time.sleep(0.02)
        passes.release()  # the holder is stored: the eight find room together

        def settled() -> bool:
            """Every call holds its message (read, waiting to be stored) or waits for room."""
            held = inflight.held
            return held > 0 and held % size == 0 and held // size + inflight.waiting == ARRIVING

        while not settled():
            assert time.monotonic() < deadline, f"held {inflight.held}, waiting {inflight.waiting}"
            time.sleep(0.02)
        held, waiting = inflight.held, inflight.waiting
        passes.release(ARRIVING)
        assert holder.result().stored == 1
        answered = [call.result(timeout=60) for call in calls]
    assert held <= cap, (
        f"{ARRIVING} {method} calls let in together hold {held} bytes ({held // size} messages read), "
        f"past max_inflight_bytes = {cap}"
    )
    assert (held // size, waiting) == (2, ARRIVING - 2)
    assert inflight.most <= cap + message, f"held {inflight.most} bytes at most, under max_inflight_bytes = {cap}"
    if method == "Push":
        assert [len(reply.stored_uids) for reply in answered] == [1] * ARRIVING
    else:
        assert [reply.stored for reply in answered] == [1] * ARRIVING
    assert held_drops_to_zero(server)


def test_a_message_larger_than_its_call_declared_is_refused_naming_both(start_server: Servers) -> None:
    """A call's declaration (expbuf-message-bytes) is what max_inflight_bytes held room for before
    its message was read: a message larger is refused INVALID_ARGUMENT naming both sizes, nothing
    of it stored (a PushStream's in its turn, after the pushes before it), and a declaration that
    is not a size is refused naming the key."""
    server = start_server()
    body = trxp.build(group_items("declared", 0, 2))
    push = pb.PushRequest(payload=body)
    later = pb.PushRequest(payload=trxp.build(group_items("later", 0, 2)) + bytes(64), seq=2)
    put = pb.PutValuesRequest(keys=["k"], values=[body])
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        for method, request in (("Push", push), ("PutValues", put)):
            with pytest.raises(grpc.RpcError) as refused:
                getattr(stub, method)(request, timeout=10, metadata=declaring(request.ByteSize() - 1))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert refused.value.details() == (
                f"{type(request).__name__}: a message of {request.ByteSize()} bytes, larger than its call declared "
                f"({MESSAGE_BYTES} = {request.ByteSize() - 1}, the most a message of the call may be, which "
                "max_inflight_bytes held room for before it was read): nothing of it is stored"
            ), refused.value.details()
        first = pb.PushRequest(payload=body, seq=1)
        stream = stub.PushStream(iter([first, later]), timeout=10, metadata=declaring(first.ByteSize()))
        assert [reply.seq for reply in itertools.islice(stream, 1)] == [1]
        with pytest.raises(grpc.RpcError) as ended:
            next(stream)
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"a message of {later.ByteSize()} bytes, larger than its call declared" in ended.value.details()
        assert f"{MESSAGE_BYTES} = {first.ByteSize()}" in ended.value.details()
        for bad in ("many", "0", "-5", "1e6"):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Push(push, timeout=10, metadata=((MESSAGE_BYTES, bad),))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{MESSAGE_BYTES} = {bad!r}" in refused.value.details(), refused.value.details()
        assert stub.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 2
        assert list(stub.GetValues(pb.GetValuesRequest(keys=["k"]), timeout=10).missing_keys) == ["k"]
        assert stub.Push(push, timeout=10, metadata=declaring(push.ByteSize())).duplicate_uids
    assert held_drops_to_zero(server)


def test_a_call_reads_its_message_once_what_it_declared_fits(start_server: Servers) -> None:
    """A PushStream that declared its messages' size and sent nothing yet holds that much of
    max_inflight_bytes for the read it has begun; one that declared nothing holds nothing, as
    before. A Push that declares more than is left waits for room (an undeclared one is read
    while anything is left, and so is an undeclared PutValues), and is stored once the silent
    stream ends; a declared PutValues that waits past its deadline is refused naming the read
    that holds the room."""
    cap = 1 << 20
    server = start_server(max_inflight_bytes=cap)
    body = trxp.build(group_items("waits", 0, 1, response=70_000))
    push = pb.PushRequest(payload=body)
    put = pb.PutValuesRequest(keys=["k"], values=[body])
    silent = cap - push.ByteSize() // 2  # the room the silent stream leaves is half the push's
    holds: list[threading.Event] = []

    def nothing(hold: threading.Event) -> Iterator[pb.PushRequest]:
        hold.wait(60)
        return
        yield

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        streams = []
        for declared in (declaring(silent), ()):
            holds.append(threading.Event())
            streams.append(stub.PushStream(nothing(holds[-1]), timeout=60, metadata=declared))
        try:
            deadline = time.monotonic() + 30
            while server.call_limits.in_progress("push_stream") < 2 or server.inflight.held != silent:
                assert time.monotonic() < deadline, f"the silent streams hold {server.inflight.held}, not {silent}"
                time.sleep(0.02)
            undeclared = stub.Push(push, timeout=30)  # read while the held bytes are below the cap
            assert len(undeclared.stored_uids) == 1
            assert stub.PutValues(put, timeout=30).stored == 1
            with pytest.raises(grpc.RpcError) as refused:
                stub.PutValues(put, timeout=1.5, metadata=declaring(put.ByteSize()))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
            assert (
                f"reads begun hold {silent} bytes for the next message of 1 call (what the call declared a "
                f"message may be, {MESSAGE_BYTES}; a PushStream open but silent holds it until its message comes"
            ) in refused.value.details(), refused.value.details()
            waiting = stub.Push.future(push, timeout=60, metadata=declaring(push.ByteSize()))
            while server.inflight.waiting != 1:
                assert time.monotonic() < deadline, "the declared Push did not wait for room"
                assert not waiting.done(), waiting.exception()
                time.sleep(0.02)
        finally:
            for hold in holds:
                hold.set()
        assert list(waiting.result(timeout=30).duplicate_uids) == list(undeclared.stored_uids)
        for stream in streams:
            assert list(stream) == []
    assert held_drops_to_zero(server)


PUSHING = ("Push", "PushStream", "PutValues")


def recorded_declarations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None]]:
    """What each Push, PushStream and PutValues of the servers started after this declared
    (expbuf-message-bytes as the server received it, None where it has none), in the order they
    came: the servers' PushMemory records each call's metadata before it goes on as ever."""
    seen: list[tuple[str, int | None]] = []

    class Recording(PushMemory):
        per_call = True  # its wrap reads each call's metadata: made on each call

        def wrap(
            self, method: str, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
        ) -> grpc.RpcMethodHandler:
            if method in PUSHING:
                found = [value for key, value in details.invocation_metadata or () if key == MESSAGE_BYTES]
                seen.append((method, int(found[0]) if found else None))
            return super().wrap(method, handler, details)

    monkeypatch.setattr(app, "PushMemory", Recording)
    return seen


CHUNK = 1 << 16  # the clients' push_chunk_bytes below


def most_in_a_chunk(table: str) -> int:
    """The largest message a pusher of push_chunk_bytes = CHUNK sends to `table`: a first chunk
    (or a push sent whole) of CHUNK bytes, its seq and total_bytes as large as they go."""
    return pb.PushRequest(table=table, payload=bytes(CHUNK), seq=2**64 - 1, total_bytes=2**64 - 1).ByteSize()


def test_expbuf_clients_declare_the_most_a_message_of_their_call_will_be(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocking and the asyncio client, their pushers and the sharded clients declare in each
    Push, PushStream and PutValues the most a message of the call will be: a push or a put sent
    whole its own size, a push in chunks or a pusher's stream the most a chunk's message takes."""
    seen = recorded_declarations(monkeypatch)
    servers = [start_server(data) for data in (start_server.data / "a", start_server.data / "b")]
    targets = [f"127.0.0.1:{server.port}" for server in servers]
    small = trxp.build(group_items("small", 0, 2))
    large = trxp.build(group_items("large", 0, 1, response=70_000))
    assert len(small) < CHUNK < len(large)
    whole = pb.PushRequest(table="t", payload=small).ByteSize()
    put = pb.PutValuesRequest(table="t", keys=["k"], values=[small]).ByteSize()
    chunks = most_in_a_chunk("t")
    expected = [("Push", whole), ("PushStream", chunks), ("PutValues", put), ("PushStream", chunks)]

    with BufferClient(targets[0], push_chunk_bytes=CHUNK) as client:
        client.create_table("t")
        client.push(small, table="t")
        client.push(large, table="t")
        client.put_values(["k"], [small], table="t")
        with client.pusher("t") as pusher:
            pusher.push(small).result()
    assert seen == expected, seen
    seen.clear()

    async def pushes() -> None:
        async with AsyncBufferClient(targets[0], push_chunk_bytes=CHUNK) as client:
            await client.push(small, table="t")
            await client.push(large, table="t")
            await client.put_values(["k"], [small], table="t")
            async with client.pusher("t") as pusher:
                await (await pusher.push(small))

    asyncio.run(pushes())
    assert seen == expected, seen
    seen.clear()

    with ShardedBufferClient(dict(zip("ab", targets, strict=True)), push_chunk_bytes=CHUNK) as sharded:
        sharded.create_table("t", exist_ok=True)
        sharded.push(small, table="t")
        sharded.put_values(["k"], [small], table="t")
        with sharded.pusher("t") as pusher:
            pusher.push(small).result()
    assert sorted(method for method, _ in seen) == ["Push", "PushStream", "PutValues"], seen
    assert ("PushStream", chunks) in seen and ("PutValues", put) in seen, seen
    assert all(declared for _, declared in seen), seen


def test_an_idle_pusher_holds_its_next_message_until_the_idle_timeout_ends_its_stream(start_server: Servers) -> None:
    """A pusher keeps its PushStream open between pushes, and the server's read of its next message
    holds what the stream declared (a chunk's message, about push_chunk_bytes) while it waits: idle
    pushers hold that much each of max_inflight_bytes, so that a push they send after an idle spell
    finds its room. The stream that stays silent for push_stream_idle_seconds is ended, and what it
    held given back; the pusher's next push goes on a new stream."""
    server = start_server(push_stream_idle_seconds=2)
    first, second = (trxp.build(group_items(batch, 0, 1)) for batch in ("first", "second"))
    with BufferClient(f"127.0.0.1:{server.port}", push_chunk_bytes=CHUNK) as client, client.pusher("t") as pusher:
        client.create_table("t")
        assert len(pusher.push(first).result(timeout=30).stored) == 1
        deadline = time.monotonic() + 30
        while server.inflight.held != most_in_a_chunk("t"):
            assert time.monotonic() < deadline, f"the idle pusher holds {server.inflight.held} bytes"
            time.sleep(0.02)
        assert held_drops_to_zero(server), f"{server.inflight.held} bytes held past push_stream_idle_seconds"
        assert len(pusher.push(second).result(timeout=30).stored) == 1


def test_a_push_that_declares_nothing_and_sends_nothing_ends_after_the_idle_time(start_server: Servers) -> None:
    """A raw Push that declares no size and never sends its message holds a worker: its read was
    bounded by max_message_bytes at push_min_mb_per_second (47 minutes by default), and 48 such
    calls refused every rollout worker busy. It now ends after push_stream_idle_seconds."""
    server = start_server(push_stream_idle_seconds=1)
    release = threading.Event()

    def nothing() -> Iterator[bytes]:
        release.wait(60)
        return
        yield

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_unary("/expbuf.v1.ExperienceBuffer/Push").future(nothing(), timeout=60)
        try:
            with pytest.raises(grpc.RpcError) as ended:
                call.result(timeout=20)  # 1 s, looked at once a second
        finally:
            release.set()
    assert ended.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


@pytest.mark.parametrize("method", ["Push", "PutValues"])
def test_a_unary_call_whose_message_never_comes_gives_its_room_back(start_server: Servers, method: str) -> None:
    """A client that opens a Push (or a PutValues) declaring a 1 MiB message and never sends it held
    that reservation of max_inflight_bytes, and a worker, for as long as it kept the call open: a
    few such calls, and every push waited. The read is bounded as a push in chunks is
    (push_stream_idle_seconds, and its size at push_min_mb_per_second): past it the call ends, the
    room comes back, and the next push is stored."""
    server = start_server(push_stream_idle_seconds=1, push_min_mb_per_second=10)
    release = threading.Event()

    def nothing() -> Iterator[bytes]:
        release.wait(60)  # the client's side stays open, sending nothing
        return
        yield

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_unary(f"/expbuf.v1.ExperienceBuffer/{method}").future(
            nothing(), metadata=((MESSAGE_BYTES, str(1 << 20)),), timeout=60
        )
        try:
            deadline = time.monotonic() + 10
            while not server.inflight.held and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.inflight.held == 1 << 20, "the read reserved the declared size"
            with pytest.raises(grpc.RpcError) as ended:
                call.result(timeout=20)  # 1 s + 1 MiB at 10 MB/s, looked at once a second
            assert ended.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert held_drops_to_zero(server)
        finally:
            release.set()
        stub = pb_grpc.ExperienceBufferStub(channel)
        assert stub.Push(pb.PushRequest(payload=trxp.build(group_items(0, 0, 2))), timeout=10).stored_uids
