"""The pickle scan replays segments it met before (trxp.codec.pickles._Segment) instead of walking
their opcodes again: with or without replaying, every pickle gets the same verdict, with the
same message, and counts the same work. These tests change the scan's limits and watch its
recording, which only its source form allows: they run on pickles.py as written, the compiled
scan being held to its verdicts by test_native.py."""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_trxp_fuzz import FUZZ

from expbuf.client.native import source_module

pickles = source_module("expbuf.client.trxp.codec.pickles")

# Plain opcodes (with arguments) that an edit inserts or writes over: memo reads and writes,
# marks, closes, values, and some that are not plain data.
PIECES = [b"N", b"]", b"}", b")", b"(", b"a", b"e", b"s", b"u", b"t", b"0", b"1", b"2", b"\x85", b"\x94", b"K\x05"]
PIECES += [b"h\x00", b"h\x03", b"h\x30", b"h\xff", b"q\x00", b"r\x01\x00\x00\x00", b"\x8c\x03abc", b"C\x02xy", b"c"]
EDITS = ["over", "in", "out"]


def verdict(meta: bytes) -> tuple[str, Any]:
    work = pickles.Work(1 << 40)
    try:
        pickles.scan_pickle(memoryview(meta), work)
    except pickles.TrxpError as exc:
        return "refused", str(exc)
    return "passed", work.used


def both_ways(meta: bytes) -> tuple[tuple[str, Any], tuple[str, Any]]:
    """The verdict with segments replayed, and with every opcode walked."""
    replayed = verdict(meta)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pickles, "_SEGMENTS_RECORDED", 0)
        walked = verdict(meta)
    return replayed, walked


def batch(count: int, info: dict[str, Any], protocol: int = 5, *, memo: bool = True) -> bytes:
    """A pickled batch of experiences as Trinity-RFT writes them (the same fields in each), or
    without memo, as the store splices a sampled batch."""
    eids = [{"batch": 1, "task": i // 8, "run": i % 8, "step": 0, "suffix": f"r{i % 8}"} for i in range(count)]
    items = [{"eid": eid, "reward": 1.0, "info": dict(info)} for eid in eids]
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=protocol)
    pickler.fast = not memo
    pickler.dump({"version": 1, "num_items": count, "items": items})
    return buffer.getvalue()


@pytest.mark.parametrize("memo", [True, False])
def test_a_batch_of_experiences_passes_with_the_same_work(monkeypatch: pytest.MonkeyPatch, memo: bool) -> None:
    recorded: list[pickles._Segment] = []
    record = pickles._Segment.record.__func__

    def counting(cls: type[pickles._Segment], *args: Any) -> pickles._Segment | None:
        segment = record(cls, *args)
        recorded.extend([segment] if segment else [])
        return segment

    monkeypatch.setattr(pickles._Segment, "record", classmethod(counting))
    data = batch(256, {"model_version": 3, "tags": ["a", "b"]}, memo=memo)
    replayed, walked = both_ways(data)
    assert replayed == walked
    assert replayed[0] == "passed"
    compiled = [segment.pattern for segment in recorded if segment.pattern is not None]
    assert max(len(pattern.findall(data)) for pattern in compiled) > 200  # most items were replayed


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (b"h\x00", "dict keys must be str or bytes"),  # memo entry 0 is the outer dict
        (b"h\x01", None),  # memo entry 1 is the str 'version': a key
        (b"\x93N", "opcode STACK_GLOBAL is not plain data"),
    ],
)
def test_an_edit_in_a_late_repeat_gets_the_same_verdict(key: bytes, message: str | None) -> None:
    meta = batch(200, {"model_version": 3})
    position = meta.rindex(b"}\x94(h") + 3  # the first key of the last item, a memo read
    replayed, walked = both_ways(meta[:position] + key + meta[position + 2 :])
    assert replayed == walked
    assert (replayed[0], message) == ("passed", None) or message in replayed[1]


def test_a_memo_entry_made_in_a_replayed_segment_keeps_what_it_is() -> None:
    """A dict memoized inside a replayed item, read back as a dict key, is refused."""
    meta = batch(100, {"model_version": 3})
    memo, dicts = 0, []
    previous = None
    for opcode, _, _ in pickletools.genops(meta):
        if opcode.name == "MEMOIZE":
            if previous == "EMPTY_DICT":
                dicts.append(memo)
            memo += 1
        previous = opcode.name
    index = max(d for d in dicts if d < 256)  # the info dict of a late item, read with BINGET
    edited = meta[: -len(b"u.")] + b"h" + bytes([index]) + b"K\x01u."
    replayed, walked = both_ways(edited)
    assert replayed == walked == ("refused", "metadata: dict keys must be str or bytes")


@given(
    st.integers(20, 120),
    st.sampled_from([3, 4, 5]),
    st.booleans(),
    st.lists(
        st.tuples(st.floats(0.3, 1.0), st.sampled_from(PIECES), st.sampled_from(["over", "in", "out"])), max_size=3
    ),
)
@FUZZ
def test_edited_batches_get_the_same_verdict(
    count: int, protocol: int, memo: bool, edits: list[tuple[float, bytes, str]]
) -> None:
    data = bytearray(batch(count, {"model_version": 3, "m": [{"role": "user"}]}, protocol, memo=memo))
    for where, piece, how in edits:
        position = min(int(where * len(data)), len(data) - 1)
        if how == "over":
            data[position : position + len(piece)] = piece
        elif how == "in":
            data[position:position] = piece
        else:
            del data[position : position + len(piece)]
    replayed, walked = both_ways(bytes(data))
    assert replayed == walked


