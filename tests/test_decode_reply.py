"""A sampled batch as a trainer reads it (`Batch.experiences`, trxp.decode_reply): the values
pushed, bit for bit, for every dtype; a malformed reply refused with an error naming the problem;
a reply's message read as protobuf reads it, its payload copied once (sample_reply)."""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import fields
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError

from expbuf.client import EID, BufferClient, DataLossError, Experience, TrxpError, trxp
from expbuf.client.rpc import wire
from expbuf.client.rpc.sample_reply import read_sample_reply
from expbuf.client.schema.experience import META_FIELDS, TENSOR_FIELDS
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from conftest import Servers, payload


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global trinity
    trinity = pytest.importorskip("trinity.common.experience")


FIXTURES = sorted(p.name for p in (Path(__file__).parent / "fixtures" / "trxp").glob("*.trxp"))
# Every safetensors dtype, each in a multi-modal input of its own.
DTYPES = {
    "bool": torch.bool,
    "u8": torch.uint8,
    "i8": torch.int8,
    "f8e5m2": torch.float8_e5m2,
    "f8e4m3": torch.float8_e4m3fn,
    "i16": torch.int16,
    "u16": torch.uint16,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i32": torch.int32,
    "u32": torch.uint32,
    "f32": torch.float32,
    "f64": torch.float64,
    "i64": torch.int64,
    "u64": torch.uint64,
}


def every_dtype() -> bytes:
    """Two experiences whose tensors cover every dtype, in shapes of 1, 2 and 0 elements' worth."""
    gen = torch.Generator().manual_seed(7)
    exps = []
    for run in range(2):
        inputs = {}
        for name, dtype in DTYPES.items():
            raw = torch.randint(0, 256, (6 + run, 4), dtype=torch.uint8, generator=gen)
            inputs[name] = raw.view(dtype) if dtype.itemsize <= 4 else raw.repeat(1, 2).view(dtype)
        inputs["empty"] = torch.empty((0, 3), dtype=torch.float16)
        exps.append(
            Experience(
                eid=EID(batch="dtypes", task=0, run=run),
                tokens=torch.arange(5 + run, dtype=torch.int64),
                prompt_length=2,
                logprobs=torch.randn(3 + run, dtype=torch.float64, generator=gen),
                action_mask=torch.tensor([1, 0, 1] + [1] * run, dtype=torch.bool),
                reward=0.25 * run,
                info={"model_version": run, "nested": {"a": [1, 2.5, "x"]}},
                multi_modal_inputs=inputs,
            )
        )
    return trxp.encode(exps)


def raw(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())


def custom(cf: object) -> dict[str, str]:
    """A custom field as TRXP carries it (Trinity-RFT reads it into a CustomField)."""
    if isinstance(cf, dict):
        return cf
    return {"source_field": cf.source_field, "destination_field": cf.destination_field, "data_type": str(cf.data_type)}


def assert_same(got: Experience, want: object) -> None:
    """Every field of an expbuf Experience equals the reference's (expbuf's or Trinity-RFT's):
    metadata by value, tensors by dtype, shape and bytes."""
    assert got.eid.uid == want.eid.uid
    for name in META_FIELDS:
        assert getattr(got, name) == getattr(want, name), name
    assert got.custom_fields == [custom(cf) for cf in want.custom_fields]
    mine = {name: getattr(got, name) for name in TENSOR_FIELDS if getattr(got, name) is not None}
    theirs = {name: getattr(want, name) for name in TENSOR_FIELDS if getattr(want, name, None) is not None}
    mine |= {f"mm:{key}": t for key, t in got.multi_modal_inputs.items()}
    theirs |= {f"mm:{key}": t for key, t in (getattr(want, "multi_modal_inputs", None) or {}).items()}
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert (mine[name].dtype, mine[name].shape) == (tensor.dtype, tensor.shape), name
        assert raw(mine[name]) == raw(tensor), name


@pytest.fixture(scope="module")
def client(start_module_server: Servers) -> Iterator[BufferClient]:
    with BufferClient(f"127.0.0.1:{start_module_server().port}", timeout=10) as c:
        yield c


