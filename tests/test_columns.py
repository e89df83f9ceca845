"""Columnar batches: `sample(..., fields=[...])` gives each field of a batch as one tensor, jagged
by experience, equal field by field to what the TRXP payload of the same batch decodes to. A real
server on loopback, real LMDB."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch

from expbuf.client import BufferClient, DataLossError, trxp
from expbuf.client.columns import decode_columns
from expbuf.client.rpc.sample_reply import read_sample_reply
from expbuf.client.schema.experience import EID, Experience
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from helpers import needs_tensordict, serving, wait_ready

FIELDS = ["tokens", "logprobs", "action_mask", "advantages", "returns", "routed_experts"]


def rollout(task: int, run: int, response: int, *, half: bool = False) -> Experience:
    """A rollout of `response` generated tokens with its routing ids (uint8, 2 experts a token)."""
    prompt = 3 + task
    return Experience(
        eid=EID(batch=0, task=task, run=run),
        tokens=torch.arange(prompt + response, dtype=torch.int64) + 100 * run,
        prompt_length=prompt,
        logprobs=torch.linspace(-1, 0, response, dtype=torch.bfloat16 if half else torch.float32),
        action_mask=torch.arange(response) % 3 != 0,
        routed_experts=(torch.arange((prompt + response) * 2, dtype=torch.uint8) % 64).reshape(-1, 2),
        reward=float(run),
    )


def pushed(client: BufferClient, table: str, *, half_from: int = 99) -> list[Experience]:
    client.create_table(table, group_size=3, estimator="grpo")
    made = [rollout(task, run, 4 + task + run, half=run >= half_from) for task in range(3) for run in range(3)]
    client.push(trxp.encode(made), table=table)
    return made


def both(client: BufferClient, table: str) -> tuple[list[Experience], dict]:
    """The same three groups, replayed: as experiences, and as columns."""
    kw = {"num_groups": 3, "delivery": "replay", "max_batches": 1, "timeout": 10}
    (trxp_batch,) = client.sample(table, **kw)
    (columnar,) = client.sample(table, **kw, fields=FIELDS)
    assert columnar.uids == trxp_batch.uids and not columnar.payload
    return trxp_batch.experiences, columnar.columns


def test_a_columnar_sample_equals_the_trxp_sample_field_by_field(client: BufferClient) -> None:
    pushed(client, "c")
    experiences, columns = both(client, "c")
    assert list(columns) == FIELDS
    for name in FIELDS:
        column = columns[name]
        assert column.items == list(range(len(experiences)))
        want = [getattr(exp, name) for exp in experiences]
        assert [tuple(t.shape) for t in want] == column.shapes
        for got, expected in zip(column.tensors, want, strict=True):
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
        assert column.values is not None and column.offsets is not None
        assert column.offsets.tolist()[-1] == column.values.shape[0]
    nested = columns["logprobs"].nested()
    assert nested.is_nested and nested.size(0) == len(experiences)
    assert torch.equal(nested.unbind()[4], experiences[4].logprobs)
    routed = columns["routed_experts"]
    assert routed.values is not None and routed.values.dtype == torch.uint8 and routed.values.shape[1:] == (2,)
    advantages = torch.cat([exp.advantages for exp in experiences])
    assert torch.equal(columns["advantages"].values, advantages) and advantages.abs().sum() > 0


@needs_tensordict
def test_the_docs_trainer_takes_a_jagged_tensordict_of_its_fields(client: BufferClient) -> None:
    """docs/concepts/pushing-and-sampling.md, "Columnar batches": its loop, as written there."""
    made = pushed(client, "d")
    fields = ["tokens", "action_mask", "logprobs", "advantages", "reward"]
    steps = []
    for batch in client.sample("d", num_groups=3, fields=fields, max_batches=1, timeout=10):
        step = batch.tensordict()
        steps.append((step, batch.columns))
        batch.ack()
    ((step, columns),) = steps
    assert step.batch_size == torch.Size([9]) and list(step.keys()) == fields
    by_uid = {exp.eid.uid: exp for exp in made}
    for k, uid in enumerate(batch.uids):
        assert torch.equal(step[k]["tokens"], by_uid[uid].tokens)
        assert torch.equal(step["logprobs"].unbind()[k], by_uid[uid].logprobs)
    assert step["tokens"].is_nested and step["reward"].tolist() == [by_uid[uid].reward for uid in batch.uids]
    assert step["tokens"].values().data_ptr() == columns["tokens"].values.data_ptr()  # no copy
    assert client.stats("d")["d"].consumed == 9


@needs_tensordict
def test_a_tensordict_refuses_a_field_some_experience_lacks_and_a_trxp_batch(client: BufferClient) -> None:
    made = [rollout(task, run, 4) for task in range(2) for run in range(3)]
    for exp in made:
        exp.info = {"model_version": 1} if exp.eid.run else {}
    client.create_table("m", group_size=3, estimator="none")
    client.push(trxp.encode(made), table="m")
    fields = ["tokens", "model_version"]
    (batch,) = client.sample("m", num_groups=2, fields=fields, max_batches=1, timeout=10, delivery="replay")
    with pytest.raises(ValueError, match="'model_version' is missing from 2 of the batch's 6 experiences"):
        batch.tensordict()
    (whole,) = client.sample("m", num_groups=1, max_batches=1, timeout=10)
    with pytest.raises(ValueError, match="sample with fields"):
        whole.tensordict()


def test_scalar_columns_come_from_what_the_server_keeps_of_each_experience(client: BufferClient) -> None:
    made = [rollout(task, run, 4 + task + run) for task in range(3) for run in range(3)]
    client.create_table("v", group_size=3, estimator="none")
    for exp in made:
        exp.info = {"model_version": exp.eid.run + 1} if exp.eid.run else {}
    client.push(trxp.encode(made), table="v")
    fields = ["model_version", "tokens", "reward", "response_length"]
    (batch,) = client.sample("v", num_groups=3, fields=fields, max_batches=1, timeout=10)
    columns = batch.columns
    assert list(columns) == fields
    by_uid = {exp.eid.uid: exp for exp in made}
    exps = [by_uid[uid] for uid in batch.uids]
    assert columns["reward"].values.tolist() == [exp.reward for exp in exps]
    assert columns["reward"].values.dtype == torch.float64 and columns["reward"].offsets.tolist() == list(range(10))
    assert columns["response_length"].values.tolist() == [len(exp.logprobs) for exp in exps]
    versions = columns["model_version"]  # the experiences of run 0 have none: left out
    assert versions.items == [k for k, exp in enumerate(exps) if exp.eid.run]
    assert versions.values.tolist() == [exp.eid.run + 1 for exp in exps if exp.eid.run]
    with pytest.raises(ValueError, match="one value per experience"):
        versions.nested()


def test_a_columnar_batch_carries_only_its_fields_and_no_experiences(client: BufferClient) -> None:
    pushed(client, "o")
    (batch,) = client.sample("o", num_groups=1, max_batches=1, fields=["logprobs", "teacher_logprobs"], timeout=10)
    assert list(batch.columns) == ["logprobs"]  # no experience has teacher log-probs
    with pytest.raises(ValueError, match="sampled as columns"):
        _ = batch.experiences
    columns = batch.columns["logprobs"]
    columns.values.add_(1.0)  # writable: the batch owns its buffer
    batch.ack()


def test_a_field_stored_with_two_dtypes_is_promoted_in_batch_order(client: BufferClient) -> None:
    pushed(client, "h", half_from=2)  # each group's third run sends bfloat16 log-probs
    experiences, columns = both(client, "h")
    logprobs = columns["logprobs"]
    assert logprobs.values is not None and logprobs.values.dtype == torch.float32
    for got, exp in zip(logprobs.tensors, experiences, strict=True):
        assert torch.equal(got, exp.logprobs.float())


def test_a_columnar_request_with_bad_fields_is_refused_naming_them(client: BufferClient) -> None:
    pushed(client, "r")
    wait_ready(client, "r", 9)  # computed by the worker, not the push, on CUDA
    with pytest.raises(ValueError, match="fields is empty"):
        next(client.sample("r", num_groups=1, fields=[]))
    request = pb.SampleRequest(table="r", num_groups=1, max_batches=1, fields=["tokens", "tokens"])
    channel = grpc.insecure_channel(client.target)
    stream = channel.stream_stream(
        "/expbuf.v1.ExperienceBuffer/Sample",
        request_serializer=pb.SampleRequest.SerializeToString,
        response_deserializer=pb.SampleReply.FromString,
    )(iter([request]))
    with pytest.raises(grpc.RpcError) as refused:
        next(stream)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fields names tokens more than once" in refused.value.details()
    channel.close()
    assert client.stats("r")["r"].ready == 9  # nothing was taken


def test_a_reply_whose_columns_do_not_fit_their_framing_is_refused() -> None:
    short = pb.Column(name="tokens", dtype="I64", items=[0], ndim=1, shapes=[4], values=b"\0" * 24)
    with pytest.raises(ValueError, match="24 bytes of values for 4 I64 values"):
        decode_columns([short], 1)
    outside = pb.Column(name="tokens", dtype="I64", items=[3], ndim=1, shapes=[1], values=b"\0" * 8)
    with pytest.raises(ValueError, match="not positions of the batch"):
        decode_columns([outside], 1)


class OlderServer(pb_grpc.ExperienceBufferServicer):
    """A server from before columnar batches: it ignores `fields` and sends the TRXP payload."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.received: list[int] = []
        self.ended = threading.Event()

    def Sample(self, requests: Iterator[pb.SampleRequest], context: grpc.ServicerContext) -> Iterator[pb.SampleReply]:
        next(requests)
        yield pb.SampleReply(payload=self.payload, uids=["0/0/0/0/"], group_ids=["0/0"], lease_id="L1")
        try:
            self.received += [request.received for request in requests]
        finally:
            self.ended.set()


