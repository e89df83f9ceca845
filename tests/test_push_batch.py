"""A rows table's push stores a batch a list at a time (issue 64): its entries cut by group, its
payloads kept as they came, its groups' views and segment groups made in C passes. Each pass must
give what the step an entry (or a group) it replaces gave; and a push of whole groups, of one size or
of mixed sizes, stores what a push cut group by group stores."""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from collections import defaultdict
from pathlib import Path
from types import MappingProxyType
from unittest import mock

import lmdb
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from expbuf.client import trxp
from expbuf.client.schema.experience import ids_of
from expbuf.client.trxp.codec import partial
from expbuf.server.store import Entry, Store
from expbuf.server.store.core.table_state.pending_reads import holding_payloads, uids_under
from expbuf.server.store.core.table_state.views import RowGroup, row_groups
from expbuf.server.store.core.verbs.rows import pending as row_pending
from expbuf.server.store.core.verbs.rows import segments
from expbuf.server.store.disk import chunk_heads, chunked, shared_prompts
from expbuf.server.store.disk.chunk_heads import HEAD_MAGIC, ZSTD_MAGIC
from expbuf.server.store.disk.rows import Member
from expbuf.server.store.disk.shared_prompts import REF_MAGIC
from expbuf.server.store.rules import pushes
from expbuf.server.store.schema.states import PENDING, READY
from expbuf.server.store.schema.table_config import TableConfig

from helpers import StoppedClock, group_items


def _member(uid: str, priority: float, version: int | None) -> Member:
    return Member(uid, bytes(16), 10, 0, 1.0, 0, 3, 3, version, 0.5, priority)


members = st.builds(
    _member,
    st.text("abc/", min_size=1, max_size=4),
    st.floats(-5, 5, allow_nan=False),
    st.none() | st.integers(0, 9),
)


@given(st.lists(st.integers(0, 5), max_size=40))
@settings(max_examples=200, deadline=None)
def test_a_push_cut_by_group_at_once_is_cut_as_entry_by_entry(keys: list[int]) -> None:
    """Entries cut by group (whole groups of one size in C, others entry by entry) are each group's
    entries in push order, the groups in the order they first appear."""
    entries = [f"e{at}" for at in range(len(keys))]
    names = [f"g{key}" for key in keys]
    each: dict[str, list[str]] = defaultdict(list)
    for entry, gkey in zip(entries, names, strict=True):
        each[gkey].append(entry)
    cut = pushes._by_group(entries, names)  # type: ignore[arg-type]
    assert [(gkey, list(found)) for gkey, found in cut.items()] == list(each.items())


@given(st.lists(st.integers(1, 4), max_size=12), st.booleans())
@settings(max_examples=100, deadline=None)
def test_whole_groups_one_after_the_other_are_cut_so(sizes: list[int], same: bool) -> None:
    """Whole groups one after the other, all of one size or not, are cut as they were pushed."""
    sizes = [sizes[0]] * len(sizes) if same and sizes else sizes
    names = [f"g{at}" for at, size in enumerate(sizes) for _ in range(size)]
    entries = [f"e{at}" for at in range(len(names))]
    cut = pushes._by_group(entries, names)  # type: ignore[arg-type]
    ends = list(itertools.accumulate(sizes, initial=0))
    assert {gkey: list(found) for gkey, found in cut.items()} == {
        f"g{at}": entries[a:b] for at, (a, b) in enumerate(itertools.pairwise(ends))
    }


@given(st.lists(st.tuples(st.sampled_from(["payload", "head", "zstd", "ref", "large"]), st.integers(0, 2048))))
@settings(max_examples=150, deadline=None)
def test_payloads_kept_whole_at_once_only_where_each_is(cases: list[tuple[str, int]]) -> None:
    """A push's payloads are kept as they came, with no step each (chunked.kept_whole), only where
    stored_value would keep each: none a head, none larger than a chunk, none with a prompt to share."""
    magic = {"payload": b"TRXP", "head": HEAD_MAGIC, "zstd": ZSTD_MAGIC, "ref": REF_MAGIC, "large": b"TRXP"}
    blobs = [magic[kind] + bytes(64 if kind == "large" else 8) for kind, _ in cases]
    prompts = [prompt for _, prompt in cases]
    with mock.patch.object(chunk_heads, "CHUNK_BYTES", 32):
        each = all(
            not chunk_heads.is_head(blob) and len(blob) <= chunk_heads.CHUNK_BYTES and prompt < shared_prompts.MIN_BYTES
            for blob, prompt in zip(blobs, prompts, strict=True)
        )
        assert chunked.kept_whole(blobs, iter(prompts)) == each
    assert chunk_heads.any_head(blobs) == any(map(chunk_heads.is_head, blobs))


