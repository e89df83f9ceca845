"""The background scrub (server/store/services/scrub.py): every stored payload checked against its digest
in read transactions of bounded size, at a bounded rate, the damaged quarantined as a read
would in short write transactions of their own; the last complete pass kept across restarts;
progress and findings in ServerInfo, `expbuf stats` and the metrics."""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path

import pytest

from expbuf.client import BufferClient, trxp
from expbuf.client.rollout_pieces import split
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.services import scrub

import cli_forks
from helpers import ServerProcess, group_items, scrape
from test_partial_rollouts import hurt_piece, piece_key, rollout
from test_piece_damage import hurt_head
from test_quarantine import damage, uids


def filled(path: Path, groups: int = 40, **settings: object) -> Store:
    store = Store(path, **settings)  # type: ignore[arg-type]
    store.create_table(TableConfig.of("t", estimator="none", group_size=4))
    for task in range(groups):
        store.put("t", group_items(0, task, 4, reward=float(task)))
    return store


def test_a_pass_quarantines_what_no_read_met_and_keeps_the_pass_on_record(tmp_path: Path, table_layout: str) -> None:
    with filled(tmp_path) as store:
        for task, run in ((3, 0), (3, 2), (17, 1)):
            damage(store, "t", uids(task)[run])
        before = store.stats("t")
        assert store.scrub_status().last_pass_end_unix == 0.0
        assert store.scrub.run_pass() == 3
        status = store.scrub_status()
        assert (status.passes, status.found, status.checked, status.running) == (1, 3, 160, False)
        assert status.pass_total_bytes == status.pass_checked_bytes == status.checked_bytes == before["bytes"]
        assert status.last_pass_found == 3 and status.last_pass_end_unix > 0
        stats = store.stats("t")
        assert (stats["quarantined"], stats["damaged"], stats["groups_failed"], stats["failed"]) == (3, 3, 2, 5)
        assert store.verify("t") == []
        served = []
        while (batch := store.sample(TakeSpec("t", num_groups=8, wait_seconds=0, allow_partial=True))) is not None:
            served += batch.uids
        assert len(served) == 38 * 4 and not {*uids(3), *uids(17)} & set(served)
        assert store.scrub.run_pass() == 0  # found once: quarantined, never found again
        last = store.scrub_status()
    with Store(tmp_path) as store:  # the last complete pass is on record; the counts since the start are not
        again = store.scrub_status()
        assert (again.passes, again.found) == (0, 0)
        assert (again.last_pass_end_unix, again.last_pass_bytes) == (last.last_pass_end_unix, last.last_pass_bytes)


def test_it_reads_in_bounded_chunks_and_writes_only_what_it_found(tmp_path: Path, monkeypatch) -> None:
    """Each read transaction holds at most CHUNK_ITEMS payloads; the writer runs one short
    transaction per chunk that found damage, and one for the pass's record."""
    monkeypatch.setattr(scrub, "CHUNK_ITEMS", 16)
    with filled(tmp_path) as store:
        damage(store, "t", uids(1)[0])  # payloads in key order: 0/0, 0/1, 0/10: the first chunk
        damage(store, "t", uids(10)[0])  # the same chunk
        damage(store, "t", uids(30)[3])  # a later one
        chunks: list[int] = []
        read = store.scrub._chunk

        def counted(prefix: bytes, after: bytes, group_by: str | None) -> tuple[list[str], bytes | None, int, int, int]:
            result = read(prefix, after, group_by)
            chunks.append(result[4])
            return result

        monkeypatch.setattr(store.scrub, "_chunk", counted)
        batches = store.environment.batches
        assert store.scrub.run_pass() == 3
        assert store.environment.batches - batches == 3  # two chunks found damage, then the record
        assert max(chunks) == 16 and sum(chunks) == 160


def test_the_rate_bound_holds_and_a_close_ends_a_pass(tmp_path: Path, monkeypatch, table_layout: str) -> None:
    """A pass at a bound reads no faster than it (payloads and a records table's records; the
    machine's load only makes it slower); a store closed in the middle of a slow pass ends it at its
    next chunk, uncounted."""
    monkeypatch.setattr(scrub, "CHUNK_ITEMS", 16)
    with filled(tmp_path, groups=60) as store:
        store.scrub.mb_per_second = 0.1
        store.scrub.run_pass()
        status = store.scrub_status()
        records = 240 * 100 if table_layout == "records" else 0  # each record is at least 100 bytes
        assert status.last_pass_seconds >= (status.last_pass_bytes + records) / 0.1e6 * 0.99
    with Store(tmp_path, scrub_mb_per_second=0.001) as store:
        while not store.scrub_status().pass_checked_bytes:  # a chunk was read: the pass is under way
            store.scrub._stop.wait(0.01)
    status = store.scrub_status()
    assert status.passes == 0 and status.pass_checked_bytes < status.pass_total_bytes


