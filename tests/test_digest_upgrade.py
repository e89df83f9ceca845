"""Format 4 digests payloads with XXH3-128 where format 3 took SHA-256: the upgrade of
tests/fixtures/datadir_v3 gives every stored payload its new digest (none to a damaged one), its
tombstones (whose payloads are gone) keep their SHA-256 digest and still tell a retried push (a duplicate) from
other content (a conflict), and `expbuf check` says the older format is brought up to date."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import lmdb
import pytest
import xxhash
from test_datadir import upgrade_notice
from test_datadir_v3 import MANIFEST, V3, group

from expbuf.client import trxp
from expbuf.server.store import Store
from expbuf.server.store.core.table_state.counters import Counters
from expbuf.server.store.core.whole_table import migrate
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.environment import Environment
from expbuf.server.store.disk.records import ItemRecord
from expbuf.server.store.schema.errors import Conflict, Damaged
from expbuf.server.store.schema.states import CONSUMED, RETIRED
from expbuf.server.store.schema.table_config import TableConfig

import cli_forks
from helpers import group_items, stored_members, take


@pytest.fixture
def v3(tmp_path: Path) -> Path:
    shutil.copy(V3 / "data.mdb", tmp_path / "data.mdb")
    return tmp_path


def records(store: Store) -> dict[bytes, tuple[ItemRecord, bytes | None]]:
    """Every item record of the directory by key, live and tombstones, with its stored payload
    (None: a tombstone's)."""
    env = store.environment
    with env.read() as txn:
        return {
            bytes(key): (ItemRecord.decode(raw), txn.get(key, db=env.db["blobs"]))
            for db in ("items", "tombs")
            for key, raw in txn.cursor(db=env.db[db])
        }


def sha256_16(item: trxp.RawItem) -> bytes:
    return hashlib.sha256(trxp.pack_item(item)).digest()[:16]


def test_the_upgrade_digests_every_stored_payload_with_xxh3_and_tombstones_keep_theirs(v3: Path) -> None:
    with Store(v3, clock=lambda: MANIFEST["now"]) as store:
        with store.environment.read() as txn:
            assert txn.get(b"format", db=store.environment.db["meta"]) == str(layout.FORMAT).encode()
        found = stored_members(store.environment)
    stored = {key: row for key, row in found.items() if row.payload is not None}
    assert len(stored) == sum(len(uids) for uids in MANIFEST["stored"].values())
    for key, row in stored.items():
        assert row.payload is not None and row.member.digest == xxhash.xxh3_128_digest(row.payload), key
    tombstones = {key[4:].decode(): row for key, row in found.items() if row.payload is None}
    retired = {item.uid: item for item in group(1, 2, 4) + group(4, 0, 1)}  # consumed, evicted
    assert set(tombstones) == set(retired)
    for uid, row in tombstones.items():
        assert row.state in RETIRED
        assert row.member.digest == sha256_16(retired[uid]) != xxhash.xxh3_128_digest(trxp.pack_item(retired[uid]))


def test_format_3_tombstones_catch_a_retry_and_a_conflict_after_the_upgrade_and_a_reopen(v3: Path) -> None:
    Store(v3, clock=lambda: MANIFEST["now"]).close()  # the upgrade a server's start makes
    with Store(v3, clock=lambda: MANIFEST["now"]) as store:  # a format-4 directory now
        before = store.stats("grpo4")
        consumed = group(1, 2, 4)
        assert store.put("grpo4", consumed).duplicates == [item.uid for item in consumed]
        with pytest.raises(Conflict, match="1/2/0/0/r0 already exists with different content"):
            store.put("grpo4", group(1, 2, 4, reward_offset=0.5))
        after = store.stats("grpo4")
        assert {k: after[k] for k in ("pushed", "pending", "bytes")} == {
            k: before[k] for k in ("pushed", "pending", "bytes")
        }
        evicted = group(4, 0, 1)
        assert store.put("small", evicted).duplicates == [evicted[0].uid]
        with pytest.raises(Conflict):
            store.put("small", group(4, 0, 1, response=5))
        assert store.verify("grpo4") == [] and store.verify("small") == []


@pytest.mark.usefixtures("records_layout")  # format 4 knew no rows
def test_a_tombstone_made_by_format_4_keeps_the_xxh3_digest_and_catches_a_retry(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", estimator="none", group_by="none"))
        items = group_items(1, 0, 2)
        store.put("t", items)
        batch = take(store, "t", num_groups=2)
        assert batch is not None and len(batch.uids) == 2
        found = records(store)
        assert len(found) == 2 and all(blob is None and rec.state == CONSUMED for rec, blob in found.values())
        by_uid = {key[4:].decode(): rec for key, (rec, _) in found.items()}
        for item in items:
            assert by_uid[item.uid].digest == xxhash.xxh3_128_digest(trxp.pack_item(item))
        assert store.put("t", items).duplicates == [item.uid for item in items]


def test_check_says_format_3_is_brought_up_to_date_and_then_passes(v3: Path) -> None:
    def check() -> subprocess.CompletedProcess[str]:
        return cli_forks.run("check", "--data", str(v3), timeout=120)

    before = check()  # nothing damaged: only the upgrade the next start makes, exit 0
    assert before.returncode == 0 and not before.stderr, before.stderr
    assert before.stdout.strip() == upgrade_notice(v3, 3), before.stdout
    Store(v3, clock=lambda: MANIFEST["now"]).close()
    after = check()
    assert after.returncode == 0 and not after.stderr, after.stderr
    assert sorted(after.stdout.splitlines()) == sorted(f"{table}: ok" for table in MANIFEST["stats"])


def test_the_upgrade_gives_no_new_digest_to_a_damaged_payload(v3: Path) -> None:
    env = lmdb.open(str(v3), max_dbs=64)
    with env.begin(write=True) as txn:
        table_id = json.loads(txn.get(b"grpo4", db=env.open_db(b"tables", txn=txn)))["id"]
        key = layout.table_prefix(table_id) + b"1/0/0/0/r0"  # ready: its payload is stored
        blobs = env.open_db(b"blobs", txn=txn)
        blob = bytearray(txn.get(key, db=blobs))
        blob[-1] ^= 0x01  # a flipped bit in its last tensor: it still parses
        txn.put(key, bytes(blob), db=blobs)
    env.close()
    with pytest.raises(Damaged, match="item 1/0/0/0/r0: its payload does not match its digest"):
        Store(v3, clock=lambda: MANIFEST["now"], check_at_open="full")


def test_a_payload_kept_as_format_1_wrote_it_gets_the_digest_of_its_canonical_packing(v3: Path) -> None:
    """Format 1's upgrade kept payloads in the layout they were pushed in, with the SHA-256 digest
    of their canonical packing; format 4's gives them the XXH3-128 digest of that packing."""
    item = group(1, 0, 4)[0]  # ready in grpo4
    kept = trxp.build([item])  # Trinity-RFT's layout, not the stored one
    env = lmdb.open(str(v3), max_dbs=64)
    with env.begin(write=True) as txn:
        dbs = {name: env.open_db(name.encode(), txn=txn) for name in ("tables", "items", "blobs", "counters")}
        prefix = layout.table_prefix(json.loads(txn.get(b"grpo4", db=dbs["tables"]))["id"])
        key = prefix + item.uid.encode()
        rec = ItemRecord.decode(txn.get(key, db=dbs["items"]))
        assert rec.digest == sha256_16(item) and kept != trxp.pack_item(item)
        counters = Counters.decode(txn.get(prefix, db=dbs["counters"]))
        counters.bytes += len(kept) - rec.size
        rec.size = len(kept)
        txn.put(key, rec.encode(), db=dbs["items"])
        txn.put(key, kept, db=dbs["blobs"])
        txn.put(prefix, counters.encode(), db=dbs["counters"])
    env.close()
    with Store(v3, clock=lambda: MANIFEST["now"]) as store:
        assert store.verify("grpo4") == []
        row = stored_members(store.environment)[key]
        assert row.payload == kept and row.member.digest == xxhash.xxh3_128_digest(trxp.pack_item(item))
        retried = group(1, 0, 4)
        assert store.put("grpo4", retried).duplicates == [one.uid for one in retried]


def test_an_upgrade_that_does_not_commit_leaves_format_3_as_it_was(v3: Path) -> None:
    """A start killed during the upgrade: the upgrade runs in the open's one transaction, the
    databases formats 4 and 5 add included, so what is left is format 3 as it was, which `expbuf
    check` says the next start upgrades (it once found the new, empty tombs database beside
    format 3's records and reported every record as belonging to no table)."""

    class Killed(Exception):
        pass

    def killed_before_the_commit(*args: Any) -> None:
        migrate.migrate(*args)
        raise Killed

    before = (v3 / "data.mdb").read_bytes()
    with pytest.raises(Killed):
        Environment(v3, migrate=killed_before_the_commit)
    reader = Environment(v3, readonly=True)
    try:
        assert reader.missing == ["tombs", "ledger", "chunks", "staged", "shared", "shared_refs", "kv", "partials"]
        with reader.read() as txn:
            assert txn.get(b"format", db=reader.db["meta"]) == b"3"
    finally:
        reader.close()
    assert (v3 / "data.mdb").read_bytes() == before
    checked = cli_forks.run("check", "--data", str(v3), timeout=120)
    assert checked.returncode == 0 and checked.stdout.strip() == upgrade_notice(v3, 3), checked.stdout
