"""How long a sent batch may wait for its client's confirmation (max_confirm_seconds): a
trainer that hangs with its stream open gives its window back, whatever the delivery, and
a confirmation that comes after the bound is refused with the stream's end; and what a raw
client is told of its lease when it confirms late. A real server on loopback, real LMDB;
raw gRPC where the test plays a client in another language."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from expbuf.client import AsyncBufferClient, BufferClient, DeadlineExceededError, trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ServerConfig, load
from expbuf.server.store.disk.rows import decode_lease
from expbuf.server.store.schema.errors import ConfigError

from conftest import Servers
from helpers import Conversation, fill, group_items, serving, settle

DELIVERIES = {"consume": pb.DELIVERY_CONSUME, "lease": pb.DELIVERY_LEASE, "replay": pb.DELIVERY_REPLAY}


@contextlib.contextmanager
def raw_stream(
    start_server: Servers, groups: int, settings: dict[str, float], **request: object
) -> Iterator[tuple[ExpbufServer, BufferClient, Conversation]]:
    """A server with `settings`, table t holding `groups` groups of two, a client of it, and a
    raw Sample stream of one group a batch, a window of 2, opened with `request`."""
    server = start_server(**settings)
    target = f"127.0.0.1:{server.port}"
    with grpc.insecure_channel(target) as channel, BufferClient(target) as client:
        client.create_table("t", group_size=2, estimator="none")
        fill(client, groups)
        first = pb.SampleRequest(table="t", num_groups=1, window=2, **request)
        yield server, client, Conversation(pb_grpc.ExperienceBufferStub(channel), first)


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_a_hung_raw_client_gives_its_window_back_and_its_late_confirmation_is_refused(
    start_server: Servers, delivery: str
) -> None:
    """A client confirms its first batch, then hangs with the stream open: the two batches sent
    after it wait max_confirm_seconds (here its default, max_wait_seconds) and go back to the
    buffer as on a broken stream; the stream ends DEADLINE_EXCEEDED naming the bound, and the
    confirmation the client sends afterwards delivers nothing. Only the first batch was delivered."""
    request = {"lease_seconds": 600, "delivery": DELIVERIES[delivery], "wait_seconds": 1}
    with raw_stream(start_server, 5, {"max_wait_seconds": 1}, **request) as (_, client, talk):
        delivered = talk.read()
        talk.confirm(1)
        held = [talk.read(), talk.read()]  # received, never confirmed: the trainer hangs
        ended = talk.end()
        assert ended.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.details()
        assert "max_confirm_seconds = 1" in ended.details() and "went back to the buffer" in ended.details()
        talk.confirm(3)  # late: the stream has ended, so nothing more is delivered
        stats = settle(client, lambda s: s.leased == (2 if delivery == "lease" else 0))
        assert stats.sampled == 2 and stats.leased == (2 if delivery == "lease" else 0)
        assert stats.consumed == (2 if delivery == "consume" else 0)
        assert stats.ready == (10 if delivery == "replay" else 8)
        again = [
            tuple(batch.uids)
            for batch in client.sample("t", num_groups=1, timeout=0.5, allow_partial=True, delivery="consume")
        ]
        if delivery == "replay":  # every group is still there, the first one replayed once
            assert len(again) == 5
        else:
            assert tuple(delivered.uids) not in again and len(again) == 4
        assert {tuple(reply.uids) for reply in held} <= set(again)
        assert client.stats("t")["t"].ready == 0
        for reply in [delivered, *held]:
            assert reply.uids and len(set(reply.uids)) == 2
        if delivery == "lease":
            assert client.ack(delivered.lease_id, "t") == 2


def _window_given_back(client: BufferClient) -> None:
    """Wait until the server gave back the batches held for the stream (the first was consumed)."""
    stats = settle(client, lambda s: s.leased == 0 and s.consumed == 2)
    assert (stats.leased, stats.consumed, stats.ready) == (0, 2, 8)


def _rest(client: BufferClient) -> list[tuple[str, ...]]:
    """Every batch left, one group each, consumed."""
    batches = client.sample("t", num_groups=1, timeout=0.5, allow_partial=True, delivery="consume")
    return [tuple(batch.uids) for batch in batches]


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_trainer_that_asks_after_the_bound_is_told_and_handed_nothing(start_server: Servers, prefetch: int) -> None:
    """The caller's step outlasts the bound (max_confirm_seconds, by default max_wait_seconds):
    its next batch raises DeadlineExceededError naming the setting, at once, and hands over
    nothing the buffer holds again, whether the batch waited decoded (prefetch) or in gRPC's
    buffers; every batch but the first is sampled again, once."""
    server = start_server(max_wait_seconds=1)
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("t", group_size=2, estimator="none")
        fill(client, 5)
        batches = client.sample("t", num_groups=1, window=2, prefetch=prefetch, delivery="consume", timeout=1)
        first = next(batches)
        _window_given_back(client)  # the stuck step
        with pytest.raises(DeadlineExceededError, match="max_confirm_seconds"):
            next(batches)
        rest = _rest(client)
        assert len(rest) == len(set(rest)) == 4 and tuple(first.uids) not in rest


def test_the_asyncio_client_tells_a_late_trainer_too(start_server: Servers) -> None:
    server = start_server(max_wait_seconds=1)
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("t", group_size=2, estimator="none")
        fill(client, 5)

        async def run() -> None:
            async with AsyncBufferClient(f"127.0.0.1:{server.port}") as aclient:
                batches = aclient.sample("t", num_groups=1, window=2, delivery="consume", timeout=1)
                async with contextlib.aclosing(batches):
                    await anext(batches)
                    await asyncio.to_thread(_window_given_back, client)
                    with pytest.raises(DeadlineExceededError, match="max_confirm_seconds"):
                        await anext(batches)

        asyncio.run(run())
        assert len(_rest(client)) == 4


def test_the_bound_runs_while_the_stream_waits_for_data(start_server: Servers) -> None:
    """A batch not confirmed while the server waits for data for the next one is bounded too:
    the stream ends at max_confirm_seconds naming it, long before its wait for data would."""
    settings = {"max_confirm_seconds": 1, "max_wait_seconds": 60}
    with raw_stream(start_server, 2, settings, delivery=pb.DELIVERY_CONSUME, wait_seconds=60) as (_, client, talk):
        talk.read()
        talk.confirm(1)  # the server takes the batch after the next: no data, it waits
        held = talk.read()
        ended = talk.end()
        assert ended.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "max_confirm_seconds = 1" in ended.details()
        stats = settle(client, lambda s: s.leased == 0)
        assert (stats.consumed, stats.ready, stats.leased) == (2, 2, 0)
        assert _rest(client) == [tuple(held.uids)]


@pytest.mark.parametrize("step", [1.002, 2.0])
def test_a_stream_that_runs_dry_delivers_the_batch_it_sent_ahead_before_it_ends(
    start_server: Servers, step: float
) -> None:
    """A consume stream whose table runs dry while a batch it sent ahead waits in the client: the
    stream ends NOT_READY only once that batch is confirmed (handed to the caller) and delivered, or
    given back with a client that stops. It ended at the end of the wait for data and gave the batch
    back, while the client, the status not yet come, handed it to its caller and confirmed it too
    late (a step just past the wait): trained on, and then delivered again to the next consumer."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("t", group_size=2, estimator="none")
        fill(client, 2)
        trained: list[str] = []
        with pytest.raises(DeadlineExceededError, match="did not have 1 group ready within 1s"):
            for batch in client.sample("t", num_groups=1, delivery="consume", timeout=1.0):  # window 2, prefetch 1
                trained += batch.uids
                time.sleep(step)  # a training step, past the wait for data
        stats = settle(client, lambda s: s.leased == 0)
        assert len(trained) == 4 and (stats.consumed, stats.ready) == (4, 0)
        assert _rest(client) == []


