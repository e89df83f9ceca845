"""A client that stops reading holds no more than its share of the server's memory in the replies of
its reads (server/rpc/interceptors/reply_memory.py), and no longer than max_confirm_seconds: gRPC
holds a unary call's reply once its handler has ended, until its client takes it, and a client
that read no more with reads in flight held them for as long as its connection lived, as many as it
sent. The client that stops reading sits behind a TCP proxy that stops taking the server's bytes,
so gRPC's flow control holds the replies in the server, as a stopped process's would."""

from __future__ import annotations

import contextlib
import socket
import threading

import grpc
import pytest

from expbuf.client import BufferClient, trxp
from expbuf.client.rollout_pieces import split
from expbuf.client.rpc.wire import BUSY
from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer

from conftest import Servers
from helpers import make_experience, wait_for

LIMIT = 64 << 20  # max_inflight_bytes: unsent replies hold at most 64 MiB, 32 MiB those of one address
TABLE = "t"
BIG = "big"  # a keyed value's key: GetValues answers in one message, as Get does
OPTIONS = [("grpc.max_receive_message_length", 256 << 20)]


class StopsReading:
    """A TCP proxy on 127.0.0.1 in front of `port` that hands the client's bytes on at once and the
    server's only while `reading` is set: cleared, it takes none of them, and the server's sends wait
    on TCP and HTTP/2 flow control. Its connections reach the server from 127.0.0.2: another address
    than a client's that connects straight."""

    def __init__(self, port: int) -> None:
        self._port = port
        self.reading = threading.Event()
        self.reading.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._port), source_address=("127.0.0.2", 0))
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.reading), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, gate: threading.Event | None) -> None:
        with contextlib.suppress(OSError):
            while True:
                if gate is not None:
                    gate.wait()
                data = source.recv(1 << 16)
                if not data:
                    return
                sink.sendall(data)

    def close(self) -> None:
        self.reading.set()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


def _serving_one(start_server: Servers, confirm_seconds: float) -> tuple[ExpbufServer, str]:
    """A server holding one experience of about 9 MB, and a keyed value as large (BIG); (the server,
    the experience's uid)."""
    server = start_server(max_inflight_bytes=LIMIT, max_confirm_seconds=confirm_seconds)
    item = trxp.from_experience(make_experience(0, 0, 0, response=1_000_000))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=OPTIONS) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        config = pb.TableConfig(name=TABLE, estimator=pb.Estimator(name="none"), group_by=pb.GROUP_BY_NONE)
        stub.CreateTable(pb.CreateTableRequest(config=config), timeout=30)
        stub.Push(pb.PushRequest(table=TABLE, payload=trxp.build([item])), timeout=60)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=60) as client:
        client.put_values([BIG], [bytes(9 << 20)], table=TABLE)
    return server, item.uid


def _stalled_reads(proxy: StopsReading, uid: str, count: int) -> tuple[grpc.Channel, list[grpc.Future]]:
    """`count` Gets of `uid` over the proxy, which takes none of their replies."""
    # no window past gRPC's first (no BDP probes): the server sends what that holds and no more, as to a
    # stopped process, and its connection's buffers keep room for a call's end to be written
    small = [*OPTIONS, ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1 << 16)]
    channel = grpc.insecure_channel(proxy.target, options=small)
    grpc.channel_ready_future(channel).result(timeout=30)
    proxy.reading.clear()
    stub = pb_grpc.ExperienceBufferStub(channel)
    return channel, [stub.Get.future(pb.GetRequest(table=TABLE, uids=[uid]), timeout=120) for _ in range(count)]