def test_a_server_that_sends_a_payload_for_fields_is_named_and_its_batch_goes_back() -> None:
    server = OlderServer(trxp.encode([rollout(0, 0, 4)]))
    with (
        serving(server) as target,
        BufferClient(target) as older,
        pytest.raises(DataLossError, match="it predates columnar batches"),
    ):
        next(older.sample("t", num_groups=1, fields=["tokens"]))
    assert server.ended.wait(30)
    assert 1 not in server.received  # never confirmed: it goes back


def test_columns_are_made_in_place_in_the_reply_aligned_and_writable(client: BufferClient) -> None:
    pushed(client, "a")
    _, columns = both(client, "a")
    for name, column in columns.items():
        assert column.values is not None and column.values.data_ptr() % 64 == 0, name
    logprobs = columns["logprobs"].values
    logprobs[0] = 7.0  # a trainer may write into its batch
    assert float(logprobs[0]) == 7.0


def test_a_columnar_reply_in_protobufs_own_layout_reads_the_same(client: BufferClient) -> None:
    """A reply serialised by protobuf (its uids before its columns, as another server's would
    be) is not read in place: it is parsed whole and each column copied, to the same tensors."""
    pushed(client, "p")
    request = pb.SampleRequest(
        table="p", num_groups=3, delivery=pb.DELIVERY_REPLAY, max_batches=1, wait_seconds=10, fields=FIELDS
    )
    with grpc.insecure_channel(client.target) as channel:
        sample = channel.stream_stream(
            "/expbuf.v1.ExperienceBuffer/Sample", request_serializer=pb.SampleRequest.SerializeToString
        )
        (raw,) = sample(iter([request]), timeout=10)
    ours = read_sample_reply(raw)
    assert ours.values is not None and len(ours.values) == len(ours.rest.columns)
    theirs = read_sample_reply(pb.SampleReply.FromString(raw).SerializeToString())
    assert theirs.values is None
    count = len(ours.rest.uids)
    in_place = decode_columns(ours.rest.columns, count, ours.values)
    parsed = decode_columns(theirs.rest.columns, count)
    assert list(in_place) == list(parsed) == FIELDS
    for name in FIELDS:
        assert torch.equal(in_place[name].values, parsed[name].values), name
        assert torch.equal(in_place[name].offsets, parsed[name].offsets), name


