"""Groups and experiences larger than one gRPC message: pushed in chunks, stored whole, and
sampled in parts (SampleReply.part) that every client puts back together, as TRXP batches and
as columns. A client that cannot take parts is refused, naming why, and the batch stays."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from expbuf.client import EID, AsyncBufferClient, BufferClient, BufferError, DataLossError, Experience, trxp
from expbuf.client.rpc.sample_reply import Parts, ReplyBuffers, SampleReplyParts, aligned, read_sample_reply
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer
from expbuf.server.rpc.sample.replies import PART_BYTES
from expbuf.server.store.disk.chunk_heads import CHUNK_BYTES

from conftest import Servers
from helpers import make_experience, servers

LIMIT = 256 << 10  # the server's and the clients' max_message_bytes
CHUNK = 64 << 10
# Three members of about 180 KB and one of 450 KB (larger than a message alone): about 1 MB.
RESPONSES = (20_000, 20_000, 20_000, 50_000)


def group(task: int) -> list[Any]:
    return [make_experience("big", task, run, response=n) for run, n in enumerate(RESPONSES)]


def sampled(kind: str, target: str, columns: bool) -> Any:
    """The one batch of table `big` sampled by a client of `kind`."""
    options: dict[str, Any] = {"num_groups": 1, "max_batches": 1, "timeout": 10, "delivery": "consume"}
    if columns:
        options["fields"] = ["tokens", "logprobs"]
    if "asyncio" in kind:

        async def take() -> Any:
            async with CLIENTS[kind](target) as client:
                return [batch async for batch in client.sample("big", **options)]

        (batch,) = asyncio.run(take())
        return batch
    with CLIENTS[kind](target) as client:
        (batch,) = list(client.sample("big", **options))
        return batch


CLIENTS: dict[str, Callable[[str], Any]] = {
    "blocking": lambda target: BufferClient(target, push_chunk_bytes=CHUNK, max_message_bytes=LIMIT),
    "asyncio": lambda target: AsyncBufferClient(target, push_chunk_bytes=CHUNK, max_message_bytes=LIMIT),
    "sharded": lambda target: ShardedBufferClient([target], push_chunk_bytes=CHUNK, max_message_bytes=LIMIT),
    "sharded asyncio": lambda target: AsyncShardedBufferClient(
        [target], push_chunk_bytes=CHUNK, max_message_bytes=LIMIT
    ),
}


@pytest.fixture
def big_server(start_server: Servers) -> ExpbufServer:
    server = start_server(max_message_bytes=LIMIT)
    with BufferClient(f"127.0.0.1:{server.port}", push_chunk_bytes=CHUNK, max_message_bytes=LIMIT) as client:
        client.create_table("big", group_size=len(RESPONSES))
    return server


@pytest.mark.parametrize("columns", [False, True], ids=["trxp", "columns"])
@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_a_group_larger_than_a_message_is_stored_and_sampled_in_parts(
    big_server: ExpbufServer, kind: str, columns: bool
) -> None:
    target = f"127.0.0.1:{big_server.port}"
    pushed = group(0)
    payload = trxp.build([trxp.from_experience(e) for e in pushed])
    assert len(payload) > 3 * LIMIT and len(trxp.build([trxp.from_experience(pushed[-1])])) > LIMIT
    with BufferClient(target, push_chunk_bytes=CHUNK, max_message_bytes=LIMIT) as client:
        stored = client.push(payload, table="big").stored
    batch = sampled(kind, target, columns)
    assert batch.uids == stored and len(stored) == len(RESPONSES)
    if columns:
        tokens, logprobs = batch.columns["tokens"], batch.columns["logprobs"]
        assert torch.equal(tokens.values, torch.cat([e.tokens for e in pushed]))
        assert torch.equal(logprobs.values, torch.cat([e.logprobs for e in pushed]))
        assert [int(n) for n in logprobs.offsets.diff()] == list(RESPONSES)
        assert tokens.values.data_ptr() % 64 == 0 and logprobs.values.data_ptr() % 64 == 0  # read in place
    else:
        got = batch.experiences
        assert [len(e.tokens) for e in got] == [len(e.tokens) for e in pushed]
        for mine, theirs in zip(got, pushed, strict=True):
            assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.logprobs, theirs.logprobs)


def test_a_client_that_cannot_take_parts_is_refused_naming_why_and_the_batch_stays(big_server: ExpbufServer) -> None:
    target = f"127.0.0.1:{big_server.port}"
    payload = trxp.build([trxp.from_experience(e) for e in group(1)])
    with BufferClient(target, push_chunk_bytes=CHUNK, max_message_bytes=LIMIT) as client:
        client.push(payload, table="big")
    options = [("grpc.max_receive_message_length", 1 << 30)]
    with grpc.insecure_channel(target, options=options) as channel:  # a client of an earlier release
        stub = pb_grpc.ExperienceBufferStub(channel)
        request = pb.SampleRequest(table="big", num_groups=1, max_batches=1, wait_seconds=10)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Sample(iter([request]), timeout=30))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = refused.value.details()
    assert f"max_message_bytes = {LIMIT}" in details and "max_reply_bytes" in details, details
    with BufferClient(target, push_chunk_bytes=CHUNK, max_message_bytes=LIMIT) as client:
        (batch,) = client.sample("big", num_groups=1, max_batches=1, timeout=10, delivery="consume")
        assert len(batch.uids) == len(RESPONSES)
        stats = client.stats("big")["big"]
        assert (stats.ready, stats.consumed) == (0, len(RESPONSES))


def test_a_push_past_the_servers_message_limit_names_the_clients_setting(big_server: ExpbufServer) -> None:
    """A client of the default settings sends a push of up to 4 MiB whole: a server whose
    max_message_bytes is lower refused it with gRPC's words alone (the limits audit). The error
    names the server's limit and the client's setting that makes it send in chunks that fit."""
    target = f"127.0.0.1:{big_server.port}"
    (run,) = [e for e in group(2) if e.eid.run == 3]  # 50,000 tokens: past the server's 256 KiB
    fix = f"takes messages of at most {LIMIT} bytes, its max_message_bytes, and this client sent one of"
    with BufferClient(target) as client:
        with pytest.raises(BufferError, match=re.escape(fix)) as refused:
            client.push([run], table="big")
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"make the client with max_message_bytes = {LIMIT}" in refused.value.details
        with pytest.raises(BufferError, match=re.escape(fix)):
            client.pusher("big").push([run]).result(30)
        assert client.stats("big")["big"].pushed == 0
    with BufferClient(target, max_message_bytes=LIMIT) as client:  # as the error says
        assert client.push([run], table="big").stored == [run.eid.uid]
        client.put_values(["a", "b"], [bytes(100_000)] * 2, "big")
    with BufferClient(target, max_message_bytes=1 << 16) as client:  # a reply past the client's own limit
        with pytest.raises(BufferError) as past_its_own:
            client.get_values(["a", "b"], "big")
        assert "CLIENT: Received message larger than max" in past_its_own.value.details
        assert "takes messages of at most" not in past_its_own.value.details  # nothing said of the server's


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_a_stream_of_batches_in_parts_is_decoded_ahead_and_each_is_whole(big_server: ExpbufServer, kind: str) -> None:
    target = f"127.0.0.1:{big_server.port}"
    tasks = [10, 11, 12]
    with CLIENTS["blocking"](target) as client:
        for task in tasks:
            client.push(trxp.build([trxp.from_experience(e) for e in group(task)]), table="big")
    options: dict[str, Any] = {"num_groups": 1, "max_batches": len(tasks), "timeout": 10, "delivery": "consume"}
    if kind == "asyncio":

        async def take() -> list[Any]:
            async with CLIENTS[kind](target) as client:
                return [batch async for batch in client.sample("big", **options, prefetch=2)]

        batches = asyncio.run(take())
    else:
        with CLIENTS[kind](target) as client:
            batches = list(client.sample("big", **options, prefetch=2))
    assert sorted(str(b.experiences[0].eid.task) for b in batches) == [str(t) for t in tasks]
    for batch in batches:
        assert [len(e.logprobs) for e in batch.experiences] == list(RESPONSES)


def _part(whole: int, data: bytes) -> SampleReplyParts:
    return SampleReplyParts(b"", pb.SampleReply(whole_bytes=whole), memoryview(data))


def test_parts_that_do_not_add_up_are_refused_as_data_loss() -> None:
    reply = pb.SampleReply(payload=b"x" * 100, uids=["a"]).SerializeToString()
    parts = Parts()
    assert parts.add(_part(len(reply), reply[:60])) is None
    whole = parts.add(SampleReplyParts(b"", pb.SampleReply(), memoryview(reply[60:])))
    assert whole is not None and whole.payload == b"x" * 100 and list(whole.rest.uids) == ["a"]
    assert parts.add(read_sample_reply(reply)) is not None  # a reply in one message passes as it is
    broken = [
        ([_part(10, b"12345"), _part(10, b"12345")], "a reply in parts began 5 bytes into one of 10"),
        ([_part(10, b"12345"), read_sample_reply(reply)], "a whole reply came 5 bytes into a reply of 10"),
        ([SampleReplyParts(b"", pb.SampleReply(), memoryview(b"12"))], "a part came that no first part"),
        ([_part(4, b"12345")], "its parts add up to 5 bytes, past the whole reply's 4"),
    ]
    for messages, what in broken:
        parts = Parts()
        with pytest.raises(DataLossError, match=what):
            for message in messages:
                parts.add(message)
    parts = Parts()
    parts.add(_part(10, b"12345"))
    with pytest.raises(DataLossError, match="the stream ended 5 bytes into a reply of 10 in parts"):
        parts.end()


def test_a_max_reply_bytes_too_small_to_carry_a_part_is_refused(big_server: ExpbufServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{big_server.port}") as channel:
        request = pb.SampleRequest(table="big", num_groups=1, max_batches=1, max_reply_bytes=100)
        with pytest.raises(grpc.RpcError) as refused:
            list(pb_grpc.ExperienceBufferStub(channel).Sample(iter([request]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_reply_bytes = 100; it must be 0 (one message a batch) or at least 1024" in refused.value.details()


# The large experience's size: 1 GiB, four times what the server may hold of pushes in progress.
BIG_MIB = 1024 * int(os.environ.get("EXPBUF_SOAK_SCALE", "1"))
# The part cut, gRPC's copies of it and of the one before, and slack: a loaded server sends slower
# than it cuts, so gRPC may hold one more (seen: 38 MiB in a clean-clone CI run beside the rest of
# the suite, at most 32 alone) - a bound of parts, a thirtieth of the 1 GiB sent.
PART_WINDOW = 5 * PART_BYTES
# A push's staging, whatever its size: the piece being filled and those waiting for the writer,
# gRPC's copies of the chunks received (more of them while a loaded server reads slower than the
# client sends), the write transaction's pages, and the free memory the heap keeps between them
# (the server lets it keep up to 128 MiB: rpc/sample/replies.keep_reply_memory). Seen: 70-100 MiB on a
# quiet machine, 173 MiB in a CI run beside the rest of the suite; a push read whole grew 2.2 GiB.
PUSH_WINDOW = 64 * CHUNK_BYTES


def status(pid: int) -> dict[str, int]:
    """The process's memory figures of /proc, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    keys = ("VmHWM", "VmRSS", "RssFile")
    return {key: int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) << 10 for key in keys}  # type: ignore[union-attr]


