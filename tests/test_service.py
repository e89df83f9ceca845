"""The ExperienceBuffer service over real gRPC on loopback, with real LMDB."""

from __future__ import annotations

import asyncio
import pickle
import queue
import signal
import socket
import struct
import threading
import time
import types
from collections import Counter
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import safetensors.torch
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from expbuf.client import AsyncBufferClient, BufferClient, BufferError, trxp
from expbuf.client.errors import AlreadyExistsError, NotFoundError
from expbuf.client.torch import ExperienceDataset
from expbuf.server.app import ExpbufServer
from expbuf.server.rpc.call_context import remaining
from expbuf.server.rpc.interceptors.base import Interceptors
from expbuf.server.rpc.interceptors.reflection import ReflectionLimits
from expbuf.server.rpc.servicers import tables as tables_servicer

from conftest import BAD_DIR, BAD_README, MANIFEST, Servers, payload
from helpers import ServerProcess, check_against_manifest, group_items, make_experience, wait_for


@pytest.fixture
def server(start_server: Servers) -> ExpbufServer:
    return start_server(max_message_bytes=4 << 20)


def encode_items(items: list[trxp.RawItem]) -> bytes:
    return trxp.build(items)


def test_every_fixture_round_trips(client: BufferClient) -> None:
    for index, (name, want) in enumerate(sorted(MANIFEST["payloads"].items())):
        table = f"t{index}"
        client.create_table(table, group_by="none", estimator="none")  # the manifest has no advantages
        result = client.push(payload(name), table=table)
        assert result.stored == [item["uid"] for item in want["items"]]
        if not want["items"]:
            continue
        batch = next(client.sample(table, batch_size=len(want["items"]), delivery="replay", timeout=5))
        assert batch.uids == result.stored
        for exp, item in zip(batch.experiences, want["items"], strict=True):
            check_against_manifest(exp, item)
        for exp, item in zip(client.get(result.stored, table=table), want["items"], strict=True):
            check_against_manifest(exp, item)


def test_sampled_payload_reads_with_pickle_and_safetensors(client: BufferClient) -> None:
    """What Trinity-RFT's Experience.deserialize_many does with a batch."""
    client.push(payload("mixed_batch.trxp"))
    batch = next(client.sample(num_groups=2, delivery="consume"))
    _, _, meta_len, _ = struct.unpack_from("<4sBQQ", batch.payload)
    meta = pickle.loads(batch.payload[21 : 21 + meta_len])
    tensors = safetensors.torch.load(batch.payload[21 + meta_len :])
    assert meta["num_items"] == 8 and len(tensors) == 8 * 5  # tokens, logprobs, mask, advantages, returns
    assert torch.allclose(tensors["1:advantages"], torch.full((6,), 0.5 / (0.5773503 + 1e-6)))
    assert [i["eid"]["run"] for i in meta["items"]] == [0, 1, 2, 3] * 2


def test_groups_are_whole_and_complete(client: BufferClient) -> None:
    client.create_table("g4", group_size=4)
    items = trxp.parse(payload("grpo_group.trxp"))
    client.push(encode_items(items[:3]), table="g4")
    with pytest.raises(BufferError) as info:
        next(client.sample("g4", num_groups=1, timeout=0.2, delivery="consume"))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not have 1 group ready" in info.value.details
    client.push(payload("mixed_batch.trxp"), table="g4")
    batch = next(client.sample("g4", num_groups=2, delivery="consume"))
    assert Counter(batch.group_ids) == {"11/0": 4, "11/1": 4}
    assert batch.groups == ["11/0", "11/1"] or batch.groups == ["11/1", "11/0"]
    with pytest.raises(BufferError, match="group 7/3 has 3 of 4 experiences; 2 more would overfill it"):
        client.push(encode_items(items[3:5]), table="g4")
    assert client.push(encode_items(items[3:4]), table="g4").completed_groups == ["7/3"]
    client.push(encode_items(group_items(8, 0, 2)), table="g4")
    assert client.seal("8/0", table="g4") == 2
    batch = next(client.sample("g4", batch_size=5, delivery="consume"))
    assert batch.group_ids == ["7/3"] * 4 + ["8/0"] * 2 and batch.groups == ["7/3", "8/0"]


