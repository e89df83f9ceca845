"""A PushStream's pushes overlap on the server (server/rpc/push/push_stream.py): while the writer stores
some, the stream reads and parses the next, up to push_stream_window of them, and stores all it
has parsed in one commit. Each reply still comes only after its push's commit, in order, with its
seq; a refused push ends the stream after the replies of those before it, whatever refused it,
and nothing after it is stored; the same uid twice in one window is a duplicate the second time.

The server's writer is kept busy by a request of the test's own (`writer_held`), so that what a
stream reads meanwhile is seen without timing anything: no commit can happen while it is held."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from expbuf.client import BufferClient, trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer

from conftest import Servers
from helpers import group_items


@contextlib.contextmanager
def writer_held(server: ExpbufServer) -> Iterator[None]:
    """The server's writer busy with a request that waits for the end of the block: nothing is
    committed meanwhile."""
    entered, go = threading.Event(), threading.Event()

    def hold(_txn: object) -> None:
        entered.set()
        go.wait(60)

    thread = threading.Thread(target=server.store.environment.submit, args=(hold,))
    thread.start()
    assert entered.wait(10)
    try:
        yield
    finally:
        go.set()
        thread.join(30)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class Stream:
    """A PushStream of `messages`, its replies collected as they come, and how it ended."""

    def __init__(self, server: ExpbufServer, messages: list[pb.PushRequest]) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        self.call = pb_grpc.ExperienceBufferStub(self.channel).PushStream(iter(messages), timeout=60)
        self.replies: list[pb.PushReply] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.replies.append(reply)
        except grpc.RpcError as exc:
            self.error = exc

    def end(self) -> Stream:
        self.thread.join(60)
        self.channel.close()
        return self


def push(payload: bytes, seq: int, table: str = "") -> pb.PushRequest:
    return pb.PushRequest(table=table, payload=payload, seq=seq)


def uids(payload: bytes) -> list[str]:
    return [item.uid for item in trxp.parse(payload)]


def test_a_stream_reads_its_window_while_the_first_push_waits_for_its_commit_and_shares_commits(
    start_server: Servers,
) -> None:
    server = start_server(push_stream_window=4)
    payloads = [trxp.build(group_items("w", task, 2)) for task in range(8)]
    size = len(payloads[0])
    assert all(len(payload) == size for payload in payloads)
    commits = server.store.environment.batches
    with writer_held(server):
        stream = Stream(server, [push(payload, seq) for seq, payload in enumerate(payloads, 1)])
        # The first push waits for the writer; the next three are read (and parsed) meanwhile.
        wait_until(lambda: server.inflight.held == 4 * size, "the stream did not read its window ahead")
        time.sleep(0.2)  # room for a fifth, were the window not kept
        assert server.inflight.held == 4 * size
        assert stream.replies == []  # no push is answered before its commit
    stream.end()
    assert stream.error is None
    assert [reply.seq for reply in stream.replies] == list(range(1, 9))
    assert [list(reply.stored_uids) for reply in stream.replies] == [uids(payload) for payload in payloads]
    # The held request, then the pushes: those read while it held the writer share a commit.
    assert server.store.environment.batches - commits - 1 < len(payloads)
    assert server.inflight.held == 0


def test_the_same_uids_twice_in_one_window_are_duplicates_the_second_time(start_server: Servers) -> None:
    server = start_server()
    first, other = trxp.build(group_items("d", 0, 2)), trxp.build(group_items("d", 1, 2))
    with writer_held(server):
        stream = Stream(server, [push(first, 1), push(first, 2), push(other, 3)])
        wait_until(lambda: server.inflight.held == 2 * len(first) + len(other), "the window was not read ahead")
    stream.end()
    assert stream.error is None
    replies = [(reply.seq, list(reply.stored_uids), list(reply.duplicate_uids)) for reply in stream.replies]
    assert replies == [(1, uids(first), []), (2, [], uids(first)), (3, uids(other), [])]


def payloads_for(kind: str) -> tuple[dict[str, object], list[pb.PushRequest], grpc.StatusCode, str]:
    """Table `t`'s settings, the messages (two stored, then the refused one, then one more),
    the status the stream ends with and words of its details."""
    version = {"version": 5}
    before = [trxp.build(group_items("r", task, 2, **version)) for task in (0, 1)]
    after = trxp.build(group_items("r", 3, 2, **version))
    table: dict[str, object] = {}
    if kind in ("conflict", "conflict, then unreadable"):
        refused = trxp.build(group_items("r", 0, 2, reward=0.0, **version))  # the first push's uids, other bytes
        code, words = grpc.StatusCode.ALREADY_EXISTS, "r/0/0/0/r0s0"
    elif kind == "full":
        table |= {"group_size": 6, "capacity_experiences": 12, "when_full": "evict"}  # two open groups: none to evict
        refused = trxp.build(group_items("r", 2, 4, **version))
        code, words = grpc.StatusCode.RESOURCE_EXHAUSTED, "is full"
    elif kind == "stale":
        table |= {"max_staleness": 0, "on_stale": "refuse"}
        refused = trxp.build(group_items("r", 2, 2, version=1))
        code, words = grpc.StatusCode.FAILED_PRECONDITION, "model_version 1"
    elif kind == "unparsable":
        refused = b"TRXP not a payload"
        code, words = grpc.StatusCode.INVALID_ARGUMENT, "TRXP"
    else:  # its message says it is shorter than it is: refused as the stream reads it
        refused = trxp.build(group_items("r", 2, 2, **version))
        code, words = grpc.StatusCode.INVALID_ARGUMENT, "total_bytes = 10 is less than"
    messages = [push(payload, seq, "t") for seq, payload in enumerate(before, 1)]
    messages.append(pb.PushRequest(table="t", payload=refused, seq=3, total_bytes=10 if kind == "unreadable" else 0))
    if kind == "conflict, then unreadable":  # refused too, as it is read: the stream ends with the first refusal
        messages.append(pb.PushRequest(table="t", payload=after, seq=4, total_bytes=10))
    else:
        messages.append(push(after, 4, "t"))
    return table, messages, code, words


KINDS = ["conflict", "full", "stale", "unparsable", "unreadable", "conflict, then unreadable"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_push_ends_the_stream_after_the_replies_before_it_and_nothing_after_it_is_stored(
    start_server: Servers, kind: str
) -> None:
    server = start_server()
    table, messages, code, words = payloads_for(kind)
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("t", **table)
        client.set_trainer_version(5, table="t")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        before = sum(len(message.payload) for message in messages[:2])
        with writer_held(server):  # the pushes before it and the refused one go to the writer together
            stream = Stream(server, messages)
            wait_until(lambda: server.inflight.held >= before, "the pushes before the refused one were not read")
        stream.end()
        assert [reply.seq for reply in stream.replies] == [1, 2]
        assert [list(reply.stored_uids) for reply in stream.replies] == [uids(m.payload) for m in messages[:2]]
        assert stream.error is not None and stream.error.code() == code, stream.error
        assert words in stream.error.details(), stream.error.details()
        refused, after = messages[2].payload, messages[3].payload
        missing = stub.Get(pb.GetRequest(table="t", uids=uids(after)), timeout=10).missing_uids
        assert list(missing) == uids(after)  # read, perhaps stored in the same commit: not stored
        if kind not in ("unparsable", "conflict", "conflict, then unreadable"):
            assert stub.Get(pb.GetRequest(table="t", uids=uids(refused)), timeout=10).missing_uids == uids(refused)
        assert stub.Stats(pb.StatsRequest(table="t"), timeout=10).tables[0].pushed == 4
    wait_until(lambda: server.inflight.held == 0, "a refused stream kept what its pushes held")


def test_a_stream_that_sends_nothing_is_ended_after_its_replies_naming_the_setting(start_server: Servers) -> None:
    server = start_server(push_stream_idle_seconds=1)
    payload = trxp.build(group_items("idle", 0, 2))
    end = threading.Event()

    def messages() -> Iterator[pb.PushRequest]:
        yield push(payload, 1)
        end.wait(30)

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.ExperienceBufferStub(channel).PushStream(messages(), timeout=30)
        replies = []
        with pytest.raises(grpc.RpcError) as ended:
            for reply in call:
                replies.append(reply)
        end.set()
    assert [list(reply.stored_uids) for reply in replies] == [uids(payload)]
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "push_stream_idle_seconds = 1" in ended.value.details()
