"""The fast paths of the TRXP checks accept only what the detailed checks accept, with the same result."""

from __future__ import annotations

import itertools
import json
import math
import pickle
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expbuf.client import EID, Experience, trxp
from expbuf.client.native import source_module
from expbuf.client.trxp import TrxpError
from expbuf.client.trxp.codec import checks, parse, pickles
from expbuf.client.trxp.codec.build import pack_item
from expbuf.client.trxp.codec.common import HEADER_SIZE, RawItem, RawTensor

_VALUES: list[Any] = [0, 7, -1, 2**63 - 1, -(2**63), 2**63, 2**31, True, 1.5, "", "a", "3/eval", "é", "x\0", "a" * 400]


# The checks run from their source whether or not the compiled module is in use: its functions look
# each other up at every call, so the fast path can be turned off there (compiled code calls its own).
_SOURCE_CHECKS = source_module("expbuf.client.trxp.codec.checks")


def _detailed(eid: Any) -> str:
    """_check_eid with its fast path bypassed."""
    plain = _SOURCE_CHECKS._plain_uid
    _SOURCE_CHECKS._plain_uid = lambda eid: None
    try:
        return _SOURCE_CHECKS._check_eid(0, eid)
    finally:
        _SOURCE_CHECKS._plain_uid = plain


def _outcome(check: Any, eid: Any) -> str:
    """The uid a check returns for an eid, or its refusal's type and message (the source module's
    TrxpError is a class of its own, of the same name)."""
    try:
        return check(eid)
    except ValueError as exc:  # TrxpError, the compiled module's or the source's
        return f"refused: {type(exc).__name__}: {exc}"


@pytest.mark.parametrize("batch", _VALUES)
def test_plain_uid_agrees_with_the_detailed_checks(batch: Any) -> None:
    for task, run, step, suffix in itertools.product(_VALUES, _VALUES[:9], _VALUES[:9], ["s", "a/b", 3, "é"]):
        eid = {"batch": batch, "task": task, "run": run, "step": step, "suffix": suffix}
        fast = checks._plain_uid(eid)
        if fast is not None:
            assert fast == _detailed(eid) == EID(**eid).uid, eid
        assert _outcome(lambda eid: checks._check_eid(0, eid), eid) == _outcome(_detailed, eid), eid


def test_plain_uid_leaves_odd_eids_to_the_detailed_checks() -> None:
    assert checks._plain_uid({"batch": 1, "task": 2, "run": 3, "step": 4}) is None
    assert checks._plain_uid({"batch": "3/eval", "task": 2, "run": 3, "step": 4, "suffix": "s"}) is None
    assert checks._plain_uid([1]) is None
    assert checks._plain_uid({"batch": 1, "task": 2, "run": 3, "step": 4, "suffix": "s"}) == "1/2/3/4/s"


@pytest.mark.parametrize("empty", [[], {}, ()])
def test_a_shared_empty_container_is_counted_once_like_any_container(empty: Any) -> None:
    """Each container costs work at its first reference only, wherever it sits: counting a
    shared empty field again at each reference would refuse, within a tight budget, a payload
    the detailed walk accepts."""
    shared = [1]
    expected = trxp.Work(1 << 40)
    measure = checks.Shape(expected, 1 << 40, check_keys=True)
    measure.item(0, "u", {"a": shared, "b": shared, "c": [shared]})
    work = trxp.Work(1 << 40)
    shape = checks.Shape(work, 1 << 40, check_keys=True)
    shape.item(0, "u", {"a": empty, "b": empty, "c": [empty]})
    assert work.used == expected.used - 1  # [1] takes a step more than an empty container: its one entry
    assert shape.size == 3 + 3 + (3 + 3) + 3 * (5 + 1)


def test_a_shared_empty_field_passes_within_the_steps_the_walk_counts() -> None:
    empty: list[Any] = []
    item = {"a": empty, "b": empty, "c": empty}
    work = trxp.Work(1)  # one step: the list, counted at its first reference
    checks.Shape(work, 1 << 40, check_keys=True).item(0, "u", item)
    assert work.used == 1


