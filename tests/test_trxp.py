"""The TRXP codec against Trinity-RFT's own payloads, hostile payloads and fuzzing."""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import struct
import tracemalloc
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expbuf.client import EID, Experience, TrxpError, decode, encode, trxp

from conftest import BAD_DIR, BAD_README, MANIFEST, TRXP_DIR, payload
from helpers import check_against_manifest

TRIPWIRE_CALLS: list[object] = []


def tripwire(*args: object) -> None:
    """A global that a hostile pickle names; calling it would prove code ran."""
    TRIPWIRE_CALLS.append(args)


def test_fixture_decodes_to_manifest(fixture_name: str) -> None:
    data = payload(fixture_name)
    want = MANIFEST["payloads"][fixture_name]
    assert hashlib.sha256(data).hexdigest() == want["sha256"]
    exps = decode(data)
    assert len(exps) == want["num_items"]
    for exp, item in zip(exps, want["items"], strict=True):
        check_against_manifest(exp, item)


def test_encode_roundtrip_is_byte_identical(fixture_name: str) -> None:
    data = payload(fixture_name)
    again = encode(decode(data))
    assert again == data
    for exp, item in zip(decode(again), MANIFEST["payloads"][fixture_name]["items"], strict=True):
        check_against_manifest(exp, item)


def test_plain_readers_read_what_expbuf_builds() -> None:
    """What Trinity's deserialize_many does: pickle.loads + safetensors.torch.load."""
    exps = decode(payload("rich_fields.trxp")) + decode(payload("grpo_group.trxp"))
    data = encode(exps)
    _, _, meta_len, _tensor_len = struct.unpack_from("<4sBQQ", data)
    meta = pickle.loads(data[21 : 21 + meta_len])
    tensors = safetensors.torch.load(data[21 + meta_len :])
    assert meta["num_items"] == 9
    assert [item["eid"] for item in meta["items"]] == [e.eid.to_dict() for e in exps]
    assert torch.equal(tensors["0:routed_experts"], exps[0].routed_experts)
    assert torch.equal(tensors["0:multi_modal_inputs:pixel_values"], exps[0].multi_modal_inputs["pixel_values"])
    assert torch.equal(tensors["8:logprobs"], exps[8].logprobs)


@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.int64, torch.bool, torch.uint8, torch.bfloat16, torch.int32]),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
        ),
        min_size=1,
        max_size=6,
    )
)
@settings(max_examples=50, deadline=None)
def test_tensor_section_matches_safetensors(specs: list[tuple[torch.dtype, list[int]]]) -> None:
    """The tensor section expbuf writes is byte-for-byte what safetensors writes."""
    tensors = {f"0:t{i}": torch.zeros(shape, dtype=dtype) for i, (dtype, shape) in enumerate(specs)}
    item = trxp.RawItem(
        meta={},
        tensors={name.split(":", 1)[1]: trxp.raw_of(t) for name, t in tensors.items()},
    )
    data = trxp.build([item])
    _, _, meta_len, _ = struct.unpack_from("<4sBQQ", data)
    assert data[21 + meta_len :] == safetensors.torch.save(tensors)


def test_encodes_trinity_style_objects() -> None:
    """A Trinity Experience is read by attribute name; CustomField dtypes become strings."""
    custom = SimpleNamespace(source_field="score", destination_field="score", data_type=torch.float32)
    trinity_like = SimpleNamespace(
        eid=SimpleNamespace(batch="3/eval", task=1, run=2, step=0, suffix="abc"),
        tokens=torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32),
        prompt_length=2,
        logprobs=torch.tensor([-0.1, -0.2, -0.3]),
        action_mask=torch.tensor([True, False, True]),
        reward=1,
        info={"model_version": 4, "score": 0.5},
        metrics={},
        custom_fields=[custom],
        multi_modal_inputs={"image_grid_thw": torch.tensor([[1, 2, 2]])},
    )
    (exp,) = decode(encode([trinity_like]))
    assert exp.eid.uid == "3/eval/1/2/0/abc"
    assert exp.eid.tid == "3/eval/1"
    assert exp.reward == 1.0
    assert exp.model_version == 4
    assert exp.custom_fields == [{"source_field": "score", "destination_field": "score", "data_type": "torch.float32"}]
    assert torch.equal(exp.action_mask, trinity_like.action_mask)
    assert torch.equal(exp.multi_modal_inputs["image_grid_thw"], torch.tensor([[1, 2, 2]]))


