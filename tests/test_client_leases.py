"""The clients' side of a leased batch: its lease starts when the client hands it to its
caller, `renew` keeps it while a long step runs, and a batch the client cannot decode is
never confirmed, so it goes back to the buffer. A real server on loopback, real LMDB; the
undecodable batch comes from a real gRPC server that sends one."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from expbuf.client import (
    AsyncBufferClient,
    BufferClient,
    DataLossError,
    ExpbufError,
    InvalidArgumentError,
    NotFoundError,
    trxp,
)
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer

from helpers import group_items, serving


@pytest.fixture
def client(client: BufferClient) -> BufferClient:
    """The shared client, with table t holding three groups of two."""
    client.create_table("t", group_size=2, estimator="none")
    for task in range(3):
        client.push(trxp.build(group_items(1, task, 2)), table="t")
    return client


def test_a_batch_lease_runs_from_when_the_caller_gets_it(client: BufferClient) -> None:
    batches = client.sample("t", num_groups=1, lease_seconds=30)
    first = next(batches)
    time.sleep(1.0)  # the caller's step; the next batch waits in the window meanwhile
    before = time.time()
    second = next(batches)
    assert second.lease_expires >= before + 30 > first.lease_expires
    batches.close()


def test_renew_keeps_a_batch_past_its_lease(client: BufferClient) -> None:
    batch = next(client.sample("t", num_groups=1, lease_seconds=1))
    before = time.time()
    assert batch.renew(120) >= before + 119
    assert batch.lease_expires >= before + 119
    time.sleep(2.0)  # past the lease asked for; the server's lease upkeep runs every 0.5 s
    stats = client.stats("t")["t"]
    assert (stats.leased, stats.leases_expired) == (2, 0)
    assert batch.ack() == 2


def test_renew_refusals_name_the_problem(client: BufferClient) -> None:
    batch = next(client.sample("t", num_groups=1))
    with pytest.raises(NotFoundError, match="unknown"):
        client.renew("nope", 10, table="t")
    with pytest.raises(InvalidArgumentError, match="lease_seconds"):
        batch.renew(0)
    with pytest.raises(NotFoundError, match="not a lease of table 'default'"):
        client.renew(batch.lease_id, 10)
    batch.ack()
    with pytest.raises(NotFoundError, match="was acked: its groups are consumed"):  # as an ack or a nack says it
        batch.renew(10)
    expiring = next(client.sample("t", num_groups=1, lease_seconds=0.2))
    time.sleep(1.5)  # past the lease; the server's lease upkeep runs every 0.5 s
    with pytest.raises(NotFoundError, match="was expired: its lease_seconds passed before an ack"):
        expiring.renew(10)


def test_async_renew(server: ExpbufServer, client: BufferClient) -> None:
    async def run() -> None:
        async with AsyncBufferClient(f"127.0.0.1:{server.port}") as aclient:
            async for batch in aclient.sample("t", num_groups=1, max_batches=1, lease_seconds=1):
                assert await batch.renew(300) > time.time() + 290
                await asyncio.sleep(1.5)
                assert await batch.ack() == 2

    asyncio.run(run())
    assert client.stats("t")["t"].leases_expired == 0


class BrokenSampler(pb_grpc.ExperienceBufferServicer):
    """Sends one batch whose payload is not TRXP, and records what the client confirms."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.ended = threading.Event()

    def Sample(self, requests: Iterator[pb.SampleRequest], context: grpc.ServicerContext) -> Iterator[pb.SampleReply]:
        next(requests)
        yield pb.SampleReply(payload=b"TRXP\x01broken", uids=["1/0/0/0/"], group_ids=["1/0"], lease_id="L1")
        for request in requests:
            self.received.append(request.received)
            if request.stop:
                break
        self.ended.set()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_batch_that_cannot_be_decoded_is_not_confirmed_and_names_itself(asynchronous: bool) -> None:
    servicer = BrokenSampler()
    with serving(servicer) as target:
        with pytest.raises(DataLossError) as info:
            if asynchronous:

                async def run() -> None:
                    async with AsyncBufferClient(target) as aclient:
                        async for _ in aclient.sample("t", num_groups=1):
                            pass

                asyncio.run(run())
            else:
                with BufferClient(target) as bclient:
                    for _ in bclient.sample("t", num_groups=1):
                        pass
        assert info.value.code == grpc.StatusCode.DATA_LOSS
        assert "table 't' (1 experiences, groups 1/0) could not be decoded" in info.value.details
        assert "goes back to the buffer" in info.value.details
        assert servicer.ended.wait(10)
        assert servicer.received and max(servicer.received) == 0  # never confirmed


def test_calls_on_a_closed_client_are_refused_naming_the_call(target: str, client: BufferClient) -> None:
    """In both clients, CANCELLED as a sharded client's calls and a pusher's pushes are. A batch acked
    after its client closed: gRPC's own errors of a closed channel differed (a ValueError blocking, a
    UsageError asyncio), were no ExpbufError, and named neither the call nor what became of the batch."""
    closing = BufferClient(target, timeout=10)
    batch = next(closing.sample("t", num_groups=1, lease_seconds=30))
    closing.close()
    before = "on a closed client: close() was called before it, nothing was sent"
    lease = " (a leased batch not acked comes back when its lease expires)"
    with pytest.raises(ExpbufError, match=re.escape(f"Ack {before}{lease}")) as refused:
        batch.ack()
    assert refused.value.code == grpc.StatusCode.CANCELLED
    with pytest.raises(ExpbufError, match=re.escape(f"Sample {before}")):
        next(closing.sample("t", num_groups=1))
    with pytest.raises(ExpbufError, match=re.escape(f"Stats {before}") + "$"):
        closing.stats()
    pushed = closing.pusher("t").push(trxp.build(group_items(3, 0, 2)))  # it said: whether it was stored is unknown
    with pytest.raises(ExpbufError, match=re.escape("Push on a closed client: close() was called before it (push 1 ")):
        pushed.result(10)
    assert pushed.exception().code == grpc.StatusCode.CANCELLED and "nothing was sent" in str(pushed.exception())

    async def closed_async() -> None:
        aclient = AsyncBufferClient(target, timeout=10)
        held = await anext(aiter(aclient.sample("t", num_groups=1, lease_seconds=30)))
        await aclient.close()
        with pytest.raises(ExpbufError, match=re.escape(f"Nack {before}{lease}")):
            await held.nack()
        with pytest.raises(ExpbufError, match=re.escape(f"Sample {before}")):
            await anext(aiter(aclient.sample("t", num_groups=1)))
        with pytest.raises(ExpbufError, match=re.escape(f"Push {before}")):
            await aclient.push(trxp.build(group_items(2, 0, 2)), table="t")
        waiting = await aclient.pusher("t").push(trxp.build(group_items(4, 0, 2)))
        with pytest.raises(ExpbufError, match=re.escape("Push on a closed client: close() was called before it")):
            await waiting

    asyncio.run(closed_async())
    assert client.stats("t")["t"].leased == 4  # the two batches still leased, not ended by either
