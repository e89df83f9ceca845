"""Quarantine (server/store/rules/quarantine.py): an experience whose stored payload no longer matches
its digest is quarantined by whichever read finds it (a sample, a Get, the advantage worker's
read of token-level payloads), never served, counted by state and in `damaged`, logged once;
its group fails and its other members keep their payloads for Get until their tombstones are
forgotten. The damage is made here by changing a stored payload's byte in place, as a bad page
would (tests/faults/test_fault_datadir.py writes over the file itself)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest

from expbuf.client import BufferClient, decode
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.kinds import Sampled
from expbuf.server.store.disk.records import ItemRecord
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import group_items, make_experience, scrape


def damage(store: Store, table: str, uid: str) -> None:
    """Flip one byte of the uid's stored payload (its last tensor's), its size unchanged."""
    key, blobs = layout.table_prefix(store.catalog.lookup(table)[0]) + uid.encode(), store.db["blobs"]

    def flip(txn) -> None:  # type: ignore[no-untyped-def]
        blob = bytearray(txn.get(key, db=blobs))
        blob[-1] ^= 0xFF
        txn.put(key, bytes(blob), db=blobs)

    store.environment.submit(flip)


def uids(task: int, size: int = 4) -> list[str]:
    return [f"0/{task}/{run}/0/r{run}s0" for run in range(size)]


def two_groups_leased(store: Store) -> Sampled:
    """Table t's groups 0/0 and 0/1 of 4, in one leased batch."""
    store.create_table(TableConfig.of("t", estimator="none", group_size=4))
    for task in range(2):
        store.put("t", group_items(0, task, 4, reward=float(task)))
    batch = store.sample(TakeSpec("t", num_groups=2, wait_seconds=0, delivery="lease"), hold=False)
    assert batch is not None and batch.lease_id
    return batch


def quarantine_logs(caplog: pytest.LogCaptureFixture, uid: str) -> int:
    return sum(uid in r.getMessage() and "quarantined" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("keep_failed", [True, False])
def test_a_get_quarantines_a_damaged_experience_and_its_group_keeps_the_others_for_get(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, keep_failed: bool, table_layout: str
) -> None:
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4, keep_failed=keep_failed))
        for task in range(3):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        bad, good = uids(1)[2], [uid for uid in uids(1) if uid != uids(1)[2]]
        damage(store, "t", bad)
        payload, missing = store.get_payload("t", uids(1))
        assert missing == [bad]
        assert [e.eid.uid for e in decode(payload)] == good
        stats = store.stats("t")
        assert (stats["quarantined"], stats["damaged"], stats["failed"], stats["groups_failed"]) == (1, 1, 3, 1)
        assert (stats["ready"], stats["groups_ready"], stats["bytes"] > 0) == (8, 2, True)
        assert "experience 0/1/2/0/r2s0 quarantined" in stats["last_failure"]
        assert store.verify("t") == []
        # Never served, logged once: a second Get, the raw read and samples find it gone.
        assert store.get_payload("t", [bad])[1] == [bad] and store.get("t", uids(1)).keys() == set(good)
        served = []
        while (batch := store.sample(TakeSpec("t", num_groups=1, wait_seconds=0))) is not None:
            served += batch.uids
        assert sorted(served) == sorted(uids(0) + uids(2))
        assert quarantine_logs(caplog, bad) == 1
        assert store.stats("t")["damaged"] == 1


def test_a_sample_quarantines_and_serves_the_other_groups(tmp_path: Path, table_layout: str) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4))
        for task in range(4):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        damage(store, "t", uids(0)[0])
        damage(store, "t", uids(2)[3])
        batch = store.sample(TakeSpec("t", num_groups=2, wait_seconds=0))
        assert batch is not None and batch.group_ids == ["0/1"] * 4 + ["0/3"] * 4
        stats = store.stats("t")
        assert (stats["quarantined"], stats["failed"], stats["groups_failed"], stats["ready"]) == (2, 6, 2, 0)
        assert store.verify("t") == []


def test_a_kept_payload_found_damaged_is_quarantined_alone(tmp_path: Path, table_layout: str) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4))
        store.put("t", group_items(0, 0, 4))
        damage(store, "t", uids(0)[0])
        assert store.get_payload("t", uids(0))[1] == [uids(0)[0]]
        damage(store, "t", uids(0)[1])  # a failed member whose payload was kept for Get
        assert store.get("t", uids(0)).keys() == set(uids(0)[2:])
        stats = store.stats("t")
        assert (stats["quarantined"], stats["damaged"], stats["failed"], stats["groups_failed"]) == (2, 2, 2, 1)
        assert store.verify("t") == []


