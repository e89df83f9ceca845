"""Batches of many groups taken, leased, acked and requeued in one step: the ready indexes,
the uniform slot array and the tombstones stay exactly as group-at-a-time steps leave them."""

from __future__ import annotations

import random
from pathlib import Path

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expbuf.server.store import Store
from expbuf.server.store.core.ordering.indexes import PriorityIndex, ReadyOrder, Slots
from expbuf.server.store.core.ordering.ready import ReadyIndex
from expbuf.server.store.core.table_state.read_check import all_unservable, unservable
from expbuf.server.store.disk import chunk_reads, digests
from expbuf.server.store.disk.chunk_heads import HEAD_MAGIC, ZSTD_MAGIC
from expbuf.server.store.disk.layout import u64
from expbuf.server.store.disk.records import ItemRecord
from expbuf.server.store.disk.shared_prompts import REF_MAGIC
from expbuf.server.store.schema import sample_spec
from expbuf.server.store.schema.errors import SpecError
from expbuf.server.store.schema.sample_spec import MAX_BATCH, TakeSpec
from expbuf.server.store.schema.states import CONSUMED, LEASED
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items, take

PREFIX = b"\x00\x00\x00\x07"
UNIFORM = TableConfig.of(name="u", estimator="none", group_size=2)


@pytest.fixture
def index(tmp_path: Path) -> tuple[lmdb.Environment, dict[str, lmdb._Database]]:
    env = lmdb.open(str(tmp_path / "idx"), max_dbs=8, map_size=1 << 24)
    dbs = {name: env.open_db(name.encode()) for name in ("ready", "prio", "slots", "slotof", "byver")}
    yield env, dbs
    env.close()


def _array(txn: lmdb.Transaction, dbs: dict[str, lmdb._Database]) -> list[bytes]:
    """The dense slot array, checked against its count and the slot of each group."""
    array = ReadyIndex(dbs, txn, PREFIX).of(Slots)
    slots = [array.slot(slot) for slot in range(array.count())]
    for slot, gkey in enumerate(slots):
        assert txn.get(PREFIX + gkey, db=dbs["slotof"]) == u64(slot)
    rows = sum(1 for key, _ in txn.cursor(db=dbs["slots"]) if key.startswith(PREFIX) and key != PREFIX)
    assert rows == len(slots)
    assert sum(1 for key, _ in txn.cursor(db=dbs["slotof"]) if key.startswith(PREFIX)) == len(slots)
    return slots


@pytest.mark.parametrize("seed", range(6))
def test_remove_many_fills_slots_as_removing_one_at_a_time(index: tuple, seed: int) -> None:
    env, dbs = index
    rng = random.Random(seed)
    groups = [(f"g{n}".encode(), n, float(rng.randrange(3)), rng.choice([None, 1, 2])) for n in range(40)]
    gone = rng.sample(groups, rng.randrange(1, 41))  # tail slots, moved groups removed later, or all
    expected = [g[0] for g in groups]
    for gkey, *_ in gone:  # the array after one remove at a time: the last group fills the hole
        hole = expected.index(gkey)
        expected[hole] = expected[-1]
        expected.pop()
    with env.begin(write=True) as txn:
        ready = ReadyIndex(dbs, txn, PREFIX)
        ready.add_many(groups)
        ready.remove_many(gone)
        assert _array(txn, dbs) == expected
        left = {g[0] for g in groups} - {g[0] for g in gone}
        assert {bytes(v) for v in ready.of(ReadyOrder).scan(reverse=False)} == left
        assert {bytes(v) for v in ready.of(PriorityIndex).scan(reverse=False)} == left
        versioned = {g[0] for g in groups if g[3] is not None} - {g[0] for g in gone}
        assert sum(1 for key, _ in txn.cursor(db=dbs["byver"]) if key.startswith(PREFIX)) == len(versioned)