def test_concurrent_trainers_receive_every_experience_once(client: BufferClient, server: ExpbufServer) -> None:
    target = f"127.0.0.1:{server.port}"
    pushers, per_pusher, group = 4, 15, 4
    expected = pushers * per_pusher * group
    received: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def push(worker: int) -> None:
        with BufferClient(target) as c:
            for task in range(per_pusher):
                c.push(encode_items(group_items(worker, task, group)))

    def train() -> None:
        try:
            with BufferClient(target) as c:
                for batch in c.sample(num_groups=2, timeout=3, allow_partial=True, delivery="consume"):
                    with lock:
                        received.extend(batch.uids)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(w,)) for w in range(pushers)]
    threads += [threading.Thread(target=train) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert len(received) == expected and len(set(received)) == expected


def test_lease_expires_and_survives_restart(start_server: Servers) -> None:
    srv = start_server()
    target = f"127.0.0.1:{srv.port}"
    with BufferClient(target) as c:
        c.push(payload("mixed_batch.trxp"))
        leased = next(c.sample(num_groups=1, delivery="lease", lease_seconds=1.0, max_batches=1))
        acked = next(c.sample(num_groups=1, delivery="lease", lease_seconds=1.0, max_batches=1))
        assert acked.ack() == 4
    srv.stop(grace=1)
    srv = start_server()
    with BufferClient(f"127.0.0.1:{srv.port}") as c:
        back = next(c.sample(num_groups=1, delivery="lease", timeout=10, max_batches=1))
        assert back.uids == leased.uids
        back.nack()
        again = next(c.sample(num_groups=1, timeout=5, max_batches=1, delivery="consume"))
        assert again.uids == leased.uids
        with pytest.raises(BufferError) as info:
            next(c.sample(num_groups=1, timeout=1.5, delivery="consume"))
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert c.stats()["default"].leases_expired == 1


def test_retried_push_is_idempotent(client: BufferClient) -> None:
    first = client.push(payload("grpo_group.trxp"))
    again = client.push(payload("grpo_group.trxp"))
    assert again.stored == [] and again.duplicates == first.stored
    changed = trxp.parse(payload("grpo_group.trxp"))
    changed[0].meta["reward"] = 0.5
    with pytest.raises(BufferError) as info:
        client.push(encode_items(changed))
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert "7/3/0/0/r0s0t3" in info.value.details
    assert client.stats()["default"].pushed == 8


@pytest.mark.parametrize("name", sorted(BAD_README))
def test_bad_payload_is_refused_and_server_stays_healthy(client: BufferClient, server: ExpbufServer, name: str) -> None:
    with pytest.raises(BufferError) as info:
        client.push((BAD_DIR / name).read_bytes())
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details
    stats = client.stats()["default"]
    assert stats.pushed == 0 and stats.ready == 0
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert client.push(payload("single_turn.trxp")).stored == ["0/0/0/0/r0s0t0"]


def test_oversized_message_is_refused_clearly(client: BufferClient) -> None:
    big = encode_items(group_items(1, 0, 1, response=2 << 20))
    with pytest.raises(BufferError) as info:
        client.push(big)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in info.value.details


def test_full_table_blocks_then_refuses(client: BufferClient) -> None:
    client.create_table("small", capacity_experiences=4)
    client.push(encode_items(group_items(1, 0, 4)), table="small")
    with pytest.raises(BufferError) as info:
        client.push(encode_items(group_items(1, 1, 2)), table="small", timeout=0.5)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "is full" in info.value.details


def test_push_stream_acknowledges_each_commit(client: BufferClient, server: ExpbufServer) -> None:
    from expbuf.proto.v1 import buffer_pb2 as pb
    from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        requests = (pb.PushRequest(payload=encode_items(group_items(2, t, 2)), seq=t + 100) for t in range(5))
        replies = list(stub.PushStream(requests, timeout=10))
    assert [r.seq for r in replies] == [100, 101, 102, 103, 104]
    assert all(len(r.stored_uids) == 2 for r in replies)
    assert client.stats()["default"].pushed == 10


def test_admin_calls(client: BufferClient) -> None:
    settings = {"group_size": 2, "max_times_sampled": 2, "when_full": "evict", "capacity_experiences": 100}
    created = client.create_table("replay", **settings)
    assert created.max_times_sampled == 2 and created.capacity_experiences == 100
    old_name = settings | {"capacity": settings.pop("capacity_experiences")}  # the old name: warned, still read
    with pytest.warns(FutureWarning, match="capacity is the old name of capacity_experiences"):
        assert client.create_table("replay", exist_ok=True, **old_name) == created
    settings["capacity_experiences"] = 100
    with pytest.raises(ValueError, match="both capacity and capacity_experiences"):
        client.create_table("replay", exist_ok=True, **settings, capacity=100)
    assert client.create_table("replay", exist_ok=True, **settings) == created
    with pytest.raises(BufferError) as info:
        client.create_table("replay")
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    other = settings | {"group_size": 4, "when_full": "block", "shaping": {"advantage_clip": 2.0}}
    with pytest.raises(AlreadyExistsError) as info:  # exist_ok takes the same settings only: it names each other one
        client.create_table("replay", exist_ok=True, **other)
    assert info.value.details == (
        "table 'replay' already exists with other settings: group_size: the table has 2, the request 4; "
        "when_full: the table has 'evict', the request 'block'; "
        "shaping.advantage_clip: the table has 0.0, the request 2.0"
    )
    with pytest.raises(ValueError, match="group_by is 'episode'"):
        client.create_table("bad", group_by="episode")
    with pytest.raises(BufferError) as info:
        client.create_table("bad", group_by="none", group_size=3)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "group_size must be 0 or 1" in info.value.details
    assert [t.name for t in client.list_tables()] == ["default", "replay"]
    client.push(encode_items(group_items(1, 0, 2)), table="replay")
    for _ in range(2):
        assert len(next(client.sample("replay", num_groups=1, delivery="replay", max_batches=1)).uids) == 2
    with pytest.raises(BufferError):
        next(client.sample("replay", num_groups=1, delivery="replay", timeout=0.1))
    client.push(encode_items(group_items(2, 0, 3)))
    assert client.delete(["2/0/0/0/r0s0"]) == 1
    assert [e.eid.uid for e in client.get(["2/0/1/0/r1s0", "2/0/0/0/r0s0"])] == ["2/0/1/0/r1s0"]
    assert client.delete(groups=["2/0"]) == 2
    info_ = client.server_info()
    assert info_.trxp_version == "1" and 0 < info_.lmdb_map_used_ratio < 1
    assert client.drop_table("replay") == 0
    with pytest.raises(BufferError) as info:
        client.push(payload("single_turn.trxp"), table="replay")
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_uptime_counts_from_the_start_through_a_step_of_the_wall_clock(
    server: ExpbufServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ServerInfo's uptime (and so the sharded client's shortest) went negative once the wall
    clock was stepped back past the server's start."""
    stepped = types.SimpleNamespace(time=lambda: time.time() - 600, monotonic=time.monotonic)
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        before = client.server_info().uptime_seconds
        monkeypatch.setattr(tables_servicer, "time", stepped)  # the servicer's clocks alone: gRPC's own stay
        assert before <= client.server_info().uptime_seconds < before + 60


def test_a_stream_whose_table_is_dropped_with_batches_sent_ahead_says_so(server: ExpbufServer) -> None:
    """A consume stream with batches sent ahead whose table is dropped (and made again) ended
    saying one of its leases was 'unknown, already acked, or expired': the confirmation of the
    batches sent failed after the take's clear refusal, and replaced it (a helper's audit)."""
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as trainer, BufferClient(target) as operator:
        trainer.create_table("dropped", group_size=1, estimator="none")
        for task in range(6):
            trainer.push([make_experience("old", task, 0)], table="dropped")
        stream = trainer.sample("dropped", batch_size=1, delivery="consume", window=2, timeout=5)
        next(stream)
        time.sleep(0.5)  # the next batches sent ahead
        operator.drop_table("dropped")
        operator.create_table("dropped", group_size=1, estimator="none")
        operator.push([make_experience("new", 0, 0)], table="dropped")
        with pytest.raises(BufferError, match="table 'dropped' was dropped") as ended:
            for _ in range(5):
                next(stream)
        assert ended.value.code == grpc.StatusCode.NOT_FOUND


def test_health_and_reflection(server: ExpbufServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="expbuf.v1.ExperienceBuffer"), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"expbuf.v1.ExperienceBuffer", "grpc.health.v1.Health"} <= services