@pytest.mark.parametrize("empty", [[], {}, ()])
def test_an_item_measured_afresh_is_charged_its_empty_containers_again(empty: Any) -> None:
    """A batch of columns makes each experience's containers anew and lets the last one's go, so an
    empty one may stand at a freed one's address (or a caller reuse one): measured afresh
    (`forget`), an item is charged every container it holds, as the first item was."""
    work = trxp.Work(1 << 40)
    shape = checks.Shape(work, 1 << 40, check_keys=True)
    used = []
    for index in range(3):
        before = work.used
        shape.item(index, "u", {"a": empty, "b": [empty]})
        used.append(work.used - before)
        shape.forget()
    assert used == [used[0]] * 3 and used[0] >= 2  # each item charged what the first was


@pytest.mark.parametrize("value", [(1 << 62) - 1, 1 << 62, -(1 << 62) + 1, -(1 << 62), 2**63 - 1, -(2**63)])
def test_plain_uid_leaves_ints_past_a_machine_word_to_the_detailed_checks(value: int) -> None:
    """_plain_uid takes ints compiled code compares in a word; the rest of int64 still passes, in detail."""
    for part in ("batch", "task", "run"):
        number = min(abs(value), 2**63 - 1) if part == "run" else value  # run: 0 to 2**63 - 1
        eid = {"batch": 1, "task": 2, "run": 3, "step": 4, "suffix": "s", part: number}
        plain = checks._plain_uid(eid)
        assert plain is None if abs(number) >= (1 << 62) else plain == EID(**eid).uid
        assert checks._check_eid(0, eid) == _detailed(eid) == EID(**eid).uid


def _entry_outcome(check: Any, entry: Any, data_len: int) -> tuple[Any, ...] | str:
    """What an entry check makes of a safetensors header entry (its span and the work it took), or
    its refusal's message."""
    work = trxp.Work(1 << 40)
    try:
        return (*check(entry, data_len, work), work.used)
    except TrxpError as exc:
        return f"refused: {exc}"


def _checked(entry: Any, data_len: int, work: trxp.Work) -> Any:
    """_parse_entry's detailed checks alone, as it passes them an entry."""
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    itemsize = parse.ITEMSIZE.get(dtype) if type(dtype) is str else None
    return parse._checked_entry("0:tokens", dtype, shape, offsets, itemsize, data_len, work)


# Entries beside the common one ({"dtype": "I32", "shape": [4], "data_offsets": [0, 16]} of 16 bytes):
# each misses the fast path's form by one thing.
_NEAR_MISSES: list[dict[str, Any]] = [
    {"shape": [0], "data_offsets": [0, 0]},
    {"shape": [0], "data_offsets": [0, 16]},
    {"shape": [True], "data_offsets": [0, 4]},
    {"shape": [4.0]},
    {"shape": [-4]},
    {"shape": [4, 1]},
    {"shape": [2, 2]},
    {"shape": []},
    {"shape": [17], "data_offsets": [0, 68]},
    {"shape": [2**62]},
    {"shape": (4,)},
    {"shape": "4"},
    {"data_offsets": [0, 17]},
    {"data_offsets": [-4, 12]},
    {"data_offsets": [4, 20]},
    {"data_offsets": [16, 0]},
    {"data_offsets": [0.0, 16]},
    {"data_offsets": [0, True]},
    {"data_offsets": [0, 16, 32]},
    {"data_offsets": [0]},
    {"data_offsets": None},
    {"dtype": "I33"},
    {"dtype": 4},
    {"dtype": "I64"},
    {"dtype": "BOOL", "data_offsets": [0, 4]},
]


@pytest.mark.parametrize("change", _NEAR_MISSES, ids=[str(change) for change in _NEAR_MISSES])
def test_a_header_entry_that_misses_the_fast_path_gets_the_detailed_checks(change: dict[str, Any]) -> None:
    entry = {"dtype": "I32", "shape": [4], "data_offsets": [0, 16], **change}
    fast = _entry_outcome(lambda entry, size, work: parse._parse_entry("0:tokens", entry, size, work), entry, 16)
    assert fast == _entry_outcome(_checked, entry, 16)
    plain = {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}
    assert _entry_outcome(_checked, plain, 16) == (0, 16, "I32", (4,), "0:tokens", 2)