@pytest.mark.parametrize("name", [*FIXTURES, "every dtype"])
def test_a_sampled_batch_decodes_to_the_pushed_values(client: BufferClient, name: str) -> None:
    """Pushed into a table of its own (no advantages added), consumed, decoded as a trainer reads
    it: each experience is Trinity-RFT's own decode of what was pushed, field for field."""
    data = every_dtype() if name == "every dtype" else payload(name)
    pushed = {exp.eid.uid: exp for exp in trinity.Experience.deserialize_many(data)}
    table = "t" + str(FIXTURES.index(name) if name in FIXTURES else len(FIXTURES))
    client.create_table(table, estimator="none", group_by="none")
    client.push(data, table=table)
    got = (
        [
            exp
            for batch in client.sample(table, num_groups=len(pushed), delivery="consume", max_batches=1, timeout=10)
            for exp in batch.experiences
        ]
        if pushed
        else []
    )
    assert sorted(exp.eid.uid for exp in got) == sorted(pushed)
    for exp in got:
        assert_same(exp, pushed[exp.eid.uid])


@pytest.mark.parametrize("name", [*FIXTURES, "every dtype"])
def test_decode_reply_gives_what_decode_gives(name: str) -> None:
    """The reader's checks change what is refused, never what is read: the same experiences as
    the full decode, with every Experience field set (those an item lacks to their defaults)."""
    data = every_dtype() if name == "every dtype" else payload(name)
    full, reply = trxp.decode(data), trxp.decode_reply(data)
    assert len(full) == len(reply)
    for a, b in zip(full, reply, strict=True):
        assert_same(b, a)
        assert {f.name for f in fields(Experience)} == set(vars(b))


def item_of(name: str = "grpo_group.trxp") -> trxp.RawItem:
    return trxp.parse(payload(name))[0]


def with_meta(**changes: object) -> bytes:
    item = item_of()
    item.meta.update(changes)
    return trxp.build([item])


def with_tensor(name: str, tensor: trxp.RawTensor | None) -> bytes:
    item = item_of()
    if tensor is None:
        del item.tensors[name]
    else:
        item.tensors[name] = tensor
    return trxp.build([item])


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"k": value}
    return value


def a_global_in_the_pickle() -> bytes:
    good = payload("single_turn.trxp")
    (meta_len,) = struct.unpack_from("<Q", good, 5)
    meta = pickle.dumps({"version": 1, "num_items": 1, "items": [torch.Size([1])]}, protocol=4)
    return struct.pack("<4sBQQ", b"TRXP", 1, len(meta), len(good) - 21 - meta_len) + meta + good[21 + meta_len :]


def truncated() -> bytes:
    return payload("grpo_group.trxp")[:-5]