def _fill(store: Store, groups: int) -> set[str]:
    store.put("u", [item for task in range(groups) for item in group_items(1, task, 2)])
    return {f"1/{task}" for task in range(groups)}


def test_uniform_take_of_many_groups_leaves_exactly_the_rest(tmp_path: Path) -> None:
    with Store(tmp_path / "data", map_size=1 << 24, seed=3) as store:
        store.create_table(UNIFORM)
        ready = _fill(store, 30)
        for size in (12, 7):  # consume many groups in one take, from anywhere in the slot array
            batch = take(store, "u", num_groups=size, order="uniform")
            assert len(set(batch.group_ids)) == size and set(batch.group_ids) <= ready
            ready -= set(batch.group_ids)
            assert store.verify("u") == []
        leased = take(store, "u", num_groups=6, order="fifo", delivery="lease", lease_seconds=60)
        assert store.verify("u") == []
        rest = take(store, "u", num_groups=len(ready) - 6, order="uniform", delivery="replay")
        assert set(rest.group_ids) == ready - set(leased.group_ids)  # each remaining group once, none taken
        assert store.nack(leased.lease_id) == 12
        assert store.verify("u") == []
        everything = take(store, "u", num_groups=len(ready), order="uniform", delivery="lease", lease_seconds=60)
        assert sorted(set(everything.group_ids)) == sorted(ready) and len(everything.uids) == 2 * len(ready)
        assert store.ack(everything.lease_id) == 2 * len(ready)
        assert store.verify("u") == []
        stats = store.stats("u")
        assert stats["ready"] == 0 and stats["leased"] == 0 and stats["consumed"] == 60
        assert take(store, "u", num_groups=1, order="uniform", allow_partial=True) is None
        again = store.put("u", group_items(1, 0, 2))  # the tombstones still know the consumed uids
        assert len(again.duplicates) == 2 and again.stored == []


def test_a_tombstone_made_without_decoding_is_the_record_retired() -> None:
    rec = ItemRecord(
        state=LEASED, group="g/1", seq=41, digest=b"d" * 16, size=8192, created=1.5, tid="t", rid="r", step=3,
        response_length=17, generated=12, version=7, reward=0.25, priority=2.0, times_sampled=3, shaped_reward=0.5,
    )  # fmt: skip
    raw = rec.encode()
    assert ItemRecord.place(raw) == (LEASED, 41, 8192)
    rec.state, rec.retired = CONSUMED, 1_000_123.456789
    assert ItemRecord.retired_as(raw, CONSUMED, 1_000_123.456789) == rec.encode()
    assert ItemRecord.decode(ItemRecord.retired_as(raw, CONSUMED, 1_000_123.456789)) == rec