def _blob(entries: dict[str, dict[str, Any]], data_len: int) -> memoryview:
    header = json.dumps(entries, separators=(",", ":")).encode()
    return memoryview(struct.pack("<Q", len(header)) + header + bytes(data_len))


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_spans_come_in_the_data_order_whatever_the_header_order(order: tuple[int, ...]) -> None:
    """The header's order is taken as it is only where it is the data's, no tensor empty; any other
    is sorted, zero-length tensors at one offset by dtype, shape and key as sorted() orders them."""
    entries = [
        ("0:tokens", {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}),
        ("0:logprobs", {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}),
        ("0:action_mask", {"dtype": "BOOL", "shape": [0], "data_offsets": [8, 8]}),
    ]
    shuffled = dict(entries[index] for index in order)
    spans = parse._spans(_blob(shuffled, 8), 8, 1, trxp.Work(1 << 40))
    assert spans == [
        (start, end, dtype, shape, 0, key[2:])
        for start, end, dtype, shape, key in sorted(
            (entry["data_offsets"][0], entry["data_offsets"][1], entry["dtype"], tuple(entry["shape"]), key)
            for key, entry in shuffled.items()
        )
    ]


def test_spans_out_of_the_data_order_are_refused_as_sorted() -> None:
    """A gap is named at the tensor that follows it in the data, not in the header."""
    shuffled = {
        "0:logprobs": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
        "0:tokens": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},
    }
    with pytest.raises(TrxpError, match=r"'0:logprobs' starts at byte 12, expected 8 \(gap or overlap\)"):
        parse._spans(_blob(shuffled, 16), 16, 1, trxp.Work(1 << 40))


def test_an_empty_container_deeper_than_the_nesting_limit_is_refused_wherever_met_first() -> None:
    """Empty containers are counted apart from the others; depth still bounds each reference."""
    empty: list[Any] = []
    deep: list[Any] = [empty]
    for _ in range(32):
        deep = [deep]
    for item in ({"a": empty, "b": deep}, {"b": deep, "a": empty}, {"b": [empty], "c": deep}):
        with pytest.raises(TrxpError, match="nested deeper than 32 levels"):
            checks.Shape(trxp.Work(1 << 40), 1 << 40, check_keys=True).item(0, "u", item)


def test_a_field_name_measured_once_is_measured_as_the_detailed_walk_measures_it() -> None:
    """Field names are measured once a payload (ASCII: a byte a character; other text: at most 4)."""
    shape = checks.Shape(trxp.Work(1 << 40), 1 << 40, check_keys=True)
    for index in range(3):
        shape.item(index, "u", {"é": None, "ab": 1.0, b"raw": None})
    assert shape.size == 3 * ((5 + 4) + 9 + (5 + 2) + 9 + (5 + 3) + 9)


def _header_outcome(text: str, data_len: int, num_items: int, *, as_json: bool = False) -> tuple[Any, ...] | str:
    """What _spans makes of a safetensors header written as `text` over `data_len` bytes of data
    in a payload of `num_items` items (or, `as_json`, what it makes of it read as JSON, each key
    then split in the data's order): its spans and the work it took, or its refusal's message."""
    header = text.encode()
    work = trxp.Work(1 << 40)
    try:
        if as_json:
            work.charge(len(header))
            return (
                [
                    (start, end, dtype, shape, *parse._split_tensor_key(key, num_items))
                    for start, end, dtype, shape, key in parse._json_spans(text, data_len, work)
                ],
                work.used,
            )
        blob = memoryview(struct.pack("<Q", len(header)) + header + bytes(data_len))
        return (parse._spans(blob, data_len, num_items, work), work.used)
    except TrxpError as exc:
        return f"refused: {exc}"


def _agrees_with_json(text: str, data_len: int, num_items: int = 1) -> bool:
    """Whether the written form's fast path reads `text` (else it is read as JSON), after checking
    that either way the spans and the work, or the refusal, are those of the header read as JSON."""
    fast = _header_outcome(text, data_len, num_items)
    assert fast == _header_outcome(text, data_len, num_items, as_json=True), text
    return parse._written_spans(text, data_len, num_items) is not None