# Malformed replies, each with the words of the error that must name it.
MALFORMED: dict[str, tuple[Callable[[], bytes], str]] = {
    "truncated": (truncated, "shorter than the declared"),
    "not trxp": (lambda: b"PK\x03\x04" + bytes(40), "not a TRXP payload"),
    "a global": (a_global_in_the_pickle, "not plain data"),
    "reward as text": (lambda: with_meta(reward="1.0"), "field 'reward' must be a number"),
    "reward nan": (lambda: with_meta(reward=float("nan")), "field 'reward' is nan"),
    "eid missing a part": (lambda: with_meta(eid={"batch": 0, "task": 0, "run": 0, "step": 0}), "eid.suffix"),
    "task with a slash": (
        lambda: with_meta(eid={"batch": 0, "task": "a/b", "run": 0, "step": 0, "suffix": "s"}),
        "field 'eid.task' contains '/'",
    ),
    "negative version": (lambda: with_meta(info={"model_version": -1}), "info.model_version"),
    "info not a dict": (lambda: with_meta(info=[1]), "field 'info' must be a dict"),
    "messages nested too deep": (lambda: with_meta(messages=[nested(40)]), "nested deeper than"),
    "prompt past the tokens": (lambda: with_meta(prompt_length=10_000), "more than the"),
    "tokens missing": (lambda: with_tensor("tokens", None), "field 'tokens' is missing"),
    "logprobs too short": (
        lambda: with_tensor("logprobs", trxp.RawTensor("F32", (1,), bytes(4))),
        "field 'logprobs' has length 1",
    ),
    "float action mask": (
        lambda: with_tensor("action_mask", trxp.RawTensor("F32", (4,), bytes(16))),
        "field 'action_mask' must be bool or integer",
    ),
    "an unlisted input": (
        lambda: with_tensor("multi_modal_inputs:x", trxp.RawTensor("U8", (1,), b"\x01")),
        "not listed in multi_modal_input_keys",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_reply_is_refused_by_name(case: str) -> None:
    make, words = MALFORMED[case]
    data = make()
    with pytest.raises(TrxpError) as refused:
        trxp.decode_reply(data)
    assert words in str(refused.value)
    with pytest.raises(TrxpError) as full:
        trxp.decode(data)
    assert words in str(full.value)


class MalformedServer(pb_grpc.ExperienceBufferServicer):
    """Answers every Sample with one reply whose payload is `payload`, then ends the stream."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def Sample(self, requests: Iterator[pb.SampleRequest], context: grpc.ServicerContext) -> Iterator[pb.SampleReply]:
        next(requests)
        yield pb.SampleReply(payload=self.payload, uids=["0/0/0/0/x"], group_ids=["0/0"], lease_id="l")


@pytest.mark.parametrize("case", ["truncated", "a global", "logprobs too short", "messages nested too deep"])
def test_a_client_refuses_a_malformed_batch_from_the_wire(case: str) -> None:
    """A real gRPC server on loopback sends the malformed batch; the client decodes it before
    it confirms it, so the iterator raises DataLossError naming the problem (the TrxpError is
    its cause), and the client stays usable."""
    make, words = MALFORMED[case]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ExperienceBufferServicer_to_server(MalformedServer(make()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with BufferClient(f"127.0.0.1:{port}", timeout=10) as client:
            with pytest.raises(DataLossError) as refused:
                list(client.sample(num_groups=1, max_batches=1, timeout=10))
            assert words in str(refused.value) and isinstance(refused.value.__cause__, TrxpError)
            with pytest.raises(DataLossError):  # usable: the next stream is read the same way
                list(client.sample(num_groups=1, max_batches=1, timeout=10))
    finally:
        server.stop(None)


def test_a_reply_is_read_as_protobuf_reads_it() -> None:
    """The payload cut from gRPC's bytes and the rest parsed alone give the fields protobuf's own
    parse gives, whatever the layout: payload first (as the server writes it), last, repeated
    (the last one wins), absent, or with a length past the end (refused as protobuf refuses it)."""
    payload = b"TRXP" + bytes(range(256)) * 600
    message = pb.SampleReply(
        payload=payload, uids=["a", "b"], group_ids=["g"], lease_id="l", lease_expires_unix=2.5, times_sampled=[1, 2]
    )
    rest = pb.SampleReply(uids=["a"], advantages=[0.5], response_lengths=[3]).SerializeToString()
    first = message.SerializeToString()
    layouts = {
        "first": first,
        "last": rest + pb.SampleReply(payload=payload).SerializeToString(),
        "repeated": first + pb.SampleReply(payload=b"later").SerializeToString(),
        "absent": rest,
        "empty": b"",
    }
    for name, raw in layouts.items():
        parts, want = read_sample_reply(raw), pb.SampleReply.FromString(raw)
        assert parts.payload == want.payload, name
        assert type(parts.payload) is bytes, name
        want.payload = b""
        assert parts.rest == want, name
    for bad in (first[:-3], b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0a\x05ab"):
        with pytest.raises(DecodeError):
            pb.SampleReply.FromString(bad)
        with pytest.raises(DecodeError):
            read_sample_reply(bad)


def test_the_reply_tags_both_sides_use_are_the_ones_protobuf_writes() -> None:
    """wire.py's tags, which the server writes a reply with by hand and the client reads it by,
    are the first byte of each field as protobuf's own serialiser writes it."""
    written = {
        wire.PAYLOAD_TAG: pb.SampleReply(payload=b"p"),
        wire.COLUMN_TAG: pb.SampleReply(columns=[pb.Column(name="c")]),
        wire.PART_TAG: pb.SampleReply(part=b"p"),
        wire.WHOLE_TAG: pb.SampleReply(whole_bytes=1),
        wire.VALUES_TAG: pb.Column(values=b"v"),
        wire.ALIGN_TAG: pb.Column(align=b"\0"),
    }
    for tag, message in written.items():
        assert message.SerializeToString()[0] == tag, message
