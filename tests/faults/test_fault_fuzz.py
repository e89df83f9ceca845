"""Structured fuzzing of the push path: TRXP parsing, then storing what parsing accepts.

Hypothesis builds payloads that get past the framing checks: plain-data metadata with
eids, rewards, versions and priorities at and past every boundary, shared (memoised)
sub-objects, and safetensors headers with odd keys, dtypes, shapes and offsets. Each
payload is pushed to the service (in-process, over a store in a temporary directory):
it is stored, or refused with INVALID_ARGUMENT (or ALREADY_EXISTS, FAILED_PRECONDITION
for a uid or group already there), never another status; Stats still answers after it;
and the CPU time it costs is bounded by its size. The same payloads get the same verdict from
the compiled parse as from its source, where the compiled modules are in use.
"""

from __future__ import annotations

import copy
import json
import pickle
import struct
import tempfile
import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_native import same_parse, side_by_side

from expbuf.client import trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.store import Store

from faultkit import channel, service_over, stub
from helpers import group_items

pytestmark = pytest.mark.faults

(TEMPLATE,) = group_items("fuzz", 0, 1)

CPU_SECONDS_PER_KB = 0.05  # generous: parsing and storing take microseconds per KB
CPU_SECONDS_FLOOR = 1.0
# What a push may be refused with: a bad payload, a conflicting uid, a complete group.
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION)

EDGE_INTS = st.sampled_from([0, 1, -1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30])
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    EDGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e300, -1e300, 10**400]),
)
TEXT = st.one_of(
    st.text(max_size=12), st.sampled_from(["a/b", "1/2/3", "\u00b2", "\u0663", "\0", "x" * 500, "int:field"])
)
PLAIN = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXT, st.binary(max_size=16)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(TEXT, inner, max_size=4),
    ),
    max_leaves=12,
)
EID_PART = st.one_of(EDGE_INTS, st.integers(0, 5), TEXT)
EID = st.fixed_dictionaries(
    {"batch": EID_PART, "task": EID_PART, "run": EID_PART, "step": EID_PART, "suffix": TEXT},
    optional={"extra": PLAIN},
)
META = st.fixed_dictionaries(
    {"eid": EID, "prompt_length": st.one_of(st.integers(0, 6), EDGE_INTS)},
    optional={
        "reward": NUMBERS,
        "info": st.one_of(
            st.fixed_dictionaries({}, optional={"model_version": NUMBERS, "priority": NUMBERS, "x": PLAIN}), PLAIN
        ),
        "metrics": PLAIN,
        "response_text": PLAIN,
        "messages": PLAIN,
        "multi_modal_input_keys": st.lists(TEXT, max_size=2),
        "custom_fields": PLAIN,
    },
)
DTYPES = st.sampled_from(["I32", "I64", "F32", "F16", "BF16", "BOOL", "U8", "F64", "X9"])
KEYS = st.one_of(
    st.sampled_from(
        ["0:tokens", "0:logprobs", "0:action_mask", "0:advantages", "0:multi_modal_inputs:img", "1:tokens"]
    ),
    st.builds(lambda head, name: f"{head}:{name}", st.sampled_from(["0", "\u0660", "\u00b2", "-0", "00", "99"]), TEXT),
)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """A TRXP payload with valid framing and fuzzed metadata and tensor header."""
    items = draw(st.lists(META, min_size=1, max_size=3))
    if draw(st.booleans()):  # share one sub-object between items: the pickle refers to it by memo
        shared = draw(PLAIN)
        for item in items:
            info = item.get("info")
            if isinstance(info, dict):
                info["shared"] = shared
    if draw(st.booleans()):  # tensors that fit the template's lengths: the payload reaches the store
        for item in items:
            item["prompt_length"] = TEMPLATE.meta["prompt_length"]
        return trxp.build([trxp.RawItem(item, TEMPLATE.tensors) for item in items])
    meta = {"version": 1, "num_items": draw(st.one_of(st.just(len(items)), EDGE_INTS)), "items": items}
    try:
        meta_bytes = pickle.dumps(meta, protocol=draw(st.integers(2, 5)))
    except (RecursionError, OverflowError, ValueError):
        meta_bytes = pickle.dumps({"version": 1}, protocol=5)
    header: dict = {}
    data = b""
    for key in draw(st.lists(KEYS, max_size=4, unique=True)):
        shape = draw(st.lists(st.one_of(st.integers(0, 8), EDGE_INTS), max_size=2))
        size = draw(st.integers(0, 64))
        start = draw(st.one_of(st.just(len(data)), st.integers(0, 80), EDGE_INTS))
        end = draw(st.one_of(st.just(len(data) + size), st.integers(0, 80), EDGE_INTS))
        header[key] = {"dtype": draw(DTYPES), "shape": shape, "data_offsets": [start, end]}
        data += bytes(size)
    return assemble(meta_bytes, header, data)


