"""Refusals carry their status on their class: every server refusal class lives in store/schema/errors.py with
its gRPC code and metric reason, every client error class with its status; a live refusal over
gRPC raises the client class of its code and counts its reason on a real /metrics scrape."""

from __future__ import annotations

import asyncio
import importlib
import pickle
import pkgutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import expbuf.server
from expbuf.client import (
    AlreadyExistsError,
    AsyncBufferClient,
    BufferClient,
    DeadlineExceededError,
    ExpbufError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from expbuf.client.rpc.connection import call_error
from expbuf.client.rpc.wire import reason_of
from expbuf.client.schema.reasons import Reason
from expbuf.client.shards.blocking import ShardedBufferClient
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ServerConfig
from expbuf.server.store.schema import errors

from conftest import BAD_DIR, Servers
from helpers import make_experience, scrape, wait_for

# What each refusal answers: the gRPC status and the reason on expbuf_refused_total.
EXPECTED = {
    errors.StoreError: ("INTERNAL", "internal"),
    errors.InvalidRequest: ("INVALID_ARGUMENT", "invalid_request"),
    errors.InvalidPayload: ("INVALID_ARGUMENT", "invalid_payload"),
    errors.ConfigError: ("INVALID_ARGUMENT", "invalid_config"),
    errors.SpecError: ("INVALID_ARGUMENT", "invalid_request"),
    errors.NotFound: ("NOT_FOUND", "not_found"),
    errors.Conflict: ("ALREADY_EXISTS", "conflict"),
    errors.Forbidden: ("PERMISSION_DENIED", "forbidden"),
    errors.GroupClosed: ("FAILED_PRECONDITION", "group_closed"),
    errors.GroupOverfilled: ("FAILED_PRECONDITION", "group_overfilled"),
    errors.StaleExperience: ("FAILED_PRECONDITION", "stale"),
    errors.StaleAttempt: ("FAILED_PRECONDITION", "stale_attempt"),
    errors.GroupIncomplete: ("FAILED_PRECONDITION", "group_incomplete"),
    errors.VersionJump: ("FAILED_PRECONDITION", "group_closed"),
    errors.TableFull: ("RESOURCE_EXHAUSTED", "table_full"),
    errors.TooLarge: ("RESOURCE_EXHAUSTED", "too_large"),
    errors.StorageFull: ("RESOURCE_EXHAUSTED", "storage_full"),
    errors.InsertLimited: ("RESOURCE_EXHAUSTED", "rate_limited"),
    errors.SampleLimited: ("DEADLINE_EXCEEDED", "rate_limited"),
    errors.IndexNotReady: ("DEADLINE_EXCEEDED", "index_building"),
    errors.Busy: ("RESOURCE_EXHAUSTED", "busy"),
    errors.ReplyLetGo: ("RESOURCE_EXHAUSTED", "replies_full"),
    errors.Cancelled: ("CANCELLED", "cancelled"),
    errors.Damaged: ("DATA_LOSS", "damaged"),
    errors.DamagedPayload: ("DATA_LOSS", "damaged"),
    errors.DamagedGroup: ("DATA_LOSS", "damaged"),
    errors.DamagedPiece: ("DATA_LOSS", "damaged"),
    errors.StoreClosed: ("UNAVAILABLE", "closed"),
    errors.AdvantagesUnavailable: ("INTERNAL", "advantages_unavailable"),
    errors.BatchStageFailed: ("INTERNAL", "internal"),
}
# Statuses a caller does not handle by type: the client raises the base for them (a caller
# never sees CANCELLED from the server: it is the one that gave up).
UNTYPED = {"INTERNAL", "CANCELLED"}


def subclasses(kind: type) -> Iterator[type]:
    for sub in kind.__subclasses__():
        yield sub
        yield from subclasses(sub)


def test_every_refusal_class_is_in_errors_py_with_its_code_and_reason() -> None:
    for module in pkgutil.walk_packages(expbuf.server.__path__, "expbuf.server."):
        if not module.name.startswith("expbuf.server.ray"):  # the ray extra: its actors raise none
            importlib.import_module(module.name)  # every module that could define a refusal is loaded
    ours = {errors.StoreError} | {k for k in subclasses(errors.StoreError) if k.__module__.startswith("expbuf.")}
    assert {k for k in ours if k.__module__ != errors.__name__} == set()
    assert ours == set(EXPECTED)
    for kind in ours:
        assert (kind.status, kind.reason) == EXPECTED[kind], kind.__name__
        code = grpc.StatusCode[kind.status]
        client = ExpbufError.for_status(code)
        if kind.status in UNTYPED:
            assert client is ExpbufError, kind.__name__
        else:
            assert client.status == code and client is not ExpbufError, kind.__name__


def test_every_client_error_class_is_the_one_its_status_maps_to() -> None:
    kinds = [k for k in ExpbufError.__subclasses__() if k.__module__ == ExpbufError.__module__]
    assert len(kinds) >= 9 and len({k.status for k in kinds}) == len(kinds)  # one class per status
    for kind in kinds:
        assert ExpbufError.for_status(kind.status) is kind
        assert type(ExpbufError(kind.status, "x")) is kind
    assert type(ExpbufError(grpc.StatusCode.ABORTED, "x")) is ExpbufError


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ExpbufServer]:
    running = ExpbufServer(ServerConfig(data=str(tmp_path), port=0, metrics_port=0)).start()
    assert running.metrics_port > 0  # a free port, read back
    yield running
    running.stop(grace=1)


