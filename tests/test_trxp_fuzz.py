"""Fuzzing the TRXP parser: every input is accepted or refused with TrxpError, and the
decoding work (counted in steps, not timed) stays proportional to the input's size.

CI runs a few dozen examples per test; EXPBUF_FUZZ_EXAMPLES sets the number, or
EXPBUF_SOAK_SCALE multiplies the default (EXPBUF_SOAK_SCALE=100 for a long run).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expbuf.client import TrxpError, trxp
from expbuf.client.trxp.codec.build import fragment
from expbuf.client.trxp.codec.pickles import scan_pickle
from expbuf.client.trxp.codec.unpickler import PlainUnpickler

EXAMPLES = int(os.environ.get("EXPBUF_FUZZ_EXAMPLES", "0")) or max(
    10, int(40 * float(os.environ.get("EXPBUF_SOAK_SCALE", "1")))
)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
# What the parser's work may reach: well below its own budget (trxp.WORK_PER_BYTE per byte
# + trxp.WORK_BASE), so a walk that went wrong shows here before the budget hides it.
WORK_PER_BYTE = 8
WORK_BASE = 16384
EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**400, -(10**400)]
EMPTY_TENSORS = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"


def check(data: bytes) -> list[trxp.RawItem] | None:
    """Parse; only TrxpError may escape, work stays linear, and what is accepted stores within bounds.
    A reader's decode (decode_reply) also raises only TrxpError, and reads whatever parse accepts."""
    work = trxp.Work.for_payload(len(data))
    try:
        items = trxp.parse(data, work=work)
    except TrxpError as exc:
        assert "decoding work exceeds" not in str(exc), exc
        items = None
    assert work.used <= WORK_PER_BYTE * len(data) + WORK_BASE, f"{work.used} steps for {len(data)} bytes"
    if items is not None:
        stored = [trxp.pack_item(item) for item in items]
        metadata = sum(sum(map(len, fragment(item.meta))) for item in items)
        assert metadata <= trxp.EXPANSION_PER_BYTE * len(data) + trxp.EXPANSION_BASE + 64 * len(items)
        for blob, item in zip(stored, items, strict=True):
            assert trxp.parse(blob) == [item]
    try:
        read = len(trxp.decode_reply(data))
    except TrxpError:
        read = None
    assert items is None or read == len(items)
    return items


def with_metadata(meta: bytes, tensors: bytes = EMPTY_TENSORS) -> bytes:
    return struct.pack("<4sBQQ", b"TRXP", 1, len(meta), len(tensors)) + meta + tensors


def tensor_blob(header: dict[str, Any], data: bytes) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data


def shared_levels(levels: int, refs: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value] * refs
    return value


# ---- generators -------------------------------------------------------------------

texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "/", "a/b", "\0", "²", "٣", "x" * 500, "\udcff"]),
)
ints = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from(EDGE_INTS))
scalars = st.one_of(
    st.none(), st.booleans(), ints, st.floats(allow_nan=True, allow_infinity=True), texts, st.binary(max_size=16)
)
plain = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(texts, inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
    ),
    max_leaves=24,
)


@st.composite
def shared(draw: st.DrawFn) -> Any:
    """Plain data whose parts are shared: pickle's memo writes them once, then refers to them."""
    kind = draw(st.sampled_from(["levels", "repeat", "deep", "big"]))
    if kind == "levels":
        return shared_levels(draw(st.integers(1, 60)), draw(st.integers(1, 8)))
    if kind == "repeat":
        return [draw(plain)] * draw(st.integers(1, 3000))
    if kind == "deep":
        value: Any = draw(scalars)
        for _ in range(draw(st.integers(1, 80))):
            value = {"k": value} if draw(st.booleans()) else [value]
        return value
    return [draw(st.sampled_from(EDGE_INTS))] * draw(st.integers(1, 50))


eids = st.fixed_dictionaries(
    {
        "batch": st.one_of(ints, texts),
        "task": st.one_of(ints, texts),
        "run": ints,
        "step": ints,
        "suffix": texts,
    },
    optional={"extra": scalars},
)
numbers = st.one_of(ints, st.floats(allow_nan=True, allow_infinity=True), texts, st.none())