_WRITTEN = '{"0:tokens":{"dtype":"I32","shape":[4],"data_offsets":[0,16]},"0:logprobs":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}}'  # noqa: E501
# The written header above, each changed in one thing: (what is replaced, by what).
_WRITTEN_NEAR_MISSES: list[tuple[str, str]] = [
    ('"dtype":"I32"', ' "dtype":"I32"'),
    ('"dtype":"I32"', '"dtype" : "I32"'),
    ("[0,16]", "[0, 16]"),
    ("},", "}, "),
    ("},", "}\n,"),
    ('"dtype":"I32","shape":[4]', '"shape":[4],"dtype":"I32"'),
    ('"dtype":"I32"', '"dtype":"I32","dtype":"I32"'),
    ('"dtype":"I32"', '"dtype":"F32","dtype":"I32"'),
    ("[0,16]}", '[0,16],"extra":1}'),
    ('"0:logprobs"', '"0:tokens"'),
    ('"0:logprobs"', '"0:log\\u0070robs"'),
    ('"0:logprobs"', '"0:log\\"probs"'),
    ('"0:logprobs"', '"0:log\\\\probs"'),
    ('"0:logprobs"', '"0:log\\/probs"'),
    ('"0:logprobs"', '"0:log\x01probs"'),
    ('"0:logprobs"', '"0:log\x7fprobs"'),
    ('"0:logprobs"', '"0:logpröbs"'),
    ('"0:logprobs"', '"0:logprobs\U0001f600"'),
    ('"0:logprobs"', '"00:logprobs"'),
    ('"0:logprobs"', '"__metadata__"'),
    ('"0:logprobs"', '"x:logprobs"'),
    ("{", '{"__metadata__":{"format":"pt"},'),
    ("{", '{"__metadata__":{"dtype":"I32","shape":[4],"data_offsets":[0,16]},'),
    ("[4]", "[4.0]"),
    ("[4]", "[4e0]"),
    ("[4]", "[04]"),
    ("[4]", "[-4]"),
    ("[4]", "[0]"),
    ("[4]", "[4,1]"),
    ("[4]", "[2,2]"),
    ("[4]", "[]"),
    ("[4]", "[true]"),
    ("[4]", '["4"]'),
    ("[2]", "[3]"),
    ("[0,16]", "[00,16]"),
    ("[0,16]", "[-0,16]"),
    ("[0,16]", "[0.0,16]"),
    ("[0,16]", "[0,16.0]"),
    ("[0,16]", "[0,1.6e1]"),
    ("[0,16]", "[0,17]"),
    ("[0,16]", "[4,20]"),
    ("[16,24]", "[15,23]"),
    ("[16,24]", "[16,24,32]"),
    ("[4]", "[4000000000000000000]"),
    ("[4]", "[" + "4" * 19 + "]"),
    ("[0,16]", "[0," + "1" * 5000 + "]"),
    ('"I32"', '"I33"'),
    ('"I32"', '"i32"'),
    ('"I32"', '"I64"'),
    ('"I32"', '"BOOL"'),
    ('"I32"', "32"),
    ("}}", "},}"),
    ("}}", "}} x"),
    ("}}", "}}\t"),
    ("}}", "}}\n"),
    ("}}", "}}}"),
    ("{", "\ufeff{"),
]


@pytest.mark.parametrize("padding", ["", " ", "       "])
def test_a_header_as_written_is_read_by_the_fast_path_as_json_reads_it(padding: str) -> None:
    """The writers' form, padded with the spaces safetensors allows after the header."""
    assert _agrees_with_json(_WRITTEN + padding, 24)
    assert _header_outcome(_WRITTEN + padding, 24, 1) == (
        [(0, 16, "I32", (4,), 0, "tokens"), (16, 24, "F32", (2,), 0, "logprobs")],
        len(_WRITTEN + padding) + 4,
    )


@pytest.mark.parametrize(("old", "new"), _WRITTEN_NEAR_MISSES, ids=[new for _, new in _WRITTEN_NEAR_MISSES])
def test_a_header_near_the_written_form_is_read_as_json_reads_it(old: str, new: str) -> None:
    """Each change takes the header out of the written form: it is read as JSON, refused as JSON
    refuses it, or, a key that names no known field or no item, as JSON reads it and then refused."""
    text = _WRITTEN.replace(old, new, 1)
    assert text != _WRITTEN
    assert not _agrees_with_json(text, 24)


def test_a_header_of_no_entries_or_other_data_lengths_is_read_as_json_reads_it() -> None:
    for text, data_len in [("{}", 0), ("{}", 8), ("{} ", 0), (_WRITTEN, 23), (_WRITTEN, 25), (_WRITTEN, 0), ("", 0)]:
        assert not _agrees_with_json(text, data_len)


