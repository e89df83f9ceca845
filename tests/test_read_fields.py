"""ReadFields: the ranks of a trainer each read some fields of a batch one process sampled, or a
share of each experience's tokens (a context-parallel rank's positions), as columns equal to the
columnar sample's; a large experience's chunks outside the share are never read. A real server
on loopback, real LMDB."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import lmdb
import pytest
import torch

from expbuf.client import AsyncBufferClient, BufferClient, DataLossError, trxp
from expbuf.client.schema.experience import EID, Experience
from expbuf.client.schema.reasons import Reason
from expbuf.client.trxp.stored.columns import MAX_SHARES, Shares
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from helpers import needs_tensordict, servers, wait_ready

FIELDS = ["tokens", "logprobs", "action_mask", "advantages", "returns", "routed_experts", "multi_modal_inputs:pixels"]
SEQUENCE = ["tokens", "routed_experts"]  # laid along all the tokens
RESPONSE = ["logprobs", "action_mask", "advantages", "returns"]  # laid along the response


def rollout(task: int, run: int, prompt: int, response: int) -> Experience:
    """A rollout with routing ids (2 experts a token) and an image's pixels (not along the tokens)."""
    length = prompt + response
    return Experience(
        eid=EID(batch=0, task=task, run=run),
        tokens=torch.arange(length, dtype=torch.int64) + 1000 * run,
        prompt_length=prompt,
        logprobs=torch.linspace(-1, 0, response),
        action_mask=torch.arange(response) % 3 != 0,
        routed_experts=(torch.arange(length * 2, dtype=torch.uint8) % 64).reshape(-1, 2),
        multi_modal_inputs={"pixels": torch.rand(4, 3)},
        reward=float(run),
    )


def pushed(client: BufferClient, table: str) -> list[Experience]:
    """Three groups of three, prompts of 1 to 5 tokens, responses of 0 to 11."""
    client.create_table(table, group_size=3, estimator="grpo")
    made = [rollout(task, run, 1 + 2 * task, 4 * task + run) for task in range(3) for run in range(3)]
    client.push(trxp.encode(made), table=table)
    wait_ready(client, table, len(made))  # with their advantages, which the worker computes on CUDA
    return made