def test_a_stream_of_a_table_dropped_and_made_again_ends_not_found(client: BufferClient) -> None:
    """A trainer's stream whose table an operator drops and makes again under its name (the next
    run's) ends NOT_FOUND once it has handed over what was on its way: it went on to the new
    table's data, taken by a trainer of the run before (a helper's repro)."""
    client.create_table("t", group_by="none", estimator="none")
    client.push([make_experience("old", task, 0) for task in range(6)], table="t")
    stream = client.sample("t", batch_size=2, delivery="lease", lease_seconds=60, timeout=3, window=1, prefetch=0)
    seen = list(next(stream).uids)  # and the next batch is sent ahead meanwhile
    client.drop_table("t")
    client.create_table("t", group_by="none", estimator="none")
    client.push([make_experience("new", task, 0) for task in range(6)], table="t")
    with pytest.raises(NotFoundError) as ended:
        for batch in stream:
            seen += batch.uids
    stream.close()
    assert all(uid.startswith("old/") for uid in seen), seen
    assert "dropped since this stream's first batch" in str(ended.value) or "does not exist" in str(ended.value)
    assert client.stats()["t"].ready == 6  # the new run's, untouched


def test_a_reflection_stream_left_open_is_ended_after_its_time() -> None:
    """A reflection stream that sends nothing more is cancelled REFLECTION_SECONDS after it opened
    (here 0.5 s), giving back its thread and its place; one past the most open is refused."""
    limits = Interceptors([], others=ReflectionLimits(streams=1, seconds=0.5))
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[limits])
    reflection.enable_server_reflection((reflection.SERVICE_NAME,), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    hold: queue.SimpleQueue = queue.SimpleQueue()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            idle = stub.ServerReflectionInfo(iter(hold.get, None), timeout=30)
            time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.ServerReflectionInfo(iter([]), timeout=5))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.RpcError) as ended:
                list(idle)
            assert ended.value.code() == grpc.StatusCode.CANCELLED
            listed = reflection_pb2.ServerReflectionRequest(list_services="")
            deadline = time.monotonic() + 10  # the cancelled stream's place is given back as its handler ends
            while True:
                try:
                    (reply,) = stub.ServerReflectionInfo(iter([listed]), timeout=5)
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
                    time.sleep(0.05)
            assert [service.name for service in reply.list_services_response.service] == [reflection.SERVICE_NAME]
    finally:
        hold.put(None)
        server.stop(None)


