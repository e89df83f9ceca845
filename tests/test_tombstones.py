"""Compact tombstones (data directory format 4): a retired experience whose payload goes keeps
only its state, digest, retired time and group, so that a retried push is still a duplicate
or a conflict and pruning still finds it; a failed one whose payload is kept keeps its full
record; the upgrade from format 3 rewrites the old, full tombstones; `expbuf check` knows
both forms."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from expbuf.server.store import RETIRED, ItemRecord, Store
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.errors import Conflict
from expbuf.server.store.schema.table_config import TableConfig

from conftest import FIXTURES
from helpers import group_items, stored_members, take

# A records table's tombstones (a rows table's are its segments' rows: test_rows_take.py, test_rows_reads.py).
pytestmark = pytest.mark.usefixtures("records_layout")

V3 = FIXTURES / "datadir_v3"
NOW = 1_800_000_000.0


def _records(store: Store, db: str = "tombs") -> dict[str, bytes]:
    """Every record of the directory in `db` (items or tombs), raw, by uid."""
    with store.environment.read() as txn:
        return {bytes(k[4:]).decode(): bytes(v) for k, v in txn.cursor(db=store.db[db])}


def _record(store: Store, table: str, uid: str, db: str) -> bytes:
    """One record of a table in `db` (items or tombs), raw."""
    with store.environment.read() as txn:
        prefix = layout.table_prefix(store.catalog.lookup(table)[0])
        return bytes(txn.get(prefix + uid.encode(), db=store.db[db]))


def _records_table(store: Store, table: str) -> bool:
    """Whether the table keeps an item record per experience (its tombstones in items and tombs)."""
    return store.table(table).storage.layout == "records"


def _retired_groups(store: Store) -> int:
    with store.environment.read() as txn:
        return int(txn.stat(store.db["retired"])["entries"])


def _consume(store: Store) -> None:
    assert take(store, "t", num_groups=1) is not None


def _lease_and_ack(store: Store) -> None:
    batch = take(store, "t", num_groups=1, delivery="lease")
    assert batch is not None and store.ack(batch.lease_id) == 2


def _evict(store: Store) -> None:
    store.put("t", group_items(2, 0, 2, reward=0.0) + group_items(2, 1, 2, reward=0.0))


@pytest.mark.parametrize(
    ("retire", "state"), [(_consume, "consumed"), (_lease_and_ack, "consumed"), (_evict, "evicted")]
)
def test_a_retired_experience_is_a_compact_tombstone_that_keeps_a_retry_a_duplicate(
    tmp_path: Path, retire: Callable[[Store], None], state: str
) -> None:
    clock = [NOW]
    config = TableConfig.of(
        "t", estimator="none", capacity_experiences=4, when_full="evict", tombstone_seconds=60, drop_zero_variance=False
    )
    with Store(tmp_path, clock=lambda: clock[0]) as store:
        store.create_table(config)
        first = group_items(1, 0, 2)
        store.put("t", first)
        retire(store)
        if _records_table(store, "t"):  # a rows table's tombstones are its segment's columns (test_rows_*)
            tombs = _records(store)
            assert set(tombs) == {item.uid for item in first} and set(tombs).isdisjoint(_records(store, "items"))
            assert len(tombs) == 2 and all(len(raw) == 25 + 2 + len("1/0") for raw in tombs.values())
            recs = {uid: ItemRecord.decode(raw) for uid, raw in tombs.items()}
            assert {(rec.state, rec.group, rec.retired) for rec in recs.values()} == {(state, "1/0", NOW)}
        assert store.stats("t")[state] == 2 and store.verify("t") == []
        assert store.put("t", first).duplicates == [item.uid for item in first]
        with pytest.raises(Conflict):
            store.put("t", group_items(1, 0, 2, reward=5.0))
        clock[0] += 61
        store.tick()  # past tombstone_seconds: forgotten, group and all
        assert _records(store) == {} and store.stats("t")[state] == 0
        assert store.verify("t") == []
        assert store.put("t", first).stored == [item.uid for item in first]  # pushed again, as new


def test_a_failed_experience_whose_payload_is_kept_keeps_its_full_record(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="grpo", keep_failed=True))
        store.create_table(TableConfig.of("lean", estimator="grpo", keep_failed=False))
        for table in ("t", "lean"):
            store.put(table, group_items(1, 0, 2, reward=1.0) + group_items(1, 1, 2, reward=0.0))
            store.finish_compute(table, {}, ready=[], failed={"1/0": "it failed"})
        if _records_table(store, "t"):  # a rows table keeps a failed member's row as any other's
            kept, gone = _record(store, "t", "1/0/0/0/r0s0", "items"), _record(store, "lean", "1/0/0/0/r0s0", "tombs")
            assert not ItemRecord.compact(kept) and ItemRecord.decode(kept).state == "failed"
            assert ItemRecord.compact(gone) and ItemRecord.decode(gone).state == "failed"
        assert store.stats("t")["failed"] == store.stats("lean")["failed"] == 2
        payload, missing = store.get_payload("t", ["1/0/0/0/r0s0"])
        assert missing == [] and payload
        assert store.get_payload("lean", ["1/0/0/0/r0s0"])[1] == ["1/0/0/0/r0s0"]
        assert store.verify("t") == [] and store.verify("lean") == []


def _raw_tombstones(path: Path, db: str) -> dict[bytes, bytes]:
    """The tombstones in `db` (items or tombs), read from the file without a Store."""
    env = lmdb.open(str(path), max_dbs=layout.MAX_DBS, readonly=True, lock=False, create=False)
    try:
        records = env.open_db(db.encode(), create=False)
        with env.begin() as txn:
            found = {bytes(key): bytes(raw) for key, raw in txn.cursor(db=records)}
        return {key: raw for key, raw in found.items() if ItemRecord.decode(raw).state in RETIRED}
    finally:
        env.close()


def _retired_index(path: Path) -> list[bytes]:
    env = lmdb.open(str(path), max_dbs=layout.MAX_DBS, readonly=True, lock=False, create=False)
    try:
        retired = env.open_db(b"retired", create=False)
        with env.begin() as txn:
            return [bytes(key) for key, _ in txn.cursor(db=retired)]
    finally:
        env.close()


def test_the_upgrade_from_format_3_rewrites_its_tombstones_compact_and_they_are_pruned_in_time(
    tmp_path: Path,
) -> None:
    shutil.copy(V3 / "data.mdb", tmp_path / "data.mdb")
    manifest = json.loads((V3 / "manifest.json").read_text())
    before = _raw_tombstones(tmp_path, "items")
    assert len(before) == 5 and not any(ItemRecord.compact(raw) for raw in before.values())
    assert len(_retired_index(tmp_path)) == 5  # format 3: one entry per tombstone
    clock = [manifest["now"]]
    with Store(tmp_path, clock=lambda: clock[0]) as store:
        with store.environment.read() as txn:
            assert txn.get(b"format", db=store.db["meta"]) == str(layout.FORMAT).encode()
        for table in manifest["stats"]:
            assert store.verify(table) == [], table
        after = {key: row for key, row in stored_members(store.environment).items() if row.state in RETIRED}
    assert _raw_tombstones(tmp_path, "items") == {} == _raw_tombstones(tmp_path, "tombs")  # kept as rows now
    assert after.keys() == before.keys()
    for key, row in after.items():
        old = ItemRecord.decode(before[key])
        assert (row.state, row.member.digest, row.retired, row.group) == (old.state, old.digest, old.retired, old.group)
        assert row.payload is None
    # one entry per retired segment (here a retired group's own), stamped when it retired
    retired = {(key[:4], key[4:12], int.from_bytes(key[12:], "big")) for key in _retired_index(tmp_path)}
    assert retired == {(key[:4], layout.micros(row.retired or 0.0), row.seg) for key, row in after.items()}
    assert {key[:4] for key, _, _ in retired} == {b"\x00\x00\x00\x02", b"\x00\x00\x00\x05"}
    with Store(tmp_path, clock=lambda: clock[0] + 86400 + 1) as store:
        store.tick()
        assert (store.stats("grpo4")["consumed"], store.stats("small")["evicted"]) == (0, 0)
        for table in manifest["stats"]:
            assert store.verify(table) == [], table
        assert [row for row in stored_members(store.environment).values() if row.state in RETIRED] == []
    assert _retired_index(tmp_path) == []


@pytest.mark.usefixtures("records_layout")  # a records table's tombstone records, damaged
def test_check_names_a_tombstone_kept_in_full_or_in_items_and_a_live_record_among_tombstones(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", drop_zero_variance=False))
        store.put("t", group_items(1, 0, 1) + group_items(1, 1, 1) + group_items(1, 2, 1))
        assert take(store, "t", num_groups=2, order="fifo") is not None
        assert store.verify("t") == []
        tombs, items = _records(store), _records(store, "items")
        full, misplaced, ready = "1/0/0/0/r0s0", "1/1/0/0/r0s0", "1/2/0/0/r0s0"
        prefix = layout.table_prefix(store.catalog.lookup("t")[0])
        with store.environment.env.begin(write=True) as txn:
            whole = ItemRecord.decode(tombs[full])
            whole.seq, whole.size = 7, 100
            txn.delete(prefix + full.encode(), db=store.db["tombs"])
            txn.put(prefix + full.encode(), whole.encode(), db=store.db["items"])
            txn.delete(prefix + misplaced.encode(), db=store.db["tombs"])
            txn.put(prefix + misplaced.encode(), tombs[misplaced], db=store.db["items"])
            live = ItemRecord.decode(items[ready])
            live.retired = NOW
            txn.put(prefix + ready.encode(), live.tombstone(), db=store.db["tombs"])
        problems = store.verify("t")
        assert f"item {full} is a consumed tombstone kept in full, not compact" in problems
        assert f"item {misplaced} is consumed: its compact tombstone belongs in tombs, not items" in problems
        assert f"item {ready} is ready, but its record is among the compact tombstones (tombs)" in problems
        with store.environment.env.begin(write=True) as txn:
            txn.drop(store.db["retired"], delete=False)
        assert "retired group 1/1 is missing from the retired index" in store.verify("t")


@pytest.mark.usefixtures("records_layout")  # a rows table's retired index names segments (test_rows_reads)
def test_a_group_whose_tombstones_are_deleted_one_by_one_leaves_the_retired_index_with_the_last(
    tmp_path: Path,
) -> None:
    clock = [NOW]
    with Store(tmp_path, clock=lambda: clock[0]) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, tombstone_seconds=60))
        first, second = group_items(1, 0, 2), group_items(1, 1, 2)
        store.put("t", first + second)
        assert take(store, "t", num_groups=2) is not None
        assert _retired_groups(store) == 2  # one per retired group, not per tombstone
        store.delete("t", uids=[first[0].uid])
        assert _retired_groups(store) == 2 and store.verify("t") == []
        store.delete("t", uids=[first[1].uid])
        assert _retired_groups(store) == 1 and store.verify("t") == []
        clock[0] += 61
        store.tick()
        assert _retired_groups(store) == 0 and _records(store) == {} and store.verify("t") == []
