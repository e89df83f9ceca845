"""Sample streams that end, break, read slowly, or come in numbers, against an `expbuf serve` child.

A consumed batch counts as consumed only when the client has it; a stream that ends
normally consumes what it delivered; the server reads at most a fixed number of
batches ahead of a slow reader; and waiting streams never starve Push, Stats or the
health check. The tests that do not kill the server share one child (conftest's
`child_server`), each on tables of its own.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from expbuf.client import trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from faultkit import SampleStream, channel, computed, group, healthy, sample_all, scaled, stats, stub
from helpers import ServerProcess

pytestmark = pytest.mark.faults


# Windows tested: the batches the server may prepare for one stream beyond those its reader
# has (docs/concepts/credit-window.md: the stream's window, 1 by default on the wire).
WINDOWS = [1, 3]
MANY_STREAMS = 80  # more than the server's 64 workers
KILLS = scaled(2)  # a kill, then a kill of the restarted server; more with EXPBUF_SOAK_SCALE


def push_groups(
    buffer: pb_grpc.ExperienceBufferStub, count: int, size: int = 1, batch: str = "s", table: str = ""
) -> list[list[str]]:
    """Push `count` complete groups of `size` in one payload (into `table`, the default table
    unless named), and wait until their advantages are computed (the tables' estimator is grpo:
    the samples after it wait 5 s for ready groups); their uids, group by group."""
    items = [item for task in range(count) for item in group(batch, task, size)]
    buffer.Push(pb.PushRequest(table=table, payload=trxp.build(items)), timeout=30)
    computed(buffer, table or "default")
    return [[item.uid for item in items[i : i + size]] for i in range(0, len(items), size)]


def own_table(buffer: pb_grpc.ExperienceBufferStub, name: str) -> str:
    """A table of the shared server's with the default table's settings, for one test alone."""
    buffer.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name=name)), timeout=10)
    return name


def settled(buffer: pb_grpc.ExperienceBufferStub, table: str, seconds: float = 10.0) -> pb.TableStats:
    """Stats once nothing is leased and the counts stopped moving (or after `seconds`)."""
    deadline = time.monotonic() + seconds
    last = stats(buffer, table)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = stats(buffer, table)
        if now.leased == 0 and (now.ready, now.consumed) == (last.ready, last.consumed):
            return now
        last = now
    return last


def test_consume_stream_that_ends_normally_consumes_its_batches(child_server: ServerProcess) -> None:
    with channel(child_server.target) as chan:
        buffer = stub(chan)
        table = own_table(buffer, "ends")
        push_groups(buffer, 5, table=table)
        request = pb.SampleRequest(
            table=table, num_groups=1, delivery=pb.DELIVERY_CONSUME, max_batches=1, wait_seconds=5
        )
        seen = [list(reply.uids) for _ in range(3) for reply in sample_all(buffer, request, timeout=30)]
        assert len(seen) == 3
        flat = [uid for uids in seen for uid in uids]
        assert len(set(flat)) == len(flat), f"max_batches=1 consume calls delivered the same uids again: {seen}"
        s = settled(buffer, table)
        assert s.consumed == 3, f"three delivered experiences, Stats.consumed is {s.consumed}"
        assert s.ready == 2
        assert list(buffer.Get(pb.GetRequest(table=table, uids=flat), timeout=10).missing_uids) == flat


@pytest.mark.parametrize("window", WINDOWS)
def test_cancelled_consume_stream_consumes_only_what_was_delivered(child_server: ServerProcess, window: int) -> None:
    with channel(child_server.target) as chan:
        buffer = stub(chan)
        table = own_table(buffer, f"cancelled_{window}")
        groups = push_groups(buffer, 300, table=table)
        request = pb.SampleRequest(
            table=table, num_groups=1, delivery=pb.DELIVERY_CONSUME, wait_seconds=5, window=window
        )
        stream = SampleStream(buffer, request)
        delivered = [uid for _ in range(3) for uid in stream.next().uids]  # each confirmed as it arrives
        time.sleep(1.0)  # the trainer works on its third batch, then stops
        stream.cancel()
        s = settled(buffer, table)
        never = [uid for uids in groups for uid in uids if uid not in delivered]
        assert s.consumed == 3, f"3 batches of 1 were delivered and confirmed, {s.consumed} experiences consumed"
        assert s.ready == 297 and s.leased == 0, s
        missing = set(buffer.Get(pb.GetRequest(table=table, uids=never), timeout=30).missing_uids)
        assert not missing, f"{len(missing)} experiences were never delivered but are gone, e.g. {sorted(missing)[:3]}"
        assert list(buffer.Get(pb.GetRequest(table=table, uids=delivered), timeout=10).missing_uids) == delivered


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("delivery", [pb.DELIVERY_LEASE, pb.DELIVERY_CONSUME], ids=["lease", "consume"])
def test_slow_reader_holds_a_bounded_number_of_batches(child_server: ServerProcess, delivery: int, window: int) -> None:
    with channel(child_server.target) as chan:
        buffer = stub(chan)
        table = own_table(buffer, f"slow_{delivery}_{window}")
        push_groups(buffer, 80, table=table)
        request = pb.SampleRequest(
            table=table, num_groups=1, delivery=delivery, lease_seconds=60, wait_seconds=5, window=window
        )
        stream = SampleStream(buffer, request)
        for received in range(1, 4):
            stream.next()
            time.sleep(1.0)  # a training step: the server must not run ahead meanwhile
            s = stats(buffer, table)
            taken = s.leased + s.consumed  # delivered or read ahead
            allowed = received + window
            assert taken <= allowed, (
                f"after {received} batch(es) of 1 group reached a slow reader, the server has taken {taken} "
                f"experiences ({s.leased} leased, {s.consumed} consumed; at most {allowed}: {received} delivered "
                f"and {window} batch(es) ahead)"
            )
        stream.cancel()


def test_many_waiting_streams_do_not_starve_other_calls(child_server: ServerProcess) -> None:
    with channel(child_server.target) as chan:
        buffer = stub(chan)
        own_table(buffer, "empty")
        during = own_table(buffer, "during")
        request = pb.SampleRequest(
            table="empty", num_groups=1, delivery=pb.DELIVERY_LEASE, lease_seconds=30, wait_seconds=30
        )
        streams = [SampleStream(buffer, request) for _ in range(MANY_STREAMS)]
        try:
            time.sleep(1.0)  # every stream has reached the server and waits for data
            try:
                assert healthy(chan), "the health check does not answer SERVING while streams wait"
                push_groups(buffer, 1, batch="during", table=during)
                assert stats(buffer, during).pushed == 1
            except grpc.RpcError as exc:
                code = exc.code().name
                pytest.fail(f"Health, Push or Stats refused while {MANY_STREAMS} streams wait: {code}: {exc.details()}")
            refused = [stream.call for stream in streams if stream.call.done()]
            assert refused, f"{MANY_STREAMS} waiting streams on one table were all accepted: no cap"
            for call in refused:
                assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (call.code(), call.details())
                assert "stream" in call.details().lower(), f"the refusal does not say why: {call.details()!r}"
        finally:
            for stream in streams:
                stream.cancel()


@pytest.mark.parametrize("delivery", [pb.DELIVERY_CONSUME, pb.DELIVERY_LEASE], ids=["consume", "lease"])
def test_a_server_killed_between_send_and_confirm_loses_and_repeats_nothing(
    tmp_path: Path, serve: Callable[..., ServerProcess], delivery: int
) -> None:
    """SIGKILL with the credit window full: one batch the client has (confirmed, and for a
    lease acked), two sent and never confirmed. At every restart the two come back ready,
    the one delivered stays delivered, and nothing else moved: consumed is exactly what the
    client has, the rest is all there."""
    data = str(tmp_path / "data")
    server = serve(data)
    with channel(server.target) as chan:
        groups = push_groups(stub(chan), 6 * KILLS, size=2)  # each round delivers one and sends two back
    stored = sum(map(len, groups))
    delivered: list[str] = []
    for rounds in range(KILLS):
        with channel(server.target) as chan:
            buffer = stub(chan)
            request = pb.SampleRequest(num_groups=1, delivery=delivery, lease_seconds=600, wait_seconds=5, window=3)
            stream = SampleStream(buffer, request)
            first = stream.next()  # confirmed: a consumed batch leaves at the server's next commit
            unconfirmed = [u for _ in range(2) for u in next(stream.call).uids]  # sent, never confirmed
            if delivery == pb.DELIVERY_LEASE:
                assert buffer.Ack(pb.AckRequest(lease_id=first.lease_id), timeout=10).acked == 2
            deadline = time.monotonic() + 20
            while stats(buffer).consumed < len(delivered) + 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # the server commits the confirmation while it waits for room in the window
            delivered += first.uids
            assert not set(delivered) & set(unconfirmed)
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
        server = serve(data)
        with channel(server.target) as chan:
            buffer = stub(chan)
            s = stats(buffer)
            assert (s.consumed, s.leased, s.ready) == (len(delivered), 0, stored - len(delivered)), (
                f"round {rounds}: {s}"
            )
            assert set(buffer.Get(pb.GetRequest(uids=delivered), timeout=10).missing_uids) == set(delivered)
            left = [uid for uids in groups for uid in uids if uid not in delivered]
            assert not buffer.Get(pb.GetRequest(uids=left), timeout=10).missing_uids