def positions(length: int, share: int, of: int) -> slice:
    return slice(length * share // of, length * (share + 1) // of)


def expected(
    exp: Experience, name: str, shares: tuple[int, ...], of: int, whole: torch.Tensor | None = None
) -> torch.Tensor:
    """What shares of an experience's tensor are, cut from the experience's own (or from `whole`:
    the server's advantages and returns)."""
    if name.startswith("multi_modal_inputs:"):
        return exp.multi_modal_inputs[name.split(":", 1)[1]]
    if whole is None:
        whole = getattr(exp, name)
    assert whole is not None
    length, prompt = exp.tokens.shape[0], exp.prompt_length
    parts = []
    for share in shares:
        at = positions(length, share, of)
        if name in SEQUENCE:
            parts.append(whole[at])
        else:
            parts.append(whole[max(at.start - prompt, 0) : max(at.stop - prompt, 0)])
    return torch.cat(parts)


def test_read_fields_equals_the_columnar_sample_of_the_same_experiences(client: BufferClient) -> None:
    pushed(client, "r")
    (sampled,) = client.sample("r", num_groups=3, delivery="lease", max_batches=1, timeout=10, fields=FIELDS)
    read = client.read_fields(sampled.uids, FIELDS, table="r")
    assert read.uids == sampled.uids and read.group_ids == sampled.group_ids and read.missing_uids == []
    assert list(read.columns) == list(sampled.columns) == FIELDS
    for name in FIELDS:
        got, want = read.columns[name], sampled.columns[name]
        assert got.items == want.items and got.shapes == want.shapes
        for one, other in zip(got.tensors, want.tensors, strict=True):
            assert one.dtype == other.dtype and torch.equal(one, other), name
    assert read.columns["advantages"].values.abs().sum() > 0  # computed by the server, and read while leased
    assert sampled.ack() == 9
    gone = client.read_fields([*sampled.uids[:2], "never-pushed"], ["tokens"], table="r")
    assert gone.uids == [] and gone.missing_uids == [*sampled.uids[:2], "never-pushed"]  # consumed


@needs_tensordict
def test_read_fields_read_as_a_jagged_tensordict(client: BufferClient) -> None:
    pushed(client, "t")
    (sampled,) = client.sample("t", num_groups=3, delivery="lease", max_batches=1, timeout=10, fields=FIELDS)
    td = client.read_fields(sampled.uids, FIELDS, table="t").tensordict()
    assert td.batch_size == torch.Size([9]) and td["tokens"].is_nested and list(td.keys()) == FIELDS


def test_more_shares_than_tokens_cost_a_run_a_token_not_a_run_a_share(client: BufferClient) -> None:
    """A read of 65,536 shares of experiences of a few tokens made a run of rows for every share of
    every tensor of every experience, empty or not: a 180 KB request cost seconds of the server's CPU,
    past its deadline (a helper's audit). A share that covers no token makes none; the shares taken
    still come in the order named, and a read of all of them, in any order, puts the whole back."""
    shares = Shares(MAX_SHARES, tuple(reversed(range(MAX_SHARES))))
    runs = shares.positions(40)
    assert runs == [(t, t + 1) for t in reversed(range(40))]
    made = {exp.eid.uid: exp for exp in pushed(client, "m")}
    uids = list(made)
    read = client.read_fields(uids, ["tokens", "logprobs"], table="m", share=tuple(range(MAX_SHARES)), of=MAX_SHARES)
    whole = client.read_fields(uids, ["tokens", "logprobs"], table="m")
    for name in ("tokens", "logprobs"):
        for k in range(len(uids)):
            assert torch.equal(read.columns[name].tensors[k], whole.columns[name].tensors[k]), (name, k)


@pytest.mark.parametrize("of", [1, 2, 3, 5])
def test_the_shares_of_each_experience_put_together_are_its_whole_tensors(client: BufferClient, of: int) -> None:
    made = {exp.eid.uid: exp for exp in pushed(client, "s")}
    uids = list(made)
    reads = [client.read_fields(uids, FIELDS, table="s", share=share, of=of) for share in range(of)]
    whole = client.read_fields(uids, FIELDS, table="s")
    for name in FIELDS:
        for k, uid in enumerate(uids):
            pieces = [read.columns[name].tensors[k] for read in reads]
            for share, piece in enumerate(pieces):
                want = expected(made[uid], name, (share,), of, whole.columns[name].tensors[k])
                assert torch.equal(piece, want), (name, uid, share)
            if name.startswith("multi_modal_inputs:"):
                assert all(torch.equal(piece, whole.columns[name].tensors[k]) for piece in pieces)  # whole in each
            else:
                assert torch.equal(torch.cat(pieces), whole.columns[name].tensors[k]), (name, uid)


def test_a_balanced_context_parallel_rank_reads_two_shares_in_the_order_named(client: BufferClient) -> None:
    """Rank r of C reads shares r and 2C-1-r of 2C, as Megatron-LM's context parallelism splits a
    causal sequence so that every rank has as much attention work."""
    made = pushed(client, "z")
    uids = [exp.eid.uid for exp in made]
    ranks = 2
    for rank in range(ranks):
        shares = (rank, 2 * ranks - 1 - rank)
        read = client.read_fields(uids, ["tokens", "logprobs"], table="z", share=shares, of=2 * ranks)
        for k, exp in enumerate(made):
            for name in ("tokens", "logprobs"):
                assert torch.equal(read.columns[name].tensors[k], expected(exp, name, shares, 2 * ranks))


def test_the_asyncio_client_reads_fields_as_the_blocking_one(client: BufferClient, target: str) -> None:
    made = pushed(client, "a")
    uids = [exp.eid.uid for exp in made]

    async def read() -> tuple[list[str], list[torch.Tensor]]:
        async with AsyncBufferClient(target, timeout=10) as aio:
            got = await aio.read_fields([*uids, "absent"], ["routed_experts"], table="a", share=1, of=2)
            return got.missing_uids, got.columns["routed_experts"].tensors

    missing, tensors = asyncio.run(read())
    assert missing == ["absent"]
    for tensor, exp in zip(tensors, made, strict=True):
        assert torch.equal(tensor, expected(exp, "routed_experts", (1,), 2))


def test_a_bad_read_is_refused_by_name_and_the_server_stays_healthy(
    client: BufferClient, stub: pb_grpc.ExperienceBufferStub
) -> None:
    made = pushed(client, "b")
    uid = made[0].eid.uid
    with pytest.raises(ValueError, match="share 2 of 2"):
        client.read_fields([uid], ["tokens"], table="b", share=2, of=2)

    def refused(request: pb.ReadFieldsRequest) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.ReadFields(request, timeout=10))
        return caught.value

    cases: list[tuple[pb.ReadFieldsRequest, grpc.StatusCode, str]] = [
        (pb.ReadFieldsRequest(table="b", uids=[uid], shares=2, take=[0]), grpc.StatusCode.INVALID_ARGUMENT,
         "name the fields to read in shares"),
        (pb.ReadFieldsRequest(table="b", uids=[uid, uid], fields=["tokens"]), grpc.StatusCode.INVALID_ARGUMENT,
         "named more than once"),
        (pb.ReadFieldsRequest(table="b", uids=[uid], fields=["tokens"], shares=4, take=[4]),
         grpc.StatusCode.INVALID_ARGUMENT, "share 4 of 4"),
        (pb.ReadFieldsRequest(table="b", uids=[uid], fields=["tokens"], shares=4), grpc.StatusCode.INVALID_ARGUMENT,
         "no share of them to take"),
        (pb.ReadFieldsRequest(table="b", uids=[uid], fields=["tokens"], take=[0]), grpc.StatusCode.INVALID_ARGUMENT,
         "1 to 65536 shares"),
        (pb.ReadFieldsRequest(table="b", uids=[uid], fields=["tokens"], shares=2, take=[1, 1]),
         grpc.StatusCode.INVALID_ARGUMENT, "named twice"),
        (pb.ReadFieldsRequest(table="b", uids=[""], fields=["tokens"]), grpc.StatusCode.INVALID_ARGUMENT,
         "is not an id"),
        (pb.ReadFieldsRequest(table="absent", uids=[uid], fields=["tokens"]), grpc.StatusCode.NOT_FOUND, "absent"),
    ]  # fmt: skip
    for request, code, words in cases:
        error = refused(request)
        assert error.code() == code and words in error.details(), (request, error.details())
    (batch,) = client.sample("b", num_groups=3, max_batches=1, timeout=10)  # all still there, and served
    assert len(batch.uids) == 9