# Mostly the written form, with each way out of it now and then.
_NAMES = st.sampled_from(["tokens", "logprobs", "action_mask", "mm_x", "tokens", "é", 'a"b', "a\\b", "\x01", "", ":"])
_DTYPES = st.sampled_from(["I32", "F32", "BOOL", "BF16", "F8_E4M3", "I64", "F32", "I33", ""])
_SHAPES = st.one_of(st.lists(st.integers(1, 5), min_size=1, max_size=1), st.lists(st.integers(-1, 5), max_size=2))
_ENTRIES = st.lists(
    st.tuples(st.integers(0, 12), _NAMES, _DTYPES, _SHAPES, st.sampled_from([0, 0, 0, 0, 0, 0, -2, -1, 1, 2])),
    min_size=1,
    max_size=6,
)


@given(
    _ENTRIES, st.booleans(), st.sampled_from(["", "   ", "\n"]), st.sampled_from([0, 0, 0, -1, 1]), st.integers(1, 14)
)
@settings(max_examples=300)
def test_any_header_is_read_by_the_fast_path_as_json_reads_it(
    entries: list[tuple[int, str, str, list[int], int]], ascii_only: bool, padding: str, slack: int, num_items: int
) -> None:
    """Generated headers written as json.dumps writes them, mostly in the data's order: each entry's
    offsets follow the one before, moved by a few bytes now and then, with its size from its shape
    or a few bytes off; names with escapes, dtypes unknown, shapes of 0, 2 or no dimensions."""
    header: dict[str, Any] = {}
    cursor = 0
    for index, name, dtype, shape, moved in entries:
        size = parse.ITEMSIZE.get(dtype, 1)
        for dim in shape:
            size *= dim
        start = cursor + (moved if moved < 0 and index % 3 == 0 else 0)
        end = start + max(size, 0) + (moved if index % 2 else 0)
        header[f"{index}:{name}"] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
        cursor = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=ascii_only) + padding
    _agrees_with_json(text, max(cursor + slack, 0), num_items)


def _header_of(payload: bytes) -> tuple[str, int]:
    """A payload's safetensors header as text, and the length of the tensor data after it."""
    meta_len = parse._frame(memoryview(payload), len(payload))
    blob = payload[HEADER_SIZE + meta_len :]
    (length,) = struct.unpack_from("<Q", blob)
    return blob[8 : 8 + length].decode(), len(blob) - 8 - length


def test_the_headers_expbuf_writes_take_the_fast_path() -> None:
    """A push as the client encodes it and each experience as the store packs it: the form the
    fast path reads, with the spans JSON reads."""
    experiences = [
        Experience(
            eid=EID(batch=0, task=index, run=0, step=0),
            tokens=torch.arange(5 + index, dtype=torch.int64),
            prompt_length=2,
            logprobs=torch.zeros(3 + index),
            action_mask=torch.ones(3 + index, dtype=torch.bool),
        )
        for index in range(12)
    ]
    payload = trxp.encode(experiences)
    items = trxp.parse(payload)
    for written, num_items in [(payload, len(items)), *((pack_item(item), 1) for item in items)]:
        text, data_len = _header_of(written)
        assert _agrees_with_json(text, data_len, num_items)


# Batches whose items' tensors keep or change their names, dtypes and shapes from one item to the
# next: runs of entries a plan reads, and entries where a plan must miss.
_TENSOR = st.tuples(
    st.sampled_from(["tokens", "logprobs", "action_mask", "multi_modal_inputs:x"]),
    st.sampled_from(["I32", "I64", "F32", "BOOL"]),
    st.sampled_from([(3,), (3,), (3,), (1,), (5,), (2, 2)]),
)
_BATCHES = st.lists(st.lists(_TENSOR, min_size=1, max_size=3), min_size=1, max_size=24)
# A change to a written header: at a fraction of its length, its text replaced by another.
_EDITS = st.lists(
    st.tuples(st.floats(0, 1), st.integers(0, 3), st.sampled_from(["", "0", "1", "9", ",", ":", '"', "}", " ", "x"])),
    max_size=2,
)


def _written_batch(batch: list[list[tuple[str, str, tuple[int, ...]]]]) -> tuple[str, int]:
    """The safetensors header a push of items with these tensors is written with, and its data's length."""
    items = [
        RawItem(
            {"i": index},
            {
                name: RawTensor(dtype, shape, bytes(parse.ITEMSIZE[dtype] * math.prod(shape)))
                for name, dtype, shape in tensors
            },
        )
        for index, tensors in enumerate(batch)
    ]
    return _header_of(trxp.build(items))