def test_a_batch_holds_at_most_max_batch_experiences(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A take holds the store's one writer: a batch holds at most MAX_BATCH experiences (a take of
    a whole table of 300,000 held every push 10 s). A request for more is refused by name, and one
    whose groups hold more than that before it has as many as it asked for, as it is taken."""
    with pytest.raises(SpecError, match=f"num_groups is {MAX_BATCH + 1}: a batch holds at most {MAX_BATCH}"):
        TakeSpec("t", num_groups=MAX_BATCH + 1)
    with pytest.raises(SpecError, match=f"batch_size is {MAX_BATCH + 1}"):
        TakeSpec("t", batch_size=MAX_BATCH + 1)
    monkeypatch.setattr(sample_spec, "MAX_BATCH", 10)  # where a take checks the batch it fills (TakeSpec.filled)
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", group_size=4, estimator="none"))
        for task in range(5):
            store.put("t", group_items(1, task, 4))
        with pytest.raises(SpecError, match="the first 3 of the 5 groups asked for hold 12 experiences"):
            store.sample(TakeSpec("t", num_groups=5))
        assert store.stats("t")["ready"] == 20  # nothing taken
        batch = store.sample(TakeSpec("t", batch_size=10))  # whole groups: 12, the batch it asked for
        assert batch is not None and len(batch.uids) == 12


@pytest.mark.parametrize("seed", range(3))
def test_a_run_taken_at_once_takes_what_a_group_at_a_time_would(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rows table takes a run's groups at once (TakeSpec.taking): as many as asking `filled` after
    each group in turn would, refused where that would be."""
    monkeypatch.setattr(sample_spec, "MAX_BATCH", 40)
    rng = random.Random(seed)

    def one_at_a_time(spec: TakeSpec, groups: int, total: int, counts: list[int]) -> int | str:
        try:
            for chosen, count in enumerate(counts, 1):
                total += count
                if spec.filled(groups + chosen, total):
                    return chosen
        except SpecError as refused:
            return str(refused)
        return len(counts)

    for _ in range(400):
        spec = (
            TakeSpec("t", num_groups=rng.randint(1, 12))
            if rng.random() < 0.5
            else TakeSpec("t", batch_size=rng.randint(1, 40))
        )
        counts = [rng.randint(0 if rng.random() < 0.1 else 1, 9) for _ in range(rng.randint(0, 10))]
        groups = rng.randint(0, spec.num_groups - 1) if spec.num_groups else rng.randint(0, 5)
        total = rng.randint(0, spec.batch_size - 1) if spec.batch_size else rng.randint(0, 30)
        try:
            found: int | str = spec.taking(groups, total, counts)
        except SpecError as refused:
            found = str(refused)
        assert found == one_at_a_time(spec, groups, total, counts), (spec, groups, total, counts)


# A batch's payloads as a take reads them: intact, a byte flipped, or shorter than its record says;
# its advantages absent, within float32's range, beyond it, infinite or NaN.
payload_cases = st.lists(
    st.tuples(
        st.sampled_from(["intact", "flipped", "short"]),
        st.none()
        | st.floats(-1e6, 1e6)
        | st.sampled_from([3.5e38, -3.5e38, float("inf"), float("-inf"), float("nan")]),
    ),
    max_size=12,
)


@given(payload_cases)
@settings(max_examples=150, deadline=None)
def test_a_batch_checked_a_list_at_a_time_finds_what_a_check_of_each_finds(cases: list) -> None:
    """The take's check of a batch's payloads and advantages in one pass (all_unservable) finds the
    very experiences, and reasons, that a check of each (unservable) finds, in order."""
    uids, blobs, sizes, found, advantages = [], [], [], [], []
    for at, (how, advantage) in enumerate(cases):
        blob = b"\x01\x02\x03\x04" + bytes([at]) * 40
        uids.append(f"u{at}")
        found.append(digests.of(blob))
        sizes.append(len(blob) + (how == "short"))
        blobs.append(memoryview(blob[:-1] + b"x" if how == "flipped" else blob))
        advantages.append(advantage)
    each = [
        (at, problem)
        for at in range(len(cases))
        if (problem := unservable(uids[at], advantages[at], sizes[at], found[at], blobs[at]))
    ]
    assert all_unservable(uids, advantages, sizes, found, blobs) == each


@given(
    st.lists(
        st.none()
        | st.binary(max_size=6)
        | st.sampled_from([HEAD_MAGIC, ZSTD_MAGIC, REF_MAGIC, b"TRXP"]).map(lambda m: m + b"..")
    )
)
def test_a_batch_of_stored_values_is_whole_at_once_only_where_each_is(values: list) -> None:
    """The one pass that says a batch's stored values are each a payload stored whole says so only
    where each is (chunk_reads.whole), and of every batch none of whose fourth bytes is a magic's."""
    views = [None if value is None else memoryview(value) for value in values]
    each = chunk_reads.all_whole(views)
    fourths = {HEAD_MAGIC[3], ZSTD_MAGIC[3], REF_MAGIC[3]}
    plain = all(value is not None and len(value) >= 4 and value[3] not in fourths for value in values)
    assert chunk_reads.each_whole(views) == plain
    assert all(each) or not plain
