"""Both clients retry by gRPC's own retry policy (the channel's service config, connection.py),
and make a push in chunks again themselves, as the policy would (calls.Attempts).

A gRPC proxy stands in front of a real server, as a load balancer does, and answers UNAVAILABLE
to the calls a test tells it to, as such a proxy does while its server is away; it counts every
call it gets, so attempts are counted where they arrive, and the server's own RPC metrics say
which of them reached it. The idempotent calls are retried up to the client's `retries` (at most
4, gRPC's limit), within one deadline; a call described with retry=False, and every call that is
not idempotent, is made once; a pusher's stream is resent by the pusher alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from expbuf.client import (
    AsyncBufferClient,
    BufferClient,
    DeadlineExceededError,
    ExpbufError,
    InvalidArgumentError,
    NotFoundError,
    PushResult,
    ResourceExhaustedError,
    UnavailableError,
    trxp,
)
from expbuf.client.rpc import calls as calls_module
from expbuf.client.rpc import connection, wire
from expbuf.client.rpc.calls import ledger_calls
from expbuf.client.rpc.connection import MAX_RETRIES, RECONNECT
from expbuf.client.schema.prompts import Claim
from expbuf.client.shards.blocking import ShardedBufferClient
from expbuf.proto.v1 import buffer_pb2, buffer_pb2_grpc
from expbuf.server import app
from expbuf.server.app import ExpbufServer

from conftest import Servers
from helpers import SlowReplies, group_items, make_experience, scrape

SERVICE = buffer_pb2.DESCRIPTOR.services_by_name["ExperienceBuffer"]
MESSAGE_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
KINDS = ("blocking", "asyncio")


class Front:
    """A gRPC proxy of the ExperienceBuffer service on a free loopback port, forwarding each call
    to `backend`. `refuse(method, times)` answers UNAVAILABLE to the next `times` calls of
    `method` without forwarding them, after `delay` seconds and after reading the first `read`
    messages of a client stream (None: all of them, a push in chunks whole). `lose(method, times)`
    forwards them and answers UNAVAILABLE instead of the reply, as a connection cut after the
    server acted does. `rewrite(method, change)` passes on `change(reply)` for each reply of
    `method` (its bytes). `calls` holds each call it got: its method and the client's address."""

    def __init__(self, backend: str) -> None:
        self.calls: list[tuple[str, str]] = []
        self._refused: Counter[str] = Counter()
        self._lost: Counter[str] = Counter()
        self._forwarded: dict[str, int] = {}  # of a held method, the calls still to forward
        self._rewrites: dict[str, Callable[[bytes], bytes]] = {}
        self._delay, self._read, self._code = 0.0, 0, grpc.StatusCode.UNAVAILABLE
        self._lock = threading.Lock()
        self._backend = grpc.insecure_channel(backend, options=MESSAGE_OPTIONS)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=MESSAGE_OPTIONS)
        handlers = {method.name: self._handler(method) for method in SERVICE.methods}
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)])
        self.target = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(None).wait()
        self._backend.close()

    def refuse(
        self,
        method: str,
        times: int,
        delay: float = 0.0,
        read: int | None = 0,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
    ) -> None:
        self._refused[method], self._delay, self._read, self._code = times, delay, read, code

    def lose(self, method: str, times: int) -> None:
        self._lost[method] = times

    def hold(self, method: str, after: int) -> None:
        """Forward the next `after` calls of `method`, and hold each one after them unanswered
        until its caller's deadline ends it, as a server too loaded to answer in time would."""
        self._forwarded[method] = after

    def rewrite(self, method: str, change: Callable[[bytes], bytes]) -> None:
        self._rewrites[method] = change

    def attempts(self, method: str) -> int:
        return sum(1 for name, _ in self.calls if name == method)

    def _arrived(self, method: str, request: Any, context: grpc.ServicerContext) -> bool:
        """Record a call; refuse it if told to. Whether its reply is to be lost."""
        with self._lock:
            self.calls.append((method, context.peer()))
            refused = self._refused[method] > 0
            lost = not refused and self._lost[method] > 0
            self._refused[method] -= refused
            self._lost[method] -= lost
            held = self._forwarded.get(method) == 0
            if method in self._forwarded and not held:
                self._forwarded[method] -= 1
        if held:
            ended = threading.Event()
            if context.add_callback(ended.set):
                ended.wait()
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the front held the call")
        if refused:
            if self._read != 0:
                for _ in itertools.islice(request, self._read):
                    pass
            time.sleep(self._delay)
            context.abort(self._code, "the front's server is away")
        return lost

    def _handler(self, method: Any) -> grpc.RpcMethodHandler:
        path = f"/{SERVICE.full_name}/{method.name}"
        kind = f"{'stream' if method.client_streaming else 'unary'}_{'stream' if method.server_streaming else 'unary'}"
        forward = getattr(self._backend, kind)(path)

        def run(request: Any, context: grpc.ServicerContext) -> Any:
            lost = self._arrived(method.name, request, context)
            try:
                reply = forward(request, timeout=context.time_remaining())
            except grpc.RpcError as exc:
                abort(context, exc)
            if lost:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the front lost the reply")
            return self._rewrites.get(method.name, lambda same: same)(reply)

        def relay(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._arrived(method.name, request, context)
            try:
                yield from forward(request, timeout=context.time_remaining())
            except grpc.RpcError as exc:
                abort(context, exc)

        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(relay if method.server_streaming else run)


def abort(context: grpc.ServicerContext, exc: grpc.RpcError) -> None:
    """End a forwarded call as the server ended it: its status, and the trailers that say why
    (the reason, and whether it did nothing: wire.BUSY), as a proxy passes them on."""
    context.set_trailing_metadata(exc.trailing_metadata() or ())
    context.abort(exc.code(), exc.details())


@pytest.fixture
def front(server: ExpbufServer) -> Iterator[Front]:
    proxy = Front(f"127.0.0.1:{server.port}")
    yield proxy
    proxy.close()


def served(server: ExpbufServer, method: str) -> float:
    """Calls of `method` that reached the server, by its own metrics."""
    return sum(
        value
        for (name, labels), value in scrape(server.metrics_port).items()
        if name == "expbuf_rpc_duration_seconds_count" and dict(labels)["method"] == method
    )


def call(kind: str, target: str, name: str, *args: Any, **options: Any) -> Any:
    """client.`name`(*args) on a client of `kind` made with `options`, closed afterwards."""
    if kind == "blocking":
        with BufferClient(target, **options) as client:
            return getattr(client, name)(*args)

    async def body() -> Any:
        async with AsyncBufferClient(target, **options) as client:
            return await getattr(client, name)(*args)

    return asyncio.run(body())


def group(task: int, size: int = 4) -> bytes:
    return trxp.build(group_items("retry", task, size))


def uids(body: bytes) -> list[str]:
    return [item.uid for item in trxp.parse(body)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_push_and_a_read_the_server_cannot_take_are_retried_until_it_is_back(
    server: ExpbufServer, front: Front, kind: str
) -> None:
    body = group(0)
    front.refuse("Push", MAX_RETRIES)
    assert call(kind, front.target, "push", body).stored == uids(body)
    front.refuse("ReadFields", MAX_RETRIES)  # what get() reads over
    assert call(kind, front.target, "get", uids(body)).missing_uids == []
    assert (front.attempts("Push"), front.attempts("ReadFields")) == (MAX_RETRIES + 1, MAX_RETRIES + 1)
    assert (served(server, "Push"), served(server, "ReadFields")) == (1, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_push_whose_reply_was_lost_is_sent_again_and_answered_as_duplicates(
    server: ExpbufServer, front: Front, kind: str
) -> None:
    body = group(1)
    front.lose("Push", 1)
    result = call(kind, front.target, "push", body)
    assert (result.stored, result.duplicates, result.completed_groups) == ([], uids(body), [])
    assert result.kept == uids(body)  # what an admission's finish counts as accepted
    assert front.attempts("Push") == served(server, "Push") == 2


@pytest.mark.parametrize("chunk_bytes", [0, 1 << 16])
def test_a_push_larger_than_grpcs_default_retry_buffer_is_retried_whole_or_in_chunks(
    front: Front, chunk_bytes: int
) -> None:
    items = [trxp.from_experience(make_experience("big", chunk_bytes, run, response=20_000)) for run in range(2)]
    body = trxp.build(items)
    assert len(body) > 256 << 10  # gRPC would commit a call that sent more, unretried
    method = "PushStream" if chunk_bytes else "Push"
    front.refuse(method, 2, read=None)
    with BufferClient(front.target, push_chunk_bytes=chunk_bytes) as client:
        assert client.push(body).stored == uids(body)
    assert front.attempts(method) == 3


def test_an_asyncio_push_in_chunks_refused_as_its_stream_opens_reads_the_refusal(front: Front) -> None:
    """The front refuses the stream of a push in chunks before reading it, while gRPC still
    writes its chunks: the client raises the front's UNAVAILABLE, not a failed write's INTERNAL
    (which grpc.aio gave 15 to 19 of these 20 pushes)."""
    body = trxp.build([trxp.from_experience(make_experience("open", 0, run, response=20_000)) for run in range(2)])

    async def rounds() -> list[BaseException | None]:
        raised: list[BaseException | None] = []
        async with AsyncBufferClient(front.target, push_chunk_bytes=1 << 16, retries=0) as client:
            for _ in range(20):
                front.refuse("PushStream", 1)
                try:
                    await client.push(body)
                except ExpbufError as exc:
                    raised.append(exc)
                else:
                    raised.append(None)
        return raised

    raised = asyncio.run(rounds())
    assert all(isinstance(exc, UnavailableError) for exc in raised), raised


@pytest.mark.parametrize("retries", [0, 1, MAX_RETRIES])
def test_the_attempts_of_a_call_are_bounded_by_the_clients_retries(front: Front, retries: int) -> None:
    front.refuse("Stats", 100)
    with pytest.raises(UnavailableError, match="the front's server is away"):
        call("blocking", front.target, "stats", "", retries=retries)
    assert front.attempts("Stats") == retries + 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("retries", [0, 2])
def test_the_attempts_of_a_push_in_chunks_are_bounded_by_the_clients_retries(
    front: Front, kind: str, retries: int
) -> None:
    """A push in chunks is made again by the client (gRPC's retries are off on its channel), as
    the retry policy makes the other calls again: after UNAVAILABLE, up to `retries` times."""
    body = trxp.build([trxp.from_experience(make_experience("bounded", 0, run, response=20_000)) for run in range(2)])
    front.refuse("PushStream", 100, read=None)
    with pytest.raises(UnavailableError, match="the front's server is away"):
        call(kind, front.target, "push", body, retries=retries, push_chunk_bytes=1 << 16)
    assert front.attempts("PushStream") == retries + 1


def test_retries_beyond_grpcs_limit_are_its_limit_with_a_warning(front: Front) -> None:
    front.refuse("Stats", 100)
    with (
        pytest.warns(UserWarning, match="at most 4 retries of a call"),
        BufferClient(front.target, retries=9) as client,
    ):
        assert client.retries == MAX_RETRIES
        with pytest.raises(UnavailableError):
            client.stats()
    assert front.attempts("Stats") == MAX_RETRIES + 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_described_not_to_retry_and_a_call_that_is_not_idempotent_are_made_once(
    server: ExpbufServer, front: Front, kind: str
) -> None:
    front.refuse("Writers", 1)
    with pytest.raises(UnavailableError):
        call(kind, front.target, "writers", "default", 1)  # opening a writer twice would count two
    front.refuse("Writers", 1)
    assert call(kind, front.target, "writers", "default", 0) == (0, False)  # a read: retried
    front.refuse("Delete", 1)
    with pytest.raises(UnavailableError):
        call(kind, front.target, "delete", ["no-such-uid"])
    assert call(kind, front.target, "delete", ["no-such-uid"]) == 0  # the server's own answer, let through
    assert (front.attempts("Writers"), front.attempts("Delete")) == (3, 2)
    assert (served(server, "Writers"), served(server, "Delete")) == (1, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_an_ack_or_a_nack_whose_reply_was_lost_is_made_again_and_answered_as_the_first(
    server: ExpbufServer, front: Front, kind: str
) -> None:
    """The server remembers the leases an ack, a nack or their expiry ended: an ack whose reply
    was lost (the connection cut after the server acted) is made again by the retry policy and
    answers the count the first did; a nack of a lease acked says so. Both raised: the first
    UNAVAILABLE, the second NotFoundError 'unknown, already acked, or expired and requeued'."""
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.push(group(20), table="default")
        admin.push(group(21), table="default")
        leased = list(admin.sample("default", num_groups=1, max_batches=2, delivery="lease"))
    front.lose("Ack", 1)
    assert call(kind, front.target, "ack", leased[0].lease_id) == 4
    front.lose("Nack", 1)
    assert call(kind, front.target, "nack", leased[1].lease_id) == 4
    with pytest.raises(NotFoundError, match="was acked: its groups are consumed"):
        call(kind, front.target, "nack", leased[0].lease_id)
    assert (front.attempts("Ack"), front.attempts("Nack")) == (2, 3)
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        stats = admin.stats("default")["default"]
    assert (stats.consumed, stats.ready) == (4, 4)


@pytest.mark.parametrize("kind", ("blocking", "asyncio", "sharded"))
def test_a_claim_whose_reply_was_lost_is_made_again_and_answered_with_the_prompts_it_claimed(
    server: ExpbufServer, front: Front, kind: str
) -> None:
    """A claim names its id, so the retry policy makes it again and the server answers the same
    prompts: the claim raised UNAVAILABLE and its prompts stayed claimed by no one for their lease
    (300 s), filling max_in_flight, and came back an attempt later (dropped, where that was the
    last). The sharded client asked the shard again and handed out two more."""
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table("t", group_size=1)
        admin.create_dataset("t", "d", 4, max_in_flight=3)
        front.lose("Claim", 1)
        if kind == "asyncio":
            claim = call(kind, front.target, "claim", "t", "d", 2)
        else:
            with ledger_client(kind, front.target) as client:
                claim = client.claim("t", "d", 2)
        assert [(p.index, p.attempt) for p in claim.prompts] == [(0, 0), (1, 0)]
        assert admin.ledger("t", "d").totals.claimed == 2
        assert [p.index for p in admin.claim("t", "d", 2).prompts] == [2]  # the room max_in_flight left
    assert front.attempts("Claim") == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_grants_finish_whose_reply_was_lost_is_made_again_and_answered_as_the_first(
    server: ExpbufServer, front: Front, kind: str
) -> None:
    """The server remembers the grants it saw end: a finish made again (the retry policy's, or its
    caller's) answers the rollouts the first gave back; one with another count, or of a grant that
    expired first, says so. The finish raised UNAVAILABLE, then NotFoundError for a grant it had
    finished, indistinguishable from one whose room all came back."""
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table("t", group_size=1, max_staleness=0, batch_size=4)
        admin.set_trainer_version(0, "t")
        grant, short = admin.admit("t", 3), admin.admit("t", 1, grant_seconds=0.2)
        front.lose("FinishGrant", 1)
        assert call(kind, front.target, "finish_grant", grant, 1) == 2
        assert admin.finish_grant(grant, 1) == 2  # a caller's own retry
        with pytest.raises(InvalidArgumentError, match="was finished with accepted = 1, which gave back 2"):
            admin.finish_grant(grant, 3)
        assert admin.stats("t")["t"].submitted == 2
        time.sleep(0.2)
        wait_for(lambda: admin.stats("t")["t"].submitted == 1, "the short grant did not expire")
        with pytest.raises(NotFoundError, match="expired before it was finished: its 1 rollouts' room went back"):
            admin.finish_grant(short, 1)
    assert front.attempts("FinishGrant") == 2


def before_repeats(reply: bytes) -> bytes:
    """A ServerInfo reply as a server before ServerInfoReply.repeats_answered gives it."""
    info = buffer_pb2.ServerInfoReply.FromString(reply)
    info.ClearField("repeats_answered")
    return info.SerializeToString()


@pytest.mark.parametrize("kind", KINDS)
def test_the_calls_a_server_does_not_answer_again_are_made_once_there(
    server: ExpbufServer, front: Front, kind: str
) -> None:
    """A server before the names of claims, grants and writers (and the leases and grants it saw
    end) answers a repeat as a new call: a claim claims again, an admit grants again, a writer
    counts twice. So a client retries those only where its server names them among the repeats it
    answers (asked once, with ServerInfo); elsewhere each is made once, as clients before made
    them, and a lost reply is the caller's UNAVAILABLE. This release's server names them all."""
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        assert admin.server_info().repeats_answered == wire.REPEATS_ANSWERED
        admin.create_table("t", group_size=1, max_staleness=0, batch_size=4)
        admin.set_trainer_version(0, "t")
        admin.create_dataset("t", "d", 4)
        admin.push(group(30), table="default")
        admin.push(group(31), table="default")
        leased = list(admin.sample("default", num_groups=1, max_batches=2, delivery="lease"))
        grant = admin.admit("t", 1)
        front.rewrite("ServerInfo", before_repeats)
        made = [
            ("Claim", ("claim", "t", "d", 1)),
            ("Admit", ("admit", "t", 1)),
            ("FinishGrant", ("finish_grant", grant)),
            ("Writers", ("writers", "t", 1, "writer-a")),
            ("Ack", ("ack", leased[0].lease_id)),
            ("Nack", ("nack", leased[1].lease_id)),
        ]
        for method, (name, *args) in made:
            front.lose(method, 1)
            with pytest.raises(UnavailableError):
                call(kind, front.target, name, *args)
            assert front.attempts(method) == 1, method
        assert front.attempts("ServerInfo") == len(made)  # once a client
        assert admin.ledger("t", "d").totals.claimed == 1
        assert admin.writers("t") == (1, False)
        assert (admin.stats("default")["default"].consumed, admin.stats("t")["t"].submitted) == (4, 2)
    front.rewrite("ServerInfo", lambda same: same)
    front.refuse("ServerInfo", 1, code=grpc.StatusCode.PERMISSION_DENIED)  # a server that will not say
    front.lose("Claim", 1)
    with pytest.raises(UnavailableError):
        call(kind, front.target, "claim", "t", "d", 1)
    front.lose("Claim", 1)
    assert len(call(kind, front.target, "claim", "t", "d", 1).prompts) == 1  # this release's: made again
    assert (front.attempts("Claim"), front.attempts("ServerInfo")) == (4, len(made) + 2)
    front.refuse("ServerInfo", MAX_RETRIES + 1)  # the ask unanswered: the claim is not made, its error the ask's
    with pytest.raises(UnavailableError):
        call(kind, front.target, "claim", "t", "d", 1)
    assert front.attempts("Claim") == 4


def test_a_client_asks_again_which_calls_a_server_answers_again_once_it_was_unavailable(
    server: ExpbufServer, front: Front
) -> None:
    """A server away may come back another release (a rollback restores the one before, which
    answers no call again as the first): a client that found it unavailable asks again before its
    next claim, and makes the claim once where the server now names none."""
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table("t", group_size=1)
        admin.create_dataset("t", "d", 4)
    with BufferClient(front.target) as client:
        assert len(client.claim("t", "d", 1).prompts) == 1
        front.refuse("Claim", MAX_RETRIES + 1)  # away past the client's retries
        with pytest.raises(UnavailableError):
            client.claim("t", "d", 1)
        front.rewrite("ServerInfo", before_repeats)
        front.lose("Claim", 1)
        with pytest.raises(UnavailableError):
            client.claim("t", "d", 1)
    assert (front.attempts("ServerInfo"), front.attempts("Claim")) == (2, 1 + MAX_RETRIES + 1 + 1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_sample_stream_is_not_retried(server: ExpbufServer, front: Front, kind: str) -> None:
    """Not by the policy, which does not name it: a batch on its way is the server's to give back.
    The front refuses the stream as it opens, while the client may still be writing its request:
    the client reads the front's UNAVAILABLE, not a failed write's INTERNAL (which grpc.aio gave
    the asyncio client for 5 to 20 of 40 such streams)."""
    for attempt in range(1, 21):
        front.refuse("Sample", 1)
        if kind == "blocking":
            with BufferClient(front.target) as client, pytest.raises(UnavailableError):
                next(client.sample(num_groups=1, timeout=1))
        else:

            async def first() -> None:
                async with AsyncBufferClient(front.target) as client:
                    await anext(client.sample(num_groups=1, timeout=1))

            with pytest.raises(UnavailableError):
                asyncio.run(first())
        assert (front.attempts("Sample"), served(server, "Sample")) == (attempt, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_sample_stream_over_a_connection_gone_silent_ends_unavailable(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A connection that goes silent (a host lost, a cut: nothing says it closed) while a Sample
    stream waits for data: the client's pings go unanswered and it closes the connection, and the
    stream raises UnavailableError. It has no deadline, and waited forever. The pings here are
    50 times as often as the client's (20 s, then 10 s for the answer), the server taking them."""
    monkeypatch.setattr(app, "PINGS_APART_MS", app.PINGS_APART_MS // 50)
    faster = tuple((name, value // 50 if name.endswith("_ms") else value) for name, value in connection.KEEPALIVE)
    monkeypatch.setattr(connection, "KEEPALIVE", faster)
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table("silent", group_size=1)
        admin.push(group(0, size=1), table="silent")
    proxy = SlowReplies(f"127.0.0.1:{server.port}")

    def after_the_first_batch() -> str:
        """Read the one batch there is, hold the connection silent, wait for the next."""
        if kind == "blocking":
            with BufferClient(proxy.target, timeout=5) as client:
                batches = client.sample("silent", num_groups=1, timeout=60, delivery="consume")
                next(batches)
                time.sleep(1)  # pings answered, none refused as too many: the server takes them this often
                proxy.hold()
                with pytest.raises(UnavailableError) as ended:
                    next(batches)
                return str(ended.value)

        async def body() -> str:
            async with AsyncBufferClient(proxy.target, timeout=5) as client:
                batches = client.sample("silent", num_groups=1, timeout=60, delivery="consume")
                await anext(batches)
                await asyncio.sleep(1)
                proxy.hold()
                with pytest.raises(UnavailableError) as ended:
                    await anext(batches)
                return str(ended.value)

        return asyncio.run(body())

    try:
        with futures.ThreadPoolExecutor(1) as pool:
            said = pool.submit(after_the_first_batch).result(timeout=30)  # it waited forever
    finally:
        proxy.release()
        proxy.close()
    assert "ping timeout" in said, said


@pytest.mark.parametrize("kind", KINDS)
def test_a_pushers_stream_is_resent_by_the_pusher_alone(front: Front, kind: str) -> None:
    """Its stream goes over the channel without the policy: two refusals are two of its own
    resends, so with one retry the push fails (the policy would have sent it a third time)."""
    body = group(2)

    def push(retries: int) -> Any:
        if kind == "blocking":
            with BufferClient(front.target, retries=retries) as client, client.pusher() as pusher:
                future = pusher.push(body)
            return future.exception() or future.result()

        async def body_async() -> Any:
            async with AsyncBufferClient(front.target, retries=retries) as client, client.pusher() as pusher:
                future = await pusher.push(body)
            return future.exception() or future.result()

        return asyncio.run(body_async())

    front.refuse("PushStream", 2)
    failed = push(retries=1)
    assert isinstance(failed, UnavailableError) and uids(body)[0] in failed.details
    assert front.attempts("PushStream") == 2
    front.refuse("PushStream", 2)
    assert push(retries=2).stored == uids(body)
    assert front.attempts("PushStream") == 5


def test_an_asyncio_pusher_resends_what_a_stream_refused_as_it_opened_left(front: Front) -> None:
    """A proxy that refuses a pusher's stream as it opens, before reading anything, ends it while
    the client is still writing its pushes: grpc.aio gave the stream a failed write's INTERNAL
    "Internal error from Core" in place of its UNAVAILABLE for 27 to 32 of these 40 pushers,
    which failed a push instead of sending it again. Each pusher reads the proxy's UNAVAILABLE,
    and its pushes are stored on the stream that follows."""
    bodies = [trxp.build(group_items("open", task, 4, response=2000)) for task in range(4)]

    async def rounds() -> list[Any]:
        outcomes = []
        async with AsyncBufferClient(front.target, retries=1) as client:
            for _ in range(40):
                front.refuse("PushStream", 1)
                async with client.pusher(window=4) as pusher:
                    pushed = [await pusher.push(body) for body in bodies]
                outcomes += await asyncio.gather(*pushed, return_exceptions=True)
        return outcomes

    outcomes = asyncio.run(rounds())
    stored = [o if isinstance(o, BaseException) else sorted(o.stored + o.duplicates) for o in outcomes]
    assert stored == [sorted(uids(body)) for body in bodies] * 40


def test_the_deadline_bounds_all_the_attempts_of_a_call(front: Front) -> None:
    front.refuse("Stats", 100, delay=0.6)
    with pytest.raises(DeadlineExceededError), BufferClient(front.target, timeout=1.0) as client:
        client.stats()
    assert 1 <= front.attempts("Stats") <= 2 < MAX_RETRIES + 1


def test_retried_and_unretried_calls_share_one_connection(front: Front) -> None:
    with BufferClient(front.target) as client:
        client.push(group(3))  # over the channel with the retry policy
        client.writers("default", 1)  # over the one without it
        with client.pusher() as pusher:
            pusher.push(group(4)).result()
        client.writers("default", -1)
    assert len(front.calls) == 4 and len({peer for _, peer in front.calls}) == 1, front.calls


@pytest.mark.parametrize("kind", KINDS)
def test_with_wait_for_ready_a_push_and_a_read_wait_for_a_server_that_comes_back_after_the_retries(
    start_server: Servers, kind: str
) -> None:
    """The server listens 1.2 s after each call starts: later than the client's one retry takes
    (after 0.15 s at most, with gRPC's jitter), well within the deadline."""
    port, body = start_server.reserve_port(), group(5)
    for name, arg, check in (("push", body, "stored"), ("get", uids(body), "missing_uids")):
        later = threading.Timer(1.2, lambda: start_server(port=port))
        later.start()
        try:
            result = call(kind, f"127.0.0.1:{port}", name, arg, wait_for_ready=True, timeout=30, retries=1)
        finally:
            later.join()
        assert getattr(result, check) == (uids(body) if name == "push" else [])
        start_server.stop_all(keep_ports=True)


class Gate:
    """A TCP port in front of a server that closes each connection it takes at once, as a port
    nothing listens on yet refuses it, until `open()`; then it forwards them. `attempts`: when
    each connection came, the client's reconnects."""

    def __init__(self, backend: int) -> None:
        self.attempts: list[float] = []
        self._backend, self._open = backend, threading.Event()
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._socket.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._socket.accept()
                self.attempts.append(time.monotonic())
                if not self._open.is_set():
                    conn.close()
                    continue
                backend = socket.create_connection(("127.0.0.1", self._backend))
                for source, sink in ((conn, backend), (backend, conn)):
                    threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


def test_a_server_back_just_after_a_reconnect_at_the_longest_pause_is_reached_by_the_next_call(
    server: ExpbufServer,
) -> None:
    """A client whose server was away long enough tries to reconnect at its longest pause; a
    call made as the server comes back is retried for longer than that pause, so it reaches the
    server (the retries spanned 0.75 s against 2 s between reconnects: such a call failed
    UNAVAILABLE up to 2.4 s after the server listened again). The asyncio client's channels take
    the same options (ClientBase._open)."""
    longest = dict(RECONNECT)["grpc.max_reconnect_backoff_ms"] / 1000
    gate = Gate(server.port)
    try:
        with BufferClient(gate.target, timeout=30) as client:
            deadline = time.monotonic() + 30
            while not (len(gate.attempts) > 2 and gate.attempts[-1] - gate.attempts[-2] > 0.75 * longest):
                assert time.monotonic() < deadline, f"the reconnects never reached their longest pause: {gate.attempts}"
                with pytest.raises(UnavailableError):
                    client.stats()
            seen = len(gate.attempts)
            wait_for(lambda: len(gate.attempts) > seen, "the channel's next reconnect")
            gate.open()  # the server is back just after a reconnect failed: the next one is a whole pause away
            assert "default" in client.stats().tables
    finally:
        gate.close()


def test_a_server_that_is_down_fails_a_call_unavailable_and_wait_for_ready_waits_only_for_retried_calls(
    start_server: Servers,
) -> None:
    target = f"127.0.0.1:{start_server.reserve_port()}"  # nothing listens there
    for retries in (0, MAX_RETRIES):
        with pytest.raises(UnavailableError):
            call("blocking", target, "push", group(6), retries=retries)
    with pytest.raises(UnavailableError):  # retry=False: one attempt, now; it would wait 30 s otherwise
        call("blocking", target, "writers", "default", 1, wait_for_ready=True, timeout=30)
    with pytest.raises(DeadlineExceededError):  # a retried call waits, until its deadline
        call("blocking", target, "stats", "", wait_for_ready=True, timeout=0.5)


# ---- waiting calls refused because as many as the server lets wait already do -------------


def refused(server: ExpbufServer, method: str) -> float:
    """Calls of `method` the server refused RESOURCE_EXHAUSTED, by its own metrics."""
    return sum(
        value
        for (name, labels), value in scrape(server.metrics_port).items()
        if name == "expbuf_rpc_duration_seconds_count"
        and dict(labels) == {"method": method, "code": "RESOURCE_EXHAUSTED"}
    )


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def ledger_client(kind: str, target: str) -> BufferClient | ShardedBufferClient:
    """A blocking client of the server (the asyncio kind's admin), or a sharded one of it alone."""
    return ShardedBufferClient({"a": target}) if kind == "sharded" else BufferClient(target)


def claims_at_once(kind: str, target: str, count: int, wait: float) -> list[Claim]:
    """`count` claims of one prompt each, made at once by one client of `kind`, each waiting `wait`."""
    if kind == "asyncio":

        async def body() -> list[Claim]:
            async with AsyncBufferClient(target) as client:
                return list(await asyncio.gather(*(client.claim("t", "d", 1, wait=wait) for _ in range(count))))

        return asyncio.run(body())
    with ledger_client(kind, target) as client, futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: client.claim("t", "d", 1, wait=wait), range(count)))


@pytest.mark.parametrize("kind", ("blocking", "asyncio", "sharded"))
def test_a_waiting_claim_refused_at_the_servers_cap_waits_in_the_client_and_claims_again(
    start_server: Servers, kind: str
) -> None:
    """The server lets one claim wait; of two claims waiting at once, the second is refused and
    made again by its client until it gets in, and both get a prompt once two are freed."""
    server = start_server(max_waiting_claims=1)
    target = f"127.0.0.1:{server.port}"
    got: list[Claim] = []
    with ledger_client(kind, target) as admin:
        admin.create_table("t", group_size=1)
        admin.create_dataset("t", "d", 2, max_in_flight=2)
        held = admin.claim("t", "d", 2).prompts  # every prompt out: the claims below wait
        claimers = threading.Thread(target=lambda: got.extend(claims_at_once(kind, target, 2, 30)))
        claimers.start()
        try:
            wait_for(lambda: refused(server, "Claim"), "no claim was refused at the cap")
            assert admin.release_claims(held) == 2
        finally:
            claimers.join(60)
    assert sorted(len(claim.prompts) for claim in got) == [1, 1], got
    assert sorted(p.index for claim in got for p in claim.prompts) == [0, 1]


def wait_one_second(kind: str, target: str, method: str) -> Any:
    """A claim of one prompt of dataset `d`, or an admit of one rollout, on table `t` that waits 1 s."""
    if kind == "asyncio":

        async def body() -> Any:
            async with AsyncBufferClient(target, timeout=10) as client:
                if method == "Claim":
                    return await client.claim("t", "d", 1, wait=1.0)
                return await client.admit("t", 1, wait=1.0)

        return asyncio.run(body())
    with BufferClient(target, timeout=10) as client:
        return client.claim("t", "d", 1, wait=1.0) if method == "Claim" else client.admit("t", 1, wait=1.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ("Claim", "Admit"))
def test_a_waiting_call_kept_out_for_its_whole_wait_answers_without_waiting_within_its_deadline(
    start_server: Servers, kind: str, method: str
) -> None:
    """While another call holds the one place the server lets a claim (an admit) wait in, a claim
    (an admit) asking to wait 1 s is refused and made again until its wait is spent, then made
    once without waiting: it answers with what there is (nothing), not with the refusal."""
    server = start_server(max_waiting_claims=1, max_waiting_admits=1)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin, grpc.insecure_channel(target) as channel:
        admin.create_table("t", group_size=1, max_staleness=0, batch_size=1)
        admin.create_dataset("t", "d", 1)
        admin.claim("t", "d", 1)
        assert admin.admit("t", 1).count == 1  # the table has no more room
        stub = buffer_pb2_grpc.ExperienceBufferStub(channel)
        if method == "Claim":
            holder = stub.Claim.future(
                buffer_pb2.ClaimRequest(table="t", dataset="d", count=1, lease_seconds=300, wait_seconds=30)
            )
        else:
            holder = stub.Admit.future(buffer_pb2.AdmitRequest(table="t", count=1, wait_seconds=30))
        kind_of = "waiting_claim" if method == "Claim" else "waiting_admit"
        wait_for(lambda: server.call_limits.in_progress(kind_of) == 1, "the holding call did not start waiting")
        try:
            answer = wait_one_second(kind, target, method)
            if method == "Claim":
                assert (answer.prompts, answer.done) == ([], False)
            else:
                assert answer.count == 0
            assert refused(server, method) >= 1  # it was kept out, and asked again
            assert not holder.done()
        finally:
            holder.cancel()


def test_the_attempts_of_a_waiting_call_end_by_its_first_deadline_the_last_one_not_waiting() -> None:
    """Each attempt after a busy refusal waits what is left of the wait and ends by the first
    attempt's deadline; once the wait is spent, one more without waiting, then the refusal."""
    first = ledger_calls.claim_call("t", "d", 1, 300.0, "", wait=1.0, timeout=3.0)
    attempts = calls_module.Attempts(first, timeout=30.0)
    deadline = time.monotonic() + (first.timeout or 0)  # the first attempt's deadline is at most this
    busy = ResourceExhaustedError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
    busy.busy = True
    made = [attempts.call]
    while True:
        asked = time.monotonic()  # the next attempt starts `pause` after a moment at least this late
        if (pause := attempts.after(busy)) is None:
            break
        assert pause >= 0
        assert asked + pause + (attempts.call.timeout or 0) <= deadline
        time.sleep(pause)
        made.append(attempts.call)
    waits = [call.request.wait_seconds for call in made]
    assert len(made) >= 3 and waits[-1] == 0 and all(w > 0 for w in waits[:-1])
    assert waits[:-1] == sorted(waits[:-1], reverse=True)
    other = calls_module.Attempts(first, timeout=30.0)
    assert other.after(ResourceExhaustedError(grpc.StatusCode.RESOURCE_EXHAUSTED, "table full")) is None
    unwaiting = calls_module.Attempts(ledger_calls.claim_call("t", "d", 1, 300.0, "", wait=0, timeout=2.0), 30.0)
    assert unwaiting.after(busy) is None


def test_the_attempts_of_a_push_kept_out_send_it_as_it_was_until_its_deadline() -> None:
    """A push refused as having done nothing is made again as it was (a push alone or in chunks)
    while an attempt may start before its deadline; any other refusal is its caller's answer."""
    busy = ResourceExhaustedError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
    busy.busy = True
    for chunk_bytes in (0, 1 << 16):
        first = calls_module.push(one_run("attempts"), "t", 0.5, chunk_bytes)
        attempts = calls_module.Attempts(first, timeout=30.0)
        made = [attempts.call]
        while (pause := attempts.after(busy)) is not None:
            time.sleep(pause)
            made.append(attempts.call)
        assert len(made) >= 2
        assert all(dataclasses.replace(call, timeout=None) == dataclasses.replace(first, timeout=None) for call in made)
        assert all(0 < (call.timeout or 0) <= 0.5 for call in made)
        other = calls_module.Attempts(first, timeout=30.0)
        assert other.after(ResourceExhaustedError(grpc.StatusCode.RESOURCE_EXHAUSTED, "table full")) is None


def test_a_call_kept_out_then_unanswered_by_its_deadline_is_answered_with_what_kept_it_out() -> None:
    """The error a caller gets: the refusal that kept the call out when an attempt made again after
    it reached the call's deadline unanswered (not busy: whether it got in is unknown); any other
    error as it came, a DEADLINE_EXCEEDED the server answered (its reason set) among them, and
    the client's own deadline on a call never kept out."""
    busy = ResourceExhaustedError(grpc.StatusCode.RESOURCE_EXHAUSTED, "table 't' is full", "table_full")
    busy.busy = True
    unanswered = DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    answered = DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "not ready", "not_ready")
    first = calls_module.push(one_run("answer"), "t", 30.0, 0)
    never = calls_module.Attempts(first, timeout=30.0)
    assert never.after(unanswered) is None and never.answer(unanswered) is unanswered
    attempts = calls_module.Attempts(first, timeout=30.0)
    assert attempts.after(busy) is not None
    assert attempts.after(unanswered) is None
    got = attempts.answer(unanswered)
    assert isinstance(got, ResourceExhaustedError) and (got.reason, got.busy) == ("table_full", False)
    assert got.details.startswith("table 't' is full") and "not answered" in got.details, got.details
    assert attempts.answer(answered) is answered


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_that_waited_for_a_server_it_never_reached_names_the_target(start_server: Servers, kind: str) -> None:
    """gRPC's own words are "Deadline Exceeded": the error says where the client looked, and why a
    call may wait out its deadline with wait_for_ready."""
    target = f"127.0.0.1:{start_server.reserve_port()}"  # nothing listens there
    with pytest.raises(DeadlineExceededError) as info:
        call(kind, target, "stats", "", wait_for_ready=True, timeout=0.5)
    assert target in info.value.details and "wait_for_ready" in info.value.details, info.value.details
    assert "TLS" in info.value.details, info.value.details  # a plaintext client: the server may take TLS only


# ---- pushes kept out of a full table because as many as the server lets wait already do -----

# How a rollout worker pushes: alone (blocking, asyncio, sharded), in chunks over a PushStream,
# or with a pipelined pusher of its own.
PUSH_KINDS = (
    *("blocking", "asyncio", "sharded"),
    *("chunks", "asyncio-chunks"),
    *("pusher", "asyncio-pusher", "sharded-pusher"),
)


def pushed_by(kind: str) -> str:
    """The method that carries a push of `kind`."""
    return "PushStream" if "chunks" in kind or "pusher" in kind else "Push"


def one_run(task: int | str) -> bytes:
    """One experience of 80 KB and more, sent in chunks by a client with push_chunk_bytes = 64 KiB."""
    return trxp.build(group_items("kept", task, 1, response=20_000))


def pushes_at_once(kind: str, target: str, bodies: list[bytes], timeout: float) -> list[Any]:
    """Each of `bodies` pushed to table `t` at once by a rollout worker of its own (a pusher of its
    own for a pusher's kind), all on one client of `kind` with `timeout`: each push's PushResult,
    or the error its caller got."""
    chunk_bytes = 1 << 16 if "chunks" in kind else 4 << 20
    if kind.startswith("asyncio"):

        async def body() -> list[Any]:
            async with AsyncBufferClient(target, timeout=timeout, push_chunk_bytes=chunk_bytes) as client:

                async def one(data: bytes) -> PushResult:
                    if "pusher" not in kind:
                        return await client.push(data, table="t")
                    async with client.pusher("t") as pusher:
                        future = await pusher.push(data)
                    return await future

                return list(await asyncio.gather(*(one(data) for data in bodies), return_exceptions=True))

        return asyncio.run(body())
    if kind.startswith("sharded"):
        client: BufferClient | ShardedBufferClient = ShardedBufferClient({"a": target}, timeout=timeout)
    else:
        client = BufferClient(target, timeout=timeout, push_chunk_bytes=chunk_bytes)

    def one(data: bytes) -> Any:
        try:
            if "pusher" not in kind:
                return client.push(data, table="t")
            with client.pusher("t") as pusher:
                return pusher.push(data).result()
        except ExpbufError as exc:
            return exc

    with client, futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def full_table(target: str) -> list[str]:
    """Table `t`, full (2 experiences) in block mode: pushes into it wait for room. The uids it holds."""
    with BufferClient(target) as admin:
        admin.create_table("t", estimator="none", group_by="none", capacity_experiences=2, when_full="block")
        held = [trxp.build(group_items("held", task, 1)) for task in range(2)]
        for data in held:
            admin.push(data, table="t")
    return [uid for data in held for uid in uids(data)]


@pytest.mark.parametrize("kind", PUSH_KINDS)
def test_pushes_kept_out_of_a_full_table_are_made_again_until_a_trainer_makes_room(
    start_server: Servers, kind: str
) -> None:
    """A block-mode table is full, and 10 rollout workers push into it at once on a server of 8
    workers: the server lets only so many wait for room (a push that waits is a call that waits
    idle), and refuses the others at once, as having done nothing. Their clients push them again
    after a pause, so once a trainer consumes, every push is stored, once, and none is refused
    to its caller."""
    server = start_server(workers=8)
    target = f"127.0.0.1:{server.port}"
    held = full_table(target)
    bodies = [one_run(task) for task in range(10)]
    outcomes: list[Any] = []
    consumed: list[str] = []
    pushers = threading.Thread(target=lambda: outcomes.extend(pushes_at_once(kind, target, bodies, 120)))
    pushers.start()
    try:
        wait_for(lambda: refused(server, pushed_by(kind)), "no push was kept out")
        with BufferClient(target) as trainer, contextlib.suppress(DeadlineExceededError):  # then: which push failed
            for batch in trainer.sample("t", num_groups=1, delivery="consume", timeout=30):
                consumed += batch.uids
                if len(consumed) == len(held) + len(bodies):
                    break
    finally:
        pushers.join(120)
    assert [o if isinstance(o, BaseException) else o.stored for o in outcomes] == [uids(data) for data in bodies]
    assert sorted(consumed) == sorted(held + [uid for data in bodies for uid in uids(data)])


@contextlib.contextmanager
def push_places_taken(server: ExpbufServer, count: int) -> Iterator[None]:
    """`count` idle PushStreams open on `server`, each holding one of the places push-scope calls
    wait in, until the block ends."""
    holds: list[Any] = []
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = buffer_pb2_grpc.ExperienceBufferStub(channel)
        for _ in range(count):
            hold: Any = queue.SimpleQueue()
            holds.append((hold, stub.PushStream(iter(hold.get, None), timeout=60)))
        try:
            wait_for(lambda: server.call_limits.in_progress("push_stream") == count, "the PushStreams did not open")
            yield
        finally:
            for hold, stream in holds:
                hold.put(None)
                stream.cancel()


def kept_out_limit(kind: str) -> str:
    """What the refusal of a push of `kind` kept out of the full table names."""
    return "max_push_streams = 5" if pushed_by(kind) == "PushStream" else "table 't' is full"


@pytest.mark.parametrize("kind", PUSH_KINDS)
def test_a_push_kept_out_past_its_deadline_is_refused_naming_the_limit(start_server: Servers, kind: str) -> None:
    """Idle PushStreams take every place the server lets push-scope calls wait in: a push into the
    full table is kept out (a push alone, as it would wait for room; a PushStream, at
    max_push_streams), made again while its deadline lasts, and then refused RESOURCE_EXHAUSTED
    naming what kept it out, however little of its deadline its last attempt had. Nothing of it
    is stored."""
    server = start_server(workers=8, max_push_streams=5)  # 8 - reserved_workers 1 - sample_scope_workers 2
    target = f"127.0.0.1:{server.port}"
    full_table(target)
    data = one_run("late")
    with push_places_taken(server, 5):
        (outcome,) = pushes_at_once(kind, target, [data], 3)
    assert isinstance(outcome, ExpbufError) and outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
    assert kept_out_limit(kind) in outcome.details, outcome.details
    assert refused(server, pushed_by(kind)) >= 2  # kept out, and made again
    with BufferClient(target) as admin:
        assert admin.get(uids(data), table="t").missing_uids == uids(data)


@pytest.mark.parametrize("kind", PUSH_KINDS)
def test_a_push_kept_out_whose_last_attempt_is_not_answered_by_its_deadline_is_refused_naming_the_limit(
    start_server: Servers, kind: str
) -> None:
    """A push made again after the server kept it out has what is left of its deadline, which may
    be too little for the answer to come back (the pauses fall close to it, a machine under load):
    here a proxy forwards the first attempt and holds every one after it until its deadline. Its
    caller gets the refusal that kept it out all the same, RESOURCE_EXHAUSTED naming the limit and
    saying that the last attempt went unanswered, not a bare DEADLINE_EXCEEDED; a pusher's push
    too (a bare DEADLINE_EXCEEDED once failed CI's run of the test above). Nothing is stored."""
    server = start_server(workers=8, max_push_streams=5)
    target = f"127.0.0.1:{server.port}"
    full_table(target)
    data = one_run("held")
    proxy = Front(target)
    try:
        with push_places_taken(server, 5):
            proxy.hold(pushed_by(kind), after=1)
            (outcome,) = pushes_at_once(kind, proxy.target, [data], 1)
        assert proxy.attempts(pushed_by(kind)) >= 2  # kept out, and made again
    finally:
        proxy.close()
    assert isinstance(outcome, ExpbufError) and outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
    assert kept_out_limit(kind) in outcome.details and "not answered" in outcome.details, outcome.details
    assert refused(server, pushed_by(kind)) == 1
    with BufferClient(target) as admin:
        assert admin.get(uids(data), table="t").missing_uids == uids(data)


def test_calls_made_as_the_server_restarts_wait_for_it_none_cancelled(start_server: Servers) -> None:
    """A server whose stop begins cancels the calls that arrive just then, before any of them ran
    (gRPC's own answer, CANCELLED): the client's retry policy made calls again on UNAVAILABLE only,
    so a rolling restart failed a few of many clients' calls (14 in 8 restarts of 4 callers once).
    They are made again on CANCELLED too, and with wait_for_ready reach the restarted server."""
    server = start_server()
    port = server.port
    outcomes: Counter[str] = Counter()
    done = threading.Event()

    def call_on() -> None:
        with BufferClient(f"127.0.0.1:{port}", timeout=20, wait_for_ready=True) as client:
            while not done.is_set():
                try:
                    client.stats("default")
                    outcomes["ok"] += 1
                except ExpbufError as exc:
                    outcomes[exc.code.name] += 1

    callers = [threading.Thread(target=call_on) for _ in range(4)]
    for caller in callers:
        caller.start()
    try:
        for _ in range(6):
            time.sleep(0.3)
            start_server.stop(server)
            server = start_server(port=port)
    finally:
        done.set()
        for caller in callers:
            caller.join()
    assert outcomes["ok"] and set(outcomes) == {"ok"}, outcomes


@pytest.mark.parametrize("kind", ["pusher", "asyncio pusher"])
def test_a_pushers_stream_the_server_cancels_as_its_stop_begins_is_sent_again(front: Front, kind: str) -> None:
    """A server whose stop begins cancels the calls that arrive just then (CANCELLED, nothing of them
    read), a pusher's new stream among them: the pusher took that for its own channel's close and
    failed the push as perhaps stored. It sends it again, as after UNAVAILABLE, and it is stored."""
    with BufferClient(front.target) as client:
        client.create_table("t", group_size=4, exist_ok=True)
    front.refuse("PushStream", 1, code=grpc.StatusCode.CANCELLED)
    data = trxp.build(group_items(7, 0, 4))
    (outcome,) = pushes_at_once(kind, front.target, [data], 10)
    assert isinstance(outcome, PushResult) and len(outcome.stored) == 4, outcome
    assert front.attempts("PushStream") == 2