@given(_BATCHES, _EDITS, st.integers(-2, 0), st.integers(-1, 1))
@settings(max_examples=400)
def test_a_written_batch_header_changed_or_not_is_read_as_json_reads_it(
    batch: list[list[tuple[str, str, tuple[int, ...]]]], edits: list[tuple[float, int, str]], fewer: int, slack: int
) -> None:
    """A batch's header as written, then edited (a character changed, dropped or added, the text cut
    short, an entry moved or written twice), over its data's length or one off, in a payload of its
    items or fewer: the plans read what JSON and the checks read, and refuse what they refuse."""
    text, data_len = _written_batch(batch)
    num_items = max(len(batch) + fewer, 1)
    unchanged = not edits and slack == 0 and num_items == len(batch)
    for fraction, width, new in edits:
        at = int(fraction * len(text))
        text = text[:at] + new + text[at + width :]
    fast = _agrees_with_json(text, data_len + slack, num_items)
    if unchanged:  # read without JSON where each tensor has 1 dimension and each name one dtype
        tensors = [{name: (dtype, shape) for name, dtype, shape in item} for item in batch]
        dtypes = {(name, dtype) for item in tensors for name, (dtype, _) in item.items()}
        one_dim = all(len(shape) == 1 for item in tensors for _, shape in item.values())
        assert fast or not one_dim or len(dtypes) != len({name for name, _ in dtypes})


@pytest.mark.parametrize("change", ["moved", "twice", "fewer items"])
def test_a_batch_header_out_of_the_writers_order_is_read_as_json_reads_it(change: str) -> None:
    """Entries a plan would read that are out of the writers' order, written twice, or name no item."""
    text, data_len = _written_batch([[("tokens", "I32", (3,))]] * 12)
    entries = text[1:-1].split("},")
    if change == "moved":
        entries.insert(5, entries.pop(2))
    elif change == "twice":
        entries.insert(5, entries[4])
        data_len += 12
    num_items = 10 if change == "fewer items" else 12
    assert not _agrees_with_json("{" + "},".join(entries) + "}", data_len, num_items)


def test_a_batch_of_more_items_than_the_plans_index_is_read_as_json_reads_it() -> None:
    """Item indices past the plans' table of them are read by a match of each entry."""
    text, data_len = _written_batch([[("tokens", "I32", (1,)), ("logprobs", "F32", (2,))]] * 4200)
    assert _agrees_with_json(text, data_len, 4200)


_FIELD_NAMES = st.sampled_from(["eid", "reward", "info", "é", "a" * 40, b"raw", "prompt_length"])
_FIELDS = st.lists(st.tuples(_FIELD_NAMES, st.sampled_from([None, 1.5, 7, "text", [], {"k": 1}])), max_size=6)


@given(st.lists(_FIELDS, min_size=1, max_size=6), st.booleans())
@settings(max_examples=200)
def test_items_whose_fields_change_from_one_to_the_next_are_measured_as_each_alone(
    items: list[list[tuple[Any, Any]]], shared_names: bool
) -> None:
    """The fields of the item before, told by identity, give their names' sizes only where they are
    the same names in the same place: items whose fields are added, dropped, reordered or renamed
    (names the same str objects or equal copies) measure as each measured by a Shape of its own."""
    shape = checks.Shape(trxp.Work(1 << 40), 1 << 40, check_keys=True)
    for index, fields in enumerate(items):
        item = {(name if shared_names or not isinstance(name, str) else "".join(name)): value for name, value in fields}
        alone = checks.Shape(trxp.Work(1 << 40), 1 << 40, check_keys=True)
        alone.item(index, "u", item)
        before = shape.size
        shape.item(index, "u", item)
        assert shape.size - before == alone.size


_FLAT_NAMES = st.sampled_from(["a", "b", "é", "eid", b"raw", 7, frozenset()])
_FLAT_VALUES = st.sampled_from([None, 1.5, True, 0, 2**70, -3, "", "text", "é", b"raw", [], [1], {"k": 1}, object()])


def _outcome_of(item: dict[str, Any]) -> tuple[int, int] | str:
    """The size and work an item measures to, or the refusal's message."""
    work = trxp.Work(1 << 40)
    shape = checks.Shape(work, 1 << 40, check_keys=False)
    try:
        shape.item(0, "u", item)
    except TrxpError as exc:
        return f"refused: {exc}"
    return shape.size, work.used


