"""Hostile metadata: shared references, expansion, numeric ranges, ambiguous uids, key order."""

from __future__ import annotations

import copy
import json
import pickle
import re
import struct
from pathlib import Path
from typing import Any

import grpc
import pytest

from expbuf.client import EID, BufferClient, BufferError, TrxpError, decode, trxp
from expbuf.client.trxp.codec.common import FLOAT32_MAX
from expbuf.server.store import Store
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers, payload

TOKENS = trxp.RawTensor("I32", (4,), struct.pack("<4i", 1, 2, 3, 4))
LOGPROBS = trxp.RawTensor("F32", (3,), struct.pack("<3f", -0.1, -0.2, -0.3))


def item_meta(**fields: Any) -> dict[str, Any]:
    """The metadata of a valid experience (4 tokens, prompt 1), with `fields` replaced."""
    meta: dict[str, Any] = {
        "eid": {"batch": 1, "task": 2, "run": 0, "step": 0, "suffix": "s"},
        "reward": 1.0,
        "info": {"model_version": 3},
        "metrics": {},
        "prompt_length": 1,
    }
    meta.update(fields)
    return meta


def one_item(meta: dict[str, Any], tensors: dict[str, trxp.RawTensor] | None = None) -> bytes:
    """A payload with one item; pickle's memo keeps whatever `meta` shares, shared."""
    return trxp.build([trxp.RawItem(meta, tensors if tensors is not None else {"tokens": TOKENS})])


def shared_levels(levels: int, refs: int = 4) -> list:
    """A list that holds the same list `refs` times at every level: tiny pickled, huge as a tree."""
    value: list = []
    for _ in range(levels):
        value = [value] * refs
    return value


def assemble(meta: dict[str, Any], header: dict[str, Any], data: bytes) -> bytes:
    """A one-item payload with a hand-written safetensors header."""
    pickled = pickle.dumps({"version": 1, "num_items": 1, "items": [meta]}, protocol=5)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    blob = struct.pack("<Q", len(head)) + head + data
    return struct.pack("<4sBQQ", b"TRXP", 1, len(pickled), len(blob)) + pickled + blob


def parse_counting(data: bytes) -> tuple[list[trxp.RawItem] | TrxpError, trxp.Work]:
    work = trxp.Work.for_payload(len(data))
    try:
        return trxp.parse(data, work=work), work
    except TrxpError as exc:
        return exc, work


# ---- item 6: shared references cost work once ------------------------------------


def test_four_references_per_level_over_30_levels_is_refused_within_budget() -> None:
    data = one_item(item_meta(info={"model_version": 3, "x": shared_levels(30)}))
    assert len(data) < 2000
    result, work = parse_counting(data)
    assert isinstance(result, TrxpError)
    assert "expands" in str(result)
    assert work.used <= 8 * len(data) + 4096


def test_shared_reference_within_bounds_is_accepted_and_walked_once() -> None:
    shared = {"k": list(range(50))}
    data = one_item(item_meta(info={"model_version": 3, "a": shared, "b": [shared, shared]}))
    result, work = parse_counting(data)
    assert not isinstance(result, TrxpError), result
    assert result[0].meta["info"]["b"][1]["k"][49] == 49
    assert work.used <= 8 * len(data) + 4096


def test_work_budget_is_enforced_and_named() -> None:
    data = payload("grpo_group.trxp")
    with pytest.raises(TrxpError, match=r"decoding work exceeds its budget of 10 steps"):
        trxp.parse(data, work=trxp.Work(10))


def test_tuple_dict_keys_are_refused_before_unpickling() -> None:
    """A tuple key is hashed by the unpickler: tuples of shared tuples hash in exponential time."""
    key = b")q\x000"  # EMPTY_TUPLE, BINPUT 0, POP
    for level in range(40):  # MARK, 3 x BINGET, TUPLE, BINPUT, POP: memo entry level + 1 holds 3 x entry level
        key += b"(" + (b"h" + bytes([level])) * 3 + b"tq" + bytes([level + 1]) + b"0"
    key += b"h" + bytes([40])
    head = pickle.dumps({"version": 1, "num_items": 0, "items": []}, protocol=2)[:-2]  # without SETITEMS, STOP
    meta = head + b"X\x01\x00\x00\x00k}" + key + b"K\x01s" + b"u."  # 'k': {key: 1}, then SETITEMS, STOP
    tensors = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"
    data = struct.pack("<4sBQQ", b"TRXP", 1, len(meta), len(tensors)) + meta + tensors
    with pytest.raises(TrxpError, match=r"dict keys must be str or bytes"):
        trxp.parse(data)