LENGTH, PROMPT = 1_000_000, 10  # a rollout of about 21 MB: six chunks of the store


def long_rollout() -> Experience:
    """Section, in safetensors' order: tokens (I64, 8 MB), log-probs (F32, 4 MB), routing ids
    (U8, 8 experts a token: 8 MB), the mask (BOOL, 1 MB); in chunks of 4 MiB, the routing ids'
    first half lies in chunks 2 and 3, their second half in chunks 3 and 4."""
    return Experience(
        eid=EID(batch=0, task="long", run=0),
        tokens=torch.arange(LENGTH, dtype=torch.int64),
        prompt_length=PROMPT,
        logprobs=torch.linspace(-2, 0, LENGTH - PROMPT),
        action_mask=torch.ones(LENGTH - PROMPT, dtype=torch.bool),
        routed_experts=(torch.arange(LENGTH * 8) % 251).to(torch.uint8).reshape(LENGTH, 8),
        reward=1.0,
    )


def damage_chunk(data: Path, index: int) -> None:
    """Flip a bit of chunk `index` of the one experience stored in chunks (the server stopped)."""
    env = lmdb.open(str(data), max_dbs=64, map_size=1 << 30)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True) as txn:
        (key, value), *_ = [(k, v) for k, v in txn.cursor(db=chunks) if int.from_bytes(k[-4:], "big") == index]
        damaged = bytearray(value)
        damaged[1000] ^= 0x40
        txn.put(key, bytes(damaged), db=chunks)
    env.close()


def test_a_share_of_a_large_experience_reads_only_its_chunks(tmp_path: Path) -> None:
    """A context-parallel rank's share is read from the chunks its rows lie in: a chunk damaged in
    the other share's routing ids leaves this share served, while the share that reads it ends the
    call DATA_LOSS naming the experience, which is quarantined."""
    data = tmp_path / "data"
    exp = long_rollout()
    quiet = {"EXPBUF_SCRUB_MB_PER_SECOND": "0"}  # the background scrub would find it first
    with servers() as start:
        server = start(str(data), env=quiet)
        with BufferClient(server.target, timeout=120) as client:
            client.create_table("t", group_size=1)
            client.push([exp], table="t")
        assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
    damage_chunk(data, 4)
    uid, fields = exp.eid.uid, ["tokens", "routed_experts"]
    with servers() as start:
        server = start(str(data), env=quiet)
        with BufferClient(server.target, timeout=120) as client:
            read = client.read_fields([uid], fields, table="t", share=0, of=2)
            half = slice(0, LENGTH // 2)
            assert torch.equal(read.columns["tokens"].tensors[0], exp.tokens[half])
            assert torch.equal(read.columns["routed_experts"].tensors[0], exp.routed_experts[half])
            sizes = client.read_fields([uid], ["length", "prompt_length"], table="t").columns  # from its head alone
            assert (sizes["length"].values.tolist(), sizes["prompt_length"].values.tolist()) == ([LENGTH], [PROMPT])
            with pytest.raises(DataLossError) as lost:
                client.read_fields([uid], fields, table="t", share=1, of=2)
            assert lost.value.reason == Reason.DAMAGED and uid in str(lost.value) and "quarantined" in str(lost.value)
            assert client.read_fields([uid], fields, table="t", share=0, of=2).missing_uids == [uid]
            assert client.stats("t").tables["t"].quarantined == 1
        assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
