"""A client that stops reading a reply sent in parts, its call open (a hung trainer process, a
receive thread stuck behind something else): what the call holds (a Sample stream's batch, the
LMDB read snapshot its reply is cut from, a worker) is given back once a message has waited
max_confirm_seconds for the client to take it (rpc/sample/stalled_sends.py). A client that cancels gives
everything back already (a review probed Sample streams cancelled after the first part and after
the whole batch before confirming, and reads cancelled after the first part, of whole, chunked and
zstd tables, as TRXP and as columns, 30 to 200 times in a row: readers, threads, memory and held
batches all back where they were). A real server on loopback, real LMDB."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from expbuf.client import AsyncBufferClient, BufferClient, DeadlineExceededError
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer
from expbuf.server.rpc.sample.stalled_sends import SNAPSHOT_SECONDS

from conftest import Servers
from helpers import make_experience, wait_for

LIMIT = 256 << 10  # the server's max_message_bytes: a reply of megabytes goes in many parts
CONFIRM = 1.0  # the server's max_confirm_seconds
# What a table holds, and how its experiences are stored: each under chunk_heads.CHUNK_BYTES
# (stored whole), one of 27 MB (stored in 4 MiB chunks), or that one in a table that compresses.
# Either way the batch is tens of MB: far more than HTTP/2 flow control lets the server send
# ahead of a client that does not read.
KINDS: dict[str, tuple[str, list[int]]] = {
    "whole": ("none", [400_000] * 8),
    "chunked": ("none", [3_000_000]),
    "zstd": ("zstd", [3_000_000]),
}


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    """No scrub: its pass reads in a transaction of its own, which keeps pages from reuse too."""
    return start_server(max_message_bytes=LIMIT, max_confirm_seconds=CONFIRM, scrub_mb_per_second=0)


@pytest.fixture
def stub(server: ExpbufServer) -> Iterator[pb_grpc.ExperienceBufferStub]:
    """A raw client whose receive window stays gRPC's first (no BDP probes, which may grow it to
    hold a whole reply of tens of MB): a client that reads no more stalls the server's send."""
    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        yield pb_grpc.ExperienceBufferStub(channel)


def buffer_client(server: ExpbufServer) -> BufferClient:
    return BufferClient(f"127.0.0.1:{server.port}", max_message_bytes=LIMIT, push_chunk_bytes=64 << 10, timeout=60)


def given_back(server: ExpbufServer, pushed: int) -> None:
    """Wait for table `t` to hold its `pushed` experiences ready again, none held for a stream."""
    with buffer_client(server) as client:

        def returned() -> bool:
            stats = client.stats("t")["t"]
            return stats.ready == pushed and stats.leased == 0

        wait_for(returned, f"the batch given back (max_confirm_seconds = {CONFIRM:g})", seconds=30)


def fill(server: ExpbufServer, kind: str) -> list[str]:
    """Table `t` of `kind` holding one group of the kind's experiences; their uids."""
    compression, responses = KINDS[kind]
    with buffer_client(server) as client:
        client.create_table("t", group_size=len(responses), estimator="none", compression=compression)
        uids = [
            uid
            for run, response in enumerate(responses)
            for uid in client.push([make_experience("big", 0, run, response=response)], table="t").stored
        ]
        assert client.stats("t")["t"].ready == len(responses) == len(uids)
    return uids


def snapshots(server: ExpbufServer) -> int:
    """The read snapshots that replies are cut from, open now (none once every reply is sent or let
    go of: no count of readers, which a call that has just ended may still hold for a moment)."""
    return sum(1 for ref in server.store.environment.readers._snapshots if (snap := ref()) is not None and snap.open)


