"""What the server stores of each pushed experience (pack_item) is byte for byte what a plain
writer makes of it: the metadata pickled by CPython's C pickler with every dict's keys sorted
(protocol 3, no memo) between the splice's fixed head and tail, the safetensors header as
json.dumps writes it, padded with spaces to 8 bytes, and the tensors' data in safetensors' order.
Replies splice these bytes and digests compare them across pushes and restarts, so whatever
pack_item keeps from one item to the next must change nothing: generated runs of items whose
metadata and tensors change shape, kinds and values from one item to the next, key objects shared
between them as an unpickled payload's are, each packed in turn and packed again."""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from expbuf.client.trxp.codec.build import pack_item
from expbuf.client.trxp.codec.common import ITEMSIZE, RawItem, RawTensor

# The splice's fixed head and tail of a one-item payload's metadata pickle (docs/internals/storage.md).
HEAD = b"\x80\x03}(X\x07\x00\x00\x00versionK\x01X\t\x00\x00\x00num_itemsJ\x01\x00\x00\x00X\x05\x00\x00\x00items]("
TAIL = b"eu."
RANK = {code: rank for rank, code in enumerate(ITEMSIZE)}  # safetensors' dtype order


def sorted_plain(value: Any) -> Any:
    """The same data with every dict's keys sorted, str before bytes."""
    if isinstance(value, dict):
        return {key: sorted_plain(value[key]) for key in sorted(value, key=lambda key: (isinstance(key, bytes), key))}
    if isinstance(value, list):
        return [sorted_plain(inner) for inner in value]
    if isinstance(value, tuple):
        return tuple(sorted_plain(inner) for inner in value)
    return value


def reference(item: RawItem) -> bytes:
    """The one-item payload the store keeps, written with the pickler and json.dumps."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=3)
    pickler.fast = True
    pickler.dump(sorted_plain(item.meta))
    meta = HEAD + out.getvalue()[2:-1] + TAIL
    header: dict[str, Any] = {}
    data = b""
    for name in sorted(item.tensors, key=lambda name: (-RANK[item.tensors[name].dtype], name)):
        tensor = item.tensors[name]
        header[f"0:{name}"] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [len(data), len(data) + len(tensor.data)],
        }
        data += bytes(tensor.data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    frame = struct.pack("<4sBQQ", b"TRXP", 1, len(meta), 8 + len(text) + len(data))
    return frame + meta + struct.pack("<Q", len(text)) + text + data


# A small pool of key objects, the same objects in every item, as an unpickled payload's items
# share their field names: items often have the keys of the item before, in its order or another.
KEYS = ["eid", "reward", "info", "metrics", "prompt_length", "response_text", "messages", "é", "batch", "a\x00"]
TEXT = st.text(alphabet=st.characters(codec=None, blacklist_categories=()), max_size=8)  # lone surrogates too
SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from([0, 1, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31), 2**31, -(2**31) - 1, 10**30])
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.sampled_from([0.0, -0.0, 1.0, math.nan, math.inf, -math.inf, 1e300])
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
    | st.binary(max_size=4)
    | st.sampled_from([[], {}, ()])
)
PLAIN = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.sampled_from(KEYS) | TEXT, inner, max_size=5)
        | st.dictionaries(st.binary(max_size=3), inner, min_size=1, max_size=2)
    ),
    max_leaves=12,
)
META = st.dictionaries(st.sampled_from(KEYS), PLAIN, max_size=len(KEYS))
NAMES = st.sampled_from(["tokens", "logprobs", "action_mask", "advantages", 'multi_modal_inputs:é"\\\n', "m:\x7f"])
SHAPES = st.lists(st.integers(min_value=0, max_value=3), max_size=3).map(tuple) | st.sampled_from([(5,), (7,)])


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, RawTensor]:
    names = draw(st.lists(NAMES, unique=True, max_size=4))
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(["I64", "I32", "F32", "BF16", "BOOL", "U8", "F64"]))
        shape = draw(SHAPES)
        size = math.prod(shape) * ITEMSIZE[dtype]
        out[name] = RawTensor(dtype, shape, (name.encode() * size)[:size])  # data of its own
    return out


@st.composite
def runs(draw: st.DrawFn) -> list[RawItem]:
    """Items, each often the item before with a few things changed."""
    items = [RawItem(draw(META), draw(tensors()))]
    for _ in range(draw(st.integers(min_value=0, max_value=6))):
        meta = dict(items[-1].meta)
        if meta and draw(st.booleans()):
            meta[draw(st.sampled_from(sorted(meta)))] = draw(PLAIN)  # one value changed: kind, size or content
        if draw(st.booleans()):
            meta = dict(reversed(list(meta.items())))  # the same keys in another order
        if draw(st.booleans()):
            meta = draw(META)
        pieces = items[-1].tensors if draw(st.booleans()) else draw(tensors())
        items.append(RawItem(meta, dict(pieces)))
    return items


@settings(max_examples=300, deadline=None)
@given(runs())
def test_each_item_packs_to_the_plain_writers_bytes_whatever_the_item_before(items: list[RawItem]) -> None:
    for item in [*items, *reversed(items)]:
        assert pack_item(item) == reference(item)


def test_an_experience_pushed_again_and_again_packs_the_same() -> None:
    """The metadata of Trinity-RFT's items (nested eid and info, messages, empty containers)
    and their tensors, one after another with only a few values changed."""
    base: dict[str, Any] = {
        "eid": {"batch": 3, "task": "t7", "run": 1, "step": 0, "suffix": ""},
        "reward": 0.5,
        "truncate_status": None,
        "info": {"model_version": 4, "priority": -0.0, "task_index": {"index": 9}},
        "metrics": {},
        "prompt_length": 300,
        "response_text": "é",
        "messages": [{"role": "user", "content": "2+2?"}],
        "custom_fields": [],
    }
    changes: list[dict[str, Any]] = [
        {},
        {"reward": -1.0, "prompt_length": 70000},
        {"eid": {"batch": 3, "task": "t7", "run": 2, "step": 0, "suffix": "é"}},
        {"response_text": None, "metrics": {"accuracy": 1.0}},
        {"reward": 2**31, "custom_fields": [1, "a"]},  # an int the pickler writes
        {"messages": None, "truncate_status": True},
        {"info": {}},
        {},
    ]
    for length in (5, 7, 5, 0, 5):
        for changed in changes:
            shape = (length,)
            item = RawItem(
                base | changed,
                {
                    "tokens": RawTensor("I64", shape, bytes(8 * length)),
                    "logprobs": RawTensor("F32", shape, bytes(4 * length)),
                },
            )
            assert pack_item(item) == reference(item)
