"""The rows a table keeps per batch of groups (disk/rows/): every row reads back as it was written,
through its decoder and through the views that read a run of its columns from a memoryview."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expbuf.server.store.disk.records import Counted, Lease
from expbuf.server.store.disk.rows import (
    SEGMENT_GROUPS,
    Group,
    GroupRef,
    Member,
    MemberBlock,
    PendingHead,
    RowLease,
    RunRow,
    SegmentView,
    SegState,
    append_groups,
    decode_member_rows,
    directory_entry,
    encode_member_rows,
    encode_members,
    encode_segment,
    member_rows,
    uid_hashes,
)
from expbuf.server.store.disk.rows.members import _COLUMNS, _stored, packed
from expbuf.server.store.schema.states import STATES

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63) + 1, 2**63 - 1)  # -2^63 stands for an absent version
number = st.floats(allow_nan=False)
text = st.text(max_size=12)
fragments_counts = st.integers(0, 2**20)  # a head's fragments, which a spill adds one to

members = st.builds(
    Member,
    uid=text,
    digest=st.binary(min_size=16, max_size=16),
    size=u64,
    seq=u64,
    created=number,
    step=i64,
    response_length=u32,
    generated=u32,
    version=st.none() | i64,
    reward=st.none() | number,
    priority=number,
    advantage=st.none() | number,
    shaped_reward=st.none() | number,
    segments=st.lists(i64, max_size=6).map(tuple),
)
groups = st.builds(
    Group,
    key=text,
    created=number,
    members=st.lists(members, min_size=1, max_size=5),
    priority=number,
    version=st.none() | i64,
    partial=st.booleans(),
    failed=st.dictionaries(text, text, max_size=2).map(lambda d: tuple(d.items())),
)
# Groups of one whose key is their uid: a table grouped by none, whose segment keeps no keys.
singles = members.map(lambda m: Group(key=m.uid, created=m.created, members=[m]))


@given(st.sampled_from(_COLUMNS), st.data())
@settings(max_examples=300)
def test_a_column_packed_is_each_value_packed(column: tuple[str, str], data: st.DataObject) -> None:
    """A member column packed (`packed`: a value repeated throughout packed once, absent values as
    their number) is each value packed, bit for bit: a zero beside -0.0, which it equals, is not
    taken for a repeat."""
    name, code = column
    pool = [0.0, -0.0, 2.5, math.nan, 7.0, None] if code == "d" else [0, 1, 7, None]
    if name not in {"version", "reward", "advantage", "shaped_reward"}:
        pool.remove(None)
    values = data.draw(st.lists(st.sampled_from(pool), max_size=6))
    assert packed(name, code, values) == struct.pack(f"<{len(values)}{code}", *_stored(name, values))


@given(st.lists(members, max_size=8))
@settings(max_examples=80, deadline=None)
def test_a_member_block_reads_back_whole_and_by_ranges(found: list[Member]) -> None:
    encoded = encode_members(found)
    block = MemberBlock(memoryview(b"head" + encoded + b"tail"), 4)
    assert block.count == len(found) and block.end == 4 + len(encoded)
    assert block.members() == found
    for lo in range(len(found) + 1):
        for hi in range(lo, len(found) + 1):
            assert block.uids(lo, hi) == [m.uid for m in found[lo:hi]]
            assert list(block.digests(lo, hi)) == [m.digest for m in found[lo:hi]]
            assert block.uid_bytes(lo, hi) == [m.uid.encode() for m in found[lo:hi]]
            assert block.keys(b"\x00\x00\x00\x07", lo, hi) == [
                b"\x00\x00\x00\x07" + m.uid.encode() for m in found[lo:hi]
            ]
            assert list(block.column("reward", lo, hi)) == [m.reward for m in found[lo:hi]]
            assert list(block.column("version", lo, hi)) == [m.version for m in found[lo:hi]]
            assert list(block.column("advantage", lo, hi)) == [m.advantage for m in found[lo:hi]]
            assert list(block.column("shaped_reward", lo, hi)) == [m.shaped_reward for m in found[lo:hi]]
            assert list(block.column("size", lo, hi)) == [m.size for m in found[lo:hi]]
            assert block.members(lo, hi) == found[lo:hi]  # one member alone read field by field
    assert [block.segments(i) for i in range(len(found))] == [m.segments for m in found]


def test_a_member_blocks_uids_far_into_it_read_back_as_near_its_start() -> None:
    """A block's uids, their bytes and their payloads' keys, read a range at a time, are the members'
    wherever the range lies: near the block's start they are cut from its uid bytes copied from the
    first, far into it (long uids before a few members) from the range's bytes alone; a uid not of
    ASCII among them as well as none."""
    for odd in ("", "é"):
        uids = [f"{odd if i == 7 else ''}{i:03d}/" + "x" * (i % 5 * 60) for i in range(40)]
        found = [
            Member(uid, bytes(16), 1, i, 0.0, 0, 1, 1, None, None, 0.0, None, None, ()) for i, uid in enumerate(uids)
        ]
        block = MemberBlock(encode_members(found))
        for lo in range(len(found) + 1):
            for hi in range(lo, len(found) + 1):
                assert block.uids(lo, hi) == uids[lo:hi]
                assert block.uid_bytes(lo, hi) == [uid.encode() for uid in uids[lo:hi]]
                assert block.keys(b"T", lo, hi) == [b"T" + uid.encode() for uid in uids[lo:hi]]


@given(st.lists(groups, min_size=1, max_size=6) | st.lists(singles, min_size=1, max_size=SEGMENT_GROUPS), u64, number)
@settings(max_examples=80, deadline=None)
def test_a_segment_reads_back_group_by_group_and_run_by_run(found: list[Group], rseq0: int, completed: float) -> None:
    view = SegmentView(memoryview(encode_segment(found, rseq0, completed)))
    assert (view.groups, view.rseq0, view.completed) == (len(found), rseq0, completed)
    for g, group in enumerate(found):
        read = view.group(g)
        assert read._replace(members=list(read.members)) == group._replace(members=list(group.members))
        lo, hi = view.span(g)
        assert view.members.uids(lo, hi) == [m.uid for m in group.members]
    assert view.keys(0, len(found)) == [g.key for g in found]
    for places in (range(len(found)), range(1, len(found)), range(len(found) - 1, -1, -1), [len(found) - 1, 0]):
        starts, stops = view.bounds(places)
        assert list(zip(starts, stops, strict=True)) == [view.span(g) for g in places]
    assert list(view.created(0, len(found))) == [g.created for g in found]
    assert list(view.priorities(0, len(found))) == [g.priority for g in found]
    assert view.versions(0, len(found)) == [g.version for g in found]
    assert view.members.members() == [m for g in found for m in g.members]


@given(
    st.lists(groups, min_size=1, max_size=4) | st.lists(singles, min_size=1, max_size=8),
    st.lists(groups, min_size=1, max_size=4) | st.lists(singles, min_size=1, max_size=8),
    u64,
    number,
)
@settings(max_examples=120, deadline=None)
def test_groups_appended_to_a_segment_make_the_segment_of_them_all(
    first: list[Group], then: list[Group], rseq0: int, completed: float
) -> None:
    """A segment grown by the groups after it (a fresh tail segment and a push's groups) holds the
    bytes of one segment of them all, whatever each side keeps: keys or none, failed runs, version
    segments, absent values."""
    view = SegmentView(memoryview(encode_segment(first, rseq0, completed)))
    assert append_groups(view, then) == encode_segment([*first, *then], rseq0, completed)


def test_a_segment_of_groups_of_one_keeps_no_keys_beside_the_uids() -> None:
    member = Member("0/0/0/0/a", b"d" * 16, 8192, 0, 1.0, 0, 10, 10)
    one = encode_segment([Group(key=member.uid, created=1.0, members=[member])], 0, 1.0)
    keyed = encode_segment([Group(key="0/0", created=1.0, members=[member])], 0, 1.0)
    assert len(keyed) == len(one) + 4 * 2 + len("0/0")
    assert SegmentView(one).keys(0, 1) == [member.uid]


def test_a_segment_refuses_no_groups_a_short_digest_and_another_layout() -> None:
    with pytest.raises(ValueError, match="1 to 65535 groups"):
        encode_segment([], 0, 0.0)
    with pytest.raises(ValueError, match="16 bytes"):
        encode_members([Member("u", b"short", 1, 0, 0.0, 0, 0, 0)])
    member = Member("u", b"d" * 16, 1, 0, 0.0, 0, 0, 0)
    data = bytearray(encode_segment([Group(key="u", created=0.0, members=[member])], 0, 0.0))
    data[0] = 2
    with pytest.raises(ValueError, match="rows 2"):
        SegmentView(bytes(data))


@given(
    st.lists(st.sampled_from(STATES), min_size=1, max_size=SEGMENT_GROUPS),
    st.integers(0, 300),
    st.data(),
)
@settings(max_examples=80, deadline=None)
def test_a_segments_state_changes_in_place_and_reads_back(states: list, count: int, data: st.DataObject) -> None:
    state = SegState.new(states, count)
    assert state.states(0, len(states)) == states and not state.any_flags and state.retired is None
    assert all(state.times(g) == 0 and state.lease(g) == bytes(8) for g in range(len(states)))
    for g in data.draw(st.lists(st.integers(0, len(states) - 1), max_size=4)):
        state.set_state(g, data.draw(st.sampled_from(STATES)))
        state.set_times(g, data.draw(u32))
        state.set_lease(g, data.draw(st.binary(min_size=8, max_size=8)))
    flagged = data.draw(st.dictionaries(st.integers(0, count - 1), st.integers(0, 255), max_size=3)) if count else {}
    for i, flags in flagged.items():
        state.set_flags(i, flags)
    state.retired = data.draw(st.none() | number)
    read = SegState.decode(memoryview(state.encode()))
    assert read.encode() == state.encode()
    assert read.states(0, len(states)) == [state.state(g) for g in range(len(states))]
    assert [read.times(g) for g in range(len(states))] == [state.times(g) for g in range(len(states))]
    assert [read.lease(g) for g in range(len(states))] == [state.lease(g) for g in range(len(states))]
    assert [read.flags(i) for i in range(count)] == [flagged.get(i, 0) for i in range(count)]
    assert read.any_flags == any(flagged.values())
    assert read.retired == state.retired


def test_a_segments_state_refuses_a_wrong_size_and_a_lease_tag_not_of_8_bytes() -> None:
    state = SegState.new(STATES[:2], 3)
    with pytest.raises(ValueError, match="for 2 groups and 3 members"):
        SegState.decode(state.encode() + b"\0")
    with pytest.raises(ValueError, match="8 bytes"):
        state.set_lease(0, b"short")


@given(u64, st.integers(0, 2**16 - 1))
def test_a_group_ref_reads_back_from_the_directory(seg: int, index: int) -> None:
    encoded = GroupRef(seg, index).encode()
    assert len(encoded) == 12
    assert directory_entry(memoryview(encoded)) == GroupRef(seg, index)


def test_member_rows_keep_their_stored_form() -> None:
    """A pending group's member rows as data formats 10 and 11 store them, field by field: a count,
    then each member's row (absent numbers NaN, an absent version -2^63), uid and segments; after the
    rows a head held before, read back as they were."""
    first = Member("a", b"d" * 16, 5, 6, 7.5, -8, 9, 10, None, None, 0.25, None, None, ())
    second = Member("bé", b"e" * 16, 1, 2, 3.0, 4, 5, 6, 7, 0.5, 1.5, -2.0, 2.5, (11, -12))
    row = struct.Struct("<16sQQdqIIqddddHI")
    expected = b"".join([
        struct.pack("<I", 2),
        row.pack(b"d" * 16, 5, 6, 7.5, -8, 9, 10, -(2**63), math.nan, 0.25, math.nan, math.nan, 1, 0), b"a",
        row.pack(b"e" * 16, 1, 2, 3.0, 4, 5, 6, 7, 0.5, 1.5, -2.0, 2.5, 3, 2), "bé".encode(),
        struct.pack("<2q", 11, -12),
    ])  # fmt: skip
    assert encode_member_rows([second], onto=encode_member_rows([first])) == expected
    assert decode_member_rows(expected) == [first, second]


@given(
    number,
    st.lists(members, max_size=10),
    fragments_counts,
    st.dictionaries(text, text, max_size=3),
    st.booleans(),
    st.none() | u64,
    st.none() | st.tuples(number, st.none() | i64),
)
def test_a_pending_head_reads_back_from_the_directory(
    created: float,
    rows: list[Member],
    fragments: int,
    failed: dict[str, str],
    partial: bool,
    queued: int | None,
    placed: tuple[float, int | None] | None,
) -> None:
    """Every part of a head (its rows kept in it or spilled to a fragment, failed runs, partial, its
    place in the compute queue, its priority and version) reads back as it was."""
    head = PendingHead(created=created, fragments=fragments, failed=failed, partial=partial, queued=queued)
    head.placed = placed
    spilled = head.add(rows)
    assert directory_entry(memoryview(head.encode())) == head
    inline = decode_member_rows(head.inline) if head.inline else []
    assert (decode_member_rows(spilled) if spilled is not None else []) + inline == rows


@given(
    number,
    st.lists(members, min_size=1, max_size=12),
    st.lists(members, min_size=1, max_size=3),
    fragments_counts,
    st.dictionaries(text, text, max_size=2),
    st.none() | u64,
)
def test_a_push_adds_to_a_plain_head_as_it_adds_to_a_decoded_one(
    created: float,
    there: list[Member],
    new: list[Member],
    fragments: int,
    failed: dict[str, str],
    queued: int | None,
) -> None:
    """PendingHead.added makes the bytes of a head decoded, added to and encoded again (`add`), where
    the head is plain (members, no failed runs, no place in the compute queue) and the new rows stay
    in it; `plain` reads its count and time, `holds` finds its members' uids' hashes (none of the new
    members' whose uid is not among them); any other head is not plain. Of a plain head that keeps
    every member itself, `outline` reads when it opened and when its first member was pushed, and
    `plain_rows` its members; of any other, neither."""
    head = PendingHead(created=created, fragments=fragments, failed=failed, queued=queued)
    head.add(there)
    raw = head.encode()
    plain = PendingHead.plain(raw)
    kept = plain is not None and not head.fragments
    assert PendingHead.outline(raw) == ((created, there[0].created) if kept else None)
    assert PendingHead.plain_rows(raw, len(there)) == (there if kept else None)
    if failed or queued is not None:
        assert plain is None
        return
    assert plain == (len(there), created)
    assert all(PendingHead.holds(raw, len(there), [member.uid]) for member in there)
    known = {member.uid for member in there}
    assert PendingHead.holds(raw, len(there), [m.uid for m in new]) == any(m.uid in known for m in new)
    spilled = head.add(new)
    added = PendingHead.added(raw, b"".join(member_rows(new)), b"".join(uid_hashes([m.uid for m in new])))
    assert added == (None if spilled is not None else head.encode())
    assert PendingHead.plain(PendingHead(created=created).encode()) is None  # no member


@given(
    st.lists(st.lists(members, min_size=1, max_size=16), min_size=1, max_size=5),
    st.lists(st.lists(members, min_size=1, max_size=3), min_size=5, max_size=5),
    st.integers(-2, 3),
    st.lists(
        st.sampled_from(["none"] * 5 + ["failed", "queued", "all kept", "shared", "cut short", "absent"]),
        min_size=5,
        max_size=5,
    ),
)
def test_heads_a_push_keeps_pending_are_found_together_as_each_alone(
    there: list[list[Member]], new: list[list[Member]], room: int, unlike: list[str]
) -> None:
    """PendingHead.staying finds, over many directory entries at once, what `plain` and `holds` find
    of each: the heads that are plain, keep their rows themselves, stay pending (fewer than `size`
    members after) and hold none of their new uids, with those uids' hashes. `unlike` makes a head
    one that is not so (a failed run, a place in the compute queue, every row spilled to a fragment,
    a new uid already among its members, its hashes cut short, a group not there)."""
    new = new[: len(there)]
    size = max(0, max(map(len, there)) + 3 + room)  # room to spare after the push, or none
    heads = [PendingHead(created=1.0) for _ in there]
    for head, rows in zip(heads, there, strict=True):
        head.add(rows)
    for at, (head, how) in enumerate(zip(heads, unlike, strict=False)):
        if how == "failed":
            head.failed = {"x": "timeout"}
        elif how == "queued":
            head.queued = 7
        elif how == "all kept":
            head.inline, head.fragments = b"", 1
        elif how == "shared":
            new[at] = [*new[at], there[at][0]]
    raws: list[bytes | None] = [head.encode() for head in heads]
    for at, how in enumerate(unlike[: len(raws)]):
        if how == "cut short":
            raws[at] = bytes(raws[at] or b"")[: PendingHead._HEAD.size + 4]
        elif how == "absent":
            raws[at] = None
    uids = [member.uid for rows in new for member in rows]
    found, hashes = PendingHead.staying(raws, [len(rows) for rows in new], size, uids)
    staying = [
        at
        for at, (raw, head, rows) in enumerate(zip(raws, heads, new, strict=True))
        if raw is not None
        and (p := PendingHead.plain(raw)) is not None
        and head.inline
        and p[0] + len(rows) < size
        and not PendingHead.holds(raw, p[0], [m.uid for m in rows])
    ]
    assert found == staying
    assert hashes == [b"".join(uid_hashes([m.uid for m in new[at]])) for at in staying]


@given(number, st.lists(st.lists(members, min_size=1, max_size=16), min_size=1, max_size=4))
def test_heads_a_push_opens_are_made_together_as_each_alone(created: float, new: list[list[Member]]) -> None:
    """PendingHead.opened makes the bytes a new head of each group makes with its first members added
    (`add`, `encode`), for them all at once; None where one's rows spill into a fragment."""
    heads = [PendingHead(created=created) for _ in new]
    spilled = [head.add(rows) for head, rows in zip(heads, new, strict=True)]
    rows = [b"".join(member_rows(added)) for added in new]
    hashes = [b"".join(uid_hashes([member.uid for member in added])) for added in new]
    made = PendingHead.opened(created, rows, hashes, [len(added) for added in new])
    assert made == (None if any(part is not None for part in spilled) else [head.encode() for head in heads])


def test_a_directory_entry_of_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind 9"):
        directory_entry(b"\x09" + bytes(11))


runs = st.builds(RunRow, seg=u64, first=st.integers(0, 2**16 - 1), length=st.integers(0, 2**16 - 1))


@given(
    u32,
    st.lists(runs, max_size=6),
    st.none() | number,
    text,
    st.none() | st.builds(Counted, experiences=u64, nbytes=u64, tokens_masked=u64),
)
def test_a_lease_of_runs_reads_back(
    table_id: int, found: list[RunRow], expires: float | None, owner: str, counted: Counted | None
) -> None:
    lease = RowLease(table_id=table_id, runs=found, expires=expires, owner=owner, counted=counted)
    assert RowLease.decode(memoryview(lease.encode())) == lease
    assert [RunRow.decode(run.encode()) for run in found] == found


def test_a_lease_of_groups_keeps_its_bytes_beside_the_lease_of_runs() -> None:
    """records.Lease and RowLease write their head and count with the same code; a lease of groups
    is written as it always was."""
    lease = Lease(table_id=3, groups=["a", "bc"], expires=None, owner="o", counted=Counted(1, 2, 3))
    before = struct.pack("<Id", 3, math.nan) + b"\x01\x00o" + struct.pack("<I", 2) + b"\x01\x00a\x02\x00bc"
    assert lease.encode() == before + struct.pack("<QQQ", 1, 2, 3)
    assert Lease.decode(lease.encode()) == lease
    lease.counted, lease.expires = None, 5.0
    assert Lease.decode(lease.encode()) == lease