@st.composite
def item_metas(draw: st.DrawFn) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "eid": draw(st.one_of(eids, eids, eids, plain)),
        "reward": draw(numbers),
        "info": draw(st.fixed_dictionaries({}, optional={"model_version": numbers, "priority": numbers, "x": plain})),
        "metrics": {},
        "prompt_length": draw(st.one_of(st.integers(0, 6), ints)),
    }
    if draw(st.booleans()):
        meta[draw(st.sampled_from(["messages", "info", "custom_fields", draw(texts)]))] = draw(
            st.one_of(shared(), plain)
        )
    if draw(st.booleans()):
        meta["multi_modal_input_keys"] = draw(st.lists(texts, max_size=3))
    if draw(st.booleans()):
        meta = dict(reversed(list(meta.items())))
    return meta


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    items = []
    for meta in draw(st.lists(item_metas(), min_size=1, max_size=3)):
        tokens = draw(st.integers(0, 8))
        tensors = {"tokens": trxp.RawTensor("I32", (tokens,), bytes(4 * tokens))}
        for key in meta.get("multi_modal_input_keys", []):
            if "\udcff" not in key:  # build writes the JSON header as UTF-8; the parser refuses such keys
                tensors[f"multi_modal_inputs:{key}"] = trxp.RawTensor("U8", (2,), b"\x01\x02")
        items.append(trxp.RawItem(meta, tensors))
    return trxp.build(items)


# ---- properties ---------------------------------------------------------------------


@given(payloads())
@FUZZ
def test_structured_payloads_are_accepted_or_refused_in_linear_work(data: bytes) -> None:
    check(data)


@given(
    payloads(), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255), st.sampled_from("rid")), max_size=6)
)
@FUZZ
def test_mutated_metadata_pickles_are_accepted_or_refused(data: bytes, edits: list[tuple[int, int, str]]) -> None:
    """Edits inside the pickle, with the section lengths fixed up so that the scan sees them."""
    (meta_len,) = struct.unpack_from("<Q", data, 5)
    meta = bytearray(data[21 : 21 + meta_len])
    for position, value, kind in edits:
        pos = position % (len(meta) + 1)
        if kind == "r" and pos < len(meta):
            meta[pos] = value
        elif kind == "i":
            meta.insert(pos, value)
        elif kind == "d" and pos < len(meta):
            del meta[pos]
    check(with_metadata(bytes(meta), data[21 + meta_len :]))


# Plain opcodes with arguments: what a hostile pickle is made of, memo and marks included.
OPCODES = st.one_of(
    st.sampled_from([b"N", b"]", b"}", b")", b"(", b"a", b"e", b"s", b"u", b"t", b"l", b"d", b"0", b"1", b"2"]),
    st.sampled_from([b"\x85", b"\x86", b"\x87", b"\x88", b"\x89", b"\x94", b"G\x00\x00\x00\x00\x00\x00\xf0\x7f"]),
    st.integers(0, 255).map(lambda i: b"K" + bytes([i])),
    st.integers(0, 12).map(lambda i: b"h" + bytes([i])),
    st.integers(0, 12).map(lambda i: b"q" + bytes([i])),
    st.integers(0, 12).map(lambda i: b"g%d\n" % i),
    st.integers(0, 12).map(lambda i: b"p%d\n" % i),
    texts.map(lambda t: t.encode("utf-8", "surrogatepass")[:255]).map(lambda b: b"\x8c" + bytes([len(b)]) + b),
    st.binary(max_size=8).map(lambda b: b"C" + bytes([len(b)]) + b),
    st.integers(0, 2**80).map(lambda n: b"\x8a" + bytes([len(n.to_bytes(11, "little"))]) + n.to_bytes(11, "little")),
    st.sampled_from([b"I99\n", b"L" + b"9" * 5000 + b"L\n", b"F1e999\n", b"g" + b"9" * 50 + b"\n"]),
)


@given(st.lists(OPCODES, max_size=60))
@FUZZ
def test_opcode_sequences_are_accepted_or_refused(ops: list[bytes]) -> None:
    meta = b"\x80\x05" + b"".join(ops) + b"."
    check(with_metadata(meta))
    work = trxp.Work(1 << 40)
    try:
        scan_pickle(memoryview(meta), work)
        value = PlainUnpickler(io.BytesIO(meta)).load()
    except Exception:  # refused by the scan, or unreadable: check() saw it become a TrxpError
        return
    assert only_string_keys(value)  # what the scan passes builds no dict with other keys