@pytest.mark.parametrize("columns", [False, True], ids=["trxp", "columns"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_sample_stream_stalled_mid_reply_gives_its_batch_back_after_max_confirm_seconds(
    server: ExpbufServer, stub: pb_grpc.ExperienceBufferStub, kind: str, columns: bool
) -> None:
    """rpc/sample/sample_stream.py: 'A client that hangs with its stream open (a stuck step) would
    otherwise hold its window for ever. Past [max_confirm_seconds] the stream ends ... and its
    unconfirmed batches return to the buffer.' A client that hangs a few parts into a batch sent
    in parts (the stream open, nothing read, nothing cancelled) holds the batch (invisible, its
    groups never sampled by anyone else), the snapshot it is read from and a worker thread for as
    long as it hangs: the server's thread waits in gRPC's send for flow-control room that never
    comes, and no bound of the stream's applies there."""
    pushed = len(fill(server, kind))
    requests: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
    requests.put(
        pb.SampleRequest(
            table="t",
            num_groups=1,
            max_batches=1,
            wait_seconds=10,
            max_reply_bytes=LIMIT,
            fields=["tokens", "logprobs"] if columns else [],
        )
    )
    call: Any = stub.Sample(iter(requests.get, None))  # no deadline, as the expbuf clients' streams
    try:
        first = next(call)
        assert first.whole_bytes > 20 * LIMIT  # a batch in many parts; the client reads no more of it
        given_back(server, pushed)
        wait_for(lambda: snapshots(server) == 0, "the batch's read snapshot ended", seconds=30)
    finally:
        call.cancel()
        requests.put(None)


class Loop:
    """A trainer's ordinary loop beside a stalled call, on table `loop`: push an experience of
    1.8 MB, consume it. Its pages are freed each round, and reused unless a read snapshot opened
    before the free keeps them."""

    ROUND_BYTES = 200_000 * 9  # one round's experience (a response of 200,000 tokens)

    def __init__(self, server: ExpbufServer, client: BufferClient) -> None:
        self.server, self.client, self.task = server, client, 0
        client.create_table("loop", group_size=1, estimator="none")
        self.rounds(3)  # the loop's pages in use, and freed, once

    def rounds(self, count: int) -> None:
        for _ in range(count):
            self.client.push([make_experience("loop", self.task, 0, response=200_000)], table="loop")
            (batch,) = self.client.sample("loop", num_groups=1, max_batches=1, timeout=30, delivery="consume")
            assert len(batch.uids) == 1
            self.task += 1

    def grown(self, count: int) -> int:
        """The pages the map grew by in `count` rounds."""
        env = self.server.store.environment.env
        before = env.info()["last_pgno"]
        self.rounds(count)
        return int(env.info()["last_pgno"] - before)

    def assert_reused(self, grown: int, count: int, after: str) -> None:
        page = self.server.store.environment.env.stat()["psize"]
        assert grown <= 5 * (self.ROUND_BYTES // page), (
            f"the map grew {grown} pages ({grown * page >> 20} MiB) in {count} rounds of push and consume {after}: "
            "the pages freed were not reused"
        )


def cancelled_beside(loop: Loop, call: Any, rounds: int) -> int:
    """The pages the map grew by in `rounds` of `loop` once the stalled `call`'s snapshot ended;
    the call ended CANCELLED."""
    wait_for(lambda: snapshots(loop.server) == 0, "the stalled call's read snapshot ended", seconds=30)
    grown = loop.grown(rounds)
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    return grown


@pytest.mark.parametrize("read", ["trxp", "columns"])
def test_a_read_stalled_mid_reply_ends_after_max_confirm_seconds_and_the_map_reuses_its_pages(
    server: ExpbufServer, stub: pb_grpc.ExperienceBufferStub, read: str
) -> None:
    """A ReadFields of 27 MB in parts whose client stops reading after the first part (its call
    open, no deadline) kept the snapshot its reply is cut from, and a worker, for as long as the
    client hung: LMDB then reused no page freed after it, and a trainer's ordinary loop (push 1.8
    MB, consume it) grew the data file by all it wrote (30 rounds: 52 MB, where without the stalled
    read it did not grow). A reply's message its client does not take within max_confirm_seconds
    now ends the call (CANCELLED), its snapshot with it, and the loop after reuses the pages."""
    (uid,) = fill(server, "chunked")
    with buffer_client(server) as client:
        loop = Loop(server, client)
        fields = ["tokens", "logprobs"] if read == "columns" else []
        call: Any = stub.ReadFields(pb.ReadFieldsRequest(table="t", uids=[uid], fields=fields, max_reply_bytes=LIMIT))
        try:
            assert next(call).whole_bytes > 20 * LIMIT  # and the client reads no more of it
            grown = cancelled_beside(loop, call, 30)
        finally:
            call.cancel()
    loop.assert_reused(grown, 30, "after a read stalled mid-reply")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "asyncio"])
