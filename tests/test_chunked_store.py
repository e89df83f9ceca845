"""Tensor sections larger than chunk_heads.CHUNK_BYTES stored in chunks (data format 6), as they are
and, in a table that compresses, as zstd frames: read back as the same bytes as stored whole, as
TRXP and as columns; duplicates, consumes, deletes and drops take their chunks with them; a
damaged chunk is never served; a push that staged sections and never completed leaves nothing at
the next open; a format 5 directory upgrades in place."""

from __future__ import annotations

import itertools
import math
import threading
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest
import zstandard

from expbuf.client import trxp
from expbuf.client.trxp.stored.pieces import Run, SplitPayload, realized, realized_span, section_at
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store
from expbuf.server.store.core.whole_table import migrate
from expbuf.server.store.disk import chunk_heads, chunk_reads, chunked, digests, layout
from expbuf.server.store.disk.environment import Environment
from expbuf.server.store.disk.kinds import Entry
from expbuf.server.store.schema.errors import DamagedPayload, NotFound, StoreError
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

import cli_forks
from helpers import group_items, take

# What expbuf check says of a chunk set that nothing reads.
STRAY = "1 chunk set(s) belong to no stored payload and to no push: expbuf repair drops them"

TABLE = TableConfig.of("big", group_by="task", group_size=2, estimator="grpo")
RESPONSE = 700_000  # tokens int32, log-probs float32, a bool mask: about 6.3 MB a section
FIELDS = ("tokens", "logprobs", "action_mask", "advantages")


def big_group(task: int) -> list[trxp.RawItem]:
    return group_items("big", task, 2, response=RESPONSE)


def push(store: Store, items: list[trxp.RawItem]) -> None:
    """Store a push and compute the advantages of the groups it completes, as a server does."""
    store.put("big", items)
    AdvantageWorker(store).run_once()


def joined(runs: list[Run]) -> bytes:
    """Runs end to end, each read (a zstd frame's Window decompressed and checked as it is)."""
    return b"".join([realized(run) for run in runs])


def rows(store: Store, db: str) -> dict[bytes, bytes]:
    with store.environment.read() as txn, txn.cursor(db=store.db[db]) as cur:
        return {bytes(key): bytes(value) for key, value in cur}


def section_bytes(item: trxp.RawItem) -> int:
    return sum(len(tensor.data) for tensor in item.tensors.values())


@pytest.fixture(params=["none", "zstd"])
def table(request: pytest.FixtureRequest) -> TableConfig:
    """The table of the tests: its chunks kept as they are, or as zstd frames."""
    return TableConfig.from_settings(TABLE.settings() | {"compression": request.param})


@pytest.fixture
def store(tmp_path: Path, table: TableConfig) -> Any:
    with Store(tmp_path / "data", seed=1) as s:
        s.create_table(table)
        yield s
        assert s.verify("big") == []