def test_encode_validates_like_decode() -> None:
    bad = Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=1, logprobs=torch.zeros(5))
    with pytest.raises(TrxpError, match=r"field 'logprobs' has length 5, but the response has 2"):
        encode([bad])
    with pytest.raises(TrxpError, match=r"field 'tokens' must hold token ids \(integer or floating point\), got BOOL"):
        encode([Experience(tokens=torch.ones(3, dtype=torch.bool), prompt_length=1)])
    # Float token ids, which Trinity-RFT accepts, come back exactly, dtype included.
    floats = Experience(tokens=torch.tensor([1.0, 2.0, 3.5]), prompt_length=1, logprobs=torch.tensor([0.1, 0.2]))
    (back,) = decode(encode([floats]))
    assert back.tokens.dtype == torch.float32 and torch.equal(back.tokens, floats.tokens)


# What each bad fixture's refusal must say, for the reason README.json gives it.
BAD_REASONS = {
    "bad_magic.bin": r"^bad magic b'TRXQ': not a TRXP payload$",
    "truncated_header.bin": r"^payload is 10 bytes, shorter than the 21-byte TRXP header$",
    "version_2.bin": r"^unknown TRXP version 2 ",
    "metadata_len_overflow.bin": r"^metadata length 1099511627776 points past the end of the 717-byte payload$",
    "tensor_len_short.bin": r"^tensor section is 286 bytes, shorter than the declared 291$",
    "trailing_garbage.bin": r"^3 trailing bytes after the declared sections$",
    "corrupt_safetensors.bin": r"^tensors: safetensors header length 18446744073709551615 exceeds the 283 bytes",
    "legacy_pickle.bin": r"^payload is a plain pickle without the TRXP header",
    "pickle_global.bin": r"^metadata: pickle opcode STACK_GLOBAL is not plain data",
    "num_items_mismatch.bin": r"^metadata: num_items is 2 but 1 items are present$",
    "missing_eid.bin": r"^item 0: field 'eid' is missing",
    "prompt_longer_than_tokens.bin": r"^item 0 \(uid 0/0/0/0/r0s0t0\): field 'prompt_length' is 10000, more than",
}


def test_every_bad_fixture_has_a_reason() -> None:
    assert sorted(BAD_REASONS) == sorted(BAD_README)


@pytest.mark.parametrize("name", sorted(BAD_README))
def test_bad_fixture_is_refused(name: str) -> None:
    data = (BAD_DIR / name).read_bytes()
    with pytest.raises(TrxpError, match=BAD_REASONS[name]):
        trxp.parse(data)


