"""Pipelined pushes: a pusher keeps up to `window` pushes in flight over one PushStream, from the
blocking and the asyncio client. Each push's future holds its own outcome, the futures complete
in the order of the pushes, a refused push fails alone and names its uids, and the others in
the window are stored (checked by Get)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from test_push_stream import wait_until, writer_held

from expbuf.client import (
    AlreadyExistsError,
    AsyncBatch,
    AsyncBufferClient,
    BufferClient,
    ExpbufError,
    InvalidArgumentError,
    PushResult,
    UnavailableError,
    trxp,
)
from expbuf.client.rpc import calls, frames
from expbuf.client.rpc.calls import sample_stream
from expbuf.client.rpc.connection import SERVICE
from expbuf.client.rpc.wire import MESSAGE_BYTES, reason_of
from expbuf.client.schema.reasons import Reason
from expbuf.client.shards.aio import AsyncShardedBufferClient
from expbuf.client.shards.blocking import ShardedBufferClient

from conftest import Servers
from helpers import SlowReplies, group_items, make_experience, scrape

Outcome = PushResult | ExpbufError
log = logging.getLogger(__name__)


def group(batch: str, task: int, size: int = 4, reward: float = 1.0) -> list[Any]:
    return [make_experience(batch, task, run, reward=reward) for run in range(size)]


def uids(items: Sequence[Any]) -> list[str]:
    return [item.eid.uid for item in items]


def push_sync(
    target: str, table: str, pushes: Sequence[Any], window: int, timeout: float | None = None
) -> tuple[list[Outcome], list[int]]:
    """Each push's outcome, and the order in which their futures completed (each push with
    `timeout`, the client's by default)."""
    done: list[int] = []
    with (
        BufferClient(target, push_chunk_bytes=1 << 16) as client,
        client.pusher(table, window=window, timeout=timeout) as pusher,
    ):
        pending = []
        for index, items in enumerate(pushes):
            future = pusher.push(items)
            future.add_done_callback(lambda _, index=index: done.append(index))
            pending.append(future)
            assert pusher.in_flight <= window
        futures.wait(pending)
    return [f.exception() or f.result() for f in pending], done  # type: ignore[misc]


def push_async(
    target: str, table: str, pushes: Sequence[Any], window: int, timeout: float | None = None
) -> tuple[list[Outcome], list[int]]:
    async def body() -> tuple[list[Outcome], list[int]]:
        done: list[int] = []
        async with AsyncBufferClient(target, push_chunk_bytes=1 << 16) as client:
            async with client.pusher(table, window=window, timeout=timeout) as pusher:
                pending = []
                for index, items in enumerate(pushes):
                    future = await pusher.push(items)
                    future.add_done_callback(lambda _, index=index: done.append(index))
                    pending.append(future)
                    assert pusher.in_flight <= window
            outcomes = await asyncio.gather(*pending, return_exceptions=True)
        return list(outcomes), done

    return asyncio.run(body())


PUSHERS: dict[str, Callable[..., tuple[list[Outcome], list[int]]]] = {
    "blocking": push_sync,
    "asyncio": push_async,
}


def stream_calls(port: int) -> float:
    return sum(
        value
        for (name, labels), value in scrape(port).items()
        if name == "expbuf_rpc_duration_seconds_count" and dict(labels)["method"] == "PushStream"
    )


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_idle_pushers_give_back_the_room_their_streams_hold(start_server: Servers, kind: str) -> None:
    """A pusher's open stream holds the server's room for its next message (the most a chunk's, 4
    MiB): the streams of pushers whose pushes were all answered stayed open up to twice the timeout,
    so a few hundred idle pushers held all of max_inflight_bytes (at its default) and every other
    push waited for room until its deadline (a helper's audit). A stream with no push sent on it for
    pipeline.QUIET ends, and gives its room back: eight pushers in turn each push where four streams
    hold all the room there is."""
    server = start_server(max_inflight_bytes=16 << 20)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin:
        admin.create_table("t", estimator="none", group_size=1)
    pushes = [[make_experience(kind, task, 0)] for task in range(8)]

    def blocking() -> list[PushResult]:
        clients = [BufferClient(target, timeout=8) for _ in pushes]
        pushers = [client.pusher("t") for client in clients]
        try:
            return [pusher.push(items).result() for pusher, items in zip(pushers, pushes, strict=True)]
        finally:
            for client in clients:
                client.close()

    async def asyncio_pushes() -> list[PushResult]:
        clients = [AsyncBufferClient(target, timeout=8) for _ in pushes]
        try:
            return [await (await client.pusher("t").push(items)) for client, items in zip(clients, pushes, strict=True)]
        finally:
            for client in clients:
                await client.close()

    results = blocking() if kind == "blocking" else asyncio.run(asyncio_pushes())
    assert [len(result.stored) for result in results] == [1] * 8


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_busy_pushers_of_small_pushes_hold_room_for_small_messages(start_server: Servers, kind: str) -> None:
    """A pusher's open stream declared the most a chunk's message takes (4 MiB) whatever it pushed,
    and the server holds that for its next message while it is open: pushers that push small
    experiences without a pause of pipeline.QUIET held 4 MiB each, so a few hundred of them (with
    max_push_streams raised for as many rollout workers) held all of the default
    max_inflight_bytes, and every other push waited for room until its deadline. A stream declares
    what the pushes it opened for take, rounded up to a power of two of at least 64 KiB; a larger
    push opens a stream of its own. Here eight busy pushers share 16 MiB: five of them would need
    20 MiB at 4 MiB each."""
    server = start_server(max_inflight_bytes=16 << 20)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin:
        admin.create_table("t", estimator="none", group_size=1)
    seconds, workers = 4.0, 8
    most: list[int] = [0]

    def watch(until: float) -> None:
        while time.monotonic() < until:
            most[0] = max(most[0], server.inflight.held)
            time.sleep(0.01)

    def blocking(worker: int, until: float) -> list[PushResult]:
        with BufferClient(target, timeout=2) as client, client.pusher("t") as pusher:
            task, results = 0, []
            while time.monotonic() < until:
                results.append(pusher.push([make_experience(f"{kind}{worker}", task, 0)]).result())
                task += 1
            return results

    async def asyncio_pushes(worker: int, until: float) -> list[PushResult]:
        async with AsyncBufferClient(target, timeout=2) as client:
            pusher, task, results = client.pusher("t"), 0, []
            while time.monotonic() < until:
                results.append(await (await pusher.push([make_experience(f"{kind}{worker}", task, 0)])))
                task += 1
            await pusher.close()
            return results

    until = time.monotonic() + seconds
    watcher = threading.Thread(target=watch, args=(until,))
    watcher.start()
    if kind == "blocking":
        with futures.ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(blocking, range(workers), [until] * workers))
    else:

        async def all_of() -> list[list[PushResult]]:
            return list(await asyncio.gather(*(asyncio_pushes(worker, until) for worker in range(workers))))

        done = asyncio.run(all_of())
    watcher.join()
    assert all(results and all(len(result.stored) == 1 for result in results) for results in done)
    assert 0 < most[0] <= workers * (1 << 17), most[0]  # at most 128 KiB a stream: a small message's room