def test_a_server_scrubs_after_its_start_and_shows_it(tmp_path: Path, table_layout: str) -> None:
    with filled(tmp_path / "data") as store:
        damage(store, "t", uids(5)[1])
    server = ServerProcess(str(tmp_path / "data"), "--scrub-mb-per-second", "1000")
    try:
        with BufferClient(server.target, timeout=20) as client:
            deadline = time.monotonic() + 60
            while client.server_info().scrub.passes < 1:
                assert time.monotonic() < deadline, "no scrub pass in a minute"
                time.sleep(0.05)
            info = client.server_info()
            assert (info.scrub.passes, info.scrub.found, info.scrub.mb_per_second) == (1, 1, 1000)
            assert info.scrub.last_pass_found == 1 and info.scrub.progress == 1.0
            assert client.stats("t")["t"].quarantined == 1
        metrics = scrape(server.metrics_port)
        assert metrics[("expbuf_scrub_found_total", ())] == 1
        assert metrics[("expbuf_scrub_passes_total", ())] == 1
        assert metrics[("expbuf_scrub_checked_experiences_total", ())] == 160
        assert metrics[("expbuf_buffer_experiences", (("state", "quarantined"), ("table", "t")))] == 1
        assert metrics[("expbuf_scrub_last_pass_end_timestamp_seconds", ())] > 0
        stats = cli_forks.run("stats", "--target", server.target)
        assert stats.returncode == 0, stats.stderr
        shown = stats.stdout
        assert "scrub idle (at most 1000 MB/s, every 24.0h), found 1 damaged since the start" in shown
        assert "; last complete pass " in shown and ", 1 found)" in shown
    finally:
        assert server.stop(signal.SIGTERM) == 0


def test_a_pass_reads_the_rollouts_held_in_pieces_and_drops_a_damaged_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, table_layout: str
) -> None:
    """The scrub read no piece of a rollout held in pieces: one damaged on disk waited for the
    rollout's last piece to be put together into it. A pass checks each piece against the size and
    digest its rollout's head took at its push (in chunks that may cut a rollout's pieces), and drops
    the rollouts with a piece damaged or lost, counted as damage found and logged, as a read of them
    would; the intact one stays, and the next pass finds nothing."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    monkeypatch.setattr(scrub, "CHUNK_ITEMS", 3)
    with filled(tmp_path, groups=2) as store:
        held = [rollout(task=50, run=run) for run in range(3)]
        for whole in held:
            for piece in split(whole, [4, 8])[:2]:
                assert store.put("t", [trxp.from_experience(piece)]).partial == [whole.eid.uid]
        head = layout.table_prefix(store.catalog.lookup("t")[0]) + held[2].eid.uid.encode() + b"\0"
        with store.environment.read() as txn:
            unread = sum(len(txn.get(piece_key(head, n), db=store.db["partials"])) for n in (0, 1))
        hurt_piece(store, "t", held[1].eid.uid, 1)
        hurt_piece(store, "t", held[2].eid.uid, 0, "lost")
        before = store.stats("t")
        assert store.scrub.run_pass() == 2
        status = store.scrub_status()
        assert (status.found, status.checked, status.last_pass_found) == (2, 8, 2)
        assert status.pass_total_bytes == before["bytes"] + before["partial_bytes"]
        assert status.pass_checked_bytes == status.pass_total_bytes - unread  # run 2's: lost, then not read on
        stats = store.stats("t")
        assert (stats["partials"], stats["damaged"], stats["quarantined"]) == (1, 2, 0)
        assert stats["last_failure"].startswith(f"partial rollout {held[2].eid.uid}, piece 0: it is not stored")
        assert sum("scrub" not in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records) == 2
        (left,) = trxp.decode(store.get_partials("t", ["0/50"])[0])
        assert left.eid.uid == held[0].eid.uid
        assert store.verify("t") == []
        assert store.scrub.run_pass() == 0


def test_a_pass_drops_a_rollout_held_in_pieces_whose_head_does_not_decode(tmp_path: Path) -> None:
    """The scrub logged a rollout's head that a damaged page left undecodable, pass after pass, and
    left its pieces held, counted against the capacity, for a push or a read of it to meet. It drops
    the rollout as they now do, counted as damage found; the task's other rollout stays."""
    with filled(tmp_path, groups=1) as store:
        damaged, intact = rollout(task=50, run=1), rollout(task=50, run=0)
        for whole in (intact, damaged):
            store.put("t", [trxp.from_experience(split(whole, [4, 8])[0])])
        hurt_head(store, "t", damaged.eid.uid)
        assert store.scrub.run_pass() == 1
        stats = store.stats("t")
        assert (stats["partials"], stats["damaged"]) == (1, 1)
        assert stats["last_failure"].startswith(f"partial rollout {damaged.eid.uid}: its head does not decode (")
        assert store.verify("t") == []
        assert store.scrub.run_pass() == 0