def test_a_client_that_reads_no_more_holds_its_share_and_others_read_on(start_server: Servers) -> None:
    server, uid = _serving_one(start_server, 60)
    port, memory = server.port, server.reply_memory
    proxy = StopsReading(port)
    try:
        channel, calls = _stalled_reads(proxy, uid, 12)
        wait_for(lambda: memory.held > LIMIT * 3 // 8, "three stalled replies held: the address's share")
        # 12 replies of 9 MB asked for: those past half the bound are refused, not held
        assert memory.held <= LIMIT // 2, memory.held
        again = StopsReading(port)  # the stalled client's address, reading
        with (
            grpc.insecure_channel(again.target, options=OPTIONS) as same,
            grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as other,
        ):
            with pytest.raises(grpc.RpcError) as refused:  # the stalled client's address: its share is spent
                pb_grpc.ExperienceBufferStub(same).Get(pb.GetRequest(table=TABLE, uids=[uid]), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            assert "replies" in refused.value.details() and "max_inflight_bytes" in refused.value.details()
            trailer = dict(refused.value.trailing_metadata() or ())
            assert BUSY in trailer and Reason.REPLIES_FULL in str(trailer), trailer
            reply = pb_grpc.ExperienceBufferStub(other).Get(pb.GetRequest(table=TABLE, uids=[uid]), timeout=30)
            assert not reply.missing_uids  # another address reads on
        # expbuf's client reads again while refused replies_full, and has its reply once the stalled one reads
        with BufferClient(again.target, timeout=60) as client:
            threading.Timer(1.0, proxy.reading.set).start()
            assert client.get_values([BIG], table=TABLE) == [bytes(9 << 20)]
        again.close()
        for call in calls:  # the stalled client's reads: each answered, or refused busy
            with contextlib.suppress(grpc.RpcError):
                call.result(timeout=60)
        refusals = [call.exception() for call in calls if call.exception() is not None]
        assert refusals and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refusals), refusals
        channel.close()
        wait_for(lambda: memory.held == 0, "the replies given back once taken")
    finally:
        proxy.close()


def test_a_read_whose_reply_waits_past_max_confirm_seconds_is_cut(start_server: Servers) -> None:
    server, uid = _serving_one(start_server, 2)
    proxy = StopsReading(server.port)
    try:
        channel, _ = _stalled_reads(proxy, uid, 2)
        wait_for(lambda: server.reply_memory.held > 0, "a stalled read's reply held")
        wait_for(lambda: server.reply_memory.held == 0, "the stalled reads cut after max_confirm_seconds", 30)
        channel.close()
    finally:
        proxy.close()


def test_the_async_client_reads_again_while_its_address_holds_its_share(start_server: Servers) -> None:
    """AsyncBufferClient's read refused `replies_full` (its address's share held by a client that
    reads no more) is made again within its deadline, as the blocking client's is, and has its reply
    once the share is given back."""
    import asyncio

    from expbuf.client import AsyncBufferClient

    server, uid = _serving_one(start_server, 60)
    proxy, again = StopsReading(server.port), StopsReading(server.port)
    try:
        channel, _ = _stalled_reads(proxy, uid, 12)
        wait_for(lambda: server.reply_memory.held > LIMIT * 3 // 8, "three stalled replies held: the address's share")

        async def read() -> list[bytes | None]:
            async with AsyncBufferClient(again.target, timeout=60) as client:
                threading.Timer(1.0, proxy.reading.set).start()
                return await client.get_values([BIG], table=TABLE)

        assert asyncio.run(read()) == [bytes(9 << 20)]
        channel.close()
    finally:
        proxy.close()
        again.close()


def test_a_partial_rollouts_reply_built_whole_is_counted_as_a_reads(start_server: Servers) -> None:
    """ReadPartials builds its reply whole (rollouts put together from their pieces) and held it,
    uncounted, for as long as its client did not read it. It is counted with the replies of reads:
    where its address holds its share already it is refused, busy (`replies_full`), and the
    client reads it again once there is room."""
    server = start_server(max_inflight_bytes=LIMIT)
    target = f"127.0.0.1:{server.port}"
    long = make_experience(0, 0, 0, response=200_000)  # its pieces put together pass SMALL
    first, _ = split(long, [100_000])
    with BufferClient(target, timeout=60) as client, grpc.insecure_channel(target, options=OPTIONS) as channel:
        client.create_table(TABLE, group_size=1)
        assert client.push([first], table=TABLE).partial == [first.eid.uid]
        stub = pb_grpc.ExperienceBufferStub(channel)
        held = server.reply_memory.copy("ipv4:127.0.0.1", LIMIT // 2)  # this address's share, taken
        assert held is not None
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ReadPartials(pb.GetPartialsRequest(table=TABLE, task_ids=["0/0"], max_reply_bytes=1 << 20)))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(refused.value.trailing_metadata())[BUSY] == "1"
        assert "the ReadPartials reply" in refused.value.details()
        threading.Timer(0.5, held).start()  # room again: the client's read made again gets through
        (read,) = client.get_partials(["0/0"], table=TABLE)
        assert read.tokens.numel() == first.tokens.numel()
        assert server.reply_memory.held == 0
