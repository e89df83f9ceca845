"""A spliced batch's header written a run of items at a time (client/trxp/stored/entries.py): for
varied batches (runs of one layout broken by others, item indices and offsets that cross a digit
count, names that JSON escapes, non-ASCII names, names with '%', tensors added after an item's own
or in place of one, tensors dropped) the batch is byte for byte what json.dumps of its header and
the items' bytes back to back make, and parses back into the items."""

from __future__ import annotations

import json
import math
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expbuf.client import trxp
from expbuf.client.trxp.codec.common import HEADER_SIZE, ITEMSIZE
from expbuf.client.trxp.stored.pieces import concatenated
from expbuf.client.trxp.stored.splice import join_parts

from conftest import payload

MM = "multi_modal_inputs:"
NAMES = ["tokens", "logprobs", "action_mask", "advantages"] + [
    MM + key for key in ("r\u00e9ponse \u4e2d", "50%d", "%", 'q"uote', "back\\slash")
]
DTYPES = ["F32", "I64", "U8", "BOOL", "BF16"]
META = trxp.parse(payload("rich_fields.trxp"))[0].meta


def tensor(dtype: str, shape: tuple[int, ...], fill: int) -> trxp.RawTensor:
    size = math.prod(shape) * ITEMSIZE[dtype]
    return trxp.RawTensor(dtype, shape, bytes([fill % 2]) * size)


layouts = st.lists(
    st.tuples(st.sampled_from(NAMES), st.sampled_from(DTYPES), st.lists(st.integers(0, 12), max_size=2).map(tuple)),
    min_size=1,
    max_size=4,
    unique_by=lambda entry: entry[0],
)


def batch_header(items: list[trxp.RawItem], added: list[dict[str, trxp.RawTensor]], drop: tuple[str, ...]) -> bytes:
    """The batch's header as json.dumps writes it: each item's stored tensors in its stored order,
    less those dropped or replaced, then those added, back to back."""
    header, base = {}, 0
    for index, (item, extra) in enumerate(zip(items, added, strict=True)):
        blob = trxp.pack_item(item)
        (meta_len,) = struct.unpack_from("<Q", blob, 5)
        (header_len,) = struct.unpack_from("<Q", blob, HEADER_SIZE + meta_len)
        stored = json.loads(blob[HEADER_SIZE + meta_len + 8 : HEADER_SIZE + meta_len + 8 + header_len])
        for key, entry in stored.items():
            name = key.partition(":")[2]
            if name in extra or name in drop:
                continue
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            header[f"{index}:{name}"] = {**entry, "data_offsets": [base, base + size]}
            base += size
        for name, given_tensor in extra.items():
            size = len(given_tensor.data)
            header[f"{index}:{name}"] = {
                "dtype": given_tensor.dtype,
                "shape": list(given_tensor.shape),
                "data_offsets": [base, base + size],
            }
            base += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    pool=st.lists(layouts, min_size=1, max_size=3),
    picks=st.lists(st.integers(0, 2), min_size=0, max_size=130),
    adds=st.sampled_from(["none", "after", "replace", "by index"]),
    drop=st.sampled_from([(), ("advantages",), ("tokens", MM + "%")]),
    views=st.booleans(),
)
def test_a_spliced_batch_is_the_json_of_its_header_and_its_items_bytes(
    pool: list[list[tuple[str, str, tuple[int, ...]]]],
    picks: list[int],
    adds: str,
    drop: tuple[str, ...],
    views: bool,
) -> None:
    items = [
        trxp.RawItem(dict(META), {name: tensor(dtype, shape, at) for name, dtype, shape in pool[pick % len(pool)]})
        for at, pick in enumerate(picks)
    ]
    blobs = [trxp.pack_item(item) for item in items]

    def extra(index: int, tensors: object) -> dict[str, trxp.RawTensor]:
        if adds == "none":
            return {}
        if adds == "after":
            return {"advantages": tensor("F32", (3,), 1), "returns": tensor("F32", (3,), 1)}
        if adds == "replace":  # an item's first stored tensor replaced, where it stores one
            first = next(iter(items[index].tensors))
            return {first: tensor("I64", (1, 2), 1)} if first not in drop else {}
        return {"advantages": tensor("F32", (index % 11,), 0)} if index % 3 else {}  # shapes that break runs

    added = [extra(index, None) for index in range(len(items))]
    runs = join_parts([memoryview(blob) for blob in blobs] if views else blobs, extra, drop)
    batch = concatenated(runs)
    (meta_len,) = struct.unpack_from("<Q", batch, 5)
    (header_len,) = struct.unpack_from("<Q", batch, HEADER_SIZE + meta_len)
    assert batch[HEADER_SIZE + meta_len + 8 : HEADER_SIZE + meta_len + 8 + header_len] == batch_header(
        items, added, drop
    )
    back = trxp.parse(batch, trusted=True)
    assert len(back) == len(items)
    for item, given_tensors, got in zip(items, added, back, strict=True):
        kept = {name: t for name, t in item.tensors.items() if name not in given_tensors and name not in drop}
        assert got.tensors == {**kept, **given_tensors}


VALUES = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.5, -2.25, 1e-40]


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(
    masks=st.lists(
        st.tuples(st.sampled_from(["BOOL", "U8", "I64", None]), st.sampled_from(["zeros", "ones", "mixed"])),
        min_size=1,
        max_size=3,
    ),
    picks=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(VALUES), st.booleans()), max_size=120),
)
def test_a_batch_with_its_advantages_is_each_item_with_its_own_spliced(
    masks: list[tuple[str | None, str]], picks: list[tuple[int, float, bool]]
) -> None:
    """stored_advantages.batch_payload: each experience's advantages and returns are its value times
    its own action mask (codec/advantages.scaled, which the Trinity-RFT tests pin), after its stored
    tensors, in runs of experiences of one layout broken by others and by experiences without one."""
    from expbuf.client.trxp.codec.advantages import scaled
    from expbuf.server.store.disk.stored_advantages import batch_payload

    items, advantages = [], []
    for at, (pick, value, has) in enumerate(picks):
        dtype, fill = masks[pick % len(masks)]
        tensors = {"tokens": tensor("I64", (6,), at), "logprobs": tensor("F32", (4,), at)}
        if dtype is not None:
            flags = {"zeros": [0] * 4, "ones": [1] * 4, "mixed": [at % 2, 1, 0, 1]}[fill]
            tensors["action_mask"] = trxp.RawTensor(
                dtype, (4,), b"".join(flag.to_bytes(ITEMSIZE[dtype], "little") for flag in flags)
            )
        items.append(trxp.RawItem(dict(META), tensors))
        advantages.append((value, 4) if has else None)
    batch = batch_payload([trxp.pack_item(item) for item in items], advantages)
    added = [
        {}
        if advantage is None
        else dict.fromkeys(("advantages", "returns"), scaled(*advantage, item.tensors.get("action_mask")))
        for item, advantage in zip(items, advantages, strict=True)
    ]
    (meta_len,) = struct.unpack_from("<Q", batch, 5)
    (header_len,) = struct.unpack_from("<Q", batch, HEADER_SIZE + meta_len)
    assert batch[HEADER_SIZE + meta_len + 8 : HEADER_SIZE + meta_len + 8 + header_len] == batch_header(items, added, ())
    for item, given_tensors, got in zip(items, added, trxp.parse(batch, trusted=True), strict=True):
        assert got.tensors == {**item.tensors, **given_tensors}
