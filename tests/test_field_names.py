"""A columnar read names what it reads: `sample(..., fields=[...])` and `read_fields` refuse a name
no column could have (a typo gave batches with no columns, which a trainer's loop acked), by the
client before any call and by the server, naming it and the known ones; and a batch says which of
the fields asked for none of its experiences has (they dropped out of `columns` and `tensordict()`
silently, so a trainer met a KeyError far from the cause). A real server on loopback, real LMDB."""

from __future__ import annotations

import asyncio
import queue
from typing import Any

import grpc
import pytest
import torch

from expbuf.client import AsyncBufferClient, BufferClient, trxp
from expbuf.client.rpc.wire import reason_of
from expbuf.client.schema.experience import EID, Experience
from expbuf.client.schema.reasons import Reason
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

KNOWN = "tokens, logprobs"  # the start of the list of known fields that a refusal names


def rollouts(client: BufferClient, table: str) -> list[str]:
    """Table `table` holding two groups of one rollout each, with tokens and log-probs but no
    teacher log-probs; their uids."""
    client.create_table(table, group_size=1, estimator="none")
    made = [
        Experience(
            eid=EID(batch=0, task=task, run=0),
            tokens=torch.arange(7, dtype=torch.int64),
            prompt_length=3,
            logprobs=torch.linspace(-1, 0, 4),
            reward=1.0,
        )
        for task in range(2)
    ]
    return client.push(trxp.encode(made), table=table).stored


@pytest.mark.parametrize("name", ["tokns", "multi_modal_inputs:", "Tokens"])
def test_an_unknown_field_is_refused_by_name_by_both_clients_before_any_call(
    client: BufferClient, target: str, name: str
) -> None:
    uids = rollouts(client, "t")
    fields = ["tokens", name]
    with pytest.raises(ValueError, match=f"sample: fields: unknown field {name!r}; the fields are {KNOWN}") as refused:
        next(client.sample("t", num_groups=1, fields=fields, max_batches=1, timeout=5))
    assert "multi_modal_inputs:KEY" in str(refused.value)

    async def sample() -> None:
        async with AsyncBufferClient(target) as aclient:
            await anext(aclient.sample("t", num_groups=1, fields=fields, max_batches=1, timeout=5))

    with pytest.raises(ValueError, match=f"unknown field {name!r}"):
        asyncio.run(sample())
    with pytest.raises(ValueError, match=f"fields: unknown field {name!r}"):
        client.read_fields(uids, fields, table="t")
    assert client.stats("t")["t"].ready == 2  # nothing was taken


def test_the_server_refuses_an_unknown_field_by_name(client: BufferClient, target: str) -> None:
    """A raw client's Sample and ReadFields naming a field no column could have: INVALID_ARGUMENT,
    naming it and the known ones, with its reason; nothing taken."""
    uids = rollouts(client, "t")
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        first = pb.SampleRequest(table="t", num_groups=1, max_batches=1, fields=["tokens", "tokns"])
        with pytest.raises(grpc.RpcError) as sampled:
            next(stub.Sample(iter([first])))
        with pytest.raises(grpc.RpcError) as read:
            next(stub.ReadFields(pb.ReadFieldsRequest(table="t", uids=uids, fields=["tokns"])))
    for refused in (sampled.value, read.value):
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"unknown field 'tokns'; the fields are {KNOWN}" in refused.details()
        assert "multi_modal_inputs:KEY" in refused.details()
        assert reason_of(refused.trailing_metadata()) == Reason.INVALID_REQUEST
    assert client.stats("t")["t"].ready == 2


def test_a_batch_says_which_fields_asked_for_it_lacks(client: BufferClient, target: str) -> None:
    """No experience of the batch has teacher log-probs: the reply names the field in
    `missing_fields`, the batch in `missing_fields`, and looking it up in `columns` or making a
    TensorDict raises, naming the field and why, where it dropped out silently."""
    uids = rollouts(client, "t")
    fields = ["tokens", "teacher_logprobs", "logprobs"]
    options: dict[str, Any] = {"num_groups": 2, "fields": fields, "max_batches": 1, "timeout": 10}
    (batch,) = client.sample("t", **options, delivery="replay")
    assert list(batch.columns) == ["tokens", "logprobs"]
    assert batch.missing_fields == ["teacher_logprobs"]
    with pytest.raises(KeyError, match="'teacher_logprobs': no experience of this batch has it"):
        _ = batch.columns["teacher_logprobs"]
    with pytest.raises(KeyError, match="'advantages' was not asked for"):
        _ = batch.columns["advantages"]
    assert batch.columns.get("teacher_logprobs") is None
    with pytest.raises(ValueError, match="'teacher_logprobs' was asked for, but no experience of the batch's 2"):
        batch.tensordict()
    read = client.read_fields(uids, fields, table="t")
    assert read.missing_fields == ["teacher_logprobs"] and list(read.columns) == ["tokens", "logprobs"]

    async def sample() -> list[str]:
        async with AsyncBufferClient(target) as aclient:
            return (await anext(aclient.sample("t", **options, delivery="replay"))).missing_fields

    assert asyncio.run(sample()) == ["teacher_logprobs"]
    requests: queue.SimpleQueue[pb.SampleRequest | None] = queue.SimpleQueue()
    requests.put(pb.SampleRequest(table="t", num_groups=2, max_batches=1, fields=fields, delivery=pb.DELIVERY_REPLAY))
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        call = stub.Sample(iter(requests.get, None))
        reply = next(call)
        requests.put(pb.SampleRequest(received=1))
        requests.put(None)
        assert list(call) == []
        assert list(reply.missing_fields) == ["teacher_logprobs"]
        everything = pb.SampleRequest(table="t", num_groups=2, max_batches=1, fields=["tokens"])
        assert list(next(stub.Sample(iter([everything]))).missing_fields) == []


def test_batches_joined_lack_a_field_only_where_every_part_lacks_it() -> None:
    """A sharded client's batch, or a read in parts, joins its parts' columns in the order the
    fields were asked: a field is missing from the whole only where no part has it."""
    from expbuf.client.columns import Column, Columns, join_columns

    tokens = Column("tokens", [0], [(2,)], torch.arange(2), torch.tensor([0, 2]))
    teacher = Column("teacher_logprobs", [0], [(2,)], torch.zeros(2), torch.tensor([0, 2]))
    one = Columns({"tokens": tokens}, missing=["teacher_logprobs", "logprobs"])
    two = Columns({"tokens": tokens, "teacher_logprobs": teacher}, missing=["logprobs"])
    joined = join_columns([(range(0, 1), one), (range(1, 2), two)], ["teacher_logprobs", "tokens", "logprobs"])
    assert list(joined) == ["teacher_logprobs", "tokens"] and joined.missing == ("logprobs",)
