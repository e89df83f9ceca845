"""Calls that wait or send nothing, in numbers, against an `expbuf serve` child: they never
lock out the calls that keep rollouts and trainers going.

The server runs with 16 workers and every cap on a class of waiting calls raised to its
highest (workers - 1). With no workers kept for either scope, only the reserve of workers
kept for calls that do not wait idle stands between the idle calls and a lock-out: each
case opens more idle calls than there are workers, those beyond the other workers are
refused at once, naming the reserve, and a push, an ack of a lease taken before, Stats, an
admin call and the health check are all answered. With a share of the workers kept for each
scope, one scope's calls at their worst (idle, waiting, blocked) leave the other scope its
share: trainers still open Sample streams and read, rollout workers still push. With the
default settings, pushes blocked on a full table leave trainers their whole share, and a fleet
of rollout workers running the prompt ledger's loop, more than the claims the server lets wait,
gets every prompt while pushes and samples get through.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from expbuf.client import BufferClient, trxp
from expbuf.client.rpc.connection import DEFAULT_PUSH_CHUNK_BYTES
from expbuf.client.rpc.frames import most_push_request
from expbuf.client.rpc.wire import BUSY
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.rpc.interceptors.limits import RESERVED_THREADS
from expbuf.server.rpc.interceptors.reflection import REFLECTION_STREAMS

from faultkit import channel, healthy, payload, sample_all, stats, stub
from helpers import ServerProcess, group_items, make_experience, scrape, wait_for, wait_ready
from pages import code_blocks, page

pytestmark = pytest.mark.faults

WORKERS = 16
RESERVED = 2  # the default: an eighth of the workers
RAISED_CAPS = {
    "EXPBUF_WORKERS": str(WORKERS),
    "EXPBUF_MAX_SAMPLE_STREAMS": str(WORKERS - 1),
    "EXPBUF_MAX_TABLE_STREAMS": str(WORKERS - 1),
    "EXPBUF_MAX_PUSH_STREAMS": str(WORKERS - 1),
    "EXPBUF_MAX_WAITING_ADMITS": str(WORKERS - 1),
    "EXPBUF_MAX_WAITING_CLAIMS": str(WORKERS - 1),
}
NO_SHARES = {"EXPBUF_PUSH_SCOPE_WORKERS": "0", "EXPBUF_SAMPLE_SCOPE_WORKERS": "0"}
SHARE = 6  # workers kept for each scope in the share cases
SHARES = {**RAISED_CAPS, "EXPBUF_PUSH_SCOPE_WORKERS": str(SHARE), "EXPBUF_SAMPLE_SCOPE_WORKERS": str(SHARE)}


MESSAGE_BYTES = "expbuf-message-bytes"  # the call metadata in which a client declares its messages' largest size
PUSHER_MESSAGE = most_push_request(DEFAULT_PUSH_CHUNK_BYTES, "default")  # what a pusher's stream declares


def idle_push_stream(
    buffer: pb_grpc.ExperienceBufferStub, holds: list[queue.SimpleQueue], declared: int = 0
) -> grpc.Call:
    """A PushStream that sends nothing until its queue is given None; with `declared`, one that
    declared its messages' largest size, as expbuf's clients do (a chunk's)."""
    hold: queue.SimpleQueue = queue.SimpleQueue()
    holds.append(hold)
    metadata = ((MESSAGE_BYTES, str(declared)),) if declared else ()
    return buffer.PushStream(iter(hold.get, None), timeout=60, metadata=metadata)


def waiting_sample(buffer: pb_grpc.ExperienceBufferStub, holds: list[queue.SimpleQueue]) -> grpc.Call:
    """A Sample stream waiting for data on the empty table."""
    hold: queue.SimpleQueue = queue.SimpleQueue()
    hold.put(pb.SampleRequest(table="empty", num_groups=1, delivery=pb.DELIVERY_CONSUME, wait_seconds=30))
    holds.append(hold)
    return buffer.Sample(iter(hold.get, None), timeout=60)


def waiting_admit(buffer: pb_grpc.ExperienceBufferStub, holds: list[queue.SimpleQueue]) -> grpc.Future:
    """An Admit waiting for room on the full table."""
    return buffer.Admit.future(pb.AdmitRequest(table="full", count=1, wait_seconds=30), timeout=60)


_blocked = itertools.count()


def blocked_push(buffer: pb_grpc.ExperienceBufferStub, holds: list[queue.SimpleQueue]) -> grpc.Future:
    """A Push waiting for room on the full table `blocking` (see blocking_table)."""
    data, _ = payload("wait", next(_blocked))
    return buffer.Push.future(pb.PushRequest(table="blocking", payload=data), timeout=60)


def blocking_table(target: str) -> str:
    """The table `blocking`, full, where pushes wait for room; the uid of one experience it holds."""
    with BufferClient(target) as client:
        client.create_table("blocking", capacity_experiences=4, when_full="block")
    with channel(target) as chan:
        data, uids = payload("fill", 0)
        stub(chan).Push(pb.PushRequest(table="blocking", payload=data), timeout=30)
    return uids[0]


def settled(calls: list[grpc.Future], accepted: int, what: str, workers: int = WORKERS) -> list[grpc.Future]:
    """The calls refused (RESOURCE_EXHAUSTED, which comes at once; an accepted call waits) once all
    but `accepted` of `calls` are; fails naming `what` when another number is accepted."""

    def refused() -> list[grpc.Future]:
        return [call for call in calls if call.done() and call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]

    deadline = time.monotonic() + 20
    while len(refused()) < len(calls) - accepted and time.monotonic() < deadline:
        time.sleep(0.1)
    found = refused()
    assert len(found) == len(calls) - accepted, (
        f"{what}: {len(calls) - len(found)} of {len(calls)} accepted on {workers} workers, {accepted} expected"
    )
    return found


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
        wait_for(lambda: stats(buffer, "leased").ready, "the group pushed computed")  # once torch has loaded
        request = pb.SampleRequest(
            table="leased", num_groups=1, delivery=pb.DELIVERY_LEASE, lease_seconds=120, max_batches=1, wait_seconds=10
        )
        (reply,) = sample_all(buffer, request, timeout=30)
        return reply.lease_id


CASES = {
    "80 idle PushStreams": [(idle_push_stream, WORKERS + 4)],
    # Each holds what a pusher declares by default (a 4 MiB chunk's message) of max_inflight_bytes for
    # its read, from its start until its message comes: those let in hold 56 MiB of the 1 GiB.
    "80 idle PushStreams that declared a pusher's messages": [
        (functools.partial(idle_push_stream, declared=PUSHER_MESSAGE), WORKERS + 4)
    ],
    "60 waiting Samples and 20 idle PushStreams": [(waiting_sample, 12), (idle_push_stream, 5)],
    "70 Admit(wait=30) on a full table": [(waiting_admit, WORKERS + 2)],
}


@pytest.mark.parametrize("case", CASES)
def test_idle_calls_leave_push_ack_and_stats_answered(
    tmp_path: Path, serve: Callable[..., ServerProcess], case: str
) -> None:
    server = serve(str(tmp_path / "data"), env=RAISED_CAPS | NO_SHARES)
    lease_id = held_lease(server.target)
    holds: list[queue.SimpleQueue] = []
    with channel(server.target) as chan:
        buffer = stub(chan)
        calls = [opener(buffer, holds) for opener, count in CASES[case] for _ in range(count)]
        try:
            refused = settled(calls, WORKERS - RESERVED, f"{case} (all but the reserve)")
            for call in refused:
                assert f"reserved_workers = {RESERVED}" in call.details(), call.details()
            try:
                data, uids = payload("during", 0)
                request = pb.PushRequest(table="default", payload=data)
                declared = ((MESSAGE_BYTES, str(request.ByteSize())),)
                pushed = buffer.Push(request, timeout=10, metadata=declared)
                acked = buffer.Ack(pb.AckRequest(table="leased", lease_id=lease_id), timeout=10)
                tables = buffer.Stats(pb.StatsRequest(), timeout=10).tables
                buffer.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="made")), timeout=10)
                assert healthy(chan)
            except grpc.RpcError as exc:
                pytest.fail(
                    f"{case}: Push, Ack, Stats, CreateTable or Health refused: {exc.code().name}: {exc.details()}"
                )
            assert list(pushed.stored_uids) == uids
            assert acked.acked
            assert {t.name for t in tables} >= {"default", "leased", "empty", "full"}
            assert not any(call.done() for call in calls if call not in refused), "an accepted idle call ended"
        finally:
            for hold in holds:
                hold.put(None)
            for call in calls:
                call.cancel()


