"""Joining stored experiences into one batch: the exact bytes of the batch header, with and
without tensors added per item, whatever layout the stored headers have; and the same stored
experiences read as columns."""

from __future__ import annotations

import json
import math
import struct

import pytest

from expbuf.client import trxp
from expbuf.client.trxp.codec.common import HEADER_SIZE, ITEMSIZE
from expbuf.client.trxp.stored.columns import column_parts
from expbuf.client.trxp.stored.pieces import SplitPayload, Stored, realized, section_at

from conftest import payload

SPLICE_HEAD = 56  # bytes of the stored metadata before an item's own opcodes


def stored_items() -> list[trxp.RawItem]:
    return trxp.parse(payload("rich_fields.trxp")) + trxp.parse(payload("mixed_batch.trxp"))


def sections(blob: bytes | memoryview) -> tuple[bytes, dict, bytes]:
    """A payload's metadata pickle, parsed safetensors header and tensor bytes."""
    blob = bytes(blob)
    _, _, meta_len, _ = struct.unpack_from("<4sBQQ", blob)
    rest = blob[HEADER_SIZE + meta_len :]
    (header_len,) = struct.unpack_from("<Q", rest)
    return blob[HEADER_SIZE : HEADER_SIZE + meta_len], json.loads(rest[8 : 8 + header_len]), rest[8 + header_len :]


def expected_header(items: list[trxp.RawItem], added: list[dict[str, trxp.RawTensor]]) -> bytes:
    """The batch header as json.dumps writes it: item by item, each item's stored tensors
    (those not replaced) in stored order, then the added ones, back to back."""
    header, base = {}, 0
    for index, (item, extra) in enumerate(zip(items, added, strict=True)):
        stored = list(sections(trxp.pack_item(item))[1].items())
        kept = [(key.partition(":")[2], entry) for key, entry in stored if key.partition(":")[2] not in extra]
        for name, entry in kept:
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            header[f"{index}:{name}"] = {
                "dtype": entry["dtype"],
                "shape": entry["shape"],
                "data_offsets": [base, base + size],
            }
            base += size
        for name, tensor in extra.items():
            entry = {
                "dtype": tensor.dtype,
                "shape": list(tensor.shape),
                "data_offsets": [base, base + len(tensor.data)],
            }
            header[f"{index}:{name}"] = entry
            base += len(tensor.data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8)


def header_bytes(batch: bytes) -> bytes:
    _, _, meta_len, _ = struct.unpack_from("<4sBQQ", batch)
    (header_len,) = struct.unpack_from("<Q", batch, HEADER_SIZE + meta_len)
    return batch[HEADER_SIZE + meta_len + 8 : HEADER_SIZE + meta_len + 8 + header_len]


def relaid(blob: bytes) -> bytes:
    """The same one-item payload with its header in another JSON layout: spaces after the
    separators and a __metadata__ entry, as a safetensors writer other than pack_item may do."""
    meta, header, data = sections(blob)
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<4sBQQ", b"TRXP", 1, len(meta), 8 + len(text) + len(data))
    return head + meta + struct.pack("<Q", len(text)) + text + data


def advantages(index: int, tensors: dict[str, trxp.RawTensor]) -> dict[str, trxp.RawTensor]:
    """Tensors added to some items and replacing one of others (names that JSON escapes included)."""
    if index % 3 == 0:
        return {}
    if index % 3 == 1:
        return {
            "advantages": trxp.RawTensor("F32", (2,), b"\x01" * 8),
            'multi_modal_inputs:r\u00e9"t\n': trxp.RawTensor("F32", (1,), b"\x02" * 4),
        }
    return {next(iter(tensors)): trxp.RawTensor("I64", (1, 2), b"\x03" * 16)}


@pytest.mark.parametrize("layout", ["stored", "other", "mixed", "memoryview"])
def test_batch_header_is_the_json_of_the_items_tensors(layout: str) -> None:
    items = stored_items()
    blobs: list[bytes | memoryview] = [trxp.pack_item(item) for item in items]
    if layout == "other":
        blobs = [relaid(blob) for blob in blobs]
    elif layout == "mixed":
        blobs = [relaid(blob) if i % 2 else blob for i, blob in enumerate(blobs)]
    elif layout == "memoryview":
        blobs = [memoryview(blob) for blob in blobs]
    plain = trxp.join(blobs)
    assert header_bytes(plain) == expected_header(items, [{}] * len(items))
    assert trxp.parse(plain) == items
    spliced = trxp.join(blobs, advantages)
    added = [advantages(i, {name: t for name, t in item.tensors.items()}) for i, item in enumerate(items)]
    assert header_bytes(spliced) == expected_header(items, added)
    got = trxp.parse(spliced, trusted=True)  # the added tensors are not a rollout's
    for item, extra, back in zip(items, added, got, strict=True):
        assert back.tensors == {**{n: t for n, t in item.tensors.items() if n not in extra}, **extra}
        assert back.meta == item.meta


def test_join_of_nothing_is_an_empty_batch() -> None:
    batch = trxp.join([])
    assert header_bytes(batch).rstrip() == b"{}"
    assert trxp.parse(batch) == []


