"""Calls that wait or send nothing, in numbers, against an `expbuf serve` child: they never
lock out the calls that keep rollouts and trainers going.

The server runs with 16 workers and every cap on a class of waiting calls raised to its
highest (workers - 1), so that only the reserve of workers kept for Push, Ack, Nack and
Stats stands between the idle calls and a lock-out. Each case opens more idle calls than
there are workers: those beyond the other workers are refused at once, naming the reserve,
and a push, an ack of a lease taken before, Stats and the health check are all answered.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from expbuf.client import BufferClient
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from faultkit import channel, healthy, payload, sample_all, servers, stub
from helpers import ServerProcess

pytestmark = pytest.mark.faults

WORKERS = 16
RESERVED = 2  # the default: an eighth of the workers
RAISED_CAPS = {
    "EXPBUF_WORKERS": str(WORKERS),
    "EXPBUF_MAX_SAMPLE_STREAMS": str(WORKERS - 1),
    "EXPBUF_MAX_TABLE_STREAMS": str(WORKERS - 1),
    "EXPBUF_MAX_PUSH_STREAMS": str(WORKERS - 1),
    "EXPBUF_MAX_WAITING_ADMITS": str(WORKERS - 1),
}


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerProcess]]:
    with servers() as start:
        yield start


def idle_push_stream(buffer: pb_grpc.ExperienceBufferStub, holds: list[queue.SimpleQueue]) -> grpc.Call:
    """A PushStream that sends nothing until its queue is given None."""
    hold: queue.SimpleQueue = queue.SimpleQueue()
    holds.append(hold)
    return buffer.PushStream(iter(hold.get, None), timeout=60)


def waiting_sample(buffer: pb_grpc.ExperienceBufferStub, holds: list[queue.SimpleQueue]) -> grpc.Call:
    """A Sample stream waiting for data on the empty table."""
    hold: queue.SimpleQueue = queue.SimpleQueue()
    hold.put(pb.SampleRequest(table="empty", num_groups=1, delivery=pb.DELIVERY_CONSUME, wait_seconds=30))
    holds.append(hold)
    return buffer.Sample(iter(hold.get, None), timeout=60)


def waiting_admit(buffer: pb_grpc.ExperienceBufferStub, holds: list[queue.SimpleQueue]) -> grpc.Future:
    """An Admit waiting for room on the full table."""
    return buffer.Admit.future(pb.AdmitRequest(table="full", count=1, wait_seconds=30), timeout=60)


def held_lease(target: str) -> str:
    """A lease taken before the lock-out, for an ack during it."""
    with BufferClient(target) as client:
        client.create_table("empty")
        client.create_table("full", max_staleness=0, batch_size=1)
        assert client.admit("full", 1).count == 1  # the table has no more room
        client.create_table("leased")
    with channel(target) as chan:
        buffer = stub(chan)
        data, _ = payload("lease", 0)
        buffer.Push(pb.PushRequest(table="leased", payload=data), timeout=30)
        request = pb.SampleRequest(
            table="leased", num_groups=1, delivery=pb.DELIVERY_LEASE, lease_seconds=120, max_batches=1, wait_seconds=10
        )
        (reply,) = sample_all(buffer, request, timeout=30)
        return reply.lease_id


CASES = {
    "80 idle PushStreams": [(idle_push_stream, WORKERS + 4)],
    "60 waiting Samples and 20 idle PushStreams": [(waiting_sample, 12), (idle_push_stream, 5)],
    "70 Admit(wait=30) on a full table": [(waiting_admit, WORKERS + 2)],
}


@pytest.mark.parametrize("case", CASES)
def test_idle_calls_leave_push_ack_and_stats_answered(
    tmp_path: Path, serve: Callable[..., ServerProcess], case: str
) -> None:
    server = serve(str(tmp_path / "data"), env=RAISED_CAPS)
    lease_id = held_lease(server.target)
    holds: list[queue.SimpleQueue] = []
    with channel(server.target) as chan:
        buffer = stub(chan)
        calls = [opener(buffer, holds) for opener, count in CASES[case] for _ in range(count)]
        try:
            accepted = WORKERS - RESERVED
            deadline = time.monotonic() + 30
            while sum(call.done() for call in calls) < len(calls) - accepted and time.monotonic() < deadline:
                time.sleep(0.1)
            refused = [call for call in calls if call.done()]
            assert len(refused) == len(calls) - accepted, (
                f"{len(calls)} idle calls on {WORKERS} workers: {len(refused)} refused, "
                f"{len(calls) - accepted} expected (all but the {accepted} workers outside the reserve)"
            )
            for call in refused:
                assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (call.code(), call.details())
                assert f"reserved_workers = {RESERVED}" in call.details(), call.details()
            try:
                data, uids = payload("during", 0)
                pushed = buffer.Push(pb.PushRequest(table="default", payload=data), timeout=10)
                acked = buffer.Ack(pb.AckRequest(table="leased", lease_id=lease_id), timeout=10)
                tables = buffer.Stats(pb.StatsRequest(), timeout=10).tables
                assert healthy(chan)
            except grpc.RpcError as exc:
                pytest.fail(f"{case}: Push, Ack, Stats or Health refused: {exc.code().name}: {exc.details()}")
            assert list(pushed.stored_uids) == uids
            assert acked.acked
            assert {t.name for t in tables} >= {"default", "leased", "empty", "full"}
            assert not any(call.done() for call in calls if call not in refused), "an accepted idle call ended"
        finally:
            for hold in holds:
                hold.put(None)
            for call in calls:
                call.cancel()


def test_idle_push_stream_and_long_waits_end_naming_their_setting(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    server = serve(str(tmp_path / "data"), "--push-stream-idle-seconds", "1", "--max-wait-seconds", "1")
    lease_id = held_lease(server.target)
    assert lease_id
    with channel(server.target) as chan:
        buffer = stub(chan)
        holds: list[queue.SimpleQueue] = []
        pushing = idle_push_stream(buffer, holds)
        data, uids = payload("first", 0)
        holds[0].put(pb.PushRequest(table="default", payload=data, seq=7))
        first = next(pushing)  # a stream that pushes is served, then falls silent
        assert (first.seq, list(first.stored_uids)) == (7, uids)
        with pytest.raises(grpc.RpcError) as ended:
            next(pushing)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "push_stream_idle_seconds = 1" in ended.value.details(), ended.value.details()
        holds[0].put(None)

        sampling = waiting_sample(buffer, holds)  # asks to wait 30 s
        with pytest.raises(grpc.RpcError) as waited:
            next(sampling)
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "max_wait_seconds = 1" in waited.value.details(), waited.value.details()
        holds[-1].put(None)

        admitted = waiting_admit(buffer, holds).result(timeout=20)  # asks to wait 30 s: answered after 1
        assert admitted.granted == 0


def test_pushes_blocked_on_a_full_table_leave_acks_and_stats_answered(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """Pushes that wait for room may take every worker; the trainer's ack, which makes room,
    and Stats are still answered."""
    server = serve(str(tmp_path / "data"), env={"EXPBUF_WORKERS": str(WORKERS)})
    lease_id = held_lease(server.target)
    with BufferClient(server.target) as client:
        client.create_table("blocking", capacity_experiences=4, when_full="block")
    with channel(server.target) as chan:
        buffer = stub(chan)
        buffer.Push(pb.PushRequest(table="blocking", payload=payload("fill", 0)[0]), timeout=30)
        calls = [
            buffer.Push.future(pb.PushRequest(table="blocking", payload=payload("wait", task)[0]), timeout=60)
            for task in range(WORKERS + 2)
        ]
        try:
            deadline = time.monotonic() + 30
            while sum(call.done() for call in calls) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            refused = [call for call in calls if call.done()]
            assert len(refused) == 2, f"{len(calls)} blocked pushes on {WORKERS} workers: {len(refused)} refused"
            for call in refused:
                assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (call.code(), call.details())
                assert f"all workers = {WORKERS}" in call.details(), call.details()
            try:
                acked = buffer.Ack(pb.AckRequest(table="leased", lease_id=lease_id), timeout=10)
                blocking = buffer.Stats(pb.StatsRequest(table="blocking"), timeout=10).tables[0]
                assert healthy(chan)
            except grpc.RpcError as exc:
                pytest.fail(f"Ack, Stats or Health refused while pushes wait: {exc.code().name}: {exc.details()}")
            assert acked.acked
            assert blocking.pushed == 4
        finally:
            for call in calls:
                call.cancel()