def test_colliding_int_keys_are_refused() -> None:
    """Int hashes are not randomised: keys i * (2**61 - 1) all collide, a quadratic dict."""
    info = {"model_version": 3, "c": {i * (2**61 - 1): 0 for i in range(50)}}
    with pytest.raises(TrxpError, match=r"dict keys must be str or bytes"):
        trxp.parse(one_item(item_meta(info=info)))


# ---- item 8: stored size proportional to the bytes pushed -------------------------


def test_shared_string_expanding_beyond_the_payload_is_refused() -> None:
    text = "x" * 20_000
    data = one_item(item_meta(info={"model_version": 3, "copies": [text] * 500}))
    assert len(data) < 30_000
    with pytest.raises(TrxpError, match=r"metadata expands to more than .* bytes"):
        trxp.parse(data)


def test_prompt_shared_by_a_group_is_accepted() -> None:
    """Trinity shares one prompt string between the runs of a task: that is not an attack."""
    prompt = "Solve: " + "y" * 4000
    items = [
        trxp.RawItem(
            item_meta(eid={"batch": 1, "task": 2, "run": run, "step": 0, "suffix": "s"}, prompt_text=prompt),
            {"tokens": trxp.RawTensor("I64", (1000,), bytes(8000))},
        )
        for run in range(64)
    ]
    data = trxp.build(items)
    assert len(trxp.parse(data)) == 64


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [([0, 2**100], "F32"), ([0, 2**63], "U8"), ([2**40, 2**40, 0], "U8"), ([0, 2**61], "F32")],
)
def test_tensor_dimensions_beyond_int64_are_refused(shape: list[int], dtype: str) -> None:
    header = {
        "0:multi_modal_inputs:pixel_values": {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]},
        "0:tokens": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]},
    }
    meta = item_meta(multi_modal_input_keys=["pixel_values"])
    with pytest.raises(TrxpError, match=r"shape .* has more elements than a tensor can hold"):
        trxp.parse(assemble(meta, header, TOKENS.data))


def test_empty_tensor_with_large_dimension_decodes() -> None:
    meta = item_meta(multi_modal_input_keys=["pixel_values"])
    data = one_item(meta, {"tokens": TOKENS, "multi_modal_inputs:pixel_values": trxp.RawTensor("F32", (0, 2**40), b"")})
    (exp,) = decode(data)
    assert tuple(exp.multi_modal_inputs["pixel_values"].shape) == (0, 2**40)


