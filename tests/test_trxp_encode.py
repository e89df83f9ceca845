"""The client's encoder: byte for byte what Trinity-RFT's serialize_many and safetensors write,
and the caller's own mistakes refused with errors that name the field."""

from __future__ import annotations

import math
import struct
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expbuf.client import EID, BufferClient, Experience, TrxpError, encode, trxp

# Tensor names JSON must escape (a quote, a backslash, control characters) or that are not ASCII.
AWKWARD_NAMES = ['say "cheese"', "back\\slash", "line\nbreak\t\x01\x1f", "pixel_värden ✓", "\x7f"]


def trinity_experiences(count: int) -> list:
    """Trinity-RFT experiences of every kind of field, sharing a prompt's messages the way
    the runs of a task do (which the metadata pickle writes once and then refers to)."""
    from trinity.common.experience import EID as TrinityEID
    from trinity.common.experience import CustomField
    from trinity.common.experience import Experience as TrinityExperience

    messages = [{"role": "user", "content": "What is 2+2? ✓"}]
    exps = []
    for i in range(count):
        logprobs = torch.randn(8)[::2]  # a strided view
        exps.append(
            TrinityExperience(
                eid=TrinityEID(batch="3/eval", task=i // 4, run=i % 4, step=0, suffix=f"s{i}"),
                tokens=torch.arange(6, dtype=torch.int64 if i % 2 else torch.int32) + i,
                prompt_length=2,
                logprobs=logprobs,
                action_mask=torch.tensor([True, False, True, True]),
                reward=None if i == 5 else 0.5 * i,
                info={"model_version": 3, "note": "ü"},
                metrics={"accuracy": 1.0},
                prompt_text="What is 2+2? ✓",
                response_text="4 — four",
                messages=messages,
                tools=[{"name": "calc", "args": [1, 2.5, None, True]}],
                custom_fields=[CustomField(source_field="a", destination_field="b", data_type=torch.float32)],
                multi_modal_inputs={
                    "pixel_values": torch.ones(2, 3),
                    **{name: torch.full((2,), i, dtype=torch.bfloat16) for name in AWKWARD_NAMES},
                },
            )
        )
    return exps


def test_encode_equals_trinity_serialize_many() -> None:
    """12 items, so that item 10's tensors sort before item 2's as safetensors sorts names."""
    pytest.importorskip("trinity")
    from trinity.common.experience import Experience as TrinityExperience

    exps = trinity_experiences(12)
    data = encode(exps)
    assert data == TrinityExperience.serialize_many(exps)
    back = TrinityExperience.deserialize_many(data)
    assert [e.eid.uid for e in back] == [e.eid.uid for e in exps]
    assert torch.equal(back[11].multi_modal_inputs['say "cheese"'], exps[11].multi_modal_inputs['say "cheese"'])


PLAIN = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
TENSOR_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool]