def test_quarantined_tombstones_are_forgotten_in_time_and_the_total_stays(tmp_path: Path, table_layout: str) -> None:
    now = [1000.0]
    with Store(tmp_path, clock=lambda: now[0]) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, tombstone_seconds=60))
        store.put("t", group_items(0, 0, 2))
        damage(store, "t", uids(0, 2)[0])
        store.get_payload("t", uids(0, 2))
        now[0] += 61
        store.tick()
        stats = store.stats("t")
        assert (stats["quarantined"], stats["failed"], stats["damaged"]) == (0, 0, 1)
        assert store.get_payload("t", uids(0, 2))[1] == uids(0, 2)
        assert store.put("t", group_items(0, 0, 2)).stored == uids(0, 2)  # pushed again, it is stored anew
        assert store.verify("t") == []


def test_the_advantage_worker_quarantines_a_damaged_token_level_payload(tmp_path: Path, table_layout: str) -> None:
    """rloo reads each member's tokens: a group with a damaged one is not computed, the
    damaged member is quarantined, the other groups are computed."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="rloo", group_size=4, drop_zero_variance=False))
        for task in range(3):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        damage(store, "t", uids(1)[3])
        worker = AdvantageWorker(store)
        assert worker.run_once() == 2
        stats = store.stats("t")
        assert (stats["groups_ready"], stats["groups_failed"], stats["quarantined"], stats["computing"]) == (2, 1, 1, 0)
        assert store.verify("t") == []


# What a test loses (a uid's record, a records table's alone, or its payload) on which layout.
LOST = [("items", "records"), ("blobs", "records"), ("blobs", "rows")]


def lose(store: Store, table: str, uid: str, db: str) -> None:
    """Delete the uid's entry from one database (its record: items; its payload: blobs), as
    damage that lost a page of it would."""
    key = layout.table_prefix(store.catalog.lookup(table)[0]) + uid.encode()
    store.environment.submit(lambda txn: txn.delete(key, db=store.db[db]))


def garble(store: Store, table: str, name: str, db: str, keep: int | None = None) -> None:
    """Cut a uid's record (items) or a group's (groups) to its first `keep` bytes (None: half), as a
    damaged page would leave it: stored, and no longer decoding."""
    key, where = layout.table_prefix(store.catalog.lookup(table)[0]) + name.encode(), store.db[db]

    def cut(txn) -> None:  # type: ignore[no-untyped-def]
        raw = bytes(txn.get(key, db=where))
        txn.put(key, raw[: len(raw) // 2 if keep is None else keep], db=where)

    store.environment.submit(cut)


# Where `hurt` cuts a record: at half, one byte into its group's name (after its fixed head and the
# name's length), one byte short of its end (inside its run id, the last of its strings).
CUTS = {"cut": None, "cut in its group": ItemRecord._HEAD.size + 3, "cut in its run id": -1}


def hurt(store: Store, table: str, uid: str, how: str) -> None:
    """The uid's record lost (`how`: "lost") or cut so that it no longer decodes (one of CUTS), as damage would."""
    if how == "lost":
        lose(store, table, uid, "items")
    else:
        garble(store, table, uid, "items", CUTS[how])


@pytest.mark.parametrize("keep", [0, 3])
def test_a_payload_cut_shorter_than_four_bytes_is_quarantined_and_the_others_served(
    tmp_path: Path, table_layout: str, keep: int
) -> None:
    """A payload a damaged page left shorter than any magic: the take that reads it finds it
    damaged (its batch not checked at once), quarantines its group and serves the others."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4))
        for task in range(3):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        garble(store, "t", uids(1)[1], "blobs", keep)
        batch = store.sample(TakeSpec("t", num_groups=2, wait_seconds=0))
        assert batch is not None and batch.group_ids == ["0/0"] * 4 + ["0/2"] * 4
        stats = store.stats("t")
        assert (stats["quarantined"], stats["damaged"], stats["failed"], stats["groups_failed"]) == (1, 1, 3, 1)
        assert store.verify("t") == []


@pytest.mark.parametrize(("db", "table_layout"), LOST, indirect=["table_layout"])
@pytest.mark.parametrize("hold", [False, True])
def test_a_sample_quarantines_a_group_whose_member_is_lost_and_serves_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, db: str, hold: bool, table_layout: str
) -> None:
    """A member its group names whose record (or payload) is not stored: the sample that finds
    it quarantines its group as it does a damaged payload, counted and logged, and serves the
    other groups; the group's other members keep their payloads for Get, and the table checks
    clean after it."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4))
        for task in range(4):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        lost = uids(1)[2]
        lose(store, "t", lost, db)
        batch = store.sample(TakeSpec("t", num_groups=3, wait_seconds=0), hold=hold)
        assert batch is not None and batch.group_ids == ["0/0"] * 4 + ["0/2"] * 4 + ["0/3"] * 4
        stats = store.stats("t")
        assert (stats["quarantined"], stats["damaged"], stats["failed"], stats["groups_failed"]) == (1, 1, 3, 1)
        assert f"experience {lost} quarantined" in stats["last_failure"]
        assert quarantine_logs(caplog, lost) == 1
        payload, missing = store.get_payload("t", uids(1))
        assert missing == [lost] and [e.eid.uid for e in decode(payload)] == [u for u in uids(1) if u != lost]
        assert store.verify("t") == []