def test_pickle_global_is_never_called(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[object] = []
    monkeypatch.setattr("builtins.eval", lambda *a: called.append(a))
    with pytest.raises(TrxpError, match="not plain data"):
        decode((BAD_DIR / "pickle_global.bin").read_bytes())
    assert called == []


def _with_metadata(meta: bytes) -> bytes:
    tensors = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"
    return struct.pack("<4sBQQ", b"TRXP", 1, len(meta), len(tensors)) + meta + tensors


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_hostile_reduce_is_refused_at_any_protocol(protocol: int) -> None:
    class Hostile:
        def __reduce__(self) -> tuple:
            return (tripwire, ("ran",))

    meta = pickle.dumps({"version": 1, "num_items": 1, "items": [Hostile()]}, protocol=protocol)
    with pytest.raises(TrxpError, match="not plain data"):
        decode(_with_metadata(meta))
    assert TRIPWIRE_CALLS == []


def test_memo_bomb_is_refused_without_allocating() -> None:
    bomb = b"\x80\x05N" + b"r" + struct.pack("<I", 2**30) + b"."
    tracemalloc.start()
    try:
        with pytest.raises(TrxpError, match="memo index"):
            trxp.parse(_with_metadata(bomb))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_cyclic_and_deep_metadata_is_refused() -> None:
    cyclic: list = []
    cyclic.append(cyclic)
    item = {"eid": {"batch": 0, "task": 0, "run": 0, "step": 0, "suffix": "x"}, "info": {"loop": cyclic}}
    meta = pickle.dumps({"version": 1, "num_items": 1, "items": [item]}, protocol=5)
    with pytest.raises(TrxpError, match="nested deeper"):
        trxp.parse(_with_metadata(meta))


def test_errors_name_item_and_field() -> None:
    exps = decode(payload("grpo_group.trxp"))
    exps[3].info["model_version"] = "v5"
    items = [trxp.RawItem(m.meta, m.tensors) for m in map(trxp.from_experience, exps[:3])]
    items.append(trxp.RawItem({**trxp.from_experience(exps[4]).meta, "prompt_length": -1}, {}))
    with pytest.raises(TrxpError, match=r"item 3 \(uid 7/3/4/0/r4s0t3\): field 'prompt_length'"):
        trxp.parse(trxp.build(items))
    with pytest.raises(TrxpError, match=r"field 'info.model_version' must be an int"):
        encode(exps)


def test_uid_keeps_slashes_of_batch() -> None:
    eid = EID(batch="3/eval_math", task="q-17", run=1, step=0, suffix="rich01")
    assert (eid.uid, eid.tid, eid.rid, eid.sid) == (
        "3/eval_math/q-17/1/0/rich01",
        "3/eval_math/q-17",
        "3/eval_math/q-17/1",
        "3/eval_math/q-17/0",
    )


# ---- fuzzing --------------------------------------------------------------------

SEEDS = [(TRXP_DIR / name).read_bytes() for name in sorted(MANIFEST["payloads"])]


def _decode_bounded(data: bytes) -> None:
    """Decode; only TrxpError may escape, and memory stays proportional to the input."""
    tracemalloc.start()
    try:
        with contextlib.suppress(TrxpError):
            decode(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(data) + (1 << 20), f"peak {peak} bytes for a {len(data)}-byte input"


@given(
    seed=st.sampled_from(SEEDS),
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255), st.sampled_from("rid")), max_size=8),
)
@settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_mutations_raise_only_trxp_error(seed: bytes, edits: list[tuple[int, int, str]]) -> None:
    data = bytearray(seed)
    for position, value, kind in edits:
        pos = position % (len(data) + 1)
        if kind == "r" and pos < len(data):
            data[pos] = value
        elif kind == "i":
            data.insert(pos, value)
        elif kind == "d" and pos < len(data):
            del data[pos]
    _decode_bounded(bytes(data))


@given(seed=st.sampled_from(SEEDS), cut=st.integers(0, 1 << 16))
@settings(max_examples=200, deadline=2000)
def test_fuzz_truncations_raise_only_trxp_error(seed: bytes, cut: int) -> None:
    data = seed[: cut % len(seed)]  # strictly shorter than the whole payload
    with pytest.raises(TrxpError):
        decode(data)


@given(
    seed=st.sampled_from(SEEDS),
    field=st.sampled_from([(5, "<Q"), (13, "<Q")]),
    value=st.integers(0, 2**64 - 1),
)
@settings(max_examples=200, deadline=2000)
def test_fuzz_length_fields_raise_only_trxp_error(seed: bytes, field: tuple[int, str], value: int) -> None:
    offset, fmt = field
    data = bytearray(seed)
    struct.pack_into(fmt, data, offset, value)
    _decode_bounded(bytes(data))


@given(st.binary(max_size=4096))
@settings(max_examples=200, deadline=2000)
def test_fuzz_random_metadata_raises_only_trxp_error(meta: bytes) -> None:
    _decode_bounded(_with_metadata(b"\x80\x05" + meta))


def test_stored_items_splice_into_the_same_batch() -> None:
    """What the server stores per experience joins, without unpickling, into a valid batch."""
    items = trxp.parse(payload("rich_fields.trxp")) + trxp.parse(payload("mixed_batch.trxp"))
    stored = [trxp.pack_item(item) for item in items]
    for blob, item in zip(stored, items, strict=True):
        assert trxp.parse(blob) == [item]  # each stored form is a valid one-item payload
    spliced = trxp.join(stored)
    assert trxp.parse(spliced) == items  # and the untrusted parser accepts the splice
    assert trxp.parse(trxp.join([trxp.build([i]) for i in items])) == items  # other layouts are rebuilt
    assert trxp.join([]) and trxp.parse(trxp.join([])) == []