@pytest.mark.parametrize("kind", sorted(PUSHERS))
def test_every_push_in_a_window_is_answered_in_order_over_one_stream(start_server: Servers, kind: str) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as client:
        client.create_table("g4", group_size=4)
    pushes = [group(kind, task) for task in range(12)]
    outcomes, order = PUSHERS[kind](target, "g4", pushes, 4)
    assert order == list(range(12))
    for task, (items, outcome) in enumerate(zip(pushes, outcomes, strict=True)):
        assert isinstance(outcome, PushResult)
        assert outcome.stored == uids(items) and outcome.duplicates == []
        assert outcome.completed_groups == [f"{kind}/{task}"]
    assert stream_calls(server.metrics_port) == 1
    with BufferClient(target) as client:
        assert client.get([u for items in pushes for u in uids(items)], table="g4").missing_uids == []


@pytest.mark.parametrize("kind", sorted(PUSHERS))
def test_a_refused_push_in_the_middle_of_a_window_fails_alone_naming_its_uids(start_server: Servers, kind: str) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    first, conflict = group(kind, 0), group(kind, 9, reward=0.0)
    conflict[0] = make_experience(kind, 0, 0, reward=0.0)  # first[0]'s uid with other bytes
    garbage = b"TRXP not a payload"
    pushes = [first, group(kind, 1), conflict, group(kind, 2), garbage, group(kind, 3), group(kind, 1)]
    outcomes, order = PUSHERS[kind](target, "default", pushes, 4)
    assert order == list(range(len(pushes)))
    refused = outcomes[2]
    assert isinstance(refused, AlreadyExistsError)
    for uid in uids(conflict):
        assert uid in refused.details
    assert "push 3 of this pusher" in refused.details
    unreadable = outcomes[4]
    assert isinstance(unreadable, InvalidArgumentError) and "push 5 of this pusher" in unreadable.details
    for index in (0, 1, 3, 5):
        outcome = outcomes[index]
        assert isinstance(outcome, PushResult) and outcome.stored == uids(pushes[index])
    again = outcomes[6]  # the same group twice in one window: the second is a duplicate
    assert isinstance(again, PushResult) and again.stored == [] and again.duplicates == uids(pushes[1])
    with BufferClient(target) as client:
        stored = client.get([u for i in (0, 1, 3, 5) for u in uids(pushes[i])])
        assert stored.missing_uids == []
        assert client.get(uids(conflict)[1:]).missing_uids == uids(conflict)[1:]  # nothing of a refused push


@pytest.mark.parametrize("kind", sorted(PUSHERS))
def test_a_push_refused_while_the_pusher_still_writes_fails_with_the_refusal(start_server: Servers, kind: str) -> None:
    """The server refuses the first push of a window while the client is still writing the
    others, round after round: the refused push fails with the server's own refusal, never with
    the failed write's INTERNAL ("Internal error from Core", which grpc.aio made of such a write
    in 7 to 14 of these 30 rounds), and every push after it is stored on the stream that follows."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as client:
        client.push(group("base", 0))
    conflict = trxp.encode(group("base", 0, reward=0.0))  # the same uids with other bytes
    for round_ in range(30):
        after = [[make_experience(f"w{round_}", task, run, response=2000) for run in range(4)] for task in range(4)]
        outcomes, _ = PUSHERS[kind](target, "default", [conflict, *after], 5)
        assert isinstance(outcomes[0], AlreadyExistsError), f"round {round_}: {outcomes[0]!r}"
        assert "push 1 of this pusher" in outcomes[0].details
        for items, outcome in zip(after, outcomes[1:], strict=True):
            assert isinstance(outcome, PushResult) and outcome.stored == uids(items), f"round {round_}: {outcome!r}"


def test_a_pusher_holds_at_most_its_window_and_waits_for_room(start_server: Servers) -> None:
    """Two pushes in flight on a full table that blocks: a third push() waits until one is answered."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, timeout=60) as client:
        client.create_table("full", group_size=4, capacity_experiences=4, when_full="block")
        client.push(group("full", 0), table="full")
        with client.pusher("full", window=2) as pusher:
            waiting = [pusher.push(group("full", task)) for task in (1, 2)]
            assert pusher.in_flight == 2
            third_sent = threading.Event()

            def third() -> None:
                waiting.append(pusher.push(group("full", 3)))
                third_sent.set()

            thread = threading.Thread(target=third)
            thread.start()
            assert not third_sent.wait(0.5) and pusher.in_flight == 2
            for _ in range(3):  # each batch taken makes room for the next group
                assert next(client.sample("full", num_groups=1, delivery="consume", max_batches=1)).groups
            thread.join(60)
            assert third_sent.is_set()
        assert [len(f.result().stored) for f in waiting] == [4, 4, 4]


@pytest.mark.parametrize("window", [0, 65, 1.5, True])
def test_a_window_out_of_bounds_is_refused_naming_it(start_server: Servers, window: Any) -> None:
    server = start_server()
    with (
        BufferClient(f"127.0.0.1:{server.port}") as client,
        pytest.raises(ValueError, match=r"window must be an integer from 1 to 64, got"),
    ):
        client.pusher("default", window=window)