# ---- items 5 and 11: numeric fields in the ranges the store and estimators take ---


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"eid": {"batch": 1, "task": 2, "run": 0, "step": 2**63, "suffix": "s"}},
            r"field 'eid.step' is 9223372036854775808, outside \[0, 2\*\*31 - 1\]",
        ),
        ({"eid": {"batch": 1, "task": 2, "run": 0, "step": 2**31, "suffix": "s"}}, r"field 'eid.step' is 2147483648"),
        (
            {"eid": {"batch": 1, "task": 2, "run": -1, "step": 0, "suffix": "s"}},
            r"field 'eid.run' is -1, outside \[0, 2\*\*63 - 1\]",
        ),
        (
            {"eid": {"batch": 1, "task": 2, "run": 2**63, "step": 0, "suffix": "s"}},
            r"field 'eid.run' is 9223372036854775808",
        ),
        (
            {"eid": {"batch": 2**63, "task": 2, "run": 0, "step": 0, "suffix": "s"}},
            r"field 'eid.batch' is 9223372036854775808, outside \[-2\*\*63, 2\*\*63 - 1\]",
        ),
        (
            {"eid": {"batch": 1, "task": -(2**63) - 1, "run": 0, "step": 0, "suffix": "s"}},
            r"field 'eid.task' is -9223372036854775809",
        ),
        (
            {"eid": {"batch": 10**5000, "task": 2, "run": 0, "step": 0, "suffix": "s"}},
            r"field 'eid.batch' is an int of 16610 bits",
        ),
        ({"info": {"model_version": 2**63}}, r"uid 1/2/0/0/s\): field 'info.model_version' is 9223372036854775808"),
        ({"info": {"model_version": -1}}, r"field 'info.model_version' is -1"),
        ({"reward": 10**400}, r"field 'reward' is an int of 1329 bits, not representable as a float64"),
        ({"reward": float("nan")}, r"field 'reward' is nan"),
        ({"info": {"priority": 10**400}}, r"field 'info.priority' is an int of 1329 bits"),
        ({"info": {"priority": float("inf")}}, r"field 'info.priority' is inf"),
        ({"info": {"priority": "high"}}, r"field 'info.priority' must be a number, got str"),
        ({"prompt_length": 2**64}, r"field 'prompt_length' is 18446744073709551616, outside \[0, 2\*\*63 - 1\]"),
    ],
)
def test_numeric_fields_out_of_range_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(TrxpError, match=r"^item 0\b.*" + message):
        trxp.parse(one_item(item_meta(**fields)))


def test_numeric_limits_themselves_are_accepted() -> None:
    eid = {"batch": -(2**63), "task": 2**63 - 1, "run": 2**63 - 1, "step": 2**31 - 1, "suffix": "s"}
    info = {"model_version": 2**63 - 1, "priority": -(10**300)}
    (item,) = trxp.parse(one_item(item_meta(eid=eid, info=info, reward=-FLOAT32_MAX)))
    assert item.model_version == 2**63 - 1
    with pytest.raises(TrxpError, match=r"field 'reward' is -1e\+308, beyond float32's range"):
        trxp.parse(one_item(item_meta(eid=eid, info=info, reward=-1e308)))


def test_huge_num_items_is_refused_with_a_short_message() -> None:
    meta = pickle.dumps({"version": 1, "num_items": 10**5000, "items": []}, protocol=5)
    tensors = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"
    data = struct.pack("<4sBQQ", b"TRXP", 1, len(meta), len(tensors)) + meta + tensors
    with pytest.raises(TrxpError, match=r"num_items is an int of 16610 bits but 0 items are present"):
        trxp.parse(data)


# ---- low items: tensor keys, eid keys --------------------------------------------


@pytest.mark.parametrize("head", ["²", "٣", "9" * 5000, "-0", " 0", "0x0", ""])
def test_tensor_keys_must_start_with_an_ascii_index(head: str) -> None:
    header = {f"{head}:tokens": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}}
    with pytest.raises(TrxpError, match=r"tensors: key .* does not name an item"):
        trxp.parse(assemble(item_meta(), header, TOKENS.data))


def test_multi_modal_key_that_is_not_utf8_is_refused() -> None:
    """JSON can spell a lone surrogate; the store could not write that tensor name back."""
    header = {
        "0:multi_modal_inputs:\udcff": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "0:tokens": {"dtype": "I32", "shape": [4], "data_offsets": [1, 17]},
    }
    with pytest.raises(TrxpError, match=r"field 'multi_modal_input_keys' must be a list of str \(UTF-8"):
        trxp.parse(assemble(item_meta(multi_modal_input_keys=["\udcff"]), header, b"\x01" + TOKENS.data))


def test_unknown_eid_key_is_refused_by_name() -> None:
    eid = {"batch": 1, "task": 2, "run": 0, "step": 0, "suffix": "s", "episode": 4}
    with pytest.raises(TrxpError, match=r"item 0: field 'eid' has unknown keys \['episode'\]"):
        trxp.parse(one_item(item_meta(eid=eid)))


# ---- uids parse from the right -----------------------------------------------------