def refusals(port: int) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["table"], dict(labels)["reason"]): value
        for (name, labels), value in scrape(port).items()
        if name == "expbuf_refused_total"
    }


def test_a_live_refusal_raises_its_client_class_and_counts_its_reason(server: ExpbufServer) -> None:
    target = f"127.0.0.1:{server.port}"
    bad = (BAD_DIR / "bad_magic.bin").read_bytes()
    with BufferClient(target, retries=0, timeout=20) as client, grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        client.create_table("g", group_size=8)
        client.create_table("st", group_size=0, max_staleness=0, on_stale="refuse")
        client.set_trainer_version(5, "st")
        client.create_table("full", group_by="none", capacity_experiences=2, estimator="none")
        client.push([make_experience(0, task, 0) for task in range(2)], table="full")
        client.create_table("rl", group_by="none", min_size_to_sample=100, estimator="none")
        client.push([make_experience(0, 0, 0)], table="rl")  # ready, but the limiter holds samples back

        def stream_push() -> object:
            replies = stub.PushStream(iter([pb.PushRequest(table="g", payload=bad)]), timeout=10)
            try:
                return list(replies)
            except grpc.RpcError as exc:
                raise call_error(exc, None) from None

        def stream_sample() -> object:
            replies = stub.Sample(iter([pb.SampleRequest(table="g", num_groups=1, order=99)]), timeout=10)
            try:
                return list(replies)
            except grpc.RpcError as exc:
                raise call_error(exc, None) from None

        cases: list[tuple[Callable[[], object], type[ExpbufError], tuple[str, str]]] = [
            (lambda: client.push(bad), InvalidArgumentError, ("default", "invalid_payload")),
            (stream_push, InvalidArgumentError, ("g", "invalid_payload")),  # the stream's table, from its message
            (stream_sample, InvalidArgumentError, ("g", "invalid_request")),
            (lambda: client.create_table("cfg", shaping={"reward_clip": -1}), InvalidArgumentError,
             ("unknown", "invalid_config")),
            (lambda: client.stats("nope"), NotFoundError, ("unknown", "not_found")),
            (lambda: client.ack("no-such-lease"), NotFoundError, ("default", "not_found")),
            (lambda: client.create_table("g", group_size=4), AlreadyExistsError, ("g", "conflict")),
            (lambda: client.push([make_experience(0, 0, 0, version=1)], table="st"), FailedPreconditionError,
             ("st", "stale")),
            (lambda: client.push([make_experience(1, 0, 0)], table="full", timeout=0.5), ResourceExhaustedError,
             ("full", "table_full")),
            (lambda: client.push([make_experience(2, t, 0) for t in range(3)], table="full"), ResourceExhaustedError,
             ("full", "too_large")),
            (lambda: next(client.sample("rl", batch_size=1, timeout=0.3, delivery="consume")), DeadlineExceededError,
             ("rl", "rate_limited")),
        ]  # fmt: skip
        for call, kind, counted in cases:
            before = refusals(server.metrics_port)
            with pytest.raises(kind) as raised:
                call()
            assert type(raised.value) is kind and raised.value.code == kind.status
            assert raised.value.reason == counted[1], (kind.__name__, raised.value.details)  # sent with the refusal
            after = refusals(server.metrics_port)
            changed = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
            assert changed == {counted: 1}, (kind.__name__, raised.value.details)