def idle_reflection(chan: grpc.Channel, holds: list[queue.SimpleQueue]) -> grpc.Call:
    """A server-reflection stream (grpcurl's, open to any client) that sends nothing."""
    hold: queue.SimpleQueue = queue.SimpleQueue()
    holds.append(hold)
    return reflection_pb2_grpc.ServerReflectionStub(chan).ServerReflectionInfo(iter(hold.get, None), timeout=60)


def test_idle_reflection_streams_leave_every_call_answered(tmp_path: Path, serve: Callable[..., ServerProcess]) -> None:
    """Reflection is open to every client and its stream holds a thread while open: 70 idle ones
    from a client with no token took every thread and nothing was answered, health checks
    included. All but REFLECTION_STREAMS are refused; a push, Stats, health, and reflection once
    they end, are answered."""
    server = serve(str(tmp_path / "data"), env=RAISED_CAPS | NO_SHARES)
    holds: list[queue.SimpleQueue] = []
    with channel(server.target) as chan:
        buffer = stub(chan)
        calls = [idle_reflection(chan, holds) for _ in range(WORKERS + RESERVED_THREADS)]
        try:
            refused = settled(calls, REFLECTION_STREAMS, "idle reflection streams")
            assert "reflection streams are open" in refused[0].details()
            data, uids = payload("during", 0)
            assert list(buffer.Push(pb.PushRequest(table="default", payload=data), timeout=10).stored_uids) == uids
            assert {t.name for t in buffer.Stats(pb.StatsRequest(), timeout=10).tables} >= {"default"}
            assert healthy(chan)
            for call in calls:
                call.cancel()
            listed = reflection_pb2.ServerReflectionRequest(list_services="")

            def listing() -> set[str]:
                asked = reflection_pb2_grpc.ServerReflectionStub(chan).ServerReflectionInfo(iter([listed]), timeout=10)
                try:
                    return {service.name for reply in asked for service in reply.list_services_response.service}
                except grpc.RpcError as exc:  # the streams cancelled may not have ended yet
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    return set()

            wait_for(lambda: "expbuf.v1.ExperienceBuffer" in listing(), "reflection answered once its streams ended")
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