def test_each_experiences_length_and_prompt_length_come_from_its_header(client: BufferClient) -> None:
    """`length` and `prompt_length`: one int64 a experience, for packing micro-batches by tokens,
    read from each stored header; asked for alone, the reply carries no tensor."""
    made = {exp.eid.uid: exp for exp in pushed(client, "l")}
    options = {"num_groups": 3, "delivery": "replay", "max_batches": 1, "timeout": 10}
    (batch,) = client.sample("l", **options, fields=["length", "prompt_length"])
    assert list(batch.columns) == ["length", "prompt_length"]
    lengths, prompts = batch.columns["length"].values.tolist(), batch.columns["prompt_length"].values.tolist()
    assert lengths == [made[uid].tokens.numel() for uid in batch.uids]
    assert prompts == [made[uid].prompt_length for uid in batch.uids]
    read = client.read_fields(batch.uids, ["tokens", "length"], table="l")  # beside a tensor, by ReadFields
    assert read.columns["length"].values.tolist() == lengths


def test_a_field_with_a_trailing_dimension_of_zero_reads_as_its_decoded_tensors(client: BufferClient) -> None:
    """Routing ids of a dense model, [tokens, 0]: a column of no values, whose rows are counted
    from its shapes (no -1 can be inferred from no values), equal to the decoded tensors."""
    made = [rollout(0, run, 3 + run) for run in range(3)]
    for exp in made:
        exp.routed_experts = torch.zeros(exp.tokens.numel(), 0, dtype=torch.uint8)
    client.create_table("z", group_size=3, estimator="none")
    client.push(trxp.encode(made), table="z")
    kw = {"num_groups": 1, "delivery": "replay", "max_batches": 1, "timeout": 10}
    (whole,) = client.sample("z", **kw)
    (columnar,) = client.sample("z", **kw, fields=["routed_experts"])
    routed = columnar.columns["routed_experts"]
    assert routed.values is not None and routed.values.shape == (sum(exp.tokens.numel() for exp in made), 0)
    for got, exp in zip(routed.tensors, whole.experiences, strict=True):
        assert got.dtype == torch.uint8 and got.shape == exp.routed_experts.shape
    assert routed.nested().size(0) == len(made)