def test_every_reason_is_one_the_server_gives_and_the_docs_list() -> None:
    """The reasons are a stable, documented set: each is given by the server (a refusal class's,
    or one the service gives itself), and docs/concepts/pushing-and-sampling.md lists each once."""
    root = Path(__file__).resolve().parent.parent
    server = "".join(path.read_text() for path in (root / "server").rglob("*.py"))
    docs = (root / "docs/concepts/pushing-and-sampling.md").read_text()
    listed = [line.split("`")[1] for line in docs.splitlines() if line.startswith("| `") and line.count("|") == 3]
    for reason in Reason:
        assert f"Reason.{reason.name}" in server, reason
    assert sorted(listed) == sorted(Reason), "the docs' table of reasons"


def reasons_of(calls: dict[str, Callable[[], object]]) -> dict[str, str | None]:
    found = {}
    for name, call in calls.items():
        with pytest.raises(ExpbufError) as raised:
            call()
        found[name] = raised.value.reason
    return found


def test_the_reason_reaches_every_client_and_a_pusher(target: str) -> None:
    """A refusal's reason, sent beside its message, is what the blocking, asyncio and sharded
    clients and a pusher give as `ExpbufError.reason`, from refusals of the store and of the
    service itself (a Sample that found too little ready)."""
    bad = (BAD_DIR / "bad_magic.bin").read_bytes()
    with BufferClient(target, retries=0, timeout=20) as client, ShardedBufferClient([target]) as sharded:
        client.create_table("four", group_size=4)
        client.push([make_experience(0, "a", run) for run in range(3)], table="four")
        client.push([make_experience(0, "b", run) for run in range(4)], table="four")
        client.push([make_experience(0, "c", 0)], table="four")
        with client.pusher("four") as pusher:
            overfill = pusher.push([make_experience(0, "a", run) for run in range(3, 5)])
            with pytest.raises(ExpbufError) as raised:
                overfill.result(timeout=30)
        assert raised.value.reason == Reason.GROUP_OVERFILLED
        assert reasons_of(
            {
                "bad payload": lambda: client.push(bad),
                "overfill": lambda: client.push([make_experience(0, "a", run) for run in range(3, 5)], table="four"),
                "complete": lambda: client.push([make_experience(0, "b", 4)], table="four"),
                "other bytes": lambda: client.push([make_experience(0, "c", 0, reward=0.5)], table="four"),
                "no table": lambda: client.stats("nope"),
                "no dataset": lambda: client.claim("four", "nope"),
                "too little": lambda: next(client.sample("four", num_groups=9, timeout=0.3, delivery="consume")),
                "sharded, no table": lambda: sharded.stats("nope"),
                "sharded, bad payload": lambda: sharded.push(bad, table="four"),
            }
        ) == {
            "bad payload": Reason.INVALID_PAYLOAD,
            "overfill": Reason.GROUP_OVERFILLED,
            "complete": Reason.GROUP_CLOSED,
            "other bytes": Reason.CONFLICT,
            "no table": Reason.NOT_FOUND,
            "no dataset": Reason.NOT_FOUND,
            "too little": Reason.NOT_READY,
            "sharded, no table": Reason.NOT_FOUND,
            "sharded, bad payload": Reason.INVALID_PAYLOAD,  # refused by the sharded client, which parses to route
        }

    async def asyncio_reasons() -> dict[str, str | None]:
        found = {}
        async with AsyncBufferClient(target, retries=0) as client:
            for name, call in {
                "bad payload": lambda: client.push(bad),
                "no table": lambda: client.stats("nope"),
                "too little": lambda: client.sample("four", num_groups=9, timeout=0.3, delivery="consume").__anext__(),
            }.items():
                with pytest.raises(ExpbufError) as raised:
                    await call()
                found[name] = raised.value.reason
        return found

    assert asyncio.run(asyncio_reasons()) == {
        "bad payload": Reason.INVALID_PAYLOAD,
        "no table": Reason.NOT_FOUND,
        "too little": Reason.NOT_READY,
    }


