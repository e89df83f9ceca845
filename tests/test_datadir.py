"""A data directory written by an earlier release opens, with every table, group, lease
and counter where that release left them (tests/fixtures/datadir_v1, made by make.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from expbuf.client import decode, trxp
from expbuf.server.advantages.batch_stage import finish_batch
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.errors import StoreError
from expbuf.server.store.schema.table_config import TableConfig

import cli_forks
from conftest import FIXTURES
from helpers import group_items, make_experience, take

V1 = FIXTURES / "datadir_v1"
MANIFEST = json.loads((V1 / "manifest.json").read_text())
COUNTS = ("pending", "computing", "ready", "leased", "consumed", "failed", "bytes", "pushed", "sampled")


@pytest.fixture
def v1(tmp_path: Path) -> Path:
    shutil.copy(V1 / "data.mdb", tmp_path / "data.mdb")
    return tmp_path


def test_first_format_opens_with_everything_in_place(v1: Path) -> None:
    now = MANIFEST["now"]
    with Store(v1, clock=lambda: now) as store:
        assert {t.name for t in store.list_tables()} == set(MANIFEST["stats"])
        assert store.table("turns").advantages.estimator == "discounted_return"  # version 1's "reinforce"
        for table, want in MANIFEST["stats"].items():
            stats = store.stats(table)
            assert {k: stats[k] for k in COUNTS} == {k: want[k] for k in COUNTS}, table
            assert store.verify(table) == [], table
        for table, uids in MANIFEST["stored"].items():
            assert sorted(store.get(table, MANIFEST["pushed"][table])) == uids
        lease = MANIFEST["lease"]
        assert store.ack(lease["id"], lease["table"]) == 4
        ready = take(store, "grpo4", num_groups=1)
        assert ready.group_ids == ["1/0"] * 4
        assert all(e.advantages is not None for e in decode(ready.payload))
        replayed = take(store, "plain", num_groups=2, delivery="replay")
        assert sorted(set(replayed.group_ids)) == ["3/0", "3/1"]
        for table in MANIFEST["stats"]:
            assert store.verify(table) == [], table


def test_first_format_takes_new_pushes_and_completes_its_pending_group(v1: Path) -> None:
    with Store(v1) as store:
        pending = [item for item in group_items(1, 3, 4) if item.eid.run >= 2]
        for item in pending:
            item.meta["eid"]["suffix"] = f"r{item.eid.run}"
        assert store.put("grpo4", pending).completed_groups == ["1/3"]
        assert AdvantageWorker(store).run_once() == 1
        assert take(store, "grpo4", num_groups=1, order="lifo").group_ids == ["1/3"] * 4
        store.put("turns", group_items(5, 0, 2))
        assert AdvantageWorker(store).run_once() == 2
        assert store.verify("grpo4") == [] and store.verify("turns") == []


def test_a_retried_push_of_a_stored_experience_stays_a_duplicate(v1: Path) -> None:
    """make.py's group 1/0, built again: the upgraded directory knows it by its content."""
    import torch

    from expbuf.client import EID, Experience, trxp

    items = [
        trxp.from_experience(
            Experience(
                eid=EID(batch=1, task=0, run=run, step=0, suffix=f"r{run}"),
                tokens=torch.arange(7, dtype=torch.int32),
                prompt_length=3,
                logprobs=torch.full((4,), -0.5),
                action_mask=torch.tensor([True, False, True, True]),
                reward=float(run),
                info={"model_version": 1, "priority": 0.0},
            )
        )
        for run in range(4)
    ]
    with Store(v1) as store:
        assert store.put("grpo4", items).duplicates == [item.uid for item in items]


def test_first_format_tables_now_finished_per_batch_compute_their_ready_groups_again(v1: Path) -> None:
    """grpo over the batch's std stored final values in format 1; its ready groups are
    computed again, so the batch stage never finishes a final value twice."""
    import lmdb

    env = lmdb.open(str(v1), max_dbs=32)
    with env.begin(write=True, db=env.open_db(b"tables")) as txn:
        record = json.loads(txn.get(b"grpo4"))
        record["config"]["estimator_params"] = {"std_over_batch": 1.0}
        txn.put(b"grpo4", json.dumps(record).encode())
    env.close()
    with Store(v1, batch_stage=finish_batch) as store:
        assert store.table("grpo4").advantages.params == {"std_cal_level": 1.0}
        stats = store.stats("grpo4")
        assert (stats["groups_ready"], stats["groups_computing"]) == (0, 1)
        assert store.verify("grpo4") == []
        assert AdvantageWorker(store).run_once() == 1
        batch = take(store, "grpo4", num_groups=1)
        rewards = [0.0, 1.0, 2.0, 3.0]
        mean, std = sum(rewards) / 4, (sum((r - 1.5) ** 2 for r in rewards) / 3) ** 0.5
        got = [float(e.advantages[0]) for e in decode(batch.payload)]
        assert got == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards], abs=1e-5)