@given(st.lists(st.tuples(_FLAT_NAMES, _FLAT_VALUES), min_size=1, max_size=6))
@settings(max_examples=300)
def test_a_dict_measures_as_its_names_and_values_laid_out_in_a_list(entries: list[tuple[Any, Any]]) -> None:
    """A dict (measured in one pass over its entries where each value is a plain scalar, else its
    names then its values) takes the size of a list of its names and values, a step fewer for each
    entry, and is refused for the first name or else the first value that is not plain data."""
    value = dict(entries)
    laid_out = [part for pair in value.items() for part in pair]
    measured, listed = _outcome_of({"f": value}), _outcome_of({"f": laid_out})
    if isinstance(listed, str):
        names_first = _outcome_of({"f": [*value.keys(), *value.values()]})
        assert measured == names_first
        assert isinstance(measured, str)
        return
    assert isinstance(measured, tuple)
    assert measured == (listed[0], listed[1] - len(value))


def _measured(items: list[Any], shared: bool) -> tuple[int, int] | str:
    """The size and work a payload's items measure to (or the refusal's message), each container
    told by its id (`shared`) or measured where it is met."""
    work = trxp.Work(1 << 40)
    shape = checks.Shape(work, 1 << 40, check_keys=False)
    shape.shared = shared
    try:
        for index, item in enumerate(items):
            shape.item(index, "u", item)
    except TrxpError as exc:
        return f"refused: {exc}"
    return shape.size, work.used


def _containers_once(value: Any, seen: set[int]) -> bool:
    """Whether no container is met twice in `value` (walked as a tree)."""
    if isinstance(value, (dict, list, tuple)):
        if id(value) in seen:
            return False
        seen.add(id(value))
        inner = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        return all(_containers_once(child, seen) for child in inner)
    return True


_LEAVES = st.sampled_from([None, 1.5, 7, "text", b"raw"])
_PLAIN = st.recursive(
    _LEAVES | st.builds(list) | st.builds(dict),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
    max_leaves=8,
)


@given(st.lists(_PLAIN, min_size=1, max_size=4), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=3))
@settings(max_examples=300)
def test_the_scans_verdict_of_shared_containers_measures_as_each_container_told_by_its_id(
    values: list[Any], shares: list[tuple[int, int]]
) -> None:
    """A pickle whose scan finds no container pushed again (a memo read or DUP of an entry that may
    be one) unpickles to metadata where each container is referenced once, which the measure then
    walks without telling them by their ids: the same size and work, or the same refusal, as the
    measure that tells every container by its id; items sharing containers are told by their ids."""
    items: list[Any] = [{"f": value} for value in values]
    for source, target in shares:  # one item's value placed in another as well: shared when a container
        items[target % len(items)][f"s{source}"] = values[source % len(values)]
    meta = pickle.dumps({"version": 1, "num_items": len(items), "items": items}, protocol=5)
    shared = pickles.scan_pickle(memoryview(meta), trxp.Work(1 << 40))
    loaded = pickle.loads(meta)["items"]
    if not shared:
        assert _containers_once(loaded, set())
    assert _measured(loaded, shared) == _measured(loaded, True)


@pytest.mark.parametrize(
    ("meta", "shared"),
    [
        (b"\x80\x05}(\x8c\x01a]2\x86u.", True),  # DUP of an empty list
        (b"\x80\x05}(\x8c\x01a]\x94\x8c\x01bh\x00u.", True),  # a list read back from the memo
        (b"\x80\x05}(\x8c\x01a\x94]\x8c\x01bh\x00u.", False),  # a key read back from the memo
        (b"\x80\x05}(\x8c\x01a]\x85\x94\x8c\x01bh\x00u.", True),  # a tuple read back from the memo
    ],
)
def test_the_scan_tells_a_container_pushed_again(meta: bytes, shared: bool) -> None:
    assert pickles.scan_pickle(memoryview(meta), trxp.Work(1 << 40)) is shared
    assert _containers_once(pickle.loads(meta), set()) is not shared


def test_a_clients_batch_has_no_container_pushed_again() -> None:
    """A batch as a client writes it (its items' field names and an eid's suffix read back from the
    memo) takes the measure that does not tell containers by their ids."""
    items = [Experience(tokens=torch.arange(4), prompt_length=1, eid=EID(batch=0, task=i, run=0)) for i in range(4)]
    payload = trxp.encode(items)
    (meta_len,) = struct.unpack_from("<Q", payload, 5)
    assert not pickles.scan_pickle(memoryview(payload)[HEADER_SIZE : HEADER_SIZE + meta_len], trxp.Work(1 << 40))