def test_pushes_blocked_on_a_full_table_leave_acks_stats_and_admin_answered(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """With no workers kept for the trainers, pushes that wait for room take every worker but the
    reserve (a push that must wait is a call that waits idle): the trainer's ack, which makes room,
    a Get, Stats and admin calls are still answered."""
    server = serve(str(tmp_path / "data"), env={"EXPBUF_WORKERS": str(WORKERS)} | NO_SHARES)
    lease_id = held_lease(server.target)
    uid = blocking_table(server.target)
    with channel(server.target) as chan:
        buffer = stub(chan)
        calls = [blocked_push(buffer, []) for _ in range(WORKERS + 2)]
        try:
            for call in settled(calls, WORKERS - RESERVED, "pushes blocked on a full table"):
                assert (
                    f"reserved_workers = {RESERVED}" in call.details() or f"all workers = {WORKERS}" in call.details()
                )
            try:
                got = buffer.Get(pb.GetRequest(table="blocking", uids=[uid]), timeout=10)
                acked = buffer.Ack(pb.AckRequest(table="leased", lease_id=lease_id), timeout=10)
                blocking = buffer.Stats(pb.StatsRequest(table="blocking"), timeout=10).tables[0]
                buffer.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="made")), timeout=10)
                assert healthy(chan)
            except grpc.RpcError as exc:
                pytest.fail(
                    f"Get, Ack, Stats, CreateTable or Health refused while pushes wait: {exc.code().name}: "
                    f"{exc.details()}"
                )
            assert got.payload and not got.missing_uids
            assert acked.acked
            assert blocking.pushed == 4
        finally:
            for call in calls:
                call.cancel()