def upgrade_notice(data: Path, found: int) -> str:
    """What `expbuf check` prints for a directory that only needs the upgrade a start makes."""
    return (
        f"{data}: data directory format {found}, which the next expbuf serve upgrades to format {layout.FORMAT};"
        " run expbuf check after that to check its tables"
    )


def test_check_says_an_older_format_is_brought_up_to_date_at_start_and_then_passes(v1: Path) -> None:
    def check() -> subprocess.CompletedProcess:
        return cli_forks.run("check", "--data", str(v1), timeout=120)

    before = check()  # nothing damaged: only the upgrade the next start makes, exit 0
    assert before.returncode == 0 and not before.stderr, before.stderr
    assert before.stdout.strip() == upgrade_notice(v1, 1)
    data = (v1 / "data.mdb").read_bytes()
    refused = cli_forks.run("repair", "--data", str(v1), timeout=120)
    assert refused.returncode == 2 and "run expbuf serve once to bring it up to date" in refused.stderr, refused
    assert (v1 / "data.mdb").read_bytes() == data  # repair brings nothing up to date
    Store(v1, clock=lambda: MANIFEST["now"]).close()  # the upgrade a server's start makes
    after = check()
    assert after.returncode == 0 and not after.stderr, after.stderr
    assert sorted(after.stdout.splitlines()) == sorted(f"{table}: ok" for table in MANIFEST["stats"])


OPEN_AND_SAMPLE = """
import sys
from pathlib import Path
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import StoreError
from expbuf.server.store.schema.sample_spec import TakeSpec
try:
    with Store(Path(sys.argv[1])) as store:
        store.sample(TakeSpec("t", num_groups=60, delivery="replay", allow_partial=True))
except StoreError as exc:
    print(exc)
"""


@pytest.mark.parametrize("cut", ["half", "the last pages"])
def test_a_data_file_cut_short_is_refused_naming_it_where_it_killed_the_process(tmp_path: Path, cut: str) -> None:
    """A data.mdb shorter than the pages its last commit uses (a copy or a restore that did not
    finish): an open, and `expbuf check`, died with SIGBUS and no word at the first read of a page
    past its end (a helper's audit). Refused now, naming the file's size and what it needs."""
    data = tmp_path / "data"
    with Store(data, map_size=1 << 22) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_by="none"))
        for task in range(60):
            store.put("t", [trxp.from_experience(make_experience(1, task, 0, response=3000))])
    size = (data / "data.mdb").stat().st_size
    os.truncate(data / "data.mdb", size // 2 if cut == "half" else size - 128 * 1024)
    opened = subprocess.run([sys.executable, "-c", OPEN_AND_SAMPLE, str(data)], capture_output=True, text=True)
    assert opened.returncode == 0 and "the file was cut short" in opened.stdout, (opened.returncode, opened.stderr)
    checked = cli_forks.run("check", "--data", str(data))
    assert checked.returncode == 1 and "the file was cut short" in checked.stdout, (checked.returncode, checked.stderr)


def test_check_and_repair_refuse_a_newer_format_as_serve_does_not_as_damage(tmp_path: Path) -> None:
    """A directory a later release wrote: `expbuf serve` refuses it, naming its format; check
    called it damaged ('the format record is b"12", not 11') and went on to check its tables with
    this release's rules, and repair refused it as damaged (a helper's audit)."""
    data = tmp_path / "data"
    with Store(data) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_by="none"))
    env = lmdb.open(str(data), max_dbs=layout.MAX_DBS)
    with env.begin(write=True) as txn:
        txn.put(b"format", str(layout.FORMAT + 1).encode(), db=env.open_db(b"meta", txn=txn))
    env.close()
    for command in ("check", "repair"):
        ran = cli_forks.run(command, "--data", str(data))
        newer = f"data directory format {layout.FORMAT + 1}, newer than this expbuf reads (up to {layout.FORMAT})"
        assert ran.returncode == 2 and newer in ran.stderr, (command, ran.returncode, ran.stdout, ran.stderr)