def test_a_sample_stream_of_a_table_with_a_lost_member_is_served_the_others(
    start_server: Servers, records_layout: None
) -> None:
    """Through the server: the Sample stream that meets a member whose record is gone is served
    the table's other groups, not refused INTERNAL, and the quarantine shows in Stats and the
    metrics."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        client.create_table("t", estimator="none", group_size=4)
        for task in range(3):
            client.push([make_experience(0, task, run) for run in range(4)], "t")
        lose(server.store, "t", uids(1)[0], "items")
        served = [uid for batch in itertools.islice(client.sample("t", num_groups=1), 2) for uid in batch.uids]
        assert sorted(served) == sorted(uids(0) + uids(2))
        stats = client.stats("t").tables["t"]
        assert (stats.damaged, stats.quarantined, stats.groups_failed) == (1, 1, 1)
    metrics = scrape(server.metrics_port)
    assert metrics[("expbuf_damaged_total", (("table", "t"),))] == 1
    assert metrics[("expbuf_buffer_experiences", (("state", "quarantined"), ("table", "t")))] == 1


@pytest.mark.parametrize("how", ["lost", "cut", "cut in its run id"])
def test_a_read_by_uid_lists_a_member_whose_record_is_lost_as_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, records_layout: None, how: str
) -> None:
    """Get, its raw read and ReadFields (whole or by field) serve the others and list a payload
    whose record is lost as missing, logged with its uid, where they refused the whole read; and
    ListExperiences lists the others, logged, where it refused the page ("experience ... is named
    but not stored"). A record a damaged page cut so that it no longer decodes (`cut`) is read as a
    lost one: each of these was refused INTERNAL (struct.error). So is one cut inside its last
    string, which decoded with that string cut short and was served. It is logged once, not by
    every read that meets it."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4))
        store.put("t", group_items(0, 0, 4))
        lost, others = uids(0)[1], [uid for uid in uids(0) if uid != uids(0)[1]]
        hurt(store, "t", lost, how)
        assert store.get("t", uids(0)).keys() == set(others)
        payload, missing = store.get_payload("t", uids(0))
        assert missing == [lost] and [e.eid.uid for e in decode(payload)] == others
        for whole in (False, True):
            batch, missing = store.read_fields("t", uids(0), whole=whole)
            try:
                assert (batch.uids, missing) == (others, [lost])
            finally:
                batch.release()
        assert any(lost in r.getMessage() and "its record is not" in r.getMessage() for r in caplog.records)
        assert [listed.uid for listed in store.list_experiences("t").items] == others
        assert sum(lost in r.getMessage() for r in caplog.records) == 1  # by the first read that met it
        assert store.stats("t")["ready"] == 4  # reads change nothing: a sample meets it


@pytest.mark.parametrize("how", ["lost", "cut"])
def test_stats_and_the_metrics_pass_over_an_oldest_experience_whose_record_is_lost(
    start_server: Servers, records_layout: None, how: str
) -> None:
    """The table's oldest live experience's record lost, or cut so that it no longer decodes: Stats and a
    scrape of the metrics give the age of the oldest whose record reads. A cut one made Stats refused
    INTERNAL (struct.error), and every scrape of the metrics, every table's, failed with it."""
    server = start_server()
    server.store.create_table(TableConfig.of("t", estimator="none", group_size=4))
    server.store.put("t", group_items(0, 0, 4))
    hurt(server.store, "t", uids(0)[0], how)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        assert 0 < client.stats("t").tables["t"].oldest_age_seconds < 60
    assert 0 < scrape(server.metrics_port)[("expbuf_oldest_age_seconds", (("table", "t"),))] < 60


@pytest.mark.parametrize("how", ["lost", "cut"])
def test_a_group_whose_record_is_lost_is_listed_and_its_lease_s_parts_are_the_other_groups(
    tmp_path: Path, records_layout: None, how: str
) -> None:
    """A group record lost (or cut so that it no longer decodes) under a lease: ListExperiences lists
    its members as their records say (ready, not leased) and the others' members as leased, and a
    rank's part of the lease is the other group's members, as a lost group is no longer the lease's.
    The page was refused ("group ... is named but not stored", or INTERNAL: struct.error), and so
    was the part of a cut one."""
    with Store(tmp_path) as store:
        batch = two_groups_leased(store)
        (lose if how == "lost" else garble)(store, "t", "0/0", "groups")
        listed = {item.uid: item.state for item in store.list_experiences("t").items}
        assert listed == {uid: "ready" for uid in uids(0)} | {uid: "leased" for uid in uids(1)}
        assert store.lease_part("t", batch.lease_id, 0, 1, "tokens") == (uids(1), uids(1), [])


@pytest.mark.parametrize(
    ("db", "table_layout"), [*LOST, ("digest", "records"), ("digest", "rows")], indirect=["table_layout"]
)
def test_a_sample_left_short_by_a_quarantine_keeps_it_and_the_table_checks_clean(
    tmp_path: Path, db: str, table_layout: str
) -> None:
    """A sample that quarantines a group (a member lost, or damaged) and then finds too few groups
    for its batch takes none, and the quarantine stands whole: the group failed, its members
    counted, the table clean. It stood in part: the tombstone and the payloads' deletes were
    written, not the group's failure nor the counters, so the group stayed ready in Stats with
    its members gone from the insertion order, and `expbuf check` found a dozen problems."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4))
        for task in range(4):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        if db == "digest":
            damage(store, "t", uids(1)[2])
        else:
            lose(store, "t", uids(1)[2], db)
        assert store.sample(TakeSpec("t", num_groups=4, wait_seconds=0), hold=False) is None
        stats = store.stats("t")
        assert (stats["quarantined"], stats["damaged"], stats["groups_failed"]) == (1, 1, 1), stats
        assert (stats["groups_ready"], stats["ready"]) == (3, 12), stats
        assert store.verify("t") == []
        batch = store.sample(TakeSpec("t", num_groups=3, wait_seconds=0), hold=False)
        assert batch is not None and sorted(set(batch.group_ids)) == ["0/0", "0/2", "0/3"]


def test_a_rank_s_part_whose_group_failed_after_its_split_names_that_group_missing(
    tmp_path: Path, table_layout: str
) -> None:
    """A member found damaged by a rank's read fails its group, which leaves the lease: the rank
    reading its part again (one that died and came back) was answered an empty part and nothing
    missing, the group gone unsaid; its members are named as missing."""
    with Store(tmp_path) as store:
        batch = two_groups_leased(store)
        parts = [store.lease_part("t", batch.lease_id, rank, 2, "tokens") for rank in range(2)]
        rank = next(rank for rank, (part, _, _) in enumerate(parts) if part == uids(1))
        damage(store, "t", uids(1)[2])
        read, missing = store.read_fields("t", parts[rank][0], whole=True)
        read.release()
        assert missing == [uids(1)[2]]
        assert store.lease_part("t", batch.lease_id, rank, 2, "tokens") == ([], uids(0), uids(1))
        assert store.lease_part("t", batch.lease_id, 1 - rank, 2, "tokens") == (uids(0), uids(0), [])


def test_a_rank_that_finds_a_member_of_its_part_damaged_reads_its_group_as_missing_every_time(
    start_server: Servers,
) -> None:
    """Damaged after the step was sampled: the rank's first read served the group's other members
    (of a group that failed) and named one missing, its next read named nothing. Each read now
    names the whole group missing, the same answer every time, and the other rank's part is whole."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("t", estimator="none", group_size=4)
        for task in range(2):
            client.push([make_experience(0, task, run, reward=float(run)) for run in range(4)], table="t")
        batch = next(client.sample("t", num_groups=2, delivery="lease", timeout=10, max_batches=1))
        parts = [client.read_part(batch.lease_id, rank, 2, ["tokens"], table="t").uids for rank in range(2)]
        rank = next(rank for rank, part in enumerate(parts) if part == uids(1))
        damage(server.store, "t", uids(1)[2])
        for _ in range(2):
            read = client.read_part(batch.lease_id, rank, 2, ["tokens"], table="t")
            assert (read.uids, sorted(read.missing_uids)) == ([], uids(1))
        other = client.read_part(batch.lease_id, 1 - rank, 2, ["tokens"], table="t")
        assert (other.uids, other.missing_uids) == (uids(0), [])