def only_string_keys(value: Any) -> bool:
    """Every dict in `value` has str or bytes keys (each container visited once)."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        current = todo.pop()
        if not isinstance(current, (dict, list, tuple)) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, dict):
            if not all(isinstance(k, (str, bytes)) for k in current):
                return False
            todo.extend(current.values())
        else:
            todo.extend(current)
    return True


HEADER_KEYS = st.one_of(
    st.sampled_from(["0:tokens", "0:logprobs", "0:multi_modal_inputs:x", "00:tokens", "²:tokens", "1:tokens"]),
    st.sampled_from(["__metadata__", "0:", ":tokens", "9" * 30 + ":tokens"]),
    texts,
)
HEADER_VALUES = st.one_of(ints, st.lists(ints, max_size=4), texts, st.none(), st.floats())


@given(
    st.dictionaries(
        HEADER_KEYS,
        st.one_of(
            st.fixed_dictionaries(
                {
                    "dtype": st.one_of(st.sampled_from(["I32", "F32", "U8", "BOOL", "I64"]), HEADER_VALUES),
                    "shape": st.one_of(st.lists(st.one_of(st.integers(0, 8), ints), max_size=5), HEADER_VALUES),
                    "data_offsets": st.one_of(st.lists(st.one_of(st.integers(0, 40), ints), max_size=3), HEADER_VALUES),
                }
            ),
            HEADER_VALUES,
        ),
        max_size=4,
    ),
    st.binary(max_size=40),
)
@FUZZ
def test_odd_tensor_headers_are_accepted_or_refused(header: dict[str, Any], data: bytes) -> None:
    meta = {"eid": {"batch": 0, "task": 0, "run": 0, "step": 0, "suffix": "s"}, "multi_modal_input_keys": ["x"]}
    pickled = pickle.dumps({"version": 1, "num_items": 1, "items": [meta]}, protocol=5)
    check(with_metadata(pickled, tensor_blob(header, data)))


@given(st.integers(1, 64), st.integers(2, 8), st.sampled_from(["info", "messages", "tools", "metrics"]))
@FUZZ
def test_memo_references_at_every_level_cost_work_once(levels: int, refs: int, field: str) -> None:
    meta = {
        "eid": {"batch": 0, "task": 0, "run": 0, "step": 0, "suffix": "s"},
        field: {"x": shared_levels(levels, refs)},
    }
    if field in ("messages", "tools"):
        meta[field] = [shared_levels(levels, refs)]
    data = trxp.build([trxp.RawItem(meta, {"tokens": trxp.RawTensor("I32", (2,), bytes(8))})])
    items = check(data)
    expanded = sum(refs**level for level in range(levels + 1))
    if items is not None:  # accepted only when shallow and small once written out
        assert levels < trxp.MAX_NESTING and expanded <= trxp.EXPANSION_PER_BYTE * len(data) + trxp.EXPANSION_BASE


@pytest.mark.parametrize("protocol", range(6))
def test_the_reported_hostile_push_is_refused_in_linear_work(protocol: int) -> None:
    """Four references per level over 30 levels, at most 1.5 KB: 4**30 lists as a tree."""
    meta = {"eid": {"batch": 0, "task": 0, "run": 0, "step": 0, "suffix": "s"}, "info": {"x": shared_levels(30, 4)}}
    pickled = pickle.dumps({"version": 1, "num_items": 1, "items": [meta]}, protocol=protocol)
    data = with_metadata(
        pickled, tensor_blob({"0:tokens": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    )
    assert len(data) <= 1600
    assert check(data) is None


text_only = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.floats(), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=24,
)


@given(st.lists(st.one_of(plain, shared()), max_size=4), st.lists(text_only, max_size=4), st.integers(0, 5))
@FUZZ
def test_python_pickles_of_plain_data_pass_the_scan(values: list[Any], old: list[Any], protocol: int) -> None:
    """The scan follows the stack as the unpickler does: whatever pickle writes for plain data
    with str keys passes it, at any protocol (before protocol 3, bytes are reduced: not plain)."""
    data = {"version": 1, "num_items": 0, "items": [], "x": values if protocol >= 3 else [], "y": old, "z": old}
    meta = pickle.dumps(data, protocol=protocol)
    scan_pickle(memoryview(meta), trxp.Work(1 << 40))