def test_push_scope_at_its_worst_leaves_trainers_their_share(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """Idle PushStreams, waiting Admits and pushes blocked on a full table, as many as the push
    scope may hold: trainers still open Sample streams, and Get, ListTables, Ack, Stats, an admin
    call and the health check are answered."""
    server = serve(str(tmp_path / "data"), env=SHARES)
    lease_id = held_lease(server.target)
    uid = blocking_table(server.target)
    holds: list[queue.SimpleQueue] = []
    calls: list[grpc.Future] = []
    # (what, opener, opened, accepted): the idle calls leave the reserve and the trainers' share, and so
    # do pushes that must wait for room (they are refused as they would start to); the trainers' Sample
    # streams then take their whole share, leaving the reserve to the calls that answer at once.
    steps = [
        ("idle PushStreams", idle_push_stream, 20, WORKERS - RESERVED - SHARE, f"sample_scope_workers = {SHARE}"),
        ("waiting Admits", waiting_admit, 20, 0, f"sample_scope_workers = {SHARE}"),
        ("blocked pushes", blocked_push, 20, 0, f"sample_scope_workers = {SHARE}"),
        ("trainer Sample streams", waiting_sample, 60, SHARE, f"reserved_workers = {RESERVED}"),
    ]
    with channel(server.target) as chan:
        buffer = stub(chan)
        try:
            for what, opener, count, accepted, setting in steps:
                opened = [opener(buffer, holds) for _ in range(count)]
                calls += opened
                for call in settled(opened, accepted, what):
                    assert setting in call.details(), (what, call.details())
            try:
                got = buffer.Get(pb.GetRequest(table="blocking", uids=[uid]), timeout=10)
                listed = buffer.ListTables(pb.ListTablesRequest(), timeout=10).tables
                acked = buffer.Ack(pb.AckRequest(table="leased", lease_id=lease_id), timeout=10)
                tables = buffer.Stats(pb.StatsRequest(), timeout=10).tables
                buffer.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="made")), timeout=10)
                assert healthy(chan)
            except grpc.RpcError as exc:
                pytest.fail(f"a trainer's or admin call refused: {exc.code().name}: {exc.details()}")
            assert got.payload and not got.missing_uids
            assert {t.name for t in listed} >= {"blocking", "leased"}
            assert acked.acked
            assert {t.name for t in tables} >= {"blocking", "leased"}
            refused = [call for call in calls if call.done()]
            assert len(refused) == len(calls) - (WORKERS - RESERVED), "an accepted call ended"
        finally:
            for hold in holds:
                hold.put(None)
            for call in calls:
                call.cancel()