def test_the_interceptors_refusals_carry_their_reasons(start_server: Servers) -> None:
    """Refusals made before a method runs (a token missing or lacking the scope) carry theirs too."""
    server = start_server(tokens={"pusher": frozenset({"push"})})
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, retries=0) as anonymous, BufferClient(target, retries=0, token="pusher") as pusher:
        assert reasons_of({"no token": lambda: anonymous.stats(), "no scope": lambda: pusher.stats()}) == {
            "no token": Reason.UNAUTHENTICATED,
            "no scope": Reason.FORBIDDEN,
        }


def test_the_interceptors_refusals_are_counted_by_their_reason(start_server: Servers) -> None:
    """Refusals for want of room (busy, streams_full, too_large as inflight_full is) and a token's
    (unauthenticated, forbidden), made before a method runs, count on expbuf_refused_total as the
    store's do: the ExpbufPushesHeldBack alert watches the room's, and only table_full was counted."""
    server = start_server(
        tokens={"job": frozenset({"push", "sample", "admin"}), "pusher": frozenset({"push"})},
        max_sample_streams=2, max_table_streams=1, max_inflight_bytes=1 << 20,
    )  # fmt: skip
    target = f"127.0.0.1:{server.port}"
    job = (("authorization", "Bearer job"),)
    with (
        BufferClient(target, retries=0, token="job") as client,
        BufferClient(target, retries=0) as anonymous,
        BufferClient(target, retries=0, token="pusher") as pusher,
        grpc.insecure_channel(target) as channel,
    ):
        for table in ("t", "u", "w"):
            client.create_table(table, group_by="none", estimator="none")
        stub = pb_grpc.ExperienceBufferStub(channel)
        found: dict[str, str | None] = {}

        release = threading.Event()

        def sample(table: str, wait: float) -> grpc.Call:
            """A Sample stream; held (`wait`) with its side open, as a trainer's is, until released."""
            request = pb.SampleRequest(table=table, num_groups=5, wait_seconds=wait, delivery=pb.DELIVERY_CONSUME)

            def requests() -> Iterator[pb.SampleRequest]:
                yield request
                if wait:
                    release.wait(30)

            return stub.Sample(requests(), timeout=30, metadata=job)

        def refused(what: str, table: str) -> bool:
            """Another Sample stream, refused for room once those held are open (before, it finds
            the table empty: not_ready)."""
            try:
                list(sample(table, 0))
            except grpc.RpcError as exc:
                if (reason := reason_of(exc.trailing_metadata())) != Reason.NOT_READY:
                    found[what] = reason
            return what in found

        held: list[grpc.Call] = []

        def hold_then_refused(held_table: str, what: str, table: str) -> None:
            """A stream held on `held_table` (opened again where a probe took its place first and it
            was refused), then a probe on `table` refused for room."""
            held.append(sample(held_table, 20))

            def step() -> bool:
                if held[-1].done():
                    held[-1] = sample(held_table, 20)
                return refused(what, table)

            wait_for(step, what)

        try:
            hold_then_refused("t", "the table's second stream", "t")
            hold_then_refused("u", "the server's third stream", "w")
        finally:
            release.set()
            for call in held:
                call.cancel()
        larger = pb.PushRequest(table="t", seq=1, payload=b"x" * 1000, total_bytes=2 << 20)
        with pytest.raises(grpc.RpcError) as too_large:
            list(stub.PushStream(iter([larger]), timeout=10, metadata=job))
        found["a push in chunks past max_inflight_bytes"] = reason_of(too_large.value.trailing_metadata())
        found.update(reasons_of({"no token": lambda: anonymous.stats(), "no scope": lambda: pusher.stats()}))
    assert found == {
        "the table's second stream": Reason.STREAMS_FULL,
        "the server's third stream": Reason.BUSY,
        "a push in chunks past max_inflight_bytes": Reason.TOO_LARGE,
        "no token": Reason.UNAUTHENTICATED,
        "no scope": Reason.FORBIDDEN,
    }
    counted = refusals(server.metrics_port)
    for reason in found.values():
        assert sum(value for (_, named), value in counted.items() if named == reason) >= 1, (reason, counted)
    assert counted[("t", Reason.TOO_LARGE)] == 1  # its first chunk named its table (read on the stream's thread)
    assert ("default", Reason.STREAMS_FULL) not in counted and ("default", Reason.BUSY) not in counted


def test_an_error_keeps_its_reason_across_processes() -> None:
    error = ExpbufError(grpc.StatusCode.FAILED_PRECONDITION, "x", Reason.STALE_ATTEMPT)
    error.busy = True
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), back.reason, back.busy) == (FailedPreconditionError, Reason.STALE_ATTEMPT, True)