# A batch of 2000 dicts keyed by memo reads, each with a memoized str and memoized itself:
# the scan replays all but the first few. The verdicts and work below are those of the scan
# that walks every opcode (no fast paths, no segments), pinned.
_HEAD = b"\x80\x05]\x94(" + b"".join(b"\x8c\x01" + bytes([97 + i]) + b"\x94" for i in range(12)) + b"N\x94"
_SEGMENT = b"(h\x01K\x01h\x02\x8c\x03abc\x94d\x94"


def _repeats(edit: bytes | None = None, at: int = 1500) -> bytes:
    segments = [_SEGMENT] * 2000
    if edit is not None:
        segments[at] = edit
    return _HEAD + b"".join(segments) + b"e."


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        (_repeats(), ("passed", 16032)),
        (_repeats(_SEGMENT.replace(b"h\x01", b"h\x0d")), ("refused", "metadata: dict keys must be str or bytes")),
        (_repeats(_SEGMENT.replace(b"h\x02", b"h\x0f")), ("refused", "metadata: dict keys must be str or bytes")),
        (_repeats(_SEGMENT.replace(b"h\x02", b"h\x0e")), ("passed", 16032)),
        (_repeats(_SEGMENT.replace(b"K\x01", b"K\x01q\x01")), ("refused", "metadata: dict keys must be str or bytes")),
        (_repeats(b"(\x94" + _SEGMENT[1:]), ("refused", "metadata: pickle MEMOIZE finds an empty stack")),
        (_repeats(_SEGMENT.replace(b"\x8c\x03abc", b"\x8c\x04abcd")), ("passed", 16032)),
        (
            _repeats(_SEGMENT.replace(b"h\x01", b"j\xff\xff\xff\x00")),
            ("refused", "metadata: pickle memo index 16777215 out of range"),
        ),
        (_repeats(b"(" + _SEGMENT + b"l"), ("passed", 16034)),
        (_repeats(_SEGMENT.replace(b"d", b"N0d")), ("passed", 16034)),
        (
            _repeats()[: len(_HEAD) + 1800 * len(_SEGMENT) + 8],
            ("refused", "metadata: pickle is truncated in SHORT_BINUNICODE"),
        ),
        (_repeats()[: len(_HEAD) + 1800 * len(_SEGMENT) + 7], ("refused", "metadata: pickle is truncated (no STOP)")),
    ],
)
def test_a_late_repeat_that_differs_gets_the_walks_verdict(meta: bytes, expected: tuple[str, Any]) -> None:
    """An edit in a repeat long after replaying began: a read of a memo entry that is no key,
    or one a replayed segment made, a PUT that rewrites an entry replayed segments read, a
    MEMOIZE with nothing to memoize, another length, a nested MARK, a truncation."""
    assert verdict(meta) == expected


# A memo written past its next index (PUT 5 first), then MEMOIZE: the unpickler writes each MEMOIZE
# at its count of entries, which may be an index a PUT wrote. Each case: the opcodes after PROTO 4,
# and the scan's refusal (None where it passes and the unpickler reads the pickle).
_SPARSE_MEMOS = [
    (b"N0N0\x8c\x01aq\x050}h\x05Ns.", None),  # 'a' at 5, read back as a key
    (b"N0N0\x8c\x01aq\x050]\x940}h\x01Ns.", "dict keys must be str or bytes"),  # MEMOIZE's list at 1
    (b"N0N0\x8c\x01aq\x050]\x940}h\x05Ns.", None),
    (b"N0N0\x8c\x01aq\x050]\x940h\x00.", "reads memo entry 0, which was never stored"),
    (b"\x8c\x01aq\x010]\x940}h\x01Ns.", "dict keys must be str or bytes"),  # MEMOIZE writes over 1
    (b"\x8c\x01aq\x010\x8c\x01b\x940}h\x01Ns.", None),  # 'b' over 'a' at 1
    (b"\x8c\x01aq\x010\x8c\x01b\x940]\x94}h\x02Ns.", "reads memo entry 2, which was never stored"),
    (b"\x8c\x01aq\x010\x8c\x01b\x940]\x940}h\x01Ns.", "dict keys must be str or bytes"),  # the list over 'b'
    (b"]q\x000\x8c\x01ar\x03\x00\x00\x000}h\x03Ns.", None),  # in order, then past it (LONG_BINPUT)
    (b"]q\x000\x8c\x01ar\x03\x00\x00\x000}h\x00Ns.", "dict keys must be str or bytes"),
    (b"]q\x000\x8c\x01ar\x03\x00\x00\x000h\x02.", "reads memo entry 2, which was never stored"),
    (b"]q\x000\x8c\x01aq\x000}h\x00Ns.", None),  # PUT over an entry, in order
    (b"N0N0\x8c\x01aq\x050h\xff.", "BINGET reads memo entry 255, which was never stored"),  # past the ops read
]


@pytest.mark.parametrize(("ops", "refusal"), _SPARSE_MEMOS, ids=[repr(ops) for ops, _ in _SPARSE_MEMOS])
def test_a_memo_written_past_its_next_index_is_followed_as_the_unpickler_follows_it(
    ops: bytes, refusal: str | None
) -> None:
    meta = b"\x80\x04" + ops
    outcome, message = verdict(meta)
    if refusal is None:
        assert outcome == "passed", message
        pickle.loads(meta)
    else:
        assert outcome == "refused"
        assert refusal in message
        with pytest.raises((TypeError, pickle.UnpicklingError, KeyError)):
            pickle.loads(meta)