def test_sample_scope_at_its_worst_leaves_pushers_their_share(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """Trainer Sample streams waiting for data, as many as the sample scope may hold: rollout workers
    still open their share of PushStreams and push through them, and Push, Admit, Writers, Ack,
    Stats, an admin call and the health check are answered."""
    server = serve(str(tmp_path / "data"), env=SHARES)
    lease_id = held_lease(server.target)
    holds: list[queue.SimpleQueue] = []
    calls: list[grpc.Future] = []
    steps = [
        ("trainer Sample streams", waiting_sample, 60, WORKERS - RESERVED - SHARE, f"push_scope_workers = {SHARE}"),
        ("idle PushStreams", idle_push_stream, 20, SHARE, f"reserved_workers = {RESERVED}"),
    ]
    with channel(server.target) as chan:
        buffer = stub(chan)
        try:
            for what, opener, count, accepted, setting in steps:
                opened = [opener(buffer, holds) for _ in range(count)]
                calls += opened
                for call in settled(opened, accepted, what):
                    assert setting in call.details(), (what, call.details())
            streaming, hold = next(
                (call, hold) for call, hold in zip(calls[-20:], holds[-20:], strict=True) if not call.done()
            )
            data, uids = payload("streamed", 0)
            hold.put(pb.PushRequest(table="default", payload=data, seq=1))
            try:
                streamed = next(streaming)
                data, pushed_uids = payload("during", 0)
                pushed = buffer.Push(pb.PushRequest(table="default", payload=data), timeout=10)
                admitted = buffer.Admit(pb.AdmitRequest(table="full", count=1), timeout=10)
                writers = buffer.Writers(pb.WritersRequest(table="default"), timeout=10)
                acked = buffer.Ack(pb.AckRequest(table="leased", lease_id=lease_id), timeout=10)
                buffer.Stats(pb.StatsRequest(), timeout=10)
                buffer.CreateTable(pb.CreateTableRequest(config=pb.TableConfig(name="made")), timeout=10)
                assert healthy(chan)
            except grpc.RpcError as exc:
                pytest.fail(f"a rollout worker's or admin call refused: {exc.code().name}: {exc.details()}")
            assert (streamed.seq, list(streamed.stored_uids)) == (1, uids)
            assert list(pushed.stored_uids) == pushed_uids
            assert admitted.granted == 0  # the table has no room: answered, not refused
            assert writers.open == 0
            assert acked.acked
            refused = [call for call in calls if call.done()]
            assert len(refused) == len(calls) - (WORKERS - RESERVED), "an accepted call ended"
        finally:
            for hold in holds:
                hold.put(None)
            for call in calls:
                call.cancel()


def trainer_stream(buffer: pb_grpc.ExperienceBufferStub, holds: list[queue.SimpleQueue]) -> grpc.Call:
    """A trainer's Sample stream on the table `ready`: once let in, it gets a batch at once and holds
    its worker while the batch is unconfirmed (the trainer's step)."""
    hold: queue.SimpleQueue = queue.SimpleQueue()
    hold.put(pb.SampleRequest(table="ready", num_groups=1, delivery=pb.DELIVERY_CONSUME, wait_seconds=10))
    holds.append(hold)
    return buffer.Sample(iter(hold.get, None), timeout=60)


def test_pushes_blocked_on_a_full_table_leave_trainers_their_whole_share(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """With the default 64 workers, pushes that wait for room in a full table are waiting calls:
    they take at most what the push scope's waiting calls may (the workers less the reserve and the
    trainers' share), and 12 trainers all open their Sample streams beside 80 of them. Each push
    refused, whether as it came or as it would have waited, says it did nothing (wire.BUSY), so
    its client pushes it again."""
    workers, reserved, share = 64, 8, 16  # the defaults
    server = serve(str(tmp_path / "data"))
    lease_id = held_lease(server.target)
    uid = blocking_table(server.target)
    with BufferClient(server.target) as client:
        client.create_table("ready")
    holds: list[queue.SimpleQueue] = []
    with channel(server.target) as chan:
        buffer = stub(chan)
        for task in range(12):
            buffer.Push(pb.PushRequest(table="ready", payload=payload("ready", task)[0]), timeout=30)
        pushes = [blocked_push(buffer, []) for _ in range(80)]
        trainers: list[grpc.Call] = []
        try:
            for call in settled(pushes, workers - reserved - share, "80 pushes blocked on a full table", workers):
                assert f"sample_scope_workers = {share}" in call.details(), call.details()
                assert (BUSY, "1") in (call.trailing_metadata() or ()), f"not marked as having done nothing: {call}"
            trainers = [trainer_stream(buffer, holds) for _ in range(12)]
            try:
                batches = [next(stream) for stream in trainers]  # a refused stream raises its refusal
                got = buffer.Get(pb.GetRequest(table="blocking", uids=[uid]), timeout=10)
                acked = buffer.Ack(pb.AckRequest(table="leased", lease_id=lease_id), timeout=10)
            except grpc.RpcError as exc:
                pytest.fail(f"a trainer's call refused beside blocked pushes: {exc.code().name}: {exc.details()}")
            assert len({reply.group_ids[0] for reply in batches}) == 12
            assert got.payload and acked.acked
        finally:
            for hold in holds:
                hold.put(None)
            for call in pushes + trainers:
                call.cancel()


def refused_claims(server: ServerProcess) -> float:
    """Claims the server refused RESOURCE_EXHAUSTED, by its own metrics."""
    return sum(
        value
        for (name, labels), value in scrape(server.metrics_port).items()
        if name == "expbuf_rpc_duration_seconds_count"
        and dict(labels) == {"method": "Claim", "code": "RESOURCE_EXHAUSTED"}
    )


def test_a_fleet_running_the_ledger_pages_loop_gets_every_prompt_while_pushes_and_samples_get_through(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """40 rollout workers run the loop of concepts/prompt-ledger.md against a server of the default
    64 workers: the claims beyond those the server lets wait at once are refused and asked again
    by their clients; every worker's loop ends, every prompt is trained once, and pushes (whole and
    in chunks) and samples get through while the claims wait."""
    server = serve(str(tmp_path / "data"))
    code = code_blocks(page("concepts/prompt-ledger.md"), "python")[0]
    scope: dict[str, Any] = {
        "generate": lambda index, n: [make_experience(0, index, run, reward=float(run)) for run in range(n)],
        "train_step": lambda experiences: None,
    }
    exec(compile(code[: code.index("\nwith BufferClient(")], "concepts/prompt-ledger.md", "exec"), scope)
    table, dataset, size = scope["TABLE"], scope["DATASET"], 64
    errors: list[BaseException] = []

    def rollout_worker() -> None:
        try:
            with BufferClient(server.target) as client:
                scope["rollout_worker"](client)
        except BaseException as exc:
            errors.append(exc)

    with BufferClient(server.target, timeout=30) as client:
        client.create_table(table, group_size=8)
        client.create_dataset(table, dataset, size, max_in_flight=8)
        client.create_table("other")
        fleet = [threading.Thread(target=rollout_worker) for _ in range(40)]
        for worker in fleet:
            worker.start()
        deadline = time.monotonic() + 60
        while not (refused_claims(server) and client.ledger(table, dataset).total("generated") == 8):
            assert time.monotonic() < deadline, "the fleet's claims never filled what the server lets wait"
            assert not errors, errors
            time.sleep(0.1)
        # The claims wait for prompts the trainer has not freed: pushes and samples meanwhile.
        whole, uids = payload("during", 0)
        assert client.push(whole, table="other").stored == uids
        large = trxp.build(group_items("chunked", 0, 2, response=8000))
        with BufferClient(server.target, push_chunk_bytes=1 << 16) as chunked:
            assert len(chunked.push(large, table="other").stored) == 2
        wait_ready(client, "other", 6)  # torch may still load: the fleet's first push began it
        sampled = next(client.sample("other", num_groups=2, max_batches=1, timeout=10, delivery="consume"))
        assert len(sampled.uids) == 6
        scope["trainer"](client)
        for worker in fleet:
            worker.join(120)
        assert not errors, errors
        assert not any(worker.is_alive() for worker in fleet)
        info = client.ledger(table, dataset)
    assert info.done and info.total("trained") == size
