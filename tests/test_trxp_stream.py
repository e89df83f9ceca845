"""A payload read as it arrives (client/trxp/codec/stream.py): its items are checked from its head
alone, its large items' data comes out in pieces that are, end to end, the data pack_item lays
out after its head, whatever sizes the payload arrives in, and the rest as parse() reads it."""

from __future__ import annotations

import random
import tracemalloc

import pytest
import torch

from expbuf.client import Experience, trxp
from expbuf.client.trxp.codec.build import frame, pack_head, pack_item
from expbuf.client.trxp.codec.common import TrxpError
from expbuf.client.trxp.codec.stream import NotStreamable, StreamedPayload

from helpers import make_experience

CHUNK = 64 << 10


def streamed(payload: bytes, sizes: list[int], chunk: int = CHUNK) -> tuple[StreamedPayload, dict[int, bytes]]:
    """`payload` fed in pieces of the given sizes (round and round); each large item's data, joined."""
    view = memoryview(payload)
    first = sizes[0]
    stream = StreamedPayload(view[:first], len(payload), chunk)
    pieces: dict[int, list[tuple[int, bytes]]] = {}

    def keep(done: list[tuple[int, int, memoryview]]) -> None:
        for item, number, data in done:
            assert len(data) == chunk or number == len(pieces.get(item, [])), "only an item's last piece is short"
            pieces.setdefault(item, []).append((number, bytes(data)))

    at, turn = stream.head_length, 1
    keep(stream.feed(view[at:first]))
    at = first
    while at < len(view):
        step = sizes[turn % len(sizes)]
        keep(stream.feed(view[at : at + step]))
        at, turn = at + step, turn + 1
    keep(stream.finish())
    joined = {}
    for item, numbered in pieces.items():
        assert [number for number, _ in numbered] == list(range(len(numbered)))
        joined[item] = b"".join(data for _, data in numbered)
    return stream, joined


def experience(task: int, response: int, mask: torch.Tensor | None = None) -> Experience:
    made = make_experience("s", task, 0, response=response)
    if mask is not None:
        made.action_mask = mask
    return made


@pytest.mark.parametrize("sizes", [[1 << 20], [70_001, 1, 4095, 333], [3000, 7]], ids=["large", "odd", "tiny"])
def test_large_items_come_out_in_pieces_that_are_the_stored_data_and_the_rest_as_parsed(sizes: list[int]) -> None:
    mask = torch.tensor([i % 3 != 0 for i in range(30_000)])
    pushed = [experience(0, 30_000, mask), experience(1, 10), experience(2, 20_000)]
    payload = trxp.build([trxp.from_experience(one) for one in pushed])
    stream, joined = streamed(payload, sizes)
    parsed = trxp.parse(payload)
    assert stream.large == [0, 2] and set(joined) == {0, 2}
    for index in (0, 2):
        whole = pack_item(parsed[index])
        head = b"".join(stream.heads[index])
        assert whole == head + joined[index]
        assert stream.section_lengths[index] == len(joined[index])
        assert stream.generated[index] == parsed[index].generated_tokens
    assert stream.generated[0] == 20_000
    assert pack_item(stream.items[1]) == pack_item(parsed[1])  # a small item: its data kept whole
    assert stream.holds < len(payload)


def test_opening_a_streamed_payload_makes_no_buffer_for_what_it_will_hold() -> None:
    """A push in chunks opens its payload's stream, from the first chunk alone, before it reserves
    what the stream `holds` under max_inflight_bytes and waits for room: the small items' buffers
    were made there, each as large as the head declares (a 4 MiB message declaring 382 MB made a
    server allocate 382 MB, uncounted). They are made as their bytes come."""
    pushed = [experience(0, 30_000), *(experience(task, 6_000) for task in range(1, 41))]
    payload = trxp.build([trxp.from_experience(one) for one in pushed])
    first = 1 << 16
    tracemalloc.start()
    try:
        opened = tracemalloc.get_traced_memory()[0]
        stream = StreamedPayload(memoryview(payload)[:first], len(payload), CHUNK)
        made = tracemalloc.get_traced_memory()[0] - opened
    finally:
        tracemalloc.stop()
    kept = stream.holds - stream.head_length - len(stream.large) * CHUNK
    assert stream.large == [0] and kept > 40 * 6_000 * 8  # the small items' tokens and log-probs, at least
    assert made < kept / 10, (made, kept)
    again, _ = streamed(payload, [first, 4096, 77_777])
    assert [pack_item(item) for item in again.items[1:]] == [pack_item(item) for item in trxp.parse(payload)[1:]]