@given(
    st.lists(
        st.tuples(
            st.integers(1, 4),  # prompt length
            st.integers(1, 4),  # response length
            st.dictionaries(st.text(max_size=5), PLAIN, max_size=3),  # info
            st.none() | st.lists(PLAIN, max_size=3),  # messages
            st.dictionaries(
                st.text(st.characters(blacklist_categories=["Cs"]), max_size=6),  # any name but lone surrogates
                st.tuples(st.sampled_from(TENSOR_DTYPES), st.lists(st.integers(0, 3), max_size=2)),
                max_size=2,
            ),  # multi-modal inputs
        ),
        min_size=1,
        max_size=12,
    )
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_encode_equals_trinity_on_any_plain_data(specs: list) -> None:
    """Any plain metadata, any multi-modal key and dtype: the bytes Trinity-RFT writes."""
    pytest.importorskip("trinity")
    from trinity.common.experience import EID as TrinityEID
    from trinity.common.experience import Experience as TrinityExperience

    exps = [
        TrinityExperience(
            eid=TrinityEID(batch=0, task=i, run=0, step=0, suffix="s"),
            tokens=torch.arange(prompt + response, dtype=torch.int32),
            prompt_length=prompt,
            logprobs=torch.zeros(response),
            info=info,
            messages=messages,
            multi_modal_inputs={key: torch.zeros(shape, dtype=dtype) for key, (dtype, shape) in mm.items()} or None,
        )
        for i, (prompt, response, info, messages, mm) in enumerate(specs)
    ]
    assert encode(exps) == TrinityExperience.serialize_many(exps)


@pytest.mark.parametrize("names", [["tokens", "logprobs"], AWKWARD_NAMES], ids=["plain", "escaped"])
def test_header_is_what_safetensors_writes(names: list[str]) -> None:
    """build writes the safetensors header itself; names JSON must escape take the slow way."""
    tensors = {f"{i}:{name}": torch.arange(i + 3, dtype=torch.int16) for i in range(11) for name in names}
    items = [
        trxp.RawItem(meta={}, tensors={name: trxp.raw_of(tensors[f"{i}:{name}"]) for name in names}) for i in range(11)
    ]
    data = trxp.build(items)
    _, _, meta_len, _ = struct.unpack_from("<4sBQQ", data)
    assert data[21 + meta_len :] == safetensors.torch.save(tensors)


def test_raw_of_takes_any_layout() -> None:
    """Tensors already contiguous on the CPU are read as they are; others are copied first."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    grad = torch.ones(3, requires_grad=True)
    for value, want in [
        (base.t(), base.t().contiguous()),
        (base[:, 1], base[:, 1].contiguous()),
        (base[1], base[1].clone()),
        (grad, grad.detach()),
        ([[1, 2], [3, 4]], torch.tensor([[1, 2], [3, 4]])),
        (torch.empty(0, 3), torch.empty(0, 3)),
    ]:
        raw = trxp.raw_of(value)
        assert (raw.dtype, raw.shape) == (trxp.raw_of(want).dtype, tuple(want.shape))
        assert raw.data == safetensors.torch.save({"t": want})[-len(raw.data) :] if raw.data else raw.data == b""
    with pytest.raises(TrxpError, match=r"tensor dtype torch.complex64 has no safetensors code"):
        trxp.raw_of(torch.zeros(2, dtype=torch.complex64))


def experience(**fields: object) -> Experience:
    values: dict = {
        "eid": EID(batch=1, task=0, run=0, suffix="x"),
        "tokens": torch.arange(4, dtype=torch.int32),
        "prompt_length": 1,
        "logprobs": torch.zeros(3),
        "reward": 1.0,
    }
    return Experience(**(values | fields))


def cyclic() -> list:
    loop: list = []
    loop.append(loop)
    return loop


def deep(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"info": {"a": object()}}, r"field 'info': object is not plain data"),
        ({"info": {"a": {"b": [torch.zeros(2)]}}}, r"field 'info': Tensor is not plain data"),
        ({"info": {"loop": cyclic()}}, r"field 'info': nested deeper than 32 levels \(or cyclic\)"),
        ({"info": {1: 2}}, r"field 'info': dict keys must be str or bytes"),
        ({"info": ["model_version"]}, r"field 'info' must be a dict"),
        ({"info": {"model_version": "v5"}}, r"field 'info.model_version' must be an int"),
        ({"metrics": {"m": {1, 2}}}, r"field 'metrics': set is not plain data"),
        ({"messages": [{"role": object()}]}, r"field 'messages': object is not plain data"),
        ({"messages": "hi"}, r"field 'messages' must be a list or None"),
        ({"tools": deep(40)}, r"field 'tools': nested deeper than 32 levels"),
        ({"chosen_messages": [{"k": [{1: 2}]}]}, r"field 'chosen_messages': dict keys must be str or bytes"),
        ({"rejected_messages": [cyclic()]}, r"field 'rejected_messages': nested deeper"),
        ({"prompt_length": torch.tensor(1)}, r"field 'prompt_length' must be an int, got Tensor"),
        ({"prompt_length": 9}, r"field 'prompt_length' is 9, more than the 4 tokens"),
        ({"truncate_status": object()}, r"field 'truncate_status' must be a str or None"),
        ({"reward": float("inf")}, r"field 'reward' is inf, not a finite number"),
        ({"reward": "abc"}, r"field 'reward' must be a number, got str 'abc'"),
        ({"reward": [1.0]}, r"field 'reward' must be a number, got list"),
        ({"multi_modal_inputs": {1: torch.zeros(2)}}, r"field 'multi_modal_inputs' has a key of type int"),
        ({"custom_fields": [{"source_field": "a"}]}, r"an entry lacks destination_field, data_type"),
        ({"eid": EID(run=-1)}, r"^item 1: field 'eid.run' is -1, outside \[0, 2\*\*63 - 1\]"),
        ({"eid": EID(suffix="a/b")}, r"^item 1: field 'eid.suffix' contains '/'"),
        ({"eid": {"batch": 0, "task": 0, "run": 0, "step": 0, "suffix": "a", "x": 1}}, r"field 'eid' has unknown"),
        ({"logprobs": torch.zeros(5)}, r"field 'logprobs' has length 5, but the response has 3 tokens"),
        ({"action_mask": torch.ones(3, 1)}, r"field 'action_mask' must be 1-D"),
        (
            {"custom_fields": [SimpleNamespace(source_field=1, destination_field="b", data_type=torch.int8)]},
            r"field 'custom_fields' must be a list of source/destination/data_type strings",
        ),
    ],
)
def test_caller_mistakes_are_named(fields: dict, message: str) -> None:
    with pytest.raises(TrxpError, match=message):
        encode([experience(), experience(**fields)])


def test_caller_containers_are_kept_as_given() -> None:
    """Nested plain data of every kind, empty and not, comes back as it went in."""
    info = {"model_version": 2, "nested": {"list": [1, 2.5, None, True, b"raw", "ü"], "tuple": (1, (2,))}}
    exp = experience(info=info, metrics={}, messages=[], tools=[{"name": "calc"}], chosen_messages=deep(30))
    (back,) = trxp.decode(encode([exp]))
    assert (back.info, back.metrics, back.messages, back.tools) == (info, {}, [], [{"name": "calc"}])
    assert back.chosen_messages == deep(30)


def test_numpy_and_torch_scalars_in_info_and_metrics_are_the_numbers_they_hold(client: BufferClient) -> None:
    """A reward function's numpy values land in metrics and info (Trinity-RFT's workflows update
    metrics with them): a numpy float, a float to the checks, was pickled as numpy's and the whole
    push refused by the server ("pickle opcode STACK_GLOBAL is not plain data"), naming no field."""
    np = pytest.importorskip("numpy")
    exp = experience(
        metrics={"accuracy": np.float64(1.0), "format": np.float32(0.5), "turns": np.int64(3)},
        info={"stats": {"score": torch.tensor(2.5)}, "scores": [np.float64(0.25)], "kept": (np.bool_(True),)},
    )
    client.push([exp], table="default")
    (back,) = client.get([exp.eid.uid])  # as the server stored it
    assert back.metrics == {"accuracy": 1.0, "format": 0.5, "turns": 3}
    assert back.info == {"stats": {"score": 2.5}, "scores": [0.25], "kept": (True,)}
    assert type(back.metrics["accuracy"]) is float and type(back.metrics["turns"]) is int


FIELD_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
MM_DTYPES = [*TENSOR_DTYPES, torch.int32, torch.int8, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn]


@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.int32, torch.int64]),  # tokens
            st.integers(1, 3),  # prompt length
            st.integers(1, 3),  # response length
            st.sets(st.sampled_from(["logprobs", "advantages", "returns", "teacher_logprobs"])),
            st.booleans(),  # routed experts: 2-D
            st.sampled_from(FIELD_DTYPES),
            st.none() | st.sampled_from([torch.bool, torch.int8, torch.int32]),  # action mask
            st.dictionaries(
                st.sampled_from(["pixel_values", "tokens", "0:tokens", *AWKWARD_NAMES]),
                st.tuples(st.sampled_from(MM_DTYPES), st.lists(st.integers(0, 3), max_size=3)),
                max_size=3,
            ),
        ),
        min_size=1,
        max_size=14,
    )
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_batch_of_mixed_tensors_is_what_trinity_writes_and_reads(specs: list) -> None:
    """Every tensor field, dtype, shape and length mixed in one batch (items 10 and up sort before
    item 2): the bytes Trinity-RFT writes, and the same tensors back through its decoder and
    expbuf's own."""
    pytest.importorskip("trinity")
    from trinity.common.experience import EID as TrinityEID
    from trinity.common.experience import Experience as TrinityExperience

    exps = []
    for i, (token_dtype, prompt, response, fields, routed, dtype, mask, mm) in enumerate(specs):
        values = {name: torch.arange(response, dtype=torch.float64).to(dtype) + i for name in sorted(fields)}
        if routed:
            values["routed_experts"] = torch.arange(2 * (prompt + response - 1), dtype=torch.int32).reshape(-1, 2)
        if mask is not None:
            values["action_mask"] = torch.ones(response, dtype=mask)
        exps.append(
            TrinityExperience(
                eid=TrinityEID(batch=0, task=i, run=0, step=0, suffix="s"),
                tokens=torch.arange(prompt + response, dtype=token_dtype),
                prompt_length=prompt,
                multi_modal_inputs={
                    key: torch.arange(math.prod(shape)).reshape(shape).to(mm_dtype)
                    for key, (mm_dtype, shape) in mm.items()
                }
                or None,
                **values,
            )
        )
    data = encode(exps)
    assert data == TrinityExperience.serialize_many(exps)
    for back in (TrinityExperience.deserialize_many(data), trxp.decode(data)):
        for want, got in zip(exps, back, strict=True):
            for name in (
                "tokens",
                "logprobs",
                "advantages",
                "returns",
                "teacher_logprobs",
                "action_mask",
                "routed_experts",
            ):
                assert (getattr(got, name) is None) == (getattr(want, name) is None), name
                if getattr(want, name) is not None:
                    assert getattr(got, name).dtype == getattr(want, name).dtype
                    assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert list(got.multi_modal_inputs or {}) == list(want.multi_modal_inputs or {})
            for key, tensor in (want.multi_modal_inputs or {}).items():
                assert got.multi_modal_inputs[key].dtype == tensor.dtype
                assert got.multi_modal_inputs[key].shape == tensor.shape
                assert torch.equal(
                    got.multi_modal_inputs[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
                ), key


def test_a_refusal_names_the_experience_by_its_place() -> None:
    exps = [experience(eid=EID(batch=1, task=0, run=i, suffix="x")) for i in range(5)]
    exps[3].logprobs = torch.zeros(2)
    with pytest.raises(TrxpError, match=r"^item 3 \(uid 1/0/3/0/x\): field 'logprobs' has length 2"):
        encode(exps)
    exps[3] = experience(info={"model_version": -1})
    with pytest.raises(TrxpError, match=r"^item 3 \(uid 1/0/0/0/x\): field 'info.model_version' is -1"):
        encode(exps)


def test_each_experience_is_measured_as_it_is_when_read() -> None:
    """A container shared by the experiences of a batch, changed between two of them as they
    are read: the later one is measured as it is then, not by what the container was."""
    info: dict = {"trace": []}

    def experiences():
        yield experience(info=info)
        info["trace"] = deep(40)
        yield experience(info=info)

    with pytest.raises(TrxpError, match=r"^item 1 \(uid .*\): field 'info': nested deeper than 32 levels"):
        encode(experiences())
    shared = {"trace": deep(20)}
    (first, second) = trxp.decode(encode([experience(info=shared), experience(info=shared)]))
    assert first.info == second.info == shared
