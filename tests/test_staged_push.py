"""A push in chunks whose large items are staged as it arrives (server/rpc/push/ingest.Stager): stored
as the same experiences as a push read whole, mixed with small items; a refused one (another
content under a stored uid, a table that does not exist) and a duplicate leave nothing staged;
the server holds a push's staging, not the push, against max_inflight_bytes; what pushes stage
fits in their table's capacity_bytes, shows in its stats, and a push that drips is ended by what
it brought lately."""

from __future__ import annotations

import signal
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import lmdb
import pytest
import torch

from expbuf.client import (
    AlreadyExistsError,
    BufferClient,
    ColumnBatch,
    DataLossError,
    Experience,
    NotFoundError,
    ResourceExhaustedError,
    trxp,
)
from expbuf.client.rpc.wire import reason_of
from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.rpc.push.ingest import Stager
from expbuf.server.store import Store
from expbuf.server.store.disk import chunk_heads
from expbuf.server.store.disk.chunk_heads import CHUNK_BYTES
from expbuf.server.store.disk.environment import Environment
from expbuf.server.store.schema.table_config import TableConfig

from helpers import ServerProcess, make_experience, scrape, servers, wait_ready

RESPONSE = 2_000_000  # about 18 MB an experience: five chunks of the store
CHUNK = 1 << 20  # the client's chunks, smaller than the store's


def counts(data: Path) -> dict[str, int]:
    """Entries of the chunk databases and payloads of a stopped server's directory (the chunks
    without the marks naming each set's experience, chunk_heads.OWNER: as many as the sets)."""
    env = Environment(data, readonly=True)
    try:
        with env.read() as txn:
            found = {name: txn.stat(env.db[name])["entries"] for name in ("chunks", "staged", "blobs")}
            with txn.cursor(db=env.db["chunks"]) as cur:
                mark = chunk_heads.OWNER.to_bytes(4, "big")
                found["chunks"] -= sum(key[12:] == mark for key in cur.iternext(values=False))
            return found
    finally:
        env.close()