@pytest.mark.parametrize("layout", ["stored", "other", "whole batches"])
def test_dropped_tensors_leave_every_item_and_nothing_else_does(layout: str) -> None:
    items = stored_items()
    for index, item in enumerate(items):
        if index % 2:
            item.tensors["advantages"] = trxp.RawTensor("F32", (2,), b"\x01" * 8)
            item.tensors["returns"] = trxp.RawTensor("F32", (2,), b"\x02" * 8)
    blobs = [trxp.pack_item(item) for item in items]
    if layout == "other":
        blobs = [relaid(blob) for blob in blobs]
    elif layout == "whole batches":  # metadata not laid out for splicing: parsed and rebuilt
        blobs = [trxp.build([item]) for item in items]
    joined = b"".join(trxp.join_parts(blobs, drop=("advantages", "returns")))
    got = trxp.parse(joined, trusted=True)
    assert any("advantages" in item.tensors for item in items)
    for item, back in zip(items, got, strict=True):
        assert back.tensors == {n: t for n, t in item.tensors.items() if n not in ("advantages", "returns")}
        assert back.meta == item.meta


def with_tensors(item: trxp.RawItem, tensors: dict[str, trxp.RawTensor]) -> trxp.RawItem:
    return trxp.RawItem(meta=item.meta, tensors=tensors)


def trailing(blob: bytes) -> bytes:
    """The same one-item payload with bytes after its last tensor, in its section."""
    meta, header, data = sections(blob)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    data += b"\x07" * 5
    head = struct.pack("<4sBQQ", b"TRXP", 1, len(meta), 8 + len(text) + len(data))
    return head + meta + struct.pack("<Q", len(text)) + text + data


def in_pieces(blob: bytes) -> SplitPayload:
    """A one-item payload as a store hands on one kept in chunks: its section in pieces."""
    start = section_at(blob)
    cut = start + (len(blob) - start) // 2
    return SplitPayload(memoryview(blob)[:start], [memoryview(blob)[start:cut], blob[cut:]])


def every_header_shape(layout: str) -> tuple[list[trxp.RawItem], list[Stored]]:
    """Items whose stored headers the splice reads in one pass, and items whose headers it reads
    otherwise (no tensors, more tensors than one pass reads, names JSON escapes, bytes after the
    last tensor), stored as `layout`."""
    base = stored_items()[0]
    many = {f"multi_modal_inputs:t{i}": trxp.RawTensor("U8", (i, 1), bytes(range(i))) for i in range(15)}
    escaped = {'multi_modal_inputs:r\u00e9"t\n': trxp.RawTensor("F32", (1,), b"\x02" * 4)}
    items = [
        base,
        with_tensors(base, {}),
        with_tensors(base, {"logprobs": trxp.RawTensor("F32", (), b"\x01" * 4)}),
        with_tensors(base, many),
        with_tensors(base, {**base.tensors, **escaped}),
        base,
        with_tensors(base, {**base.tensors, **many}),
    ]
    packed = [trxp.pack_item(item) for item in items]
    packed.insert(3, trailing(trxp.pack_item(base)))
    items.insert(3, base)
    blobs: list[Stored] = list(packed)
    if layout == "memoryview":
        blobs = [memoryview(blob) for blob in packed]
    elif layout == "pieces":
        blobs = [in_pieces(blob) for blob in packed]
    return items, blobs


@pytest.mark.parametrize("layout", ["stored", "memoryview", "pieces"])
@pytest.mark.parametrize("drop", [(), ("tokens", 'multi_modal_inputs:r\u00e9"t\n')])
def test_every_header_shape_joins_back_into_its_items(layout: str, drop: tuple[str, ...]) -> None:
    items, blobs = every_header_shape(layout)
    got = trxp.parse(b"".join([realized(run) for run in trxp.join_parts(blobs, drop=drop)]), trusted=True)
    for item, back in zip(items, got, strict=True):
        assert back.tensors == {name: t for name, t in item.tensors.items() if name not in drop}
        assert back.meta == item.meta


@pytest.mark.parametrize("layout", ["stored", "pieces"])
def test_every_header_shape_reads_into_its_columns(layout: str) -> None:
    items, blobs = every_header_shape(layout)
    fields = ["tokens", "logprobs", 'multi_modal_inputs:r\u00e9"t\n', "multi_modal_inputs:t14", "action_mask"]
    got: dict[tuple[str, int], trxp.RawTensor] = {}
    for column in column_parts(blobs, fields):  # a value in pieces comes as several runs
        shapes, values = iter(column.shapes), b"".join([realized(run) for run in column.values])
        for index in column.items:
            shape = tuple(next(shapes) for _ in range(column.ndim))
            size = math.prod(shape) * ITEMSIZE[column.dtype]
            got[column.name, index] = trxp.RawTensor(column.dtype, shape, values[:size])
            values = values[size:]
    expected = {
        (name, index): item.tensors[name] for index, item in enumerate(items) for name in fields if name in item.tensors
    }
    assert got == expected