@pytest.mark.parametrize("value", ["-1", "100001", "x"])
def test_the_rate_is_a_checked_setting(value: str, tmp_path: Path) -> None:
    done = cli_forks.run(
        "serve", "--data", str(tmp_path), "--port", "0", "--metrics-port", "-1",
        env={"EXPBUF_SCRUB_MB_PER_SECOND": value},
    )  # fmt: skip
    assert done.returncode == 2
    assert "scrub_mb_per_second" in done.stderr or "EXPBUF_SCRUB_MB_PER_SECOND" in done.stderr


def test_a_pass_checks_a_rows_tables_payloads_against_its_rows(tmp_path: Path) -> None:
    """A rows table (issue 64) keeps no item record: a pass reads each payload's digest from its
    group's segment, or a pending group's fragments, and quarantines what it finds as a read would
    (the group fails whole, its damaged members quarantined); retired payloads are not there to check."""
    with Store(tmp_path) as store:
        config = TableConfig.of("t", estimator="none", group_size=4)
        store.create_table(dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout="rows")))
        for task in range(12):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        store.put("t", group_items(0, 20, 2))  # a pending group
        assert store.sample(TakeSpec("t", num_groups=2, wait_seconds=0)) is not None  # tasks 0, 1 consumed
        for task, run in ((3, 0), (3, 2), (7, 1), (20, 1)):
            damage(store, "t", uids(task)[run])
        before = store.stats("t")
        assert store.scrub.run_pass() == 4
        status = store.scrub_status()
        assert (status.found, status.checked, status.pass_checked_bytes) == (4, 10 * 4 + 2, before["bytes"])
        stats = store.stats("t")
        assert (stats["damaged"], stats["groups_failed"], stats["failed"], stats["quarantined"]) == (4, 3, 6, 4)
        assert store.verify("t") == []
        served = store.sample(TakeSpec("t", num_groups=10, wait_seconds=0, allow_partial=True))
        assert served is not None and len(served.uids) == 8 * 4 and not {3, 7} & {int(g[2:]) for g in served.group_ids}
        assert store.scrub.run_pass() == 0


def test_a_segment_that_does_not_decode_is_reported_and_the_pass_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rows table's segment a damaged page left undecodable is structure, for `expbuf check`, as a
    records table's undecodable record is: the pass logs it and goes on to every other payload, so the
    damage behind it is still quarantined (a pass that stopped there would stop there every time)."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        for name in ("a", "b"):
            config = TableConfig.of(name, estimator="none", group_size=4)
            store.create_table(dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout="rows")))
            store.put(name, group_items(0, 0, 4))
        segment = layout.table_prefix(store.catalog.lookup("a")[0]) + layout.u64(0)

        def garble(txn) -> None:  # type: ignore[no-untyped-def]
            txn.put(segment, b"\xff" + bytes(txn.get(segment, db=store.db["segs"]))[1:], db=store.db["segs"])

        store.environment.submit(garble)
        damage(store, "b", uids(0)[1])
        assert store.scrub.run_pass() == 1
        assert store.stats("b")["quarantined"] == 1 and store.scrub_status().passes == 1
        assert any("scrub" in r.getMessage() and "does not decode" in r.getMessage() for r in caplog.records)