def test_async_client(server: ExpbufServer) -> None:
    async def run() -> None:
        async with AsyncBufferClient(f"127.0.0.1:{server.port}") as c:
            result = await c.push(payload("grpo_group.trxp"))
            assert len(result.stored) == 8
            async for batch in c.sample(num_groups=1, delivery="lease", max_batches=1):
                assert len(batch.experiences) == 8
                assert await batch.ack() == 8
            assert (await c.stats())["default"].consumed == 8

    asyncio.run(run())


def test_experience_dataset_acks_when_the_next_batch_is_requested(client: BufferClient) -> None:
    for task in range(3):
        client.push(encode_items(group_items(5, task, 2)))
    dataset = ExperienceDataset(client, num_groups=1, max_batches=3, timeout=5)
    seen = []
    for batch in dataset:
        seen.append(batch.groups[0])
        stats = client.stats()["default"]
        # this batch is still leased (plus whatever the server read ahead); earlier ones are acked
        assert stats.leased >= 2 and stats.consumed == 2 * (len(seen) - 1)
    assert seen == ["5/0", "5/1", "5/2"]
    assert client.stats()["default"].consumed == 6


def test_batches_read_ahead_but_not_taken_come_back(client: BufferClient) -> None:
    client.push(encode_items(group_items(6, 0, 2)))
    client.push(encode_items(group_items(6, 1, 2)))
    stream = client.sample(num_groups=1, lease_seconds=1.0, delivery="consume")
    assert next(stream).groups[0] == "6/0"
    stream.close()  # 6/1 may already be on its way to this client: it must not be lost
    remaining = next(client.sample(num_groups=1, timeout=10, max_batches=1, delivery="consume"))
    assert remaining.group_ids == ["6/1", "6/1"] and remaining.groups == ["6/1"]
    assert client.stats()["default"].consumed == 4


def test_a_stop_waits_for_its_calls_not_for_a_connection_that_never_made_one(start_server: Servers) -> None:
    """A TCP connection that never finished gRPC's handshake (a load balancer's probe, a port scan)
    held a stop for its whole grace, 10 s at every SIGTERM. The stop ends once no call is left, and
    a call in flight at the stop (a push waiting for room in a full table) runs its course in it."""
    srv = start_server()
    with BufferClient(f"127.0.0.1:{srv.port}", timeout=3) as client:
        client.create_table("full", capacity=2, when_full="block", group_by="none")
        client.push(encode_items(group_items(1, 0, 2)), table="full")
        waited: list[BaseException] = []

        def push() -> None:
            try:
                client.push(encode_items(group_items(2, 0, 2)), table="full")
            except BufferError as exc:
                waited.append(exc)

        pusher = threading.Thread(target=push)
        with socket.create_connection(("127.0.0.1", srv.port)):
            pusher.start()
            wait_for(lambda: srv.call_limits._waiting == 1, "the push to wait for room", 10)
            stopping = threading.Thread(target=srv.stop, kwargs={"grace": 600})
            stopping.start()
            pusher.join(30)
            stopping.join(10)  # held by the connection, it took 20 s (gRPC's own bound under a longer grace)
            assert not stopping.is_alive(), "the stop waited for a connection without a call"
    (error,) = waited  # the push's own deadline ended its wait, not the stop
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "table 'full' is full" in error.details, error