def test_a_large_section_is_stored_in_chunks_and_read_back_as_stored_whole(
    store: Store, table: TableConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = big_group(0)
    push(store, items)
    heads = rows(store, "blobs")
    assert len(heads) == 2 and all(chunk_heads.is_head(head) and len(head) < 8192 for head in heads.values())
    expected = sum(math.ceil(section_bytes(item) / chunk_heads.CHUNK_BYTES) for item in items)
    chunks = rows(store, "chunks")
    marks = {key: chunks.pop(key) for key in list(chunks) if key[12:] == chunk_heads.OWNER.to_bytes(4, "big")}
    assert sorted(marks.values()) == sorted(heads)  # each set marked with the key of its experience
    assert len(chunks) == expected > 2 and rows(store, "staged") == {}
    compressed = table.storage.compression == "zstd"
    assert {head[:4] for head in heads.values()} == {chunk_heads.ZSTD_MAGIC if compressed else chunk_heads.HEAD_MAGIC}
    if compressed:  # each chunk a zstd frame of its bytes, and the group's sections smaller for it
        plain = [zstandard.ZstdDecompressor().decompress(chunk) for chunk in chunks.values()]
        assert sum(map(len, plain)) == sum(map(section_bytes, items)) > 2 * sum(map(len, chunks.values()))
        with store.environment.read() as txn:  # the scrub's check, a chunk at a time
            read = chunk_reads.reader(txn, store.db)
            streamed = {key: chunk_reads.streamed(head, key, read) for key, head in heads.items()}
        packed = [trxp.pack_item(item) for item in items]
        assert sorted(streamed.values()) == sorted((digests.of(blob), len(blob)) for blob in packed)
    assert store.scrub.run_pass() == 0
    got = take(store, "big", num_groups=1, delivery="replay")
    assert got is not None and all(isinstance(blob, SplitPayload) for blob in got.blobs)
    payload = got.payload
    columns = got.columns(FIELDS, lambda parts: {part.name: joined(part.values) for part in parts})
    got.release()

    monkeypatch.setattr(chunk_heads, "CHUNK_BYTES", 1 << 40)  # the same experiences stored whole
    with Store(tmp_path / "whole", seed=1) as whole:
        whole.create_table(TABLE)
        push(whole, items)
        assert rows(whole, "chunks") == {}
        same = take(whole, "big", num_groups=1, delivery="replay")
        assert same is not None and not any(isinstance(blob, SplitPayload) for blob in same.blobs)
        assert same.payload == payload
        assert same.columns(FIELDS, lambda parts: {part.name: joined(part.values) for part in parts}) == columns
        same.release()
    assert [item.uid for item in trxp.parse(payload)] == [item.uid for item in items]
    assert store.get("big", [items[0].uid])[items[0].uid] == trxp.pack_item(items[0])


def test_a_retried_push_is_a_duplicate_and_leaves_no_chunks_behind(store: Store) -> None:
    items = big_group(0)
    push(store, items)
    before = rows(store, "chunks")
    result = store.put("big", items)
    assert result.duplicates == [item.uid for item in items] and result.stored == []
    assert rows(store, "chunks") == before


def test_consumed_deleted_and_dropped_experiences_take_their_chunks(store: Store) -> None:
    for task in range(3):
        push(store, big_group(task))
    assert len(rows(store, "chunks")) > 0
    batch = take(store, "big", num_groups=1, delivery="consume")
    assert batch is not None
    batch.release()
    other = next(group[0].eid.tid for group in map(big_group, range(3)) if group[0].eid.tid != batch.group_ids[0])
    assert store.delete("big", group_ids=[other]) == 2
    left = set(rows(store, "blobs").values())
    assert len(left) == 2
    sets = {chunk_heads.read_head(head).set_id for head in left}
    assert {key[4:12] for key in rows(store, "chunks")} == {set_id.to_bytes(8, "big") for set_id in sets}
    store.drop_table("big")
    assert rows(store, "chunks") == {} and rows(store, "blobs") == {}
    store.create_table(TABLE)


def test_a_damaged_chunk_is_never_served_and_the_other_groups_are(store: Store) -> None:
    push(store, big_group(0))
    push(store, big_group(1))
    victim = next(key for key in sorted(rows(store, "chunks")))
    db = store.db["chunks"]

    def damage(txn: lmdb.Transaction[bytes]) -> None:
        value = bytearray(txn.get(victim, db=db) or b"")
        value[1000] ^= 0xFF
        txn.put(victim, bytes(value), db=db)

    store.environment.submit(damage)
    got = take(store, "big", num_groups=2, delivery="consume", allow_partial=True)
    assert got is not None and len(got.uids) == 2 and len(set(got.group_ids)) == 1  # the other group, whole
    assert len(trxp.parse(got.payload)) == 2
    got.release()
    stats = store.stats("big")
    assert stats["damaged"] == 1 and stats["groups_failed"] == 1
    assert victim not in rows(store, "chunks")  # the quarantined experience's chunks went with it


@pytest.mark.parametrize("chunk", [0, 1])
@pytest.mark.parametrize("how", ["flipped", "cut short"])
def test_a_damaged_chunk_is_found_by_a_held_take_and_by_the_scrub(store: Store, how: str, chunk: int) -> None:
    """A chunk changed on disk, or one cut short (a frame that then does not say it holds its
    chunk's length), is refused where a stream's reply is built and found by the scrub: the first
    chunk, and the second, which a reply of zstd frames decompresses ahead of its read."""
    push(store, big_group(0))
    victim = sorted(rows(store, "chunks"))[chunk]  # the first experience's chunk 0 or 1
    db = store.db["chunks"]

    def damage(txn: lmdb.Transaction[bytes]) -> None:
        value = bytearray(txn.get(victim, db=db) or b"")
        if how == "flipped":
            value[len(value) // 2] ^= 0xFF
        else:
            del value[len(value) // 2 :]
        txn.put(victim, bytes(value), db=db)

    store.environment.submit(damage)
    held = store.sample(TakeSpec("big", num_groups=1, delivery="lease"), hold=True)
    assert held is not None and all(isinstance(blob, chunk_reads.Deferred) for blob in held.blobs)
    with pytest.raises(DamagedPayload, match=f"experience {held.uids[0]}: (its payload|chunk {chunk} of its data)"):
        held.render(joined)
    held.release()
    store.nack(held.lease_id, "big")
    assert store.scrub.run_pass() == 1
    assert store.stats("big")["damaged"] == 1 and victim not in rows(store, "chunks")


def test_a_push_that_staged_sections_and_never_completed_leaves_nothing_at_the_next_open(tmp_path: Path) -> None:
    with Store(tmp_path / "data") as store:
        store.create_table(TABLE)
        first, second = store.new_chunk_set(), store.new_chunk_set()
        assert first != second
        written = [store.stage("big", first, 0, b"x" * 1000), store.stage("big", first, 1, b"y" * 1000)]
        written.append(store.stage("big", second, 0, b"z" * 10))
        assert [future.result() for future in written] == [None] * 3
        store.drop_staged("big", [second])
        assert len(rows(store, "chunks")) == 2 and len(rows(store, "staged")) == 1
    with Store(tmp_path / "data") as store:  # the push staging `first` never completed
        assert rows(store, "chunks") == {} and rows(store, "staged") == {}
        assert store.new_chunk_set() > second  # a set's number is never used again


def staged_entry(store: Store, item: trxp.RawItem) -> Entry:
    """An item's entry as a push in chunks makes it: its section staged in the store chunk by
    chunk (compressed where its table compresses), its head made as the chunks passed."""
    payload = memoryview(trxp.pack_item(item))
    start = section_at(payload)
    staging = chunked.Staging([payload[:start]], len(payload) - start)
    staging.set_id, staging.level = store.new_chunk_set(), store.zstd_level("big")
    for number, at in enumerate(range(start, len(payload), chunk_heads.CHUNK_BYTES)):
        chunk = payload[at : at + chunk_heads.CHUNK_BYTES]
        store.stage("big", staging.set_id, number, chunk, staging.level).result()
        staging.add(chunk)
    return Entry.staged(item, staging.head(), staging.digest(), staging.size, item.generated_tokens)


def test_a_push_whose_table_was_dropped_while_it_was_staged_is_refused(store: Store, table: TableConfig) -> None:
    """Its staged data went with the table: storing its heads in the table made again would
    acknowledge experiences whose data is gone."""
    first, second = big_group(0)
    assert store.put_entries("big", [staged_entry(store, first)]).stored == [first.uid]
    assert store.get("big", [first.uid])[first.uid] == trxp.pack_item(first)
    entry = staged_entry(store, second)
    store.drop_table("big")
    store.create_table(table)
    with pytest.raises(NotFound, match=f"the data of experience {second.uid} staged as its push arrived is gone"):
        store.put_entries("big", [entry])
    assert store.get("big", [second.uid]) == {} and rows(store, "blobs") == {}


def test_a_chunk_staged_after_its_table_was_dropped_and_made_again_is_refused(store: Store, table: TableConfig) -> None:
    """Its first chunk went with the dropped table: the rest of its set is refused as it comes."""
    payload = memoryview(trxp.pack_item(big_group(0)[0]))
    start, chunk, level = section_at(payload), chunk_heads.CHUNK_BYTES, store.zstd_level("big")
    set_id = store.new_chunk_set()
    store.stage("big", set_id, 0, payload[start : start + chunk], level).result()
    store.drop_table("big")
    store.create_table(table)
    with pytest.raises(NotFound, match="the table was dropped"):
        store.stage("big", set_id, 1, payload[start + chunk : start + 2 * chunk], level).result()
    assert rows(store, "chunks") == {} and rows(store, "staged") == {}


def test_a_chunk_staged_in_the_commit_that_drops_its_table_is_refused(store: Store, table: TableConfig) -> None:
    """A chunk that reaches the writer in the same batch as the drop of its table, after it, is
    refused: the table is gone in the transaction it would be written in, though the catalog
    still lists it until the drop's commit. Written, it stayed under the dropped table's id until
    the next start, and `expbuf check` of the stopped directory failed."""
    payload = memoryview(trxp.pack_item(big_group(0)[0]))
    start, level, set_id = section_at(payload), store.zstd_level("big"), store.new_chunk_set()
    gate, holding = threading.Event(), threading.Event()

    def hold(txn: lmdb.Transaction[bytes]) -> None:
        holding.set()
        gate.wait(30)

    held = store.environment.queue(hold)  # the writer waits here; what is queued meanwhile is one batch
    assert holding.wait(30)
    queued = store.environment.writer._queue.qsize
    dropping = threading.Thread(target=store.drop_table, args=("big",))
    dropping.start()
    while queued() < 1:  # the drop is in the batch first
        time.sleep(0.001)
    staged = store.stage("big", set_id, 0, payload[start : start + chunk_heads.CHUNK_BYTES], level)
    gate.set()
    dropping.join(30)
    held.result(30)
    with pytest.raises(NotFound, match="'big' was dropped"):
        staged.result(30)
    assert rows(store, "chunks") == {} and rows(store, "staged") == {}
    store.create_table(table)


def format_5(path: Path) -> None:
    """A directory as a format 5 expbuf leaves it: no chunk databases, format 5."""
    env = lmdb.open(str(path), max_dbs=layout.MAX_DBS)
    with env.begin(write=True) as txn:
        for name in (b"chunks", b"staged"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
        txn.put(b"format", b"5", db=env.open_db(b"meta", txn=txn))
    env.close()


def marked(env: lmdb.Environment, txn: lmdb.Transaction[bytes]) -> list[bytes]:
    """The keys of the chunk sets' marks (chunk_heads.OWNER)."""
    with txn.cursor(db=env.open_db(b"chunks", txn=txn)) as cur:
        return [bytes(key) for key in cur.iternext(values=False) if key[12:] == chunk_heads.OWNER.to_bytes(4, "big")]


class Killed(Exception):
    pass


def upgrade_killed_before_its_commit(data: Path) -> None:
    """An open whose upgrade is killed before its commit leaves the directory as it was: the
    upgrade is the open's one transaction."""
    before = (data / "data.mdb").read_bytes()

    def killed_before_the_commit(*args: Any) -> None:
        migrate.migrate(*args)
        raise Killed

    with pytest.raises(Killed):
        Environment(data, migrate=killed_before_the_commit)
    assert (data / "data.mdb").read_bytes() == before


def test_a_format_5_directory_upgrades_in_place_and_serves_its_large_payloads_stored_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    with monkeypatch.context() as patch:
        patch.setattr(chunk_heads, "CHUNK_BYTES", 1 << 40)  # format 5 stored every payload whole
        with Store(data) as store:
            store.create_table(TABLE)
            push(store, big_group(0))
            push(store, big_group(1))
    format_5(data)
    upgrade_killed_before_its_commit(data)
    with Store(data) as store:
        with store.environment.read() as txn:
            assert txn.get(b"format", db=store.db["meta"]) == str(layout.FORMAT).encode()
        assert rows(store, "chunks") == {}
        push(store, big_group(2))  # a new one is stored in chunks
        assert len(rows(store, "chunks")) > 0
        for _ in range(3):
            got = take(store, "big", num_groups=1, delivery="consume")
            assert got is not None and len(trxp.parse(got.payload)) == 2
            got.release()
        assert rows(store, "chunks") == {} and rows(store, "blobs") == {}
        assert store.verify("big") == []


def test_a_head_whose_chunk_set_is_missing_is_damage_the_check_finds(store: Store) -> None:
    push(store, big_group(0))
    gone = next(iter(rows(store, "chunks")))
    store.environment.submit(lambda txn: txn.delete(gone, db=store.db["chunks"]))
    problems = store.verify("big")
    assert problems and all("payload" in problem for problem in problems)
    store.quarantine("big", [item.uid for item in big_group(0)])
    assert store.verify("big") == []
    stray = chunk_heads.chunk_key(gone[:4], 999, 0)  # a set neither a head names nor a push stages
    store.environment.submit(lambda txn: txn.put(stray, b"x", db=store.db["chunks"]))
    assert store.verify("big") == [STRAY]
    store.environment.submit(lambda txn: txn.delete(stray, db=store.db["chunks"]))
    with pytest.raises(StoreError):
        store.stage("absent", store.new_chunk_set(), 0, b"")


def test_a_stray_chunk_set_refuses_no_start_and_expbuf_repair_drops_it(tmp_path: Path, table: TableConfig) -> None:
    """A chunk set no head names and no push stages (what damage before data format 9 may leave,
    which its upgrade cannot give to a head) is read by nothing: `expbuf check` reports it with
    the command that drops it, a start that checks everything serves all the same (it refused
    to start, and nothing dropped the set), and `expbuf repair` drops that set alone, refused
    while a server holds the directory."""
    data = tmp_path / "data"
    with Store(data, seed=1) as store:
        store.create_table(table)
        push(store, big_group(0))
        kept = rows(store, "chunks")
        prefix = next(iter(kept))[:4]
        strays = [chunk_heads.chunk_key(prefix, 999, index) for index in (0, 1, chunk_heads.OWNER)]
        store.environment.submit(lambda txn: [txn.put(key, b"x", db=store.db["chunks"]) for key in strays])
    with Store(data, check_at_open="full") as store:
        assert store.verify("big") == [STRAY]
        held = cli_forks.run("repair", "--data", str(data), timeout=120)
        assert held.returncode == 2 and "another expbuf process" in held.stderr, held.stderr
    assert cli_forks.run("check", "--data", str(data), timeout=120).returncode == 1
    done = cli_forks.run("repair", "--data", str(data), timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines() == ["big: dropped 1 stray chunk set(s)"], done
    again = cli_forks.run("repair", "--data", str(data), timeout=120)
    assert again.returncode == 0 and again.stdout.splitlines() == ["no stray chunk sets"], again
    checked = cli_forks.run("check", "--data", str(data), timeout=120)
    assert checked.returncode == 0 and checked.stdout.splitlines() == ["big: ok", "default: ok"], checked
    with Store(data, check_at_open="full") as store:
        assert rows(store, "chunks") == kept
        got = take(store, "big", num_groups=1, delivery="consume")
        assert got is not None and len(trxp.parse(got.payload)) == 2
        got.release()


@pytest.mark.parametrize("damage", ["format record", "no blobs database"])
def test_expbuf_repair_refuses_a_damaged_directory_and_changes_nothing(
    tmp_path: Path, table: TableConfig, damage: str
) -> None:
    """Repair finds strays from the directory's own records: where those are damaged (a format
    record that is not a number, the payloads' database gone) it refuses, naming the damage and
    expbuf check, and writes nothing (without the payloads every set looked a stray, and went)."""
    data = tmp_path / "data"
    with Store(data, seed=1) as store:
        store.create_table(table)
        push(store, big_group(0))
    env = lmdb.open(str(data), max_dbs=layout.MAX_DBS)
    with env.begin(write=True) as txn:
        if damage == "format record":
            txn.put(b"format", b"9x", db=env.open_db(b"meta", txn=txn))
        else:
            txn.drop(env.open_db(b"blobs", txn=txn), delete=True)
    env.close()
    before = (data / "data.mdb").read_bytes()
    done = cli_forks.run("repair", "--data", str(data), timeout=120)
    assert done.returncode == 2 and "damaged" in done.stderr and "expbuf check names the damage" in done.stderr, done
    assert (data / "data.mdb").read_bytes() == before


@pytest.mark.parametrize("where", ["magic", "set number"])
def test_expbuf_repair_keeps_the_chunks_of_a_damaged_head_its_mark_names(
    tmp_path: Path, table: TableConfig, where: str
) -> None:
    """A head damaged on disk (its magic, so that it no longer reads as a head, or its set number,
    so that it names another) leaves its own chunk set named by no head; the set's mark still
    names the experience, whose record and head are there: `expbuf check` reports the damaged
    payload, not a stray, and `expbuf repair` keeps the chunks (it dropped them, the only copy of
    an experience whose head a few bytes could mend)."""
    data = tmp_path / "data"
    with Store(data, seed=1) as store:
        store.create_table(table)
        push(store, big_group(0))
        kept = rows(store, "chunks")
        heads = {key: value for key, value in rows(store, "blobs").items() if chunk_heads.is_head(value)}
        victim, head = min(heads.items())
        damaged = bytearray(head)
        if where == "magic":
            damaged[0] ^= 0xFF
        else:
            damaged[4] ^= 0x40  # the low byte of the set number: a set no head names
        store.environment.submit(lambda txn: txn.put(victim, bytes(damaged), db=store.db["blobs"]))
        problems = store.verify("big")
        assert problems and STRAY not in problems
    done = cli_forks.run("repair", "--data", str(data), timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines() == ["no stray chunk sets"], done
    with Store(data) as store:
        assert rows(store, "chunks") == kept
        store.environment.submit(lambda txn: txn.put(victim, head, db=store.db["blobs"]))  # mended by hand
        assert store.verify("big") == []


@pytest.fixture
def decompressed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, str]]:
    """Each zstd chunk a reply decompresses, as it is: (experience, chunk, thread)."""
    made: list[tuple[str, int, str]] = []
    checked_from = chunk_reads.Deferred.checked_from

    def noted(deferred: chunk_reads.Deferred, index: int, stored: Any) -> Any:
        made.append((deferred.uid, index, threading.current_thread().name))
        return checked_from(deferred, index, stored)

    monkeypatch.setattr(chunk_reads.Deferred, "checked_from", noted)
    return made


def test_a_reply_of_zstd_frames_decompresses_the_next_chunk_on_the_reply_threads_ahead_of_its_read(
    store: Store, table: TableConfig, decompressed: list[tuple[str, int, str]]
) -> None:
    """Where a reply reads payloads whole (TRXP) from zstd frames, the first read of a chunk starts
    the next on the decompressing threads, so that it is decompressed while this one is sent, and
    each chunk is decompressed once; the bytes are those a read in the writer gives. Columns of
    several experiences (a field of each, then the next field) read none ahead. A table that does
    not compress reads its chunks as they are, on no other thread."""
    plain = TableConfig.from_settings(table.settings() | {"name": "plain", "estimator": "none"})
    store.create_table(plain)
    store.put("plain", group_items("plain", 0, 2, response=RESPONSE))  # no advantages: no mask read first
    made = decompressed
    held = store.sample(TakeSpec("plain", num_groups=1, delivery="lease"), hold=True)
    assert held is not None and len(held.uids) == 2
    got = held.render(joined)
    store.nack(held.lease_id, "plain")
    held.release()
    whole = store.sample(TakeSpec("plain", num_groups=1, delivery="lease"))  # read whole in the writer
    assert whole is not None and got == whole.payload
    store.nack(whole.lease_id, "plain")
    whole.release()
    if table.storage.compression != "zstd":
        assert made == []
        return
    here = threading.current_thread().name
    each = [(uid, index) for uid in sorted(held.uids) for index in (0, 1)]
    assert sorted((uid, index) for uid, index, _ in made) == each  # each chunk decompressed once
    assert all((thread == here) == (index == 0) for _, index, thread in made), made  # chunk 1 ahead
    assert all(thread.startswith("expbuf-zstd-reply") for _, index, thread in made if index == 1)
    made.clear()
    held = store.sample(TakeSpec("plain", num_groups=1, delivery="lease"), hold=True)
    assert held is not None
    held.columns(["tokens", "logprobs"], lambda parts: {part.name: joined(part.values) for part in parts})
    store.nack(held.lease_id, "plain")
    held.release()
    assert made and {thread for _, _, thread in made} == {here}


@pytest.mark.parametrize("order", [1, -1])
def test_columns_read_in_any_order_decompress_each_chunk_once(
    store: Store, table: TableConfig, decompressed: list[tuple[str, int, str]], order: int
) -> None:
    """A reply reads fields in the order asked, not the order stored: a read that reaches a
    chunk's end is not its last, and the chunk stays among those decompressed last for the next
    field (it was let go there, and decompressed again: twice a chunk for a batch of one)."""
    push(store, big_group(0))
    held = store.sample(TakeSpec("big", num_groups=1, delivery="lease"), hold=True)
    assert held is not None
    held.columns(list(FIELDS[::order]), lambda parts: {part.name: joined(part.values) for part in parts})
    store.nack(held.lease_id, "big")
    held.release()
    made = [(uid, index) for uid, index, _ in decompressed]
    if table.storage.compression == "zstd":
        assert sorted(made) == sorted(set(made)) and len(made) == 4  # two experiences of two chunks
    else:
        assert made == []


def test_replies_read_side_by_side_decompress_each_chunk_once(
    tmp_path: Path, decompressed: list[tuple[str, int, str]]
) -> None:
    """Three replies whose parts are cut in turn, a MiB at a time, each decompress every chunk of
    theirs once, the chunk after the one read ahead of its read: a reply's read ahead is its own,
    not among the chunks decompressed last that all replies share (there it took two of their
    four places a reply, and three replies then pushed each other's out, to be decompressed again
    and again)."""
    zstd = TableConfig.from_settings(TABLE.settings() | {"compression": "zstd"})
    with Store(tmp_path / "data", seed=1) as store:
        store.create_table(zstd)
        for task in range(3):
            push(store, big_group(task))
        held = [store.sample(TakeSpec("big", num_groups=1, delivery="lease"), hold=True) for _ in range(3)]
        assert all(batch is not None for batch in held)
        replies = [[run for blob in chunk_reads.checked(batch.blobs) for run in blob.pieces] for batch in held if batch]
        cuts = [[(run, at, min(at + (1 << 20), len(run))) for run in runs for at in range(0, len(run), 1 << 20)]
                for runs in replies]  # fmt: skip
        for parts in itertools.zip_longest(*cuts):
            for part in parts:
                if part is not None:
                    realized_span(*part)
        chunks = [(batch.uids[at], index) for batch in held if batch for at in range(2) for index in range(2)]
        assert sorted((uid, index) for uid, index, _ in decompressed) == sorted(chunks)
        for batch in held:
            if batch is not None:
                batch.release()


def test_a_held_take_reads_only_the_chunks_of_its_fields_and_they_equal_a_full_read(store: Store) -> None:
    """A stream's take (held) defers its chunks to the reply: a columnar reply reads those its
    fields lie in (advantages read the action mask they are spread under) and checks each against
    its digest; the columns equal those of a take that read everything."""
    push(store, big_group(0))
    spec = TakeSpec("big", num_groups=1, delivery="lease")
    held = store.sample(spec, hold=True)
    assert held is not None and all(isinstance(blob, chunk_reads.Deferred) for blob in held.blobs)
    fields = ("tokens", "advantages")
    got = held.columns(fields, lambda parts: {part.name: joined(part.values) for part in parts})
    for blob in held.blobs:  # copied out of the snapshot (its end comes first): the same columns
        assert isinstance(blob, chunk_reads.Deferred) and blob.detach() is blob
    assert held.columns(fields, lambda parts: {part.name: joined(part.values) for part in parts}) == got
    held.release()
    store.nack(held.lease_id, "big")
    whole = take(store, "big", num_groups=1, delivery="replay")
    assert whole is not None and not any(isinstance(blob, chunk_reads.Deferred) for blob in whole.blobs)
    assert whole.columns(fields, lambda parts: {part.name: joined(part.values) for part in parts}) == got
    whole.release()


def test_a_damaged_head_is_found_by_every_read(store: Store) -> None:
    push(store, big_group(0))
    key, head = next(iter(rows(store, "blobs").items()))
    damaged = bytearray(head)
    damaged[-20] ^= 0x01  # in the safetensors header of its prefix
    store.environment.submit(lambda txn: txn.put(key, bytes(damaged), db=store.db["blobs"]))
    assert not chunk_heads.read_head(bytes(damaged)).intact
    held = store.sample(TakeSpec("big", num_groups=1, delivery="lease"), hold=True)
    assert held is not None
    with pytest.raises(DamagedPayload, match="head does not match its digest"):
        held.columns(("tokens",), lambda parts: None)
    with pytest.raises(DamagedPayload, match="head is damaged"):
        held.render(joined)
    held.release()
    store.nack(held.lease_id, "big")
    assert any(
        "does not match its digest" in problem or "bytes, its record says" in problem for problem in store.verify("big")
    )
    assert store.quarantine("big", [key[4:].decode()]) == 1
    own_set = chunk_heads.read_head(head).set_id.to_bytes(8, "big")  # found by its mark, its head damaged
    assert own_set not in {chunk[4:12] for chunk in rows(store, "chunks")}


def test_a_quarantined_payload_stored_whole_is_deleted_without_a_walk_over_the_sets(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a damaged head is looked for by its mark: a quarantined payload that its record says is
    stored whole goes without a walk over the table's chunk sets (with 300,000 sets, half a second
    a payload in the writer)."""
    push(store, big_group(0))
    small = group_items("big", 5, 2, response=100)
    push(store, small)
    key, blob = next((key, blob) for key, blob in rows(store, "blobs").items() if key.endswith(small[0].uid.encode()))
    damaged = bytearray(blob)
    damaged[-5] ^= 0x01
    store.environment.submit(lambda txn: txn.put(key, bytes(damaged), db=store.db["blobs"]))
    walks: list[bytes] = []
    walk = chunked._sets_of
    monkeypatch.setattr(chunked, "_sets_of", lambda txn, dbs, key: walks.append(key) or walk(txn, dbs, key))
    assert store.quarantine("big", [small[0].uid]) == 1
    assert walks == []


@pytest.mark.parametrize("how", ["sampled", "deleted"])
def test_a_set_number_damaged_into_anothers_leaves_that_experience_whole(store: Store, how: str) -> None:
    """A head's own digest covers its chunk set (format 9): a set number damaged into another
    experience's is found by every read, and the damaged experience, quarantined as a sample finds
    it or deleted, takes none of the other's chunks (it took them all before), and its own with it,
    found by their mark (the same bytes as the other's: the chunks cannot say whose they are)."""
    ours, theirs = big_group(0), big_group(1)
    push(store, ours)
    push(store, theirs)
    heads = {bytes(key[4:]).decode(): (key, head) for key, head in rows(store, "blobs").items()}
    key, head = heads[ours[0].uid]
    own_set = chunk_heads.read_head(head).set_id
    damaged = bytearray(head)
    damaged[4:12] = heads[theirs[0].uid][1][4:12]
    store.environment.submit(lambda txn: txn.put(key, bytes(damaged), db=store.db["blobs"]))
    assert not chunk_heads.read_head(bytes(damaged)).intact
    assert [problem for problem in store.verify("big") if ours[0].uid in problem]
    if how == "deleted":
        assert store.delete("big", uids=[ours[0].uid]) == 1
        got = store.get("big", [item.uid for item in theirs])
        assert got == {item.uid: trxp.pack_item(item) for item in theirs}
    else:
        batch = take(store, "big", num_groups=1, delivery="consume")  # ours fails, theirs is served
        assert batch is not None
        served = {item.uid: item for item in trxp.parse(batch.payload)}
        assert served.keys() == {item.uid for item in theirs}
        for item in theirs:  # as pushed (the advantages were added since)
            for name, tensor in item.tensors.items():
                assert bytes(served[item.uid].tensors[name].data) == bytes(tensor.data)
        batch.release()
    assert own_set.to_bytes(8, "big") not in {chunk[4:12] for chunk in rows(store, "chunks")}


@pytest.mark.usefixtures("records_layout")  # format 8 knew no rows
def test_a_format_8_directory_reseals_its_heads_in_place(tmp_path: Path, table: TableConfig) -> None:
    """Format 8 took a head's own digest of its bytes after the digest alone: the open, in its one
    transaction, brings each head that matches it to format 9's and marks its set with its key. A
    head damaged since stays damaged, its set marked as its (no other head names it), so its
    quarantine takes its chunks. A head whose set number was damaged into another's before the
    upgrade matched format 8's digest, which left the set out: the set goes to the head whose
    chunks match it, the other head left damaged, so its quarantine takes none of the other's
    chunks (its own stay, a stray set)."""
    data = tmp_path / "data"
    other = group_items("big", 2, 2, response=RESPONSE + 4096)  # other bytes than big_group's
    with Store(data, seed=1) as store:
        store.create_table(table)
        push(store, big_group(0))
        push(store, other)
        heads = rows(store, "blobs")
    by_uid = {bytes(key[4:]).decode(): key for key in heads}
    damaged, flipped, victim = by_uid["big/0/0/0/r0s0"], by_uid["big/0/1/0/r1s0"], by_uid[other[0].uid]
    flipped_set = chunk_heads.read_head(heads[flipped]).set_id
    env = lmdb.open(str(data), max_dbs=layout.MAX_DBS)
    with env.begin(write=True) as txn:  # as format 8 left them, unmarked, two damaged since
        marks = marked(env, txn)
        for mark in marks:
            txn.delete(mark, db=env.open_db(b"chunks", txn=txn))
        for key, head in heads.items():
            old = bytearray(head)
            if key == flipped:
                old[4:12] = heads[victim][4:12]
            old[12:28] = digests.of(memoryview(bytes(old))[28:])
            if key == damaged:
                old[-20] ^= 0x01  # in the safetensors header of its prefix
            txn.put(key, bytes(old), db=env.open_db(b"blobs", txn=txn))
        txn.put(b"format", b"8", db=env.open_db(b"meta", txn=txn))
    env.close()
    upgrade_killed_before_its_commit(data)
    with Store(data) as store:
        with store.environment.read() as txn:
            assert txn.get(b"format", db=store.db["meta"]) == str(layout.FORMAT).encode()
        after = rows(store, "blobs")
        intact = {key: chunk_heads.read_head(head).intact for key, head in after.items()}
        assert intact == {key: key not in (damaged, flipped) for key in heads}
        assert all(after[key] == head for key, head in heads.items() if intact[key])
        chunks = rows(store, "chunks")
        assert sorted(chunks[mark] for mark in marks if mark in chunks) == sorted(
            key for key in heads if key != flipped
        )
        uids = [bytes(key[4:]).decode() for key in (damaged, flipped)]
        problems = "".join(store.verify("big"))
        assert all(uid in problems for uid in uids)
        assert store.quarantine("big", uids) == 2
        assert store.get("big", [item.uid for item in other]) == {item.uid: trxp.pack_item(item) for item in other}
        assert store.verify("big") == [STRAY]
        store.environment.submit(lambda txn: chunked.drop_set(txn, store.db, bytes(flipped[:4]), flipped_set))
        assert store.verify("big") == []
        batch = take(store, "big", num_groups=1, delivery="consume")
        assert batch is not None and set(batch.uids) == {item.uid for item in other}
        batch.release()