def test_the_bound_is_a_step_not_the_time_since_a_batch_was_sent(start_server: Servers) -> None:
    """With a window of 4 each batch is sent about three steps before the caller takes it,
    longer than the bound: counted from the confirmation before it, each step (well within
    the bound) is in time, and the stream runs far longer than the bound."""
    server = start_server(max_confirm_seconds=3)
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("t", group_size=2, estimator="none")
        fill(client, 6)
        seen = []
        for batch in client.sample("t", num_groups=1, window=4, prefetch=0, max_batches=6, delivery="consume"):
            assert batch.confirm_seconds >= 3
            seen.append(tuple(batch.uids))
            time.sleep(1.0)  # the step
        assert len(set(seen)) == 6
        assert client.stats("t")["t"].consumed == 12


def test_each_reply_says_how_long_its_batch_may_wait_from_the_confirmation_before(start_server: Servers) -> None:
    """confirm_seconds is max_confirm_seconds for a batch sent before the confirmation of the
    one before it, and that plus the time since that confirmation for one sent after it (here:
    the server waited for data)."""
    settings = {"max_confirm_seconds": 30}
    with raw_stream(start_server, 2, settings, delivery=pb.DELIVERY_CONSUME, wait_seconds=30) as (_, client, talk):
        replies = [talk.read(), talk.read()]  # both sent before any confirmation
        talk.confirm(2)
        time.sleep(0.5)  # the server waits for data for the third
        client.push(trxp.build(group_items(1, 7, 2)), table="t")
        replies.append(talk.read())
        talk.confirm(3)
        talk.cancel()
        assert replies[1].confirm_seconds == 30
        assert 30 <= replies[0].confirm_seconds < 40  # sent right after the first message
        assert replies[2].confirm_seconds > 30