def test_a_trainer_back_from_a_step_past_the_bound_is_told_as_before(server: ExpbufServer, asynchronous: bool) -> None:
    """A trainer's step outlasts max_confirm_seconds while the next batch, too large to wait in
    the channel's buffers, is being sent (no prefetch): the server cancels the stream at the bound,
    and the trainer, back, is told what it was told before the server did (DeadlineExceededError
    naming max_confirm_seconds), not that its call was cancelled; the batch goes back."""
    pushed = len(fill(server, "chunked")) + len(fill_more(server, 2))
    target = f"127.0.0.1:{server.port}"
    options: dict[str, Any] = {"num_groups": 1, "window": 2, "prefetch": 0, "delivery": "consume"}
    if asynchronous:

        async def run() -> None:
            async with AsyncBufferClient(target, max_message_bytes=LIMIT, push_chunk_bytes=0) as aclient:
                batches = aclient.sample("t", **options)
                async with contextlib.aclosing(batches):
                    await anext(batches)
                    await asyncio.sleep(4 * CONFIRM)  # the step
                    await anext(batches)

        with pytest.raises(DeadlineExceededError, match="max_confirm_seconds"):
            asyncio.run(run())
    else:
        with buffer_client(server) as client:
            batches = client.sample("t", **options)
            next(batches)
            time.sleep(4 * CONFIRM)
            with pytest.raises(DeadlineExceededError, match="max_confirm_seconds"):
                next(batches)
            batches.close()
    with buffer_client(server) as client:
        wait_for(lambda: client.stats("t")["t"].ready == pushed - 1, "the batches after the first given back", 30)


def fill_more(server: ExpbufServer, count: int) -> list[str]:
    """`count` more groups of one experience of 27 MB in table `t` (made by `fill`)."""
    with buffer_client(server) as client:
        made = [make_experience("big", task, 0, response=3_000_000) for task in range(1, 1 + count)]
        return [uid for one in made for uid in client.push([one], table="t").stored]


def test_a_sample_client_confirming_within_the_documented_bound_is_not_cancelled(start_server: Servers) -> None:
    """A batch waits for its confirmation at most max_confirm_seconds counted from the later of its
    send and the client's confirmation of the batch before it, and so does a message of it that
    waits in gRPC's send. A raw client (window 2, no prefetch) reads batch 1 whole, takes 2.5 s to
    get it ready (decode, copy to the GPU) before it confirms it, trains 2.5 s, and reads batch 2:
    5 s after batch 2's send began, too large for the channel's buffers, but 2.5 s after the
    confirmation before it, inside the bound of 4 s. It is not cut off (counted from the send's
    start, it was cancelled at 4 s)."""
    server = start_server(max_message_bytes=LIMIT, max_confirm_seconds=4.0, scrub_mb_per_second=0)
    fill(server, "chunked")
    fill_more(server, 1)
    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.http2.bdp_probe", 0)]  # as `stub`
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        requests: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
        requests.put(
            pb.SampleRequest(
                table="t", num_groups=1, max_batches=2, window=2, wait_seconds=10, max_reply_bytes=LIMIT,
                delivery=pb.DELIVERY_CONSUME,
            )
        )  # fmt: skip
        call: Any = stub.Sample(iter(requests.get, None))

        def whole_batch() -> None:
            first = next(call)
            got = len(first.part) if first.whole_bytes else first.whole_bytes
            while got < first.whole_bytes:
                got += len(next(call).part)

        try:
            whole_batch()
            time.sleep(2.5)  # batch 1 made ready for the step
            requests.put(pb.SampleRequest(received=1))
            time.sleep(2.5)  # the step, 2.5 s of the 4 s bound counted from the confirmation
            try:
                whole_batch()
            except grpc.RpcError as exc:
                pytest.fail(f"batch 2 asked for 2.5 s after batch 1's confirmation (bound 4 s): {exc.code()}")
            requests.put(pb.SampleRequest(received=2))
        finally:
            call.cancel()
            requests.put(None)


def test_a_sample_client_that_reads_no_more_but_sends_messages_confirming_nothing_is_cut_off(
    server: ExpbufServer, stub: pb_grpc.ExperienceBufferStub
) -> None:
    """Only a message that confirms a batch not confirmed before, or stops, moves the bound on: a
    client that stopped reading a batch mid-reply but sent a message confirming nothing new
    (received = 0) every quarter second kept its batch held, and the read snapshot its reply is
    cut from open, for as long as it sent them (45 s under a bound of 4 s; 40 s of a loop of 2 MiB
    pushes and consumes grew the data file 872 MB). It is cut off at max_confirm_seconds
    (CANCELLED), its batch given back, and the loop beside it reuses the map's pages."""
    pushed = len(fill(server, "chunked"))
    with buffer_client(server) as client:
        loop = Loop(server, client)
        requests: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
        requests.put(pb.SampleRequest(table="t", num_groups=1, max_batches=1, wait_seconds=10, max_reply_bytes=LIMIT))
        call: Any = stub.Sample(iter(requests.get, None))
        quiet = threading.Event()

        def confirming_nothing() -> None:
            while not quiet.wait(0.25):
                requests.put(pb.SampleRequest(received=0))

        sender = threading.Thread(target=confirming_nothing, daemon=True)
        try:
            assert next(call).whole_bytes > 20 * LIMIT  # a batch in many parts; the client reads no more of it
            sender.start()
            given_back(server, pushed)
            grown = cancelled_beside(loop, call, 10)
        finally:
            quiet.set()
            call.cancel()
            requests.put(None)
    loop.assert_reused(grown, 10, "beside a Sample stream stalled mid-reply that sends messages confirming nothing")