@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor([i % 2 for i in range(20_000)], dtype=torch.int64),
        torch.tensor([i % 5 for i in range(20_000)], dtype=torch.int32),
        torch.tensor([i % 4 == 0 for i in range(20_000)], dtype=torch.int16),
    ],
    ids=["int64", "int32", "int16"],
)
def test_a_mask_of_wide_elements_cut_between_feeds_is_counted_whole(mask: torch.Tensor) -> None:
    payload = trxp.build([trxp.from_experience(experience(0, 20_000, mask))])
    stream, _ = streamed(payload, [4096, 3, 5, 7, 1001])
    assert stream.generated[0] == int((mask != 0).sum()) == trxp.parse(payload)[0].generated_tokens


def test_what_is_not_for_streaming_is_said_and_what_is_invalid_refused() -> None:
    small = trxp.build([trxp.from_experience(experience(0, 10))])
    with pytest.raises(NotStreamable, match="larger than a chunk"):
        StreamedPayload(memoryview(small), len(small), CHUNK)
    large = trxp.build([trxp.from_experience(experience(0, 30_000))])
    with pytest.raises(NotStreamable, match="head is not whole"):
        StreamedPayload(memoryview(large)[:100], len(large), CHUNK)
    reversed_data = out_of_order(large)
    with pytest.raises(NotStreamable, match="order the store keeps"):
        StreamedPayload(memoryview(reversed_data), len(reversed_data), CHUNK)
    assert trxp.parse(reversed_data)[0].uid == trxp.parse(large)[0].uid  # a valid payload all the same
    with pytest.raises(TrxpError, match="shorter than the declared"):
        StreamedPayload(memoryview(large), len(large) - 1, CHUNK)
    item = trxp.from_experience(experience(0, 30_000))
    item.meta["prompt_length"] = 40_000
    invalid = trxp.build([item])
    with pytest.raises(TrxpError, match="prompt_length"):
        StreamedPayload(memoryview(invalid), len(invalid), CHUNK)


def out_of_order(payload: bytes) -> bytes:
    """The one-item payload with its tensors' data laid out in the reverse of the store's order."""
    (item,) = trxp.parse(payload)
    _, order = pack_head(item)
    header, data, offset = [], [], 0
    for name in reversed(order):
        tensor = item.tensors[name]
        end = offset + len(tensor.data)
        dims = list(tensor.shape)
        header.append(f'"0:{name}":{{"dtype":"{tensor.dtype}","shape":{dims},"data_offsets":[{offset},{end}]}}')
        data.append(bytes(tensor.data))
        offset = end
    meta_len = int.from_bytes(payload[5:13], "little")
    meta = payload[trxp.HEADER_SIZE : trxp.HEADER_SIZE + meta_len]
    return b"".join(frame([meta], ("{" + ",".join(header) + "}").encode(), data))


def test_pieces_fill_the_store_s_chunks_whatever_the_arrival() -> None:
    random.seed(7)
    payload = trxp.build([trxp.from_experience(experience(task, 50_000)) for task in range(3)])
    sizes = [random.randrange(1, 200_000) for _ in range(50)]
    sizes[0] = max(sizes[0], 4096)
    stream, joined = streamed(payload, sizes, chunk=100_000)
    for index, item in enumerate(trxp.parse(payload)):
        assert b"".join(stream.heads[index]) + joined[index] == pack_item(item)


def test_a_head_is_parsed_within_the_budgets_of_the_bytes_that_came_not_of_the_size_claimed() -> None:
    """A first chunk claims the size of the whole push: the budgets of the head's parse (its work,
    its metadata written out) are those of the bytes present, so a head whose metadata would be
    written out to more than they allow is refused here (the server then reads the push whole,
    with the budgets of all that was sent), whatever size the first chunk claims."""
    shared = "x" * 20_000  # one string the pickle keeps once and every item names
    items = [trxp.from_experience(experience(0, 40_000))]
    for task in range(1, 60):
        item = trxp.from_experience(experience(task, 4))
        item.meta["info"] = {"note": shared}
        items.append(item)
    payload = trxp.build(items)
    head = StreamedPayload(memoryview(payload), len(payload), CHUNK).head_length
    first = memoryview(payload)[: head + 1000]
    with pytest.raises(TrxpError, match="written out"):
        StreamedPayload(first, len(payload), CHUNK)
    with pytest.raises(TrxpError):  # a larger claim changes nothing (its frame does not add up, either)
        StreamedPayload(first, 1 << 40, CHUNK)
    assert len(trxp.parse(payload)) == 60  # whole, with the budget of all its bytes, it passes