@given(st.lists(st.lists(members, min_size=1, max_size=3), max_size=10), st.booleans(), st.booleans())
@settings(max_examples=150, deadline=None)
def test_groups_made_at_once_are_those_made_one_by_one(rows: list[list[Member]], ones: bool, failed: bool) -> None:
    """The views of groups a push opened (row_groups) and their groups as segments keep them
    (segments.wholes) are each group's own (RowGroup, segments.whole), groups of one made in C."""
    grouped = [tuple(group[:1]) if ones else tuple(group) for group in rows]
    keys = [f"k{at}" for at in range(len(grouped))]
    views = row_groups(keys, PENDING, grouped, 7.0)
    assert views == [RowGroup(key, PENDING, group, created=7.0) for key, group in zip(keys, grouped, strict=True)]
    if failed and views:
        views[0] = views[0]._replace(failed=MappingProxyType({"x": "why"}))
    assert segments.wholes(views) == [segments.whole(v.key, v.created, v.rows, False, v.failed) for v in views]
    assert row_groups(keys, READY, grouped) == [
        RowGroup(key, READY, group) for key, group in zip(keys, grouped, strict=True)
    ]


def _stored(path: Path) -> dict[bytes, list[tuple[bytes, bytes]]]:
    """Every named database of a data directory but its meta, each with its keys and values in order."""
    env = lmdb.open(str(path), max_dbs=64, readonly=True, lock=False)
    found = {}
    with env.begin() as txn:
        names = [bytes(name) for name, _ in txn.cursor()]
        for name in names:
            if name != b"meta":
                db = env.open_db(name, txn=txn)
                found[name] = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
    env.close()
    return found


def _by_group_each(entries: list[Entry], keys: list[str]) -> dict[str, list[Entry]]:
    found: dict[str, list[Entry]] = defaultdict(list)
    for entry, gkey in zip(entries, keys, strict=True):
        found[gkey].append(entry)
    return dict(found)


def _row_groups_each(
    keys: list[str], state: str, rows: list[tuple[Member, ...]], created: float = 0.0
) -> list[RowGroup]:
    return [RowGroup(key, state, tuple(group), created=created) for key, group in zip(keys, rows, strict=True)]


def _pushed(path: Path, batches: list[list[Entry]]) -> dict[bytes, list[tuple[bytes, bytes]]]:
    """The databases after these pushes into a fresh rows table of groups by task, each complete in
    its push (group_size 0), with a clock that stands still."""
    config = TableConfig.of(name="t", estimator="none", group_by="task", group_size=0)
    config = dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout="rows"))
    with Store(path, clock=StoppedClock()) as store:
        store.create_table(config)
        for batch in batches:
            store.put_entries("t", batch)
    return _stored(path)


@pytest.mark.parametrize("sizes", [[1] * 9, [4] * 5, [3, 1, 2, 5, 1]])
def test_a_push_stored_a_list_at_a_time_stores_what_a_step_an_entry_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sizes: list[int]
) -> None:
    """Pushes of whole groups (of one, of one size, of sizes mixed) stored with the passes over the
    batch store, byte for byte, what the same pushes store with each pass replaced by its step an
    entry (or a group): the same payloads, rows, directory entries, runs and counters."""
    groups = [[Entry.of(item) for item in group_items(0, task, size)] for task, size in enumerate(sizes)]
    half = len(groups) // 2
    batches = [list(itertools.chain.from_iterable(part)) for part in (groups[:half], groups[half:])]
    fast = _pushed(tmp_path / "fast", batches)
    monkeypatch.setattr(pushes, "_by_group", _by_group_each)
    monkeypatch.setattr(chunked, "kept_whole", lambda blobs, prompts: False)
    monkeypatch.setattr(segments, "wholes", lambda views: [segments.whole(v.key, v.created, v.rows) for v in views])
    monkeypatch.setattr(segments, "row_groups", _row_groups_each)
    monkeypatch.setattr(row_pending, "row_groups", _row_groups_each)
    assert fast == _pushed(tmp_path / "each", batches)