def test_task_and_suffix_slash_collision_is_refused() -> None:
    """(task 't', suffix '2/x') and (task 't/1', ...) would both be uid 0/t/1/2/2/x."""
    a = {"batch": 0, "task": "t", "run": 1, "step": 2, "suffix": "2/x"}
    b = {"batch": 0, "task": "t/1", "run": 2, "step": 2, "suffix": "x"}
    assert EID(**a).uid == EID(**b).uid
    with pytest.raises(TrxpError, match=r"field 'eid.suffix' contains '/'"):
        trxp.parse(one_item(item_meta(eid=a)))
    with pytest.raises(TrxpError, match=r"field 'eid.task' contains '/'"):
        trxp.parse(one_item(item_meta(eid=b)))


def test_batch_may_contain_slashes() -> None:
    eid = {"batch": "3/eval_math", "task": "t", "run": 1, "step": 2, "suffix": "x"}
    (item,) = trxp.parse(one_item(item_meta(eid=eid)))
    assert item.uid == "3/eval_math/t/1/2/x"


# ---- messages stay short -----------------------------------------------------------


def test_error_messages_truncate_untrusted_text() -> None:
    long_field = "f" * 10_000
    meta = item_meta(**{long_field: {"x": shared_levels(40, 1)}})
    with pytest.raises(TrxpError) as info:
        trxp.parse(one_item(meta))
    message = str(info.value)
    assert len(message) < 400
    assert "(10000 chars)" in message
    long_suffix = "s" * 390
    with pytest.raises(TrxpError) as info:
        trxp.parse(
            one_item(item_meta(eid={"batch": 1, "task": 2, "run": 0, "step": 0, "suffix": long_suffix}, reward="r"))
        )
    assert len(str(info.value)) < 400
    assert "chars)" in str(info.value)


# ---- duplicates by content, whatever the key order --------------------------------


def reordered(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: reordered(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [reordered(v) for v in value]
    return value


def test_packed_form_ignores_dict_key_order() -> None:
    for original in trxp.parse(payload("rich_fields.trxp")) + trxp.parse(payload("grpo_group.trxp")):
        other = trxp.RawItem(reordered(copy.deepcopy(original.meta)), dict(original.tensors))
        assert list(other.meta) != list(original.meta)
        assert trxp.pack_item(other) == trxp.pack_item(original)


def test_same_content_in_another_key_order_is_a_duplicate(tmp_path: Path) -> None:
    (original,) = trxp.parse(payload("rich_fields.trxp"))
    other = trxp.parse(trxp.build([trxp.RawItem(reordered(original.meta), dict(original.tensors))]))
    with Store(tmp_path / "data", map_size=1 << 22) as store:
        store.create_table(TableConfig.of(name="plain", estimator="none"))
        assert store.put("plain", [original]).stored == [original.uid]
        result = store.put("plain", other)
        assert result.duplicates == [original.uid]
        assert result.stored == []


# ---- over gRPC: refused as INVALID_ARGUMENT, nothing stored, the server goes on ----


def test_hostile_pushes_are_invalid_argument_and_store_nothing(start_server: Servers) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=30) as client:
        client.create_table("plain", group_by="none", estimator="none")
        hostile = {
            "memo levels": (
                one_item(item_meta(info={"model_version": 3, "x": shared_levels(30)})),
                r"metadata expands to more than",
            ),
            "step 2**63": (
                one_item(item_meta(eid={"batch": 1, "task": 2, "run": 0, "step": 2**63, "suffix": "s"})),
                r"field 'eid.step' is 9223372036854775808",
            ),
            "version 2**63": (
                one_item(item_meta(info={"model_version": 2**63})),
                r"field 'info.model_version' is 9223372036854775808",
            ),
            "reward 10**400": (one_item(item_meta(reward=10**400)), r"field 'reward' is an int of 1329 bits"),
            "extra eid key": (
                one_item(item_meta(eid={"batch": 1, "task": 2, "run": 0, "step": 0, "suffix": "s", "x": 1})),
                r"field 'eid' has unknown keys \['x'\]",
            ),
        }
        for name, (data, reason) in hostile.items():
            with pytest.raises(BufferError) as info:
                client.push(data, table="plain")
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, name
            assert re.search(reason, info.value.details), (name, info.value.details)
        assert client.stats("plain")["plain"].pending == 0
        assert client.push(one_item(item_meta()), table="plain").stored == ["1/2/0/0/s"]