def _lease_end(server: ExpbufServer, lease_id: str) -> float | None:
    """When the server's store has a lease end (None while it is held, its clock not started)."""
    with server.store.environment.read() as txn:
        raw = txn.get(lease_id.encode(), db=server.store.db["leases"])
    return None if raw is None else decode_lease(raw).expires


def test_a_raw_client_that_confirms_late_is_told_how_long_its_lease_runs(start_server: Servers) -> None:
    """A raw client confirms a leased batch after the reply's lease_expires_unix has passed:
    that value is the earliest the lease can end, as documented, and the reply's lease_seconds,
    counted on the client's clock from when it sent the confirmation, gives an end no later
    than the lease's true one."""
    request = {"delivery": pb.DELIVERY_LEASE, "lease_seconds": 1, "wait_seconds": 30}
    with raw_stream(start_server, 3, {}, **request) as (server, _, talk):
        talk.read()
        talk.confirm(1)
        second = talk.read()
        while time.time() <= second.lease_expires_unix:  # the client is busy with the first batch
            time.sleep(0.05)
        sent = time.time()
        talk.confirm(2)  # the server waits for data for the fourth batch: it starts this lease at once
        deadline = time.monotonic() + 10
        while (end := _lease_end(server, second.lease_id)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        talk.cancel()
        assert second.lease_seconds == 1
        assert second.lease_expires_unix < sent
        assert end is not None and end >= sent + second.lease_seconds


class PatientSampler(pb_grpc.ExperienceBufferServicer):
    """Sends two batches whose replies give 1 s for each confirmation, never ends the stream
    itself, and records what the client confirms."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.ended = threading.Event()

    def Sample(self, requests: Iterator[pb.SampleRequest], context: grpc.ServicerContext) -> Iterator[pb.SampleReply]:
        next(requests)
        for task in range(2):
            uids = [f"1/{task}/{run}/0/" for run in range(2)]
            payload = trxp.build(group_items(1, task, 2))
            yield pb.SampleReply(payload=payload, uids=uids, group_ids=[f"1/{task}"] * 2, confirm_seconds=1)
        for request in requests:
            self.received.append(request.received)
            if request.stop:
                break
        self.ended.set()


@pytest.mark.parametrize(("asynchronous", "prefetch"), [(False, 0), (False, 1), (True, 0), (True, 1)])
def test_the_client_never_hands_over_a_batch_its_confirmation_would_reach_too_late(
    asynchronous: bool, prefetch: int
) -> None:
    """Past a batch's confirm_seconds from the confirmation before it (less a margin for the
    confirmation's way), the client raises DeadlineExceededError itself rather than hand over
    a batch the server may have given back, even before any status from the server; it ends
    the stream, its last confirmation counting only the batch it handed over."""
    servicer = PatientSampler()
    with serving(servicer) as target:
        with pytest.raises(DeadlineExceededError) as info:
            if asynchronous:

                async def run() -> None:
                    async with AsyncBufferClient(target) as aclient:
                        batches = aclient.sample("t", num_groups=1, window=2, prefetch=prefetch)
                        async with contextlib.aclosing(batches):
                            await anext(batches)
                            await asyncio.sleep(1.5)  # the step, past the bound
                            await anext(batches)

                asyncio.run(run())
            else:
                with BufferClient(target) as bclient:
                    batches = bclient.sample("t", num_groups=1, window=2, prefetch=prefetch)
                    next(batches)
                    time.sleep(1.5)
                    try:
                        next(batches)
                    finally:
                        batches.close()
        assert "too late for the server, which waits 1s for its confirmation (max_confirm_seconds" in str(info.value)
        assert "was not handed over and goes back to the buffer" in str(info.value)
        assert servicer.ended.wait(10)
        assert servicer.received and max(servicer.received) == 1  # the first batch only


def test_max_confirm_seconds_comes_from_the_settings_and_defaults_to_max_wait_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ServerConfig().confirm_seconds == 600
    assert ServerConfig(max_wait_seconds=30).confirm_seconds == 30
    assert ServerConfig(max_wait_seconds=30, max_confirm_seconds=900).confirm_seconds == 900
    for bad in (0, -1, 86401, "60", True):
        with pytest.raises(ConfigError, match=r"max_confirm_seconds must be a number"):
            ServerConfig(max_confirm_seconds=bad)
    config_file = tmp_path / "expbuf.toml"
    config_file.write_text("max_confirm_seconds = 1800\n")
    assert load(str(config_file)).confirm_seconds == 1800
    monkeypatch.setenv("EXPBUF_MAX_CONFIRM_SECONDS", "45")
    assert load(str(config_file)).confirm_seconds == 45