@pytest.mark.parametrize("timeout", [10.001, 30.001, 100.001])  # just past a round value: rounded up to the next
def test_a_wait_to_the_callers_deadline_ends_before_the_caller_gives_up(timeout: float) -> None:
    """gRPC sends a call's timeout rounded up to three digits (30 s arrives as 30.1): a push that
    waited for room to the deadline the server saw, less 50 ms, was refused after its client had
    given up, which saw DEADLINE_EXCEEDED with no word of the full table (the limits audit: every
    push to a full blocking table under the client's default 30 s). A wait the server gives a call
    (remaining) ends before the client's deadline."""
    ends: list[float] = []

    def wait(request: bytes, context: grpc.ServicerContext) -> bytes:
        ends.append(time.monotonic() + remaining(context))
        return b""

    same = lambda raw: raw  # noqa: E731
    handlers = {"Wait": grpc.unary_unary_rpc_method_handler(wait, same, same)}
    server = grpc.server(futures.ThreadPoolExecutor(1))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Waits", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            deadline = time.monotonic() + timeout
            channel.unary_unary("/t.Waits/Wait", same, same)(b"", timeout=timeout)
    finally:
        server.stop(None)
    assert ends[0] < deadline, f"the wait ends {ends[0] - deadline:.3f} s after the client's deadline"


def test_sigterm_finishes_and_restart_finds_everything(tmp_path: Path) -> None:
    proc = ServerProcess(str(tmp_path))
    with BufferClient(proc.target) as c:
        c.push(payload("grpo_group.trxp"))
    assert proc.stop(signal.SIGTERM) == 0
    assert any("stopped" in line for line in proc.log)
    proc = ServerProcess(str(tmp_path))
    try:
        with BufferClient(proc.target) as c:
            assert len(next(c.sample(num_groups=1, delivery="consume")).uids) == 8
    finally:
        proc.stop(signal.SIGTERM)


def test_a_killed_childs_port_stays_its_own_until_it_is_started_again_there(tmp_path: Path) -> None:
    """The restart tests' guard (helpers.ServerProcess): from a child's death to its restart on its
    port, no other server (another test's, started on a free port) may bind that port and answer
    the first one's clients; and the restart binds it."""
    proc = ServerProcess(str(tmp_path))
    with BufferClient(proc.target) as c:
        c.create_table("kept")
    proc.stop(signal.SIGKILL)
    with socket.socket() as intruder, pytest.raises(OSError, match="Address already in use"):
        intruder.bind(("127.0.0.1", proc.port))  # bound: a free port (port 0) is never this one
    again = ServerProcess(str(tmp_path), "--port", str(proc.port))
    try:
        with BufferClient(again.target) as c:
            assert again.port == proc.port and "kept" in c.stats()
    finally:
        again.stop(signal.SIGTERM)


@pytest.mark.soak
def test_kill_9_during_pushes_loses_no_acknowledged_uid(tmp_path: Path) -> None:
    proc = ServerProcess(str(tmp_path))
    acked: list[str] = []
    stop = threading.Event()

    def pusher(worker: int) -> None:
        with BufferClient(proc.target, retries=0, timeout=5) as c:
            task = 0
            while not stop.is_set():
                try:
                    acked.extend(c.push(encode_items(group_items(worker, task, 8, response=256))).stored)
                except BufferError:
                    return
                task += 1

    threads = [threading.Thread(target=pusher, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    while len(acked) < 400:
        threading.Event().wait(0.01)
    proc.stop(signal.SIGKILL)
    stop.set()
    for t in threads:
        t.join(30)
    proc = ServerProcess(str(tmp_path))
    try:
        with BufferClient(proc.target) as c:
            found = {e.eid.uid for e in c.get(acked)}
        assert found == set(acked)
    finally:
        proc.stop(signal.SIGTERM)


def test_a_push_with_wait_for_ready_waits_for_a_server_that_starts_late(start_server: Servers) -> None:
    port = start_server.reserve_port()
    later = threading.Timer(0.5, lambda: start_server(port=port))
    later.start()
    try:
        with BufferClient(f"127.0.0.1:{port}", timeout=20, wait_for_ready=True) as c:
            assert len(c.push(payload("grpo_group.trxp")).stored) == 8
        with BufferClient(f"127.0.0.1:{port}", retries=0) as c:
            assert c.stats()["default"].pushed == 8
    finally:
        later.join()