def test_an_experience_larger_than_a_message_round_trips_with_the_servers_memory_bounded_by_its_parts(
    tmp_path: Path,
) -> None:
    size = BIG_MIB << 20
    tokens = size // 9  # int32 tokens, float32 log-probs and a bool mask: 9 bytes a token
    pushed = make_experience("huge", 0, 0, response=tokens)
    payload = trxp.build([trxp.from_experience(pushed)])
    env = {
        "EXPBUF_MAX_INFLIGHT_BYTES": str(size // 4),  # a push in chunks is staged, not held
        "EXPBUF_ADVANTAGE_WORKER": "at_start",  # torch loaded before, not while, the memory is measured
    }
    with servers() as start:
        server = start(str(tmp_path / "data"), env=env, fresh=True)
        pid = server.proc.pid
        with BufferClient(server.target, timeout=300) as client:
            client.create_table("huge", group_size=1)
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            before = status(pid)["VmRSS"]
            assert client.push(payload, table="huge").stored
            pushing = status(pid)["VmHWM"] - before
            del payload
            fields = ["tokens", "logprobs", "action_mask"]
            # A first read brings the stored pages into the server's map (they count in its RSS):
            (warm,) = client.sample("huge", num_groups=1, max_batches=1, timeout=30, delivery="lease", fields=fields)
            warm.nack()
            del warm
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS starts again from here
            reading = status(pid)
            (batch,) = client.sample("huge", num_groups=1, max_batches=1, timeout=30, delivery="consume", fields=fields)
            read = status(pid)
        # Pages of the map that the page cache gave up since the first read (a machine short of
        # memory) come back into the RSS as the read faults them in again: the page cache's, not
        # the server's own memory, which is the rest of its growth.
        again = max(0, read["RssFile"] - reading["RssFile"])
        grew = read["VmHWM"] - reading["VmRSS"] - again
        assert server.proc.poll() is None, "".join(server.log)
    columns = batch.columns
    assert torch.equal(columns["tokens"].values, pushed.tokens)
    assert torch.equal(columns["logprobs"].values, pushed.logprobs)
    assert torch.equal(columns["action_mask"].values, pushed.action_mask)
    assert grew <= PART_WINDOW < size, (
        f"the server grew {grew >> 20} MiB to send {BIG_MIB} MiB ({again >> 20} MiB of its map)"
    )
    assert pushing <= PUSH_WINDOW < size, f"the server grew {pushing >> 20} MiB to store {BIG_MIB} MiB"


def test_a_large_reply_s_buffer_is_used_again_only_once_nothing_holds_it() -> None:
    """A reply of 32 MiB or more goes into a buffer used again once its tensors are let go
    (rpc/sample_reply.ReplyBuffers): never while a tensor or view made on it lives."""
    pool = ReplyBuffers()
    first = pool.take(2 << 20)
    first[:3] = b"abc"
    tensor = torch.frombuffer(first, dtype=torch.uint8)
    held = id(first.obj)  # the pool keeps it: its id stays its own
    del first
    second = pool.take(2 << 20)
    assert id(second.obj) != held and bytes(tensor[:3]) == b"abc"  # the tensor holds the first
    del tensor
    third = pool.take(2 << 20)
    assert id(third.obj) == held and third.nbytes == 2 << 20  # let go: used again, its pages already there
    assert id(pool.take(8 << 20).obj) not in (held, id(second.obj))  # a buffer of another size is another
    assert aligned(1 << 20).obj.__class__ is bytearray  # a reply under 32 MiB: malloc keeps its memory


@pytest.mark.parametrize("columns", [False, True], ids=["trxp", "columns"])
def test_batches_in_reused_buffers_stay_whole_while_the_trainer_holds_them(
    start_server: Servers, columns: bool
) -> None:
    """Every batch of a consume stream of 36 MiB experiences kept to the end: each keeps its own
    bytes (a later batch never lands in a buffer an earlier one holds), as TRXP experiences and
    as columns."""
    target = f"127.0.0.1:{start_server().port}"
    with BufferClient(target) as client:
        client.create_table("kept", group_size=1)
        pushed = [make_experience("k", task, 0, response=(36 << 20) // 9 + task) for task in range(5)]
        client.push(pushed, table="kept")
        options: dict[str, Any] = {"num_groups": 1, "max_batches": 5, "timeout": 30, "delivery": "consume"}
        if columns:
            options["fields"] = ["tokens", "logprobs"]
        kept = list(client.sample("kept", **options))
    by_uid = {exp.eid.uid: exp for exp in pushed}
    assert sorted(batch.uids[0] for batch in kept) == sorted(by_uid)
    for batch in kept:
        want = by_uid[batch.uids[0]]
        got = batch.columns["tokens"].values if columns else batch.experiences[0].tokens
        assert torch.equal(got, want.tokens)


def test_a_forked_process_writes_its_own_copy_of_a_kept_buffer() -> None:
    """A data loader's worker, forked, inherits the kept buffers: what it writes into one it uses
    again is its own copy, never the parent's batch."""
    pool = ReplyBuffers()
    first = pool.take(2 << 20)
    first[:6] = b"parent"
    del first  # free, and kept
    child = os.fork()
    if child == 0:  # the worker: takes the same kept buffer and writes into it
        mine = pool.take(2 << 20)
        mine[:6] = b"child!"
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    assert bytes(pool.take(2 << 20)[:6]) == b"parent"


@pytest.mark.parametrize("read", ["trxp", "columns", "get"])
def test_reads_of_a_compressing_table_hold_a_few_chunks_not_the_batch(tmp_path: Path, read: str) -> None:
    """A table that keeps its chunks as zstd frames decompresses each as the part of a reply that
    holds it is cut, and lets it go: a sample as TRXP or as columns, and a Get, of 512 MiB (a few
    KiB on disk) grow the server by a few chunks and parts, where holding the batch decompressed
    grew it by all of it (a Get of 30 x 13.5 MB: +383 MiB)."""
    tokens, count = (16 << 20) // 9, 32  # 16 MiB experiences of int32 tokens, float32 log-probs and a mask
    pushed = [
        Experience(
            eid=EID(batch="z", task=task, run=0),
            tokens=torch.zeros(tokens + 1, dtype=torch.int32),
            prompt_length=1,
            logprobs=torch.full((tokens,), -0.5),
            action_mask=torch.ones(tokens, dtype=torch.bool),
            reward=1.0,
        )
        for task in range(count)
    ]
    with servers() as start:
        server = start(str(tmp_path / "data"), fresh=True)
        pid = server.proc.pid
        with BufferClient(server.target, timeout=300) as client:
            client.create_table("z", group_size=1, estimator="none", compression="zstd")
            for experience in pushed:
                assert client.push([experience], table="z").stored
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS starts again from here
            before = status(pid)["VmRSS"]
            if read == "get":
                got = list(client.get([e.eid.uid for e in pushed], table="z"))
            else:
                fields = ["tokens", "logprobs", "action_mask"] if read == "columns" else None
                (batch,) = client.sample("z", num_groups=count, max_batches=1, timeout=30, fields=fields)
                got = batch.experiences if fields is None else [batch.columns["logprobs"].values]
            peak = status(pid)["VmHWM"]
        assert server.proc.poll() is None, "".join(server.log)
    whole = count * (tokens * 9 + 4)
    if read == "columns":
        assert torch.equal(got[0], torch.cat([e.logprobs for e in pushed]))
    else:
        assert all(
            torch.equal(e.tokens, p.tokens) and torch.equal(e.action_mask, p.action_mask)
            for e, p in zip(got, pushed, strict=True)
        )
    assert peak - before <= COMPRESSED_WINDOW < whole // 2, (
        f"the server grew {(peak - before) >> 20} MiB to send {whole >> 20} MiB"
    )


# What a reply from a compressing table holds besides a reply's parts: the chunks decompressed
# last (chunk_reads.RECENT) and those a part is cut from, and the heap's free memory between them.
COMPRESSED_WINDOW = PART_WINDOW + 24 * CHUNK_BYTES