def whole_reply(call: Any, first: pb.SampleReply | None = None) -> pb.SampleReply:
    """The next reply of a raw call, put together from its parts (`first`: its first, read already)."""
    first = next(call) if first is None else first
    if not first.whole_bytes:
        return first
    data = bytearray(first.part)
    while len(data) < first.whole_bytes:
        data += next(call).part
    return pb.SampleReply.FromString(bytes(data))


@pytest.mark.parametrize(
    ("kind", "method", "columns", "parts"),
    [
        ("chunked", "Sample", False, True),
        ("zstd", "Sample", True, True),
        ("whole", "ReadFields", False, True),
        ("zstd", "ReadFields", True, True),
        ("chunked", "Sample", False, False),
    ],
    ids=["sample-chunked", "sample-zstd-columns", "read-whole", "read-zstd-columns", "sample-one-message"],
)
def test_a_reply_waiting_in_grpcs_send_lets_its_read_snapshot_go_long_before_the_bound(
    start_server: Servers, kind: str, method: str, columns: bool, parts: bool
) -> None:
    """A reply's message that waits in gRPC's send (its client reads no more for now) keeps the
    read snapshot its reply is cut from for no more than stalled_sends.SNAPSHOT_SECONDS: what is
    left of the reply is copied out of the map and the snapshot ends, where it stayed open until
    the call's bound (max_confirm_seconds: 600 s by default), LMDB reusing no page freed after it
    meanwhile. A reply in one message (or its last part) is a copy already: its snapshot ends
    before it is sent. The client that reads again gets the reply as it was."""
    server = start_server(
        max_message_bytes=LIMIT if parts else 64 << 20, max_confirm_seconds=120.0, scrub_mb_per_second=0
    )
    uids = fill(server, kind)
    fields = ["tokens", "logprobs"] if columns else []
    first_request = pb.SampleRequest(
        table="t", num_groups=1, max_batches=1, wait_seconds=10, max_reply_bytes=LIMIT if parts else 0,
        delivery=pb.DELIVERY_REPLAY, fields=fields,
    )  # fmt: skip
    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.http2.bdp_probe", 0)]  # as `stub`
    with (
        grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel,
        buffer_client(server) as client,
    ):
        stub = pb_grpc.ExperienceBufferStub(channel)
        # Each Sample call's messages in a queue of its own: a call that ends before gRPC has read
        # its end (None) from its queue leaves it there, which would end the next call at once.
        requests: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()

        def open_call() -> Any:
            nonlocal requests
            if method == "ReadFields":
                read = pb.ReadFieldsRequest(table="t", uids=uids, fields=fields, max_reply_bytes=LIMIT)
                return stub.ReadFields(read)
            requests = queue.SimpleQueue()
            requests.put(first_request)
            return stub.Sample(iter(requests.get, None))

        def end(call: Any) -> None:
            if method == "Sample":
                requests.put(pb.SampleRequest(received=1))
                requests.put(None)
            assert list(call) == []

        reference_call = open_call()
        reference = whole_reply(reference_call)  # read at once, by a client that reads
        end(reference_call)
        loop = Loop(server, client)
        call = open_call()
        try:
            if parts:
                first = next(call)
                assert first.whole_bytes > 20 * LIMIT  # and the client reads no more of it for now
            else:  # the batch taken, its one message on its way: the client reads none of it for now
                first = None
                wait_for(lambda: client.stats("t")["t"].leased == len(uids), "the batch taken", seconds=30)
            wait_for(
                lambda: snapshots(server) == 0,
                "the read snapshot of a reply waiting in gRPC's send ended (max_confirm_seconds = 120)",
                seconds=20,
            )
            grown = loop.grown(10)
            again = whole_reply(call, first)
            if columns:
                assert list(again.columns) == list(reference.columns)
            else:
                assert again.payload == reference.payload
            assert list(again.uids) == list(reference.uids)
            end(call)
        finally:
            call.cancel()
            requests.put(None)
    loop.assert_reused(grown, 10, "beside a reply waiting in gRPC's send")