@pytest.mark.parametrize(
    "dtype",
    [
        *(torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32),
        *(torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64),
    ],
)
def test_an_action_mask_counts_its_generated_tokens_as_torch_does_without_torch(dtype: torch.dtype) -> None:
    """The storage engine counts a mask's ones from its bytes; torch's comparison is the reference."""
    from expbuf.client.trxp.codec.common import count_nonzero

    values = [0, 1, 0, 1, 1, 0, 2, 0] if dtype != torch.bool else [0, 1, 0, 1, 1, 0, 1, 0]
    mask = torch.tensor(values).to(dtype)
    if dtype.is_floating_point:
        mask[0] = -0.0  # zero, with its sign bit set
    raw = trxp.raw_of(mask)
    assert count_nonzero(raw) == int((mask != 0).sum()) == 4


@pytest.mark.parametrize(
    "values",
    [[], [0] * 9, [1] * 9, [0, 0, 0, 1, 1], [1, 1, 1, 0, 1, 0, 0, 3], [1] * 40 + [0] * 3 + [1] * 5 + [0]],
)
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_a_one_byte_mask_counts_the_same_with_or_without_a_zero_or_from_its_first(
    values: list[int], dtype: torch.dtype
) -> None:
    """A one-byte mask is counted from its first zero on (none: every element): each layout of its
    zeros, none, at its start, only at its end, and values above 1 (a uint8 mask's), gives torch's count."""
    from expbuf.client.trxp.codec.common import count_nonzero

    mask = torch.tensor(values, dtype=torch.int64).to(dtype)
    assert count_nonzero(trxp.raw_of(mask)) == int((mask != 0).sum()) == sum(1 for v in values if v)


NON_FINITE_DTYPES = (
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(NON_FINITE_DTYPES),
    st.binary(min_size=0, max_size=64),
    st.sampled_from(["as drawn", "a NaN in it", "an infinity in it", "the largest finite"]),
)
def test_not_finite_reads_nan_and_infinity_as_torch_does(dtype: torch.dtype, bits: bytes, plant: str) -> None:
    """The push's check of token-level rewards reads NaN and infinity from the bytes of each float
    dtype as torch.isfinite tells them, for any bits (a value with every exponent bit set, or just
    below)."""
    size = torch.empty(0, dtype=dtype).element_size()
    values = torch.frombuffer(bytearray(bits[: len(bits) // size * size]) or bytearray(size), dtype=dtype).clone()
    if plant == "a NaN in it":
        values[len(values) // 2] = float("nan")
    elif plant == "an infinity in it" and dtype != torch.float8_e4m3fn:  # e4m3fn has no infinity
        values[0] = float("-inf")
    elif plant == "the largest finite":
        values[-1] = torch.finfo(dtype).max
    raw = trxp.raw_of(values)
    assert trxp.codec.checks.not_finite(raw) == (not bool(torch.isfinite(values.double()).all()))


def test_a_push_with_nan_or_infinite_token_rewards_is_refused_naming_the_field() -> None:
    """Token-level rewards are rewards: NaN or infinity in them is refused at the decode, naming the
    item and the field, as a scalar reward's is, where the advantage worker found it only as a
    group's non-finite advantage."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for bad in (float("nan"), float("inf")):
            rewards = torch.tensor([0.0, 1.0, bad, 0.5], dtype=dtype)
            exp = Experience(eid=EID(batch=0, task=0, run=0), tokens=list(range(7)), prompt_length=3)
            item = trxp.from_experience(exp)
            item.tensors["token_level_reward"] = trxp.raw_of(rewards)
            with pytest.raises(TrxpError, match=r"field 'token_level_reward' holds NaN or infinity"):
                decode(trxp.build([item]))
    rewards = torch.tensor([0.0, 1.0, torch.finfo(torch.float32).max, -0.5])
    exp = Experience(
        eid=EID(batch=0, task=0, run=0), tokens=list(range(7)), prompt_length=3, token_level_reward=rewards
    )
    (back,) = decode(encode([exp]))
    assert torch.equal(back.token_level_reward, rewards)
    exp.token_level_reward = rewards.double()
    (back,) = decode(encode([exp]))  # float64 within float32's range
    assert torch.equal(back.token_level_reward, rewards.double())
    for beyond in (1e39, -1e39):  # infinite where the frameworks compute: refused, as a reward of it is
        exp.token_level_reward = torch.tensor([0.0, 1.0, beyond, 0.5], dtype=torch.float64)
        with pytest.raises(TrxpError, match=r"field 'token_level_reward' holds a value beyond float32's range"):
            decode(encode([exp]))