def test_a_pusher_sends_large_payloads_in_chunks_among_whole_ones(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    big = [make_experience("big", 0, run, response=20_000) for run in range(2)]
    pushes = [group("small", 0), big, group("small", 1), trxp.encode(group("small", 2))]
    outcomes, order = push_sync(target, "default", pushes, 3)
    assert order == [0, 1, 2, 3]
    assert [o.stored if isinstance(o, PushResult) else o for o in outcomes] == [uids(p) for p in pushes[:3]] + [
        uids(group("small", 2))
    ]


class HeldEnd:
    """A hook on a client's PushStreams: the first that the server ends reaches its pusher's
    reader only once `release` is set. Until then the pusher has not seen the end (`ended`, with
    the status it came with) and still sends its pushes on that stream, as one does whose push
    and the server's end of its stream cross."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.release = threading.Event()
        self.status: tuple[Any, str | None] | None = None

    def hold(self, error: grpc.RpcError) -> None:
        if self.status is None:
            self.status = (error.code(), reason_of(error.trailing_metadata()))
            self.ended.set()
        assert self.release.wait(30), "the test never let the pusher see its stream end"

    def blocking(self, client: BufferClient) -> None:
        opened = client.push_stream

        def push_stream(*args: Any, **kwargs: Any) -> Any:
            def replies() -> Iterator[Any]:
                try:
                    yield from opened(*args, **kwargs)
                except grpc.RpcError as error:
                    self.hold(error)
                    raise

            return replies()

        client.push_stream = push_stream  # type: ignore[method-assign]

    def asyncio(self, client: AsyncBufferClient) -> None:
        opened, hook = client.push_stream, self

        class Call:
            def __init__(self, call: Any) -> None:
                self._call = call

            def __getattr__(self, name: str) -> Any:
                return getattr(self._call, name)

            async def read(self) -> Any:
                try:
                    return await self._call.read()
                except grpc.RpcError as error:
                    await asyncio.to_thread(hook.hold, error)
                    raise

        client.push_stream = lambda *args, **kwargs: Call(opened(*args, **kwargs))  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", sorted(PUSHERS))
def test_a_push_sent_as_the_server_ends_an_idle_stream_goes_again_on_a_new_one(
    start_server: Servers, kind: str
) -> None:
    """A pusher idle past push_stream_idle_seconds pushes as the server ends its stream, before
    it has seen the end: the server read nothing after the pusher's last answered push, so the
    push goes on a new stream and is stored once (it failed DEADLINE_EXCEEDED "PushStream idle"
    before, the idle end taken for the push's refusal). The server's idle bound is below
    pipeline.QUIET, after which the pusher ends an idle stream itself."""
    server = start_server(push_stream_idle_seconds=0.3)
    target = f"127.0.0.1:{server.port}"
    first, second = group(kind, 0), group(kind, 1)
    hook = HeldEnd()

    def outcome_sync() -> Outcome:
        with BufferClient(target) as client:
            hook.blocking(client)
            with client.pusher("g4") as pusher:
                assert pusher.push(first).result(timeout=30).stored == uids(first)
                assert hook.ended.wait(30), "the server did not end the idle stream"
                later = pusher.push(second)  # on the stream the server ended: the pusher has not seen its end
                hook.release.set()
                return later.exception(timeout=30) or later.result()

    async def outcome_async() -> Outcome:
        async with AsyncBufferClient(target) as client:
            hook.asyncio(client)
            async with client.pusher("g4") as pusher:
                assert (await (await pusher.push(first))).stored == uids(first)
                assert await asyncio.to_thread(hook.ended.wait, 30), "the server did not end the idle stream"
                later = await pusher.push(second)
                hook.release.set()
                return (await asyncio.gather(later, return_exceptions=True))[0]

    with BufferClient(target) as client:
        client.create_table("g4", group_size=4)
    outcome = outcome_sync() if kind == "blocking" else asyncio.run(outcome_async())
    assert hook.status == (grpc.StatusCode.DEADLINE_EXCEEDED, Reason.IDLE)
    assert isinstance(outcome, PushResult), repr(outcome)
    assert outcome.stored == uids(second) and outcome.duplicates == []
    with BufferClient(target) as client:
        assert client.get(uids(first) + uids(second), table="g4").missing_uids == []


@pytest.mark.parametrize("kind", sorted(PUSHERS))
def test_pushes_unanswered_at_the_pusher_s_deadline_are_reported_as_the_server_holds_them(
    start_server: Servers, kind: str
) -> None:
    """The server reads a window of pushes while its writer is held, stores the first, and the
    others wait for the writer again (a slow disk) until the pusher's stream is past its deadline
    (the pusher's `timeout`); the writer then stores them. A push reported stored is held, one
    reported not stored is not (its caller pushes it again), and of any other the report says
    that whether it was stored is unknown: the pushes after the oldest unanswered one were
    reported not stored, and were held."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as client:
        client.create_table("g4", group_size=4)
    groups = [group(kind, task) for task in range(4)]
    pushes = [calls.payload(items) for items in groups]
    # What the server holds once it has read them: each push's bytes, and, while the stream is
    # open, the room it keeps for the next message, as large as the pusher declares its messages
    # (chunks of 64 KiB). The asyncio pusher's close() ends the stream at once (nothing follows its
    # pushes), the blocking one's after push_sync's wait for the futures.
    read = sum(map(len, pushes))
    held = (read, read + frames.most_push_request(1 << 16, "g4"))
    outcomes: list[Outcome] = []
    release = threading.Event()
    held_again = threading.Thread(
        target=server.store.environment.submit, args=(lambda _: release.wait(60),), kwargs={"background": True}
    )
    pusher = threading.Thread(target=lambda: outcomes.extend(PUSHERS[kind](target, "g4", pushes, 4, timeout=0.5)[0]))
    with writer_held(server):
        held_again.start()  # the writer's next commit, then this, alone
        pusher.start()
        wait_until(lambda: server.inflight.held in held, "the server did not read the pushes")
    pusher.join(30)
    release.set()
    held_again.join(30)
    wait_until(lambda: server.inflight.held == 0, "the server did not store or let go of what it read")
    with BufferClient(target) as client:
        missing = set(client.get([uid for items in groups for uid in uids(items)], table="g4").missing_uids)
    assert len(outcomes) == len(pushes)
    for items, outcome in zip(groups, outcomes, strict=True):
        held = [uid for uid in uids(items) if uid not in missing]
        if isinstance(outcome, PushResult):
            assert held == outcome.stored == uids(items)
        elif "not stored" in outcome.details:
            assert held == [], outcome
        else:
            assert "whether it was stored is unknown" in outcome.details, outcome


@contextlib.contextmanager
def dropping(target: str, lost: int) -> Iterator[str]:
    """The address of a front of the server at `target`: a gRPC server on loopback that passes
    each PushStream through to it, message by message as bytes, and its replies back, but drops
    the `lost`-th message of all it reads, as gRPC's transparent retry can drop a message it
    reports sent (connection.RETRIED_METHODS): the server never gets that push, and answers the
    others of the stream. Unary calls (a sharded client's questions) it passes through whole."""
    messages = itertools.count(1)
    channel = grpc.insecure_channel(target)
    forward = channel.stream_stream(f"/{SERVICE}/PushStream")

    def unary(method: str) -> grpc.RpcMethodHandler:
        call = channel.unary_unary(method)

        def passed(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                return call(request, metadata=context.invocation_metadata(), timeout=context.time_remaining())
            except grpc.RpcError as exc:
                context.set_trailing_metadata(exc.trailing_metadata())
                context.abort(exc.code(), exc.details())

        return grpc.unary_unary_rpc_method_handler(passed)

    def push_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        declared = [(key, value) for key, value in context.invocation_metadata() if key == MESSAGE_BYTES]
        passed = (message for message in requests if next(messages) != lost)
        call = forward(passed, metadata=declared, timeout=context.time_remaining())
        context.add_callback(call.cancel)
        try:
            yield from call
        except grpc.RpcError as exc:
            context.set_trailing_metadata(exc.trailing_metadata())
            context.abort(exc.code(), exc.details())

    class Front(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
            method: str = details.method  # type: ignore[attr-defined]
            if method == f"/{SERVICE}/PushStream":
                return grpc.stream_stream_rpc_method_handler(push_stream)
            return unary(method)

    front = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    front.add_generic_rpc_handlers((Front(),))
    port = front.add_insecure_port("127.0.0.1:0")
    front.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        front.stop(None)
        channel.close()


def large(batch: str, task: int) -> list[Any]:
    """A group of 4 whose payload goes in about 5 chunks of push_sync's and push_async's 64 KiB."""
    return [make_experience(batch, task, run, response=8_000) for run in range(4)]


@dataclass(frozen=True)
class Loss:
    """A message lost on its way to the server (`dropping`): the pushes made, which message of
    all the front reads is lost, the push it belongs to, and what the server's answer says of it."""

    pushes: Callable[[str, int], list[Any]]
    message: int
    push: int
    says: str


LOSSES = {
    # the third push, sent whole: the server answers the fourth first
    "a push": Loss(group, 3, 2, "never got this push"),
    # the second chunk of the first push in chunks: the server reads the second push's first message
    # before its last chunk, and refuses it as cut short
    "a chunk": Loss(large, 2, 0, "never came"),
    # the first chunk of the second push in chunks (each takes 5 messages): the server reads its second
    # chunk after the first push, with neither table nor seq, and refuses it as cut short
    "a first chunk": Loss(large, 6, 1, "never came"),
    # the first chunk of the stream's first push: the server's first message is its second chunk,
    # which says where in a payload it starts, and refuses it as cut short
    "the stream's first chunk": Loss(large, 1, 0, "never came"),
}


def loss_table(target: str) -> None:
    with BufferClient(target) as client:
        client.create_table("g4", group_size=4, estimator="none")


@pytest.mark.parametrize("lost", sorted(LOSSES))
@pytest.mark.parametrize("kind", sorted(PUSHERS))
def test_a_push_the_server_never_got_goes_again_on_a_new_stream(start_server: Servers, kind: str, lost: str) -> None:
    """A message is lost on its way (`dropping`): a push's, which the server's answers skip, or a
    chunk of a push in chunks, which the server refuses as cut short (reason cut_short), nothing of
    it stored. The pusher sends that push again, on a new stream, with any after it that the
    server did not read, and every push is stored once, read back as pushed, each future with its
    own result, in order. (The push failed INTERNAL "PushStream answered seq 4, not 3", and every
    push after it on the stream failed, each answer then taken for the push before its own; the
    push in chunks failed INVALID_ARGUMENT "a chunk after the first carries a payload and nothing
    else", though it was well formed.)"""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    loss = LOSSES[lost]
    loss_table(target)
    pushes = [loss.pushes(kind, task) for task in range(6)]
    with dropping(target, loss.message) as front:
        outcomes, order = PUSHERS[kind](front, "g4", pushes, 4)
    assert order == list(range(len(pushes)))
    stored_once(target, pushes, outcomes)
    assert stream_calls(server.metrics_port) == 2


def stored_once(target: str, pushes: Sequence[Any], outcomes: Sequence[Outcome]) -> None:
    """Each push answered with its own uids stored, and every experience stored once, read back
    as pushed."""
    for items, outcome in zip(pushes, outcomes, strict=True):
        assert isinstance(outcome, PushResult), repr(outcome)
        assert outcome.stored == uids(items) and outcome.duplicates == []
    with BufferClient(target) as client:
        got = client.get([u for items in pushes for u in uids(items)], table="g4")
        assert got.missing_uids == []
        assert [trxp.encode([exp]) for exp in got] == [trxp.encode([item]) for items in pushes for item in items]
        stats = client.stats("g4")["g4"]
    assert (stats.pushed, stats.duplicates) == (sum(map(len, pushes)), 0)


@pytest.mark.parametrize("lost", sorted(LOSSES))
def test_a_push_the_server_never_got_fails_not_stored_once_the_retries_are_spent(
    start_server: Servers, lost: str
) -> None:
    """As above, from a client with no retries (`retries=0`): the push the server never got whole
    fails UnavailableError saying it was not stored, and was not; the pushes after it keep their
    own answers."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    loss = LOSSES[lost]
    loss_table(target)
    pushes = [loss.pushes("spent", task) for task in range(5)]
    with (
        dropping(target, loss.message) as front,
        BufferClient(front, retries=0, push_chunk_bytes=1 << 16) as client,
        client.pusher("g4") as pusher,
    ):
        pending = [pusher.push(items) for items in pushes]
        outcomes = [future.exception(timeout=30) or future.result() for future in pending]
    failed = outcomes.pop(loss.push)
    assert isinstance(failed, UnavailableError), repr(failed)
    assert loss.says in failed.details and "not stored" in failed.details
    assert list(failed.uids) == uids(pushes[loss.push])
    for items, outcome in zip(pushes[: loss.push] + pushes[loss.push + 1 :], outcomes, strict=True):
        assert isinstance(outcome, PushResult), repr(outcome)
        assert outcome.stored == uids(items)
    with BufferClient(target) as client:
        missing = client.get([u for items in pushes for u in uids(items)], table="g4").missing_uids
    assert missing == uids(pushes[loss.push])


def messages_of(pushes: Sequence[Any]) -> int:
    """How many messages the pushes take on a stream of push_sync's and push_async's (chunks of 64 KiB)."""
    return sum(len(list(calls.push_requests(calls.payload(items), "g4", 1 << 16))) for items in pushes)


LAST_LOSSES = {
    # the last chunk of the last push: no message follows it
    "its last chunk": (large, 0),
    # a chunk in the middle of the last push
    "a chunk": (large, 2),
    # the last push, sent whole
    "all of it": (group, 0),
}


def push_then_wait(kind: str, target: str, pushes: Sequence[Any], wait: str, timeout: float) -> list[Outcome]:
    """Each push's outcome, from a pusher that pushes them all and then waits for them with
    `wait`: flush() or close() before it looks at a future, or each future's result."""

    def blocking() -> list[Outcome]:
        with BufferClient(target, push_chunk_bytes=1 << 16) as client:
            pusher = client.pusher("g4", window=4, timeout=timeout)
            pending = [pusher.push(items) for items in pushes]
            if wait != "result":
                (pusher.flush if wait == "flush" else pusher.close)()
                assert all(future.done() for future in pending)
            outcomes = [future.exception() or future.result() for future in pending]
            pusher.close()
        return outcomes  # type: ignore[return-value]

    async def asyncio_() -> list[Outcome]:
        async with AsyncBufferClient(target, push_chunk_bytes=1 << 16) as client:
            pusher = client.pusher("g4", window=4, timeout=timeout)
            pending = [await pusher.push(items) for items in pushes]
            if wait != "result":
                await (pusher.flush if wait == "flush" else pusher.close)()
                assert all(future.done() for future in pending)
            outcomes = list(await asyncio.gather(*pending, return_exceptions=True))
            await pusher.close()
        return outcomes

    return blocking() if kind == "blocking" else asyncio.run(asyncio_())


@pytest.mark.parametrize("wait", ["flush", "close", "result"])
@pytest.mark.parametrize("lost", sorted(LAST_LOSSES))
@pytest.mark.parametrize("kind", sorted(PUSHERS))
def test_a_loss_in_the_last_push_on_a_stream_goes_again_when_the_pusher_waits(
    start_server: Servers, kind: str, lost: str, wait: str
) -> None:
    """A message of the last push is lost on its way (`dropping`), and no push follows it: the
    pusher ends its stream before it waits in flush() or close(), or once no push went on it for
    a while (pipeline.QUIET) as its caller waits for a future's result, so the server refuses a
    push in chunks as cut short, or ends the stream having never got a push sent whole, and the
    pusher sends that push again. Every push is stored once. (The pusher waited for the stream's
    deadline, twice its timeout, and the push failed DEADLINE_EXCEEDED, whether it was stored
    unknown: with a timeout of 10 s, the push's own deadline had passed by then.)"""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    loss_table(target)
    make, from_end = LAST_LOSSES[lost]
    pushes = [make(f"{kind}-{wait}", task) for task in range(3)]
    with dropping(target, messages_of(pushes) - from_end) as front:
        outcomes = push_then_wait(kind, front, pushes, wait, timeout=10)
    stored_once(target, pushes, outcomes)


@pytest.mark.parametrize("window", [4, 1])
@pytest.mark.parametrize("kind", sorted(PUSHERS))
def test_a_loss_in_the_last_push_of_a_sharded_pusher_goes_again_when_it_waits(
    start_server: Servers, kind: str, window: int
) -> None:
    """As above, through a sharded pusher (of one shard): its flush() makes each shard's pusher end
    its stream, and in a window of 1 its push() waits for room as a flush does, so the last chunk
    of the last push sent (of all three, or of the first), lost on its way, is sent again at once,
    and every push is stored once."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    loss_table(target)
    pushes = [large(f"sharded-{kind}", task) for task in range(3)]
    with dropping(target, messages_of(pushes if window > 1 else pushes[:1])) as front:
        outcomes = sharded_push_then_flush(kind, front, pushes, window)
    stored_once(target, pushes, outcomes)


def sharded_push_then_flush(kind: str, target: str, pushes: Sequence[Any], window: int) -> list[Outcome]:
    """Each push's outcome, from a sharded pusher of the one shard at `target` that pushes them all
    (with `window`) and then flushes, before it looks at a future."""
    settings: dict[str, Any] = {"push_chunk_bytes": 1 << 16, "timeout": 10}

    def blocking() -> list[Outcome]:
        with ShardedBufferClient({"a": target}, **settings) as client, client.pusher("g4", window=window) as pusher:
            pending = [pusher.push(items) for items in pushes]
            pusher.flush()
            assert all(future.done() for future in pending)
            return [future.exception() or future.result() for future in pending]  # type: ignore[misc]

    async def asyncio_() -> list[Outcome]:
        async with AsyncShardedBufferClient({"a": target}, **settings) as client:
            async with client.pusher("g4", window=window) as pusher:
                pending = [await pusher.push(items) for items in pushes]
                await pusher.flush()
                assert all(future.done() for future in pending)
            return list(await asyncio.gather(*pending, return_exceptions=True))

    return blocking() if kind == "blocking" else asyncio.run(asyncio_())


@pytest.mark.parametrize("kind", sorted(PUSHERS))
def test_a_push_to_a_server_that_never_answers_fails_at_its_own_timeout(kind: str) -> None:
    """A pusher made with wait_for_ready whose server never answers (a port that takes
    connections and says nothing) waits for it: each push fails DEADLINE_EXCEEDED at its own
    `timeout`, saying that whether it was stored is unknown, and naming its uids. It ran on to
    its stream's deadline, twice the timeout (a push joins a stream up to `timeout` after it
    opened), and a push sent again after a broken stream to that of its new stream."""
    timeout = 1.5
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts: gRPC's handshake never ends
    target = f"127.0.0.1:{silent.getsockname()[1]}"
    items = group(kind, 0)
    began = time.monotonic()
    try:
        if kind == "blocking":
            with BufferClient(target, wait_for_ready=True) as client, client.pusher(timeout=timeout) as pusher:
                future = pusher.push(items)
                outcome = future.exception(timeout=60)
        else:

            async def body() -> BaseException | None:
                async with (
                    AsyncBufferClient(target, wait_for_ready=True) as client,
                    client.pusher(timeout=timeout) as pusher,
                ):
                    future = await pusher.push(items)
                    await asyncio.wait([future], timeout=60)
                    return future.exception()

            outcome = asyncio.run(body())
    finally:
        silent.close()
    log.info("the push failed %.2f s after it was made, its timeout %g s", time.monotonic() - began, timeout)
    assert isinstance(outcome, ExpbufError), outcome
    assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED, outcome
    assert f"not answered within the pusher's timeout of {timeout:g}s" in outcome.details, outcome
    assert "whether it was stored is unknown" in outcome.details
    assert list(outcome.uids) == uids(items)


def test_a_push_failed_at_its_deadline_before_it_went_is_not_sent_and_the_next_one_is_stored(
    start_server: Servers,
) -> None:
    """Pushes A, B and C join one stream while the server does not answer the connection
    (wait_for_ready); A and B fail at their deadlines while C still has time. When the connection
    opens, gRPC takes the stream's messages: B, whose body went with its failure, went as an empty
    push, and its refusal was taken for C's, which was neither stored nor sent again. Now a push
    that failed before its messages went sends none, and C is stored."""
    server = start_server()
    proxy = SlowReplies(f"127.0.0.1:{server.port}")
    proxy.hold()
    items = [group("gate", task) for task in range(3)]
    with BufferClient(proxy.target, timeout=3.0, wait_for_ready=True) as client:
        pusher = client.pusher(window=8)
        pushed = []
        for items_of in items:  # deadlines 0.5 s, then 1 s apart
            pushed.append(pusher.push(items_of))
            time.sleep(0.5 * len(pushed))
        futures.wait(pushed[:2], timeout=60)  # past their deadlines, unsent; C not yet
        proxy.release()
        pusher.close()
    proxy.close()
    outcomes = [future.exception() or future.result() for future in pushed]
    for outcome in outcomes[:2]:
        assert isinstance(outcome, ExpbufError) and outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED, outcome
    assert isinstance(outcomes[2], PushResult) and outcomes[2].stored == uids(items[2]), outcomes[2]


def test_a_push_in_flight_when_its_client_closes_fails_as_perhaps_stored_not_sent_again(
    start_server: Servers,
) -> None:
    """The client's own close() cancels its pusher's stream (CANCELLED, as a stopping server's
    cancel of a new stream is): that one is not sent again on a closed channel; the push fails,
    whether it was stored unknown."""
    server = start_server()
    client = BufferClient(f"127.0.0.1:{server.port}", timeout=30)
    client.create_table("closing", group_size=4)
    pusher = client.pusher("closing")
    with writer_held(server):
        future = pusher.push(group("closing", 0))
        wait_until(lambda: server.inflight.held > 0, "the server did not read the push")
        client.close()
        outcome = future.exception(timeout=30)
    assert isinstance(outcome, ExpbufError) and outcome.code == grpc.StatusCode.CANCELLED, outcome
    assert "the pusher's call was cancelled, whether it was stored is unknown" in outcome.details


def test_an_asyncio_push_whose_caller_is_cancelled_mid_write_leaves_the_pusher_going(start_server: Servers) -> None:
    """`asyncio.wait_for(pusher.push(big), t)` whose time runs out while the push's chunks are
    written: grpc.aio cancels a stream whose write is cancelled, and the pushes in flight beside it
    and every later one then waited out the pusher's timeout and failed, nothing stored (a helper's
    audit). The push is written by the pusher's own task now: it goes on, and so do the others."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin:
        admin.create_table("t", group_size=2, estimator="none")
    small = [trxp.build(group_items(1, task, 2)) for task in range(3)]
    big = trxp.build([trxp.from_experience(make_experience(2, 0, run, response=3_000_000)) for run in range(2)])

    async def body() -> list[PushResult]:
        async with AsyncBufferClient(target, timeout=10) as client:
            pusher = client.pusher("t", window=4)
            futures = [await pusher.push(small[0]), await pusher.push(small[1])]
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(pusher.push(big), 0.01)  # cut while its chunks are written
            futures.append(await pusher.push(small[2]))
            results = [await future for future in futures]
            await pusher.close()
            return results

    results = asyncio.run(body())
    assert [len(result.stored) for result in results] == [2, 2, 2]
    with BufferClient(target) as admin:
        assert admin.stats()["t"].ready == 8  # the big push went on too


@pytest.mark.parametrize("ending", ["flush", "close"])
def test_an_asyncio_pusher_s_flush_or_close_cancelled_leaves_its_pushes_going(
    start_server: Servers, ending: str
) -> None:
    """`asyncio.wait_for(pusher.flush(), t)` (or close()) whose time runs out as the stream's end
    is written: grpc.aio cancels a call whose done_writing is cancelled, and the pushes in flight
    on it failed at the pusher's deadline (DEADLINE_EXCEEDED, nothing timed out), whether stored
    unknown, and the next close() waited that long (a helper's audit: 7 of 41 cancel points). The
    end is written by the pusher's own task: a cancel stops the caller's wait, not the pushes. The
    cancel lands at each of the first loop turns in turn."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin:
        admin.create_table("t", group_size=2, estimator="none")

    async def body() -> list[list[Any]]:
        outcomes = []
        async with AsyncBufferClient(target, timeout=10) as client:
            for turns in range(24):
                pusher = client.pusher("t", window=4, timeout=30)
                futures = [await pusher.push(trxp.build(group_items(turns, task, 2))) for task in range(3)]
                waiting = asyncio.ensure_future(getattr(pusher, ending)())
                for _ in range(turns):
                    await asyncio.sleep(0)
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
                await asyncio.wait_for(pusher.close(), 10)
                outcomes.append([future.exception() or future.result() for future in futures])
        return outcomes

    for turns, results in enumerate(asyncio.run(body())):
        assert all(isinstance(result, PushResult) and len(result.stored) == 2 for result in results), (turns, results)


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_a_client_closed_under_its_pusher_fails_the_pushes_in_flight_at_once(start_server: Servers, kind: str) -> None:
    """The client closed while its pusher's pushes wait for a server that says nothing: they fail
    CANCELLED (whether stored unknown) at once. The asyncio pusher took the channel's cancel for an
    error of its own and left them to their deadline; both, sending them again after the stream
    ended, opened a stream on the closed channel, which raised, leaving them pending for good (a
    helper's audit)."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as admin:
        admin.create_table("t", group_size=2, estimator="none")
    proxy = SlowReplies(f"127.0.0.1:{server.port}")
    proxy.hold()  # the server says nothing: the pushes stay in flight
    payloads = [trxp.build(group_items(1, task, 2)) for task in range(4)]
    try:
        if kind == "blocking":
            client = BufferClient(proxy.target, timeout=5)
            pusher = client.pusher("t", window=4)
            pushed = [pusher.push(payload) for payload in payloads]
            time.sleep(0.3)
            client.close()
            done, _ = futures.wait(pushed, timeout=15)
            errors = [future.exception() for future in done]
            pusher.close()
        else:

            async def body() -> list[BaseException | None]:
                client = AsyncBufferClient(proxy.target, timeout=5)
                pusher = client.pusher("t", window=4)
                pushed = [await pusher.push(payload) for payload in payloads]
                await asyncio.sleep(0.3)
                await client.close()
                done, _ = await asyncio.wait(pushed, timeout=15)
                await pusher.close()
                return [future.exception() for future in done]

            errors = asyncio.run(body())
    finally:
        proxy.release()
    assert len(errors) == 4
    assert all(isinstance(e, ExpbufError) and e.code == grpc.StatusCode.CANCELLED for e in errors), errors


@pytest.mark.parametrize("thread", ["reader", "deadline timer"])
def test_a_push_interrupted_as_its_streams_threads_start_leaves_the_pusher_going(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch, thread: str
) -> None:
    """A KeyboardInterrupt (Ctrl-C, ray.cancel's interrupt) landing in push() as its stream's reader
    thread started left the push in the window, sent by none and failed by none: every later
    push's future (they complete in push order), flush() and close() waited forever (a helper's
    audit). The pushes are the stream's, their deadlines watched and its reader started, whatever
    start the interrupt lands in (a review: the deadline's timer starts a thread first)."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    start = threading.Thread.start
    interrupted = []

    def interrupting(self: threading.Thread) -> None:
        start(self)
        hit = isinstance(self, threading.Timer) if thread == "deadline timer" else self.name == "expbuf-pusher"
        if hit and not interrupted:
            interrupted.append(self)
            raise KeyboardInterrupt

    with BufferClient(target) as client:
        client.create_table("t", group_size=1, estimator="none")
        pusher = client.pusher("t", window=4, timeout=5)
        monkeypatch.setattr(threading.Thread, "start", interrupting)
        with pytest.raises(KeyboardInterrupt):
            pusher.push([make_experience(1, 0, 0)])
        later = pusher.push([make_experience(1, 1, 0)])
        closing = threading.Thread(target=pusher.close, daemon=True)
        closing.start()
        closing.join(30)
        assert not closing.is_alive() and later.result(0).stored == ["1/1/0/0/r0s0"]
        assert client.stats("t")["t"].ready == 2


def four_groups(start_server: Servers) -> str:
    """A server's target, its table t holding four groups of one experience each."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin:
        admin.create_table("t", group_size=1, estimator="none")
        admin.push([make_experience(1, task, 0) for task in range(4)], table="t")
    return target


def words_late(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Each word of a delivery (but the first, of none) heard by the client `seconds` after it came."""
    heard = sample_stream.Deliveries.heard

    def late(self: Any, rest: Any) -> bool:
        if not rest.HasField("delivered") or rest.delivered == 0:
            return heard(self, rest)
        asyncio.get_running_loop().call_later(seconds, heard, self, rest)
        return True

    monkeypatch.setattr(sample_stream.Deliveries, "heard", late)


async def handed_under_a_cancel(target: str, *, first: bool, wait: float) -> int:
    """The experiences an asyncio consume stream of one group a batch hands its caller: the first
    batch awaited whole where `first`, then one under asyncio.wait_for(..., wait), the stream
    closed after."""
    async with AsyncBufferClient(target, timeout=10) as client:
        stream = client.sample("t", num_groups=1, delivery="consume", window=1, prefetch=0)
        had = [await anext(stream)] if first else []
        with contextlib.suppress(TimeoutError):
            had.append(await asyncio.wait_for(anext(stream), wait))
        await stream.aclose()
        return sum(len(batch.uids) for batch in had)


def test_an_asyncio_sample_cancelled_as_it_confirms_never_loses_the_batch(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asyncio client confirmed a batch (an await: the confirmation's write) before it handed
    it to its caller: a cancel landing then (asyncio.wait_for around the next batch) left the batch
    consumed, or leased, and never had (a helper's audit: 3 runs of 4). The confirmation is
    written on a task of its own now, the batch handed over with no await between. Here each
    confirmation's write returns only 0.5 s after its message went."""
    import grpc.aio._call as aio_call

    target = four_groups(start_server)
    write = aio_call._StreamRequestMixin._write
    writes = itertools.count()

    async def slow(self: Any, request: Any) -> None:
        await write(self, request)
        if next(writes):  # a confirmation (the first write is the request)
            await asyncio.sleep(0.5)

    monkeypatch.setattr(aio_call._StreamRequestMixin, "_write", slow)

    had = asyncio.run(handed_under_a_cancel(target, first=True, wait=0.2))
    with BufferClient(target) as admin:
        stats = admin.stats()["t"]
    assert stats.consumed == had and stats.ready == 4 - had


def test_an_asyncio_sample_cancelled_as_it_waits_for_the_word_of_its_delivery_never_loses_the_batch(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consume stream hands a batch over only once the server says it is delivered; a cancel
    landing in that wait (asyncio.wait_for around the next batch, the server's commit slow) left
    the batch consumed and had by no one (a helper's audit: 6 batches of 25 streams). Its
    confirmation gone, the wait runs to the word: the cancelled await returns the consumed batch,
    as the sharded client's does (a leased batch is handed over without the word). Here each
    word of a delivery comes 0.3 s after it arrived."""
    target = four_groups(start_server)
    words_late(monkeypatch, 0.3)

    had = asyncio.run(handed_under_a_cancel(target, first=False, wait=0.15))
    with BufferClient(target) as admin:
        stats = admin.stats()["t"]
    assert (had, stats.consumed, stats.ready) == (1, 1, 3)


@pytest.mark.parametrize("leaves", [False, True], ids=["reads-on", "breaks-out"])
def test_a_task_cancelled_as_its_consume_stream_waits_for_a_word_is_handed_the_batch_then_cancelled(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch, leaves: bool
) -> None:
    """The consumed batch a cancelled await is handed (above) held the cancel back for good: a task
    cancelled there (`task.cancel()`, a trainer's shutdown) went on with its stream, consuming all
    there was and waiting for more (an audit's repro: once in six). The cancel is raised at the
    task's next step of the stream now, the batch in the caller's hands; a task that leaves the
    stream with that batch (`break`) is cancelled as the stream ends, where it went on with its
    work after the stream uncancelled. Each word of a delivery comes 1 s after it arrived: the task
    is cancelled 0.3 s into its wait for the second's."""
    target = four_groups(start_server)
    words_late(monkeypatch, 1.0)

    async def cancelled_in_its_wait() -> tuple[int, bool]:
        had: list[AsyncBatch] = []
        async with AsyncBufferClient(target, timeout=10) as client:

            async def train() -> None:
                async for batch in client.sample("t", num_groups=1, delivery="consume"):
                    had.append(batch)
                    if leaves and len(had) == 2:
                        break
                await asyncio.sleep(30)  # its work after the stream

            task = asyncio.ensure_future(train())
            while not had:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # the second batch (come ahead) confirmed, its word awaited
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=10)
            return sum(len(batch.uids) for batch in had), bool(done) and task.cancelled()

    had, cancelled = asyncio.run(cancelled_in_its_wait())
    with BufferClient(target) as admin:
        stats = admin.stats()["t"]
    assert cancelled and (had, stats.consumed, stats.ready) == (2, 2, 2)


def test_a_task_under_a_cancel_of_its_own_reads_on_through_a_timeout_as_a_batch_is_handed_over(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel raised at the next step (above) is one that came as the batch was handed over: a
    task that stood under a cancel before (draining a stream in its shutdown handler) and read each
    step under `asyncio.timeout` had the timeout's cancel, over once the batch was returned, taken
    for a standing one, its next step raising CancelledError (a review). Each word of a delivery
    comes 0.6 s after it arrived, past each step's 0.3 s."""
    target = four_groups(start_server)
    words_late(monkeypatch, 0.6)

    async def drained_under_a_cancel() -> int:
        had: list[AsyncBatch] = []

        async def shutting_down() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:  # its shutdown: what is left drained, then the cancel goes on
                async with AsyncBufferClient(target, timeout=10) as client:
                    stream = client.sample("t", num_groups=1, delivery="consume")
                    for _ in range(4):
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(0.3):
                                had.append(await anext(stream))
                    await stream.aclose()
                raise

        task = asyncio.ensure_future(shutting_down())
        await asyncio.sleep(0.1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return sum(len(batch.uids) for batch in had)

    had = asyncio.run(drained_under_a_cancel())
    with BufferClient(target) as admin:
        stats = admin.stats()["t"]
    assert (had, stats.consumed, stats.ready) == (4, 4, 0)


def test_a_timeout_held_back_by_a_batch_handed_over_ends_as_a_timeout_after_a_break(
    start_server: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel a hand-over held back, passed on as the stream ends (the caller left it with
    `break`), was counted as a second one: an `asyncio.timeout` whose cancel it was took it for
    another's, and its block ended the task cancelled, not with TimeoutError (the review). Each
    word of a delivery comes 0.6 s after it arrived, past the block's 0.3 s."""
    target = four_groups(start_server)
    words_late(monkeypatch, 0.6)

    async def timed_out() -> tuple[str, int]:
        had: list[AsyncBatch] = []
        async with AsyncBufferClient(target, timeout=10) as client:
            try:
                async with asyncio.timeout(0.3):
                    async for batch in client.sample("t", num_groups=1, delivery="consume"):
                        had.append(batch)  # handed over as the timeout's cancel came
                        break
                    await asyncio.sleep(10)  # the cancel held back comes here
            except TimeoutError:
                return "timeout", len(had)
            return "went on", len(had)

    outcome = asyncio.run(asyncio.wait_for(timed_out(), 20))
    assert outcome == ("timeout", 1)


def test_an_asyncio_lease_stream_cancelled_as_it_hands_a_batch_over_gives_the_batch_back(start_server: Servers) -> None:
    """A lease stream's batch whose confirmation went as a cancel landed (the one step a batch come
    ahead awaits before it is handed over) was delivered by the server at the stream's end and had
    by no caller: leased, out of every trainer's reach until its lease_seconds passed (an audit:
    once in about 20 random cancels). It is given back at once now (its nack), and the cancel goes
    on, as the sharded client's parts are."""
    target = four_groups(start_server)

    async def cancelled_as_handed() -> None:
        async with AsyncBufferClient(target, timeout=10) as client:
            stream = client.sample("t", num_groups=1, delivery="lease", lease_seconds=600)
            first = await anext(stream)
            await asyncio.sleep(0.3)  # the batches after it come ahead
            second = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)  # its confirmation written, the batch about to be handed over
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            await first.ack()
            await stream.aclose()

    asyncio.run(cancelled_as_handed())
    with BufferClient(target) as admin:
        stats = admin.stats()["t"]
    assert (stats.consumed, stats.leased, stats.ready) == (1, 0, 3)


def test_an_asyncio_sample_made_for_another_event_loop_ends_under_its_wait_for(start_server: Servers) -> None:
    """A client made where another event loop is current, then used in asyncio.run: its Sample
    call's writes never go (the call is the other loop's), and sample() under asyncio.wait_for(..., 3) hung for
    good, its end awaiting a stop that could not be written (a helper's audit). The end is bounded
    whole now (STOP_SECONDS): the wait_for's TimeoutError comes."""
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as admin:
        admin.create_table("t", group_size=1, estimator="none")
        admin.push([make_experience(1, task, 0) for task in range(2)], table="t")
    other = asyncio.new_event_loop()
    asyncio.set_event_loop(other)  # the loop current where the client is made (module level, say)
    try:
        client = AsyncBufferClient(target, timeout=5)
    finally:
        asyncio.set_event_loop(None)
    outcome: list[BaseException | None] = []

    async def first() -> None:
        async for _ in client.sample("t", num_groups=1, max_batches=0, delivery="replay"):
            return

    def run() -> None:
        try:
            asyncio.run(asyncio.wait_for(first(), 3))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "sample() under wait_for(..., 3) still waiting after 60 s"
    other.close()
    assert outcome and (outcome[0] is None or isinstance(outcome[0], (TimeoutError, RuntimeError))), outcome