def test_what_stalled_replies_copy_out_of_the_map_is_bounded_with_the_other_replies(start_server: Servers) -> None:
    """A reply in parts whose client reads no more has its rest copied out of the map (so its
    snapshot ends); those copies are counted against max_inflight_bytes as a read's unary replies
    are (half of it an address). Uncounted, each stalled ReadFields held its rest for up to
    max_confirm_seconds: four of 288 MB grew the server by 1 GB (a helper's audit). A copy past
    the bound is not made: that reply reads on from its snapshot, and both replies come whole."""
    server = start_server(max_message_bytes=LIMIT, max_confirm_seconds=120.0, scrub_mb_per_second=0)
    uids = fill(server, "whole")
    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.http2.bdp_probe", 0)]  # as `stub`
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        request = pb.ReadFieldsRequest(table="t", uids=uids, max_reply_bytes=LIMIT)
        reference = whole_reply(stub.ReadFields(request))
        calls = [stub.ReadFields(request), stub.ReadFields(request)]
        try:
            first = next(calls[0])
            server.reply_memory.limit = 3 * first.whole_bytes  # an address holds 1.5 replies: one copy, not two
            wait_for(lambda: server.reply_memory.held > 0, "the first stalled reply's rest copied, counted")
            held = server.reply_memory.held  # what is left after the parts sent or being sent
            assert first.whole_bytes - 3 * LIMIT < held <= first.whole_bytes - len(first.part)
            second = next(calls[1])
            time.sleep(3 * SNAPSHOT_SECONDS)  # its send waited past SNAPSHOT_SECONDS: its copy would be made by now
            assert server.reply_memory.held == held  # not made: past the address's half
            assert snapshots(server) == 1  # the second reads on from its snapshot
            assert whole_reply(calls[1], second).payload == reference.payload
            assert whole_reply(calls[0], first).payload == reference.payload
            assert [list(call) for call in calls] == [[], []]
            wait_for(lambda: server.reply_memory.held == 0, "the copy given back as its reply ended")
        finally:
            for call in calls:
                call.cancel()


@pytest.mark.parametrize("room", [True, False], ids=["copied", "let_go"])
def test_a_stalled_reply_whose_snapshot_the_store_ends_is_copied_within_the_bound_or_let_go(
    start_server: Servers, room: bool
) -> None:
    """A reply in parts whose client reads no more, and whose rest could not be copied within
    max_inflight_bytes, reads on from its snapshot; the store must end that snapshot at a map
    resize or with more open than it keeps (readers.MAX_SNAPSHOTS), and its detach copied every
    such reply's rest and the batch's payloads again, counted nowhere: eight stalled streams of
    64 MB grew a 32 MiB-capped server by 480 MiB (a helper's audit). The detach's copy counts now:
    within the bound the reply comes whole; past it the reply is let go, its call ends
    RESOURCE_EXHAUSTED (replies_full) and its batch goes back to the buffer, to be served again."""
    server = start_server(max_message_bytes=LIMIT, max_confirm_seconds=120.0, scrub_mb_per_second=0)
    uids = fill(server, "whole")
    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.http2.bdp_probe", 0)]  # as `stub`
    requests: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
    requests.put(pb.SampleRequest(table="t", num_groups=1, max_batches=1, wait_seconds=10, max_reply_bytes=LIMIT))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        call = pb_grpc.ExperienceBufferStub(channel).Sample(iter(requests.get, None))
        try:
            server.reply_memory.limit = 2  # no copy fits: the stalled reply keeps its snapshot
            first = next(call)
            time.sleep(3 * SNAPSHOT_SECONDS)  # its send waited past SNAPSHOT_SECONDS: a copy would be made by now
            assert snapshots(server) == 1 and server.reply_memory.held == 0
            server.reply_memory.limit = 4 * first.whole_bytes if room else 2
            server.store.environment.readers.detach_snapshots()  # as a map resize does
            assert snapshots(server) == 0
            held = server.reply_memory.held
            if room:
                assert first.whole_bytes - 3 * LIMIT < held <= first.whole_bytes
                assert list(whole_reply(call, first).uids) == uids
                requests.put(pb.SampleRequest(received=1))
                requests.put(None)
                assert list(call) == []
            else:
                assert held == 0
                with pytest.raises(grpc.RpcError) as ended:
                    whole_reply(call, first)
                assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "its client read none of it while the store ended the snapshot" in ended.value.details()
                given_back(server, len(uids))
            wait_for(lambda: server.reply_memory.held == 0, "the copy given back as its reply ended")
        finally:
            call.cancel()
            requests.put(None)