def crafted(**fields: object) -> bytes:
    """The template experience, in a group of its own, with some metadata fields replaced."""
    meta = copy.deepcopy(TEMPLATE.meta)
    meta["eid"]["task"] = "-".join(fields)
    for name, value in fields.items():
        if name.startswith("eid_"):
            meta["eid"][name[4:]] = value
        elif name.startswith("info_"):
            meta["info"][name[5:]] = value
        else:
            meta[name] = value
    return trxp.build([trxp.RawItem(meta, TEMPLATE.tensors)])


def renamed_tensor(old: str, new: str) -> bytes:
    """The template experience with one tensor under another safetensors key."""
    header, data, offset = {}, b"", 0
    for name, tensor in TEMPLATE.tensors.items():
        raw = bytes(tensor.data)
        key = new if name == old else f"0:{name}"
        header[key] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    meta = pickle.dumps({"version": 1, "num_items": 1, "items": [TEMPLATE.meta]}, protocol=5)
    return assemble(meta, header, data)


def assemble(meta_bytes: bytes, header: dict, data: bytes) -> bytes:
    """TRXP framing around a metadata pickle and a safetensors header and data."""
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    tensors = struct.pack("<Q", len(header_bytes)) + header_bytes + data
    return struct.pack("<4sBQQ", b"TRXP", 1, len(meta_bytes), len(tensors)) + meta_bytes + tensors


@pytest.fixture(scope="module")
def buffer() -> Iterator[pb_grpc.ExperienceBufferStub]:
    """The service over a store in a temporary directory, in-process, for speed."""
    with (
        tempfile.TemporaryDirectory(prefix="expbuf-fuzz-") as tmp,
        Store(tmp) as store,
        service_over(store) as target,
        channel(target) as chan,
    ):
        yield stub(chan)


@given(payload=payloads())
@example(payload=crafted(eid_extra=1))  # an unknown key in eid
@example(payload=crafted(reward=10**400))  # a reward no float can hold
@example(payload=crafted(info_priority=10**400))
@example(payload=crafted(info_model_version=2**63))  # beyond int64
@example(payload=crafted(eid_step=2**63))
@example(payload=crafted(eid_suffix="x" * 380))  # a uid of 400 bytes, within the limit
@example(payload=renamed_tensor("tokens", "\u00b2:tokens"))  # a digit int() does not read
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_a_push_is_stored_or_refused_with_a_status_and_bounded_work(
    buffer: pb_grpc.ExperienceBufferStub, payload: bytes
) -> None:
    start = time.process_time()
    try:
        buffer.Push(pb.PushRequest(payload=payload), timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() in REFUSALS, f"a push got {exc.code().name}: {exc.details()}"
    spent = time.process_time() - start
    assert spent < CPU_SECONDS_FLOOR + CPU_SECONDS_PER_KB * len(payload) / 1024, (
        f"a {len(payload)}-byte push took {spent:.2f} CPU-seconds"
    )
    try:
        buffer.Stats(pb.StatsRequest(), timeout=30)
    except grpc.RpcError as exc:
        pytest.fail(f"Stats fails after the push: {exc.code().name}: {exc.details()}")


@side_by_side
@given(payload=payloads())
@example(payload=crafted(eid_extra=1))
@example(payload=crafted(reward=10**400))
@example(payload=crafted(info_model_version=2**63))
@example(payload=renamed_tensor("tokens", "\u00b2:tokens"))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_the_compiled_parse_gives_each_push_the_same_verdict(payload: bytes) -> None:
    """The push fuzzer's payloads through the compiled parse and its source (test_native.py)."""
    same_parse(payload)