def test_a_directory_whose_format_record_is_gone_is_damage_not_the_first_format(tmp_path: Path) -> None:
    """A directory of tables without a format record was taken for format 1 (which recorded none):
    check said a server would bring it up to date, exit 0, and serve ran format 1's upgrade over a
    later format's records, after which every table failed to read (one byte flipped in its page, a
    helper's audit). Without format 1's own databases it is damage: check names it, a start refuses
    it naming the directory, and the first format's directory still upgrades (the tests above)."""
    data = tmp_path / "data"
    with Store(data) as store:
        store.create_table(TableConfig.of("t", estimator="none"))
        store.put("t", group_items(0, 0, 1))
    env = lmdb.open(str(data), max_dbs=layout.MAX_DBS)
    with env.begin(write=True) as txn:
        assert txn.delete(b"format", db=env.open_db(b"meta", txn=txn))
    env.close()
    ran = cli_forks.run("check", "--data", str(data))
    assert ran.returncode == 1 and "the format record (" in ran.stdout + ran.stderr, (ran.stdout, ran.stderr)
    with pytest.raises(StoreError, match="its format record is gone"):
        Store(data)
    ran = cli_forks.run("check", "--data", str(data))  # the refused start changed nothing
    assert ran.returncode == 1 and "the format record (" in ran.stdout + ran.stderr


def test_check_names_a_damaged_page_wherever_it_is_without_a_traceback(tmp_path: Path) -> None:
    """`expbuf check` of a directory one of whose pages LMDB finds of the wrong type ended in a
    traceback (MDB_BAD_TXN: it read the quarantined counts in the transaction the damage ended) where
    the damage it exists to report was (a helper's audit): each page's type flipped in turn, check
    exits 0 or 1, names what it found, and never a traceback."""
    data = tmp_path / "data"
    with Store(data) as store:
        store.create_table(TableConfig.of("t", estimator="none"))
        store.put("t", group_items(0, 0, 1))
    whole = (data / "data.mdb").read_bytes()
    page = 4096
    corrupted = 0
    for pgno in range(2, len(whole) // page):
        copy = tmp_path / f"page{pgno}"
        copy.mkdir()
        flipped = bytearray(whole)
        flipped[pgno * page + 16] ^= 0xFF  # the place of its first node: LMDB finds the page of the wrong type
        (copy / "data.mdb").write_bytes(bytes(flipped))
        ran = cli_forks.run("check", "--data", str(copy))
        assert ran.returncode in (0, 1) and "Traceback" not in ran.stderr, (pgno, ran.stdout, ran.stderr)
        corrupted += "Corrupted" in ran.stdout
        shutil.rmtree(copy)
    assert corrupted  # some page's damage was met as LMDB's


def test_check_reads_each_table_after_lmdb_damage_in_a_transaction_of_its_own(tmp_path: Path) -> None:
    """LMDB ends a read transaction in which it met a damaged page, and `expbuf check` read every
    table in one: each table after the damaged one was reported "reading it raised BadTxnError",
    damage it does not have, which an operator deciding what to restore reads as more loss. A
    table whose check LMDB's damage ended is followed by a fresh transaction: each page's type
    flipped in turn, no table is reported so."""
    data = tmp_path / "data"
    with Store(data) as store:
        for name in ("a", "b", "c"):
            store.create_table(TableConfig.of(name, estimator="none"))
            store.put(name, group_items(0, 0, 1))
    whole = (data / "data.mdb").read_bytes()
    page = 4096
    for pgno in range(2, len(whole) // page):
        copy = tmp_path / f"page{pgno}"
        copy.mkdir()
        flipped = bytearray(whole)
        flipped[pgno * page + 16] ^= 0xFF
        (copy / "data.mdb").write_bytes(bytes(flipped))
        ran = cli_forks.run("check", "--data", str(copy))
        assert "BadTxnError" not in ran.stdout, (pgno, ran.stdout)
        shutil.rmtree(copy)


def test_the_lmdb_environment_of_another_program_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """`data` pointed at another program's LMDB environment (a typo in a path, a shared volume):
    expbuf took it for a new directory and wrote its thirty-odd databases into it, beside the other
    program's. It is refused, naming what the environment holds, and nothing is written to it."""
    data = tmp_path / "other"
    env = lmdb.open(str(data), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v", db=env.open_db(b"their_records", txn=txn))
    env.close()
    with pytest.raises(StoreError, match=r"not an expbuf data directory.*their_records"):
        Store(data)
    env = lmdb.open(str(data), max_dbs=4, readonly=True, lock=False)
    with env.begin() as txn:
        assert [bytes(key) for key, _ in txn.cursor()] == [b"their_records"]
    env.close()