def config_refusals(channel: grpc.Channel) -> dict[str, tuple[str, str | None]]:
    """CreateTable over a raw stub with one bad setting each (what the clients catch before they
    call, sent as any gRPC client can): each refusal's status and reason."""
    bad = {
        "when_full out of its enum": pb.TableConfig(name="t", when_full=99),
        "group_by out of its enum": pb.TableConfig(name="t", group_by=99),
        "compression out of its enum": pb.TableConfig(name="t", compression=9),
        "on_token_stale out of its enum": pb.TableConfig(name="t", on_token_stale=9),
        "an unknown estimator": pb.TableConfig(name="t", estimator=pb.Estimator(name="nope")),
        "an unknown estimator parameter": pb.TableConfig(
            name="t", estimator=pb.Estimator(name="grpo", params={"z": 1})
        ),
        "an unknown device": pb.TableConfig(name="t", estimator=pb.Estimator(name="grpo", device="tpu")),
        "a negative timeout": pb.TableConfig(name="t", group_timeout_seconds=-1),
        "a group_size too large": pb.TableConfig(name="t", group_size=2**32 - 1),
        "min_group_size past group_size": pb.TableConfig(name="t", group_size=2, min_group_size=5),
        "a bad shaping": pb.TableConfig(name="t", shaping=pb.Shaping(reward_clip=-1)),
        "an unknown extension": pb.TableConfig(name="t", extensions=["nope"]),
        "a bad name": pb.TableConfig(name="a/b"),
    }
    stub = pb_grpc.ExperienceBufferStub(channel)
    found = {}
    for what, config in bad.items():
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateTable(pb.CreateTableRequest(config=config), timeout=10)
        found[what] = (refused.value.code().name, reason_of(refused.value.trailing_metadata()))
    raw = pb.TableConfig(name="t").SerializeToString() + b"\x98\x06\x01"  # field 99, a setting this server lacks
    call = channel.unary_unary(
        "/expbuf.v1.ExperienceBuffer/CreateTable", request_serializer=bytes, response_deserializer=bytes
    )
    with pytest.raises(grpc.RpcError) as refused:
        call(b"\x0a" + bytes([len(raw)]) + raw, timeout=10)
    found["a setting this server does not know"] = (
        refused.value.code().name,
        reason_of(refused.value.trailing_metadata()),
    )
    return found


def test_every_bad_setting_of_create_table_is_refused_with_the_config_reason(target: str) -> None:
    """A table's settings refused for whatever cause carry INVALID_ARGUMENT and `invalid_config`,
    the reason the docs give a table's settings, so code that acts on the reason need not know
    which check found it."""
    with grpc.insecure_channel(target) as channel:
        found = config_refusals(channel)
    assert found == dict.fromkeys(found, ("INVALID_ARGUMENT", Reason.INVALID_CONFIG))


def test_every_refusal_of_every_call_carries_a_reason(target: str) -> None:
    """Each method of the service, called with an empty request and with one naming a table that
    does not exist: whatever it refuses carries a reason of the enum (read from the proto's
    service, so a new method is covered when it is added)."""
    channel = grpc.insecure_channel(target)
    service = pb.DESCRIPTOR.services_by_name["ExperienceBuffer"]
    refusals: dict[tuple[str, str], tuple[str, str | None]] = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        reply_class = getattr(pb, method.output_type.name)
        requests = {"empty": request_class()}
        if "table" in request_class.DESCRIPTOR.fields_by_name:
            requests["no such table"] = request_class(table="nope")
        kind = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary"}
        make = getattr(channel, kind.get((method.client_streaming, method.server_streaming), "stream_stream"))
        call = make(
            f"/expbuf.v1.ExperienceBuffer/{method.name}",
            request_serializer=request_class.SerializeToString,
            response_deserializer=reply_class.FromString,
        )
        for what, request in requests.items():
            try:
                reply = call(iter([request]) if method.client_streaming else request, timeout=10)
                if method.server_streaming:
                    list(reply)
            except grpc.RpcError as exc:
                refusals[(method.name, what)] = (exc.code().name, reason_of(exc.trailing_metadata()))
    channel.close()
    assert len(refusals) > 30  # most calls refuse one or the other: the test sees refusals
    unreasoned = {call: found for call, found in refusals.items() if found[1] not in set(Reason)}
    assert unreasoned == {}