uids = st.builds(
    "{}/{}/{}/0/x".format, st.sampled_from(["0", "1", "1/2", "12", "1!"]), st.integers(0, 30), st.integers(0, 3)
)
tasks = st.builds("{}/{}".format, st.sampled_from(["0", "1", "1/2", "12", "1!", "2"]), st.integers(0, 30))


@given(st.lists(uids, max_size=30), st.lists(tasks, max_size=20, unique=True), st.sampled_from(["task", "none"]))
@example(["1/2/3/0/x"], ["0/5", "1/2"], "task")  # the key found for 0/5 falls under 1/2, a begin after it
@settings(max_examples=150, deadline=None)
def test_groups_holding_payloads_are_found_as_by_a_seek_each(stored: list[str], opened: list[str], by: str) -> None:
    """The groups a push opens that hold a payload (pending_reads.holding_payloads, which passes over
    the groups a seek's key shows hold none) are those a seek for each finds, batches holding '/'
    among them, and among the keys of other tables."""
    opened = opened if by == "task" else [f"{gkey}/0/0/x" for gkey in opened]
    prefix = b"\0\0\0\2"
    with tempfile.TemporaryDirectory() as path:
        env = lmdb.open(path, max_dbs=2, map_size=1 << 24)
        blobs = env.open_db(b"blobs")
        with env.begin(write=True) as txn:
            for uid in stored:
                txn.put(prefix + uid.encode(), b"p", db=blobs)
            txn.put(b"\0\0\0\3" + b"0/1/0/0/x", b"p", db=blobs)  # another table's
            with txn.cursor(db=blobs) as cur:
                each = [gkey for gkey in sorted(opened) if next(uids_under(cur, prefix, by, gkey), None)]
            keys = [prefix + gkey.encode() for gkey in opened]  # their directory keys, as a push has them
            assert holding_payloads(txn, blobs, prefix, by, keys, {}) == each
        env.close()


@pytest.mark.parametrize(
    ("info", "shape", "more"),
    [
        (None, (12,), {}),
        ({}, (12,), {}),
        ({"priority": -0.0, "model_version": 3}, (12,), {"reward": 0.5, "prompt_length": 5}),
        ({"priority": 2, "version_segments": [[4, 0], [5, 3]], "partial": True}, (2, 6), {"prompt_length": 0}),
        ({"priority": "high", "partial_offset": 7}, (12,), {"prompt_length": 0, "token_level_reward": True}),
    ],
)
def test_an_entry_set_field_by_field_is_the_one_its_constructor_makes(
    info: dict[str, object] | None, shape: tuple[int, ...], more: dict[str, object]
) -> None:
    """Entry.staged sets each field on a bare instance (no __init__ run): every field is set, each to
    what the dataclass's constructor is given from the item's own properties; a field it missed would
    be unset, and the comparison of the two would raise."""
    eid = {"batch": "b", "task": "t/1", "run": 2, "step": 3, "suffix": "x"}
    meta: dict[str, object] = {"eid": eid, **more}
    meta.pop("token_level_reward", None)
    if info is not None:  # without, an item's info is none
        meta["info"] = info
    info = info or {}
    count = 1
    for side in shape:
        count *= side
    tensors = {"tokens": trxp.RawTensor("I32", shape, bytes(4 * count))}
    if more.get("token_level_reward"):
        tensors["token_level_reward"] = trxp.RawTensor("F32", (count,), bytes(4 * count))
    uid = ids_of(eid)[0]
    item = trxp.RawItem(meta, tensors, uid)
    priority = info.get("priority", 0.0)
    made = Entry(
        *ids_of(eid), b"blob", b"d" * 16, 4, item.model_version, meta.get("reward"),
        float(priority) + 0.0 if isinstance(priority, (int, float)) else 0.0,
        "token_level_reward" in tensors, 3, item.response_length, 9,
        int(meta.get("prompt_length", 1)) * 4, item.version_segments, partial.marks_in(info),
    )  # fmt: skip
    staged = Entry.staged(item, b"blob", b"d" * 16, 4, 9)
    assert staged == made
    assert str(staged.priority) == str(made.priority)  # -0.0 made 0.0 by both