# a cap smaller than one push: a push whose items are staged holds a piece of each
SMALL_CAP = {"EXPBUF_MAX_INFLIGHT_BYTES": str(22 << 20)}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server of the test's own, whose data directory it counts once it has stopped it."""
    with servers() as start:
        yield start(str(tmp_path / "data"), env=SMALL_CAP)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server of the same settings for the tests that count nothing on disk, each on a table of its own."""
    with servers() as start:
        yield start(str(tmp_path_factory.mktemp("shared") / "data"), env=SMALL_CAP)


def columns_of(group: list) -> ColumnBatch:
    """The experiences as a batch of columns."""
    return ColumnBatch(
        [one.eid for one in group],
        {name: [getattr(one, name) for one in group] for name in ("tokens", "logprobs", "action_mask")},
        reward=[one.reward for one in group],
        prompt_length=[one.prompt_length for one in group],
        model_version=[one.info["model_version"] for one in group],
    )


def stopped(server: ServerProcess) -> None:
    assert server.stop(signal.SIGTERM) == 0, "".join(server.log)


def test_large_and_small_items_in_one_push_are_stored_as_a_push_read_whole(
    server: ServerProcess, tmp_path: Path
) -> None:
    group = [
        make_experience("s", 0, 0, response=RESPONSE),
        make_experience("s", 0, 1, response=7),
        make_experience("s", 0, 2, response=RESPONSE // 3),
    ]
    with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
        client.create_table("t", group_size=3)
        assert len(client.push(group, table="t").stored) == 3
        got = {one.eid.uid: one for one in client.get([one.eid.uid for one in group], table="t")}
        (batch,) = client.sample("t", num_groups=1, max_batches=1, timeout=30, delivery="consume")
    for pushed in group:
        assert torch.equal(got[pushed.eid.uid].tokens, pushed.tokens)
    assert [one.eid.uid for one in batch.experiences] == [one.eid.uid for one in group]
    for pushed, sampled in zip(group, batch.experiences, strict=True):
        assert torch.equal(sampled.logprobs, pushed.logprobs) and torch.equal(sampled.action_mask, pushed.action_mask)
    stopped(server)
    assert counts(tmp_path / "data") == {"chunks": 0, "staged": 0, "blobs": 0}  # consumed, chunks and all


def test_a_batch_of_columns_is_staged_as_it_arrives_and_stored_as_its_experiences_pushed_whole(
    server: ServerProcess, tmp_path: Path
) -> None:
    """Its one-value columns and tensors come in the store's order, so the server stages its large
    experiences as it stages a TRXP push's: 2 x 18 MB under a max_inflight_bytes of 22 MiB, which a
    push read whole could not take; the same bytes as the experiences pushed whole (duplicates)."""
    group = [make_experience("c", 0, run, response=RESPONSE if run != 1 else 7) for run in range(3)]
    columns = columns_of(group)
    uids = [one.eid.uid for one in group]
    with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
        client.create_table("t", group_size=3)
        assert client.push(columns, table="t").stored == uids
        assert client.push(group, table="t").duplicates == uids  # identical bytes
        got = {one.eid.uid: one for one in client.get(uids, table="t")}
    for pushed in group:
        assert torch.equal(got[pushed.eid.uid].tokens, pushed.tokens)
        assert torch.equal(got[pushed.eid.uid].logprobs, pushed.logprobs)
    stopped(server)
    assert counts(tmp_path / "data") == {"chunks": 10, "staged": 0, "blobs": 3}  # 2 x 5 chunks, nothing left staged


@pytest.mark.parametrize("as_columns", [False, True], ids=["experiences", "columns"])
def test_a_staged_push_whose_data_ends_in_empty_tensors_is_stored(
    shared_server: ServerProcess, as_columns: bool
) -> None:
    """A last experience with an empty response: the data's last spans take no byte, which no chunk
    steps past (the push failed INTERNAL where a push read whole stores it)."""
    group = [make_experience("e", 0, run, response=size) for run, size in enumerate((RESPONSE, 7, 0))]
    pushed = columns_of(group) if as_columns else group
    table = "empty_columns" if as_columns else "empty_experiences"
    with BufferClient(shared_server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
        client.create_table(table, group_size=3)
        assert client.push(pushed, table=table).stored == [one.eid.uid for one in group]
        (empty,) = client.get([group[2].eid.uid], table=table)
    assert empty.logprobs.numel() == 0 and torch.equal(empty.tokens, group[2].tokens)


def test_a_client_chunk_of_many_store_chunks_holds_no_more_than_its_push_reserves(tmp_path: Path) -> None:
    """A client may send its push in chunks up to a message (256 MiB by default), where expbuf's
    clients send 4 MiB: the server cuts each into the store's chunks, staging each before it reads
    the next, so the pieces it makes at once stay within what the push reserves of
    max_inflight_bytes (`holds`). Fed whole, a chunk of 51 MiB held its 48 MiB of pieces at once."""
    payload = memoryview(trxp.encode([make_experience("p", 0, 0, response=6_000_000)]))
    with Store(tmp_path / "data", map_size=1 << 30) as store:
        store.create_table(TableConfig.of(name="t", group_size=1, estimator="none", device="cpu"))
        staged = Stager(store, 1 << 20).open("t", payload[: 1 << 20], len(payload))
        assert staged is not None and len(payload) > 12 * CHUNK_BYTES
        staged.open(timeout=10.0)
        tracemalloc.start()
        try:
            staged.feed(payload[staged.payload.head_length :])  # the rest of the push, one client chunk
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        (entry,) = staged.entries()
    assert peak <= staged.holds + (64 << 10), (peak, staged.holds)  # and the few objects beside the pieces
    assert entry.uid == "p/0/0/0/r0s0"


def test_a_refused_or_duplicate_push_leaves_nothing_staged(server: ServerProcess, tmp_path: Path) -> None:
    first = make_experience("s", 0, 0, response=RESPONSE)
    other = make_experience("s", 0, 0, response=RESPONSE)
    other.logprobs = torch.full((RESPONSE,), -1.5)  # another content under the same uid
    with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
        client.create_table("t", group_size=1)
        assert client.push([first], table="t").stored
        assert client.push([first], table="t").duplicates == [first.eid.uid]
        with pytest.raises(AlreadyExistsError) as conflict:
            client.push([other], table="t")
        assert conflict.value.reason == Reason.CONFLICT
        with pytest.raises(NotFoundError) as missing:
            client.push([other], table="absent")
        assert missing.value.reason == Reason.NOT_FOUND and "absent" in str(missing.value)
        (stored,) = client.get([first.eid.uid], table="t")
        assert torch.equal(stored.logprobs, first.logprobs)
    stopped(server)
    found = counts(tmp_path / "data")
    assert found["staged"] == 0 and found["blobs"] == 1 and found["chunks"] == 5  # the first push's alone


@pytest.mark.parametrize(
    ("large", "dtype", "value", "problem"),
    [
        (True, torch.float32, float("nan"), "holds NaN or infinity"),
        (False, torch.float32, float("-inf"), "holds NaN or infinity"),
        (True, torch.float64, 1e300, "beyond float32's range"),
    ],
    ids=["NaN in a staged item", "infinity in a small item beside one", "float64 beyond float32 in a staged item"],
)
def test_a_token_level_reward_a_push_in_chunks_brings_is_checked_as_a_push_read_whole(
    shared_server: ServerProcess, large: bool, dtype: torch.dtype, value: float, problem: str
) -> None:
    """A push in chunks with a large item is read from its head, its tensors' data as it comes: the
    head's checks cannot read a token-level reward, and one holding NaN, infinity or (float64) a
    value beyond float32's range was stored, where the same payload sent whole is refused; its Get
    then failed to decode. Now each reward is checked as its bytes pass: INVALID_ARGUMENT naming
    the item, as for a push read whole, and nothing stored."""
    table = f"rewards-{int(large)}-{str(dtype)[6:]}"
    group = [make_experience("r", 0, 0, response=RESPONSE), make_experience("r", 0, 1, response=7)]
    bad = group[0 if large else 1]
    mark = 12345.0
    rewards = torch.zeros(bad.tokens.numel() - bad.prompt_length, dtype=dtype)
    rewards[-1] = mark
    bad.token_level_reward = rewards
    payload = bytearray(trxp.encode(group))
    marked = torch.tensor([mark], dtype=dtype).numpy().tobytes()
    assert payload.count(marked) == 1
    at = payload.find(marked)
    payload[at : at + len(marked)] = torch.tensor([value], dtype=dtype).numpy().tobytes()
    with BufferClient(shared_server.target, timeout=120) as client:
        client.create_table(table, group_size=2)
        stub = pb_grpc.ExperienceBufferStub(client._channel)
        with pytest.raises(grpc.RpcError) as whole:
            stub.Push(pb.PushRequest(table=table, payload=bytes(payload)), timeout=120)
        channel, replies = raw_push(shared_server.target, bytes(payload), table, len(payload), iter)
        with channel, pytest.raises(grpc.RpcError) as chunked:
            list(replies)
        for refused in (whole.value, chunked.value):
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
            assert f"item {int(not large)} (uid {bad.eid.uid})" in refused.details(), refused.details()
            assert problem in refused.details()
        assert client.stats(table)[table].pushed == 0 and staged_bytes(client, table) == 0


def test_a_damaged_field_is_refused_on_read_and_the_rest_served(tmp_path: Path) -> None:
    """A take reads a large experience by its head alone (in the writer); the chunks a reply's
    fields lie in are read, and checked, where its reply is built. A field whose chunk is damaged
    ends the stream DATA_LOSS naming the experience, which is quarantined, and its batch goes back
    unsent, so a new stream gets the other groups; a field whose chunks are whole was served."""
    data = tmp_path / "data"
    first, second = make_experience("d", 0, 0, response=RESPONSE), make_experience("d", 1, 0, response=RESPONSE)
    quiet = {"EXPBUF_SCRUB_MB_PER_SECOND": "0"}  # the background scrub would find it first
    with servers() as start:
        server = start(str(data), env=quiet)
        with BufferClient(server.target, timeout=120) as client:
            client.create_table("t", group_size=1)
            client.push([first], table="t")
            client.push([second], table="t")
        stopped(server)
    env = lmdb.open(str(data), max_dbs=64, map_size=1 << 30)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(db=chunks)))  # the first experience's first chunk: log-probs
        damaged = bytearray(value)
        damaged[12345] ^= 0x40
        txn.put(key, bytes(damaged), db=chunks)
    env.close()
    with servers() as start:
        server = start(str(data), env=quiet)
        with BufferClient(server.target, timeout=120) as client:
            options = {"num_groups": 1, "max_batches": 1, "timeout": 10, "delivery": "replay"}
            (whole,) = client.sample("t", **options, fields=["tokens"])  # in chunks past the damage
            assert whole.uids == [first.eid.uid] and torch.equal(whole.columns["tokens"].values, first.tokens)
            with pytest.raises(DataLossError) as lost:
                list(client.sample("t", **options, fields=["logprobs"]))
            assert lost.value.reason == Reason.DAMAGED and first.eid.uid in str(lost.value)
            assert "quarantined" in str(lost.value)
            (batch,) = client.sample("t", num_groups=1, max_batches=1, timeout=10, fields=["tokens"])
            assert batch.uids == [second.eid.uid]
            assert torch.equal(batch.columns["tokens"].values, second.tokens)
            stats = client.stats("t").tables["t"]
            assert (stats.damaged, stats.quarantined, stats.groups_failed) == (1, 1, 1)
        stopped(server)


def test_a_push_larger_than_max_push_bytes_is_refused_at_its_first_chunk(tmp_path: Path) -> None:
    """A push stored as it arrives holds little memory but writes all of itself to disk before its
    commit: one larger than max_push_bytes is refused at its first chunk, naming the setting, with
    nothing stored or staged, and the server goes on."""
    pushed = make_experience("s", 0, 0, response=RESPONSE)  # about 18 MB
    with servers() as start:
        server = start(str(tmp_path / "data"), env={"EXPBUF_MAX_PUSH_BYTES": str(16 << 20)})
        with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
            client.create_table("t", group_size=1)
            with pytest.raises(ResourceExhaustedError) as refused:
                client.push([pushed], table="t")
            assert refused.value.reason == Reason.TOO_LARGE and "max_push_bytes = 16777216" in str(refused.value)
            smaller = make_experience("s", 1, 0, response=RESPONSE // 2)
            assert client.push([smaller], table="t").stored == [smaller.eid.uid]
        stopped(server)
    assert counts(tmp_path / "data") == {"chunks": 3, "staged": 0, "blobs": 1}


def staged_bytes(client: BufferClient, table: str) -> int:
    return client.stats(table)[table].staged_bytes


def wait_for(what: Callable[[], bool], failure: str) -> None:
    deadline = time.monotonic() + 60
    while not what():
        assert time.monotonic() < deadline, failure
        time.sleep(0.05)


def raw_push(
    target: str, payload: bytes, table: str, sent: int, then: Callable[[], Iterator[pb.PushRequest]]
) -> tuple[grpc.Channel, Iterator[pb.PushReply]]:
    """A PushStream of `payload` in chunks of CHUNK: its first `sent` chunks, then what `then` yields."""
    parts = [payload[at : at + CHUNK] for at in range(0, len(payload), CHUNK)]

    def messages() -> Iterator[pb.PushRequest]:
        yield pb.PushRequest(table=table, seq=1, payload=parts[0], total_bytes=len(payload))
        for part in parts[1:sent]:
            yield pb.PushRequest(payload=part)
        yield from then()

    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.ExperienceBufferStub(channel).PushStream(messages(), timeout=120)


def test_a_staged_push_larger_than_capacity_bytes_is_refused_at_its_first_chunk_staging_nothing(
    server: ServerProcess, tmp_path: Path
) -> None:
    """What a push stages is written to disk before its commit, which alone checked the table's
    capacity: an 18 MB push into a table of 16 MiB wrote all of itself first. Now it is refused
    at its first chunk, naming the setting, the data file not grown by a chunk of it."""
    big, small = make_experience("c", 0, 0, response=RESPONSE), make_experience("c", 1, 0, response=RESPONSE // 3)
    with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
        client.create_table("t", group_size=1, capacity_bytes=16 << 20)
        before = client.server_info().storage_bytes
        with pytest.raises(ResourceExhaustedError) as refused:
            client.push([big], table="t")
        assert refused.value.reason == Reason.TOO_LARGE, refused.value
        assert "capacity_bytes = 16777216" in str(refused.value) and "nothing of it is stored" in str(refused.value)
        assert client.server_info().storage_bytes - before < CHUNK_BYTES  # it staged 18 MB before
        assert staged_bytes(client, "t") == 0
        assert client.push([small], table="t").stored == [small.eid.uid]
    stopped(server)
    assert counts(tmp_path / "data") == {"chunks": 2, "staged": 0, "blobs": 1}  # the small push's alone


def test_staged_pushes_share_capacity_bytes_and_show_in_stats_and_metrics(tmp_path: Path) -> None:
    """A push staging into an evicting table of 30 MiB counts its 18 MB against it from its first
    chunk: its staged bytes show in Stats and the metrics while it stages, and a second such push
    waits for room beside it (here 8 s, half the idle time), then is refused naming capacity_bytes,
    having staged nothing. Once the first is stored and ready (computed: only a ready group is
    evicted) the second is stored (its commit evicts the first), and nothing shows staged."""
    first, second = make_experience("a", 0, 0, response=RESPONSE), make_experience("b", 0, 0, response=RESPONSE)
    env = {"EXPBUF_PUSH_STREAM_IDLE_SECONDS": "16", "EXPBUF_PUSH_MIN_MB_PER_SECOND": "0.001"}
    with servers() as start:
        server = start(str(tmp_path / "data"), env=env)
        go = threading.Event()
        with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
            client.create_table("t", group_size=1, capacity_bytes=30 << 20, when_full="evict")

            def rest() -> Iterator[pb.PushRequest]:
                go.wait(60)
                payload = trxp.encode([first])
                for at in range(10 * CHUNK, len(payload), CHUNK):
                    yield pb.PushRequest(payload=payload[at : at + CHUNK])

            channel, call = raw_push(server.target, trxp.encode([first]), "t", 10, rest)
            with channel:
                try:
                    wait_for(lambda: staged_bytes(client, "t") == 2 * CHUNK_BYTES, "the first push staged no chunk")
                    gauge = scrape(server.metrics_port)[("expbuf_staged_bytes", (("table", "t"),))]
                    assert gauge == 2 * CHUNK_BYTES
                    with pytest.raises(ResourceExhaustedError) as refused:
                        client.push([second], table="t")
                    assert refused.value.reason == Reason.TABLE_FULL, refused.value
                    assert "capacity_bytes = 31457280" in str(refused.value), refused.value
                    assert staged_bytes(client, "t") == 2 * CHUNK_BYTES  # the second staged nothing
                finally:
                    go.set()
                assert [len(reply.stored_uids) for reply in call] == [1]
            assert staged_bytes(client, "t") == 0
            wait_ready(client, "t", 1)  # computed once torch has loaded, which the first push asked for
            assert client.push([second], table="t").stored == [second.eid.uid]
            stats = client.stats("t")["t"]
            assert (stats.ready, stats.evicted, stats.staged_bytes) == (1, 1, 0)
            assert scrape(server.metrics_port)[("expbuf_staged_bytes", (("table", "t"),))] == 0
        stopped(server)
    assert counts(tmp_path / "data")["staged"] == 0


def refused_staging_nothing(client: BufferClient, pushed: Experience) -> None:
    """A push into table 't' (capacity_bytes 30 MiB) refused TABLE_FULL naming the setting, the
    data file not grown by a chunk of it."""
    before = client.server_info().storage_bytes
    with pytest.raises(ResourceExhaustedError) as refused:
        client.push([pushed], table="t")
    assert refused.value.reason == Reason.TABLE_FULL, refused.value
    assert "capacity_bytes = 31457280" in str(refused.value), refused.value
    assert client.server_info().storage_bytes - before < CHUNK_BYTES


def test_a_staged_push_into_a_full_blocking_table_waits_for_room_then_is_refused_staging_nothing(
    tmp_path: Path,
) -> None:
    """In block mode what is left of capacity_bytes is less what the table holds, which only its
    consumers free: a push that does not fit waits for room before it stages anything, is
    refused naming the setting once its wait ends, and is stored once the table has room."""
    first, second = make_experience("a", 0, 0, response=RESPONSE), make_experience("b", 0, 0, response=RESPONSE)
    with servers() as start:
        server = start(str(tmp_path / "data"), env={"EXPBUF_PUSH_STREAM_IDLE_SECONDS": "4"})
        with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
            client.create_table("t", group_size=1, capacity_bytes=30 << 20)
            assert client.push([first], table="t").stored
            refused_staging_nothing(client, second)
            (batch,) = client.sample("t", num_groups=1, max_batches=1, timeout=30, delivery="consume")
            assert batch.uids == [first.eid.uid]
            assert client.push([second], table="t").stored == [second.eid.uid]
        stopped(server)


def test_a_staged_push_that_drips_after_most_of_its_bytes_is_ended_by_what_it_brought_lately(
    tmp_path: Path,
) -> None:
    """A push that sends 16 of its 18 MB at once, then 16 bytes every 0.2 s, keeps every chunk
    coming within the idle time. Its allowance was taken from the size it announced (here 2 s +
    18 MB at 0.1 MB/s: three minutes, 47 hours for 16 GiB), so it held what it staged that long;
    now it must bring 0.1 MB/s over every 2 s (push_stream_idle_seconds) after its first, and it
    is ended DEADLINE_EXCEEDED naming the setting, its staged chunks dropped."""
    pushed = make_experience("d", 0, 0, response=RESPONSE)
    payload = trxp.encode([pushed])
    dripping = threading.Event()

    def drip() -> Iterator[pb.PushRequest]:
        dripping.set()
        for at in range(16 * CHUNK, min(len(payload) - 1, 16 * CHUNK + 16 * 300), 16):  # a minute of it
            time.sleep(0.2)
            yield pb.PushRequest(payload=payload[at : at + 16])

    with servers() as start:
        server = start(str(tmp_path / "data"), env={"EXPBUF_PUSH_STREAM_IDLE_SECONDS": "2"})
        with BufferClient(server.target, timeout=120) as client:
            client.create_table("t", group_size=1)
            channel, call = raw_push(server.target, payload, "t", 16, drip)
            with channel:
                assert dripping.wait(60)
                with pytest.raises(grpc.RpcError) as ended:
                    list(call)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value.details()
            assert reason_of(ended.value.trailing_metadata()) == Reason.TOO_SLOW
            assert "push_min_mb_per_second = 0.1 over every push_stream_idle_seconds = 2" in ended.value.details()
            assert "EXPBUF_PUSH_MIN_MB_PER_SECOND" in ended.value.details()
            assert staged_bytes(client, "t") == 0 and client.stats("t")["t"].pushed == 0
        stopped(server)
    assert counts(tmp_path / "data") == {"chunks": 0, "staged": 0, "blobs": 0}


@pytest.mark.parametrize("when_full", ["block", "evict"])
def test_a_staged_push_into_a_table_its_keyed_values_fill_is_refused_staging_nothing(
    tmp_path: Path, when_full: str
) -> None:
    """Keyed values count against capacity_bytes and nothing evicts them: a push that does not fit
    beside a table's values waits for room before it stages anything, then is refused naming the
    setting, in either mode (it staged all its 18 MB before its commit found the table full)."""
    pushed = make_experience("v", 0, 0, response=RESPONSE)
    with servers() as start:
        server = start(str(tmp_path / "data"), env={"EXPBUF_PUSH_STREAM_IDLE_SECONDS": "4"})
        with BufferClient(server.target, push_chunk_bytes=CHUNK, timeout=120) as client:
            client.create_table("t", group_size=1, capacity_bytes=30 << 20, when_full=when_full)
            client.put_values([f"k{i}" for i in range(5)], [bytes(4 << 20)] * 5, table="t")
            refused_staging_nothing(client, pushed)
            assert client.clear_values([f"k{i}" for i in range(5)], table="t") == 5
            assert client.push([pushed], table="t").stored == [pushed.eid.uid]
        stopped(server)
