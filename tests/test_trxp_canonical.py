"""An item's canonical metadata pickle written directly (codec/canonical.py) is byte for byte what
CPython's C pickler writes of the metadata with its dicts' keys sorted, protocol 3, fast mode: the
bytes a stored experience's digest is taken over, so a retried push is a duplicate whichever path
packed it. Where the writer declines (a type, a size it leaves to the pickler), the pickler packs
it, the same bytes again. Generated plain data, and each bound at its edges."""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expbuf.client.trxp.codec import build, canonical


def pickled(meta: dict[str, Any]) -> bytes:
    """What the C pickler writes of the metadata with its keys sorted, less PROTO and STOP."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=3)
    pickler.fast = True
    pickler.dump(build._canonical(meta))
    written = out.getvalue()
    assert written[:2] == b"\x80\x03" and written[-1:] == b"."
    return written[2:-1]


def fragment(meta: dict[str, Any]) -> bytes:
    return b"".join(bytes(run) for run in build.fragment(meta))


def same(meta: dict[str, Any]) -> bytes | None:
    """The writer's opcodes (None where it declines), checked against the pickler's, as is the
    fragment a push packs."""
    want = pickled(meta)
    written = canonical.opcodes(meta)
    assert written is None or written == want
    assert fragment(meta) == want
    return written


TEXT = st.text(alphabet=st.characters(codec=None, blacklist_categories=()), max_size=12)  # lone surrogates too
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.sampled_from([0, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31), 2**31, -(2**31) - 1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
    | st.binary(max_size=8)
)
PLAIN = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(TEXT, inner, max_size=5)
        | st.dictionaries(st.binary(max_size=4), inner, min_size=1, max_size=2)
    ),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(TEXT, PLAIN, max_size=16))
def test_generated_metadata_packs_to_the_picklers_bytes(meta: dict[str, Any]) -> None:
    same(meta)


def experience_meta(**changed: Any) -> dict[str, Any]:
    """An experience's metadata as Trinity-RFT's items carry it, keys in its own order."""
    meta: dict[str, Any] = {
        "eid": {"batch": 3, "task": "t7", "run": 1, "step": 0, "suffix": ""},
        "reward": 0.5,
        "truncate_status": None,
        "info": {"model_version": 4, "priority": -0.0, "task_index": {"index": 9}},
        "metrics": {"accuracy": 1.0},
        "prompt_length": 300,
        "response_text": "é",
        "prompt_text": None,
        "messages": [{"role": "user", "content": "2+2?"}],
        "tools": None,
        "chosen_messages": None,
        "rejected_messages": None,
        "custom_fields": [],
        "multi_modal_input_keys": [],
    }
    return meta | changed


def test_an_experiences_metadata_is_written_without_the_pickler() -> None:
    assert same(experience_meta()) is not None
    assert same(experience_meta(reward=math.nan, prompt_length=70000, response_text="\ud800")) is not None


@pytest.mark.parametrize(
    ("changed", "written"),
    [
        ({"prompt_length": 255}, True),  # BININT1
        ({"prompt_length": 256}, True),  # BININT2
        ({"prompt_length": 65535}, True),
        ({"prompt_length": 65536}, True),  # BININT
        ({"prompt_length": -1}, True),
        ({"prompt_length": 2**31 - 1}, True),
        ({"prompt_length": 2**31}, False),  # LONG1: the pickler's
        ({"prompt_length": -(2**31)}, True),
        ({"metrics": {str(i): i for i in range(999)}}, True),
        ({"metrics": {str(i): i for i in range(1000)}}, False),  # in batches: the pickler's
        ({"messages": list(range(1000))}, True),
        ({"messages": list(range(1001))}, False),
        ({"response_text": "x" * (canonical.LARGE - 1)}, True),
        ({"response_text": "x" * canonical.LARGE}, False),  # the pickler hands it on uncopied
        ({"info": {"k": (1, 2)}}, False),
        ({"info": {b"k": 1}}, False),
        ({"info": {"k": b"v"}}, False),
        ({"info": {"a": 1, b"b": 2}}, False),  # str before bytes: the pickler's
        ({"info": {1: "a", 2: "b"}}, False),
        ({"messages": [True, False, None, 1.5, -7]}, True),
        ({"info": {"only": 1}}, True),  # one entry: SETITEM
        ({"messages": [1]}, True),  # one entry: APPEND
    ],
)
def test_each_bound_is_met_at_its_edge(changed: dict[str, Any], written: bool) -> None:
    assert (same(experience_meta(**changed)) is not None) is written


def test_a_nan_keeps_its_payload() -> None:
    (nan,) = struct.unpack(">d", bytes.fromhex("7ff8000000000123"))
    assert same(experience_meta(reward=nan)) is not None


def test_each_item_s_tensors_are_laid_out_in_safetensors_order_whatever_the_item_before_had() -> None:
    """pack_item reuses the order of the last item of the same tensor names and dtypes: items of the
    same names with other dtypes, or other names of the same count, each in turn, are laid out in
    safetensors' own order (dtype descending, then name), and an item packed again packs the same."""
    from expbuf.client.trxp.codec.common import DTYPE_RANK, HEADER, HEADER_SIZE, RawItem, RawTensor

    def item(dtypes: dict[str, str]) -> RawItem:
        meta = {"eid": {"batch": 0, "task": 1, "run": 0, "step": 0, "suffix": ""}, "prompt_length": 1}
        sizes = {"I64": 8, "I32": 4, "F32": 4, "BF16": 2, "BOOL": 1}
        return RawItem(meta, {name: RawTensor(dtype, (2,), bytes(2 * sizes[dtype])) for name, dtype in dtypes.items()})

    def laid_out(packed: bytes) -> list[str]:
        meta_len = HEADER.unpack_from(packed)[2]
        at = HEADER_SIZE + meta_len
        (length,) = struct.unpack_from("<Q", packed, at)
        header = json.loads(packed[at + 8 : at + 8 + length])
        return sorted(header, key=lambda key: header[key]["data_offsets"][0])

    kinds = [
        {"tokens": "I64", "logprobs": "F32", "action_mask": "BOOL"},
        {"tokens": "I32", "logprobs": "F32", "action_mask": "BOOL"},
        {"tokens": "BF16", "logprobs": "F32", "action_mask": "I64"},
        {"tokens": "I64", "advantages": "F32", "action_mask": "BOOL"},
        {"tokens": "I64", "logprobs": "F32", "action_mask": "BOOL"},
    ]
    for dtypes in [*kinds, *reversed(kinds)]:
        packed = build.pack_item(item(dtypes))
        want = sorted(dtypes, key=lambda name: (-DTYPE_RANK[dtypes[name]], name))
        assert laid_out(packed) == [f"0:{name}" for name in want]
        assert build.pack_item(item(dtypes)) == packed
