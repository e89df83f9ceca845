"""`expbuf check` and the check at open read the prompt ledger too: a real data directory
with a dataset in every state, then damaged through LMDB writes of the kind a bug or a torn
copy would leave, each named by the check (dataset and prompt) and refused at open."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from expbuf.client import trxp
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.environment import Environment
from expbuf.server.store.ledger.claimed import Claimed
from expbuf.server.store.ledger.records import (
    DatasetRecord,
    PromptRecord,
    counts_key,
    dataset_key,
    encode_counts,
    expiry_key,
    group_entry,
    group_entry_key,
    place,
    prompt_key,
    queue_key,
)
from expbuf.server.store.schema.errors import Damaged
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.tables import integrity

import cli_forks
from helpers import make_experience


def items(prompt: Claimed, runs: range) -> list[trxp.RawItem]:
    """The experiences of one attempt at a prompt of dataset math."""
    return [
        trxp.from_experience(
            make_experience(f"math/{prompt.epoch}", f"{prompt.index}@{prompt.attempt}", run, reward=float(run))
        )
        for run in runs
    ]


@pytest.fixture(scope="module")
def ledger_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stopped store whose dataset math (4 prompts, 2 epochs, index order) holds prompt 0/0
    trained, 0/1 generated, 0/2 claimed and 0/3 sent back (pending, queued, attempt 1)."""
    data = tmp_path_factory.mktemp("ledger") / "data"
    with Store(data) as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        store.claims.create("t", DatasetRecord("math", size=4, epochs=2))
        trained, generated, claimed, released = store.claims.claim("t", "math", 4, seconds=3600)[0]
        store.put("t", items(trained, range(2)))
        assert store.sample(TakeSpec("t", num_groups=1)) is not None
        store.put("t", items(generated, range(2)))
        store.put("t", items(claimed, range(1)))
        assert store.claims.release("t", "math", [(released.epoch, released.index, released.attempt)]) == 1
        (ds,) = store.claims.datasets("t", "math")
        assert ds.counts[0] == {"claimed": 1, "generated": 1, "trained": 1}
        assert store.verify("t") == []
    return data


def report(data: Path) -> dict[str, list[str]]:
    """What `expbuf check` finds, read in-process."""
    environment = Environment(data, readonly=True)
    try:
        with environment.read() as txn:
            return integrity.scan(txn, environment.db, time.time())
    finally:
        environment.close()


Write = Callable[[lmdb.Transaction, "lmdb._Database", int], None]


def damaged(source: Path, into: Path, write: Write) -> Path:
    """A copy of the directory with one change written straight into its ledger database."""
    shutil.copytree(source, into)
    env = lmdb.open(str(into), max_dbs=layout.MAX_DBS)
    try:
        tables, ledger = env.open_db(b"tables"), env.open_db(b"ledger")
        with env.begin(write=True) as txn:
            table_id = json.loads(txn.get(b"t", db=tables))["id"]
            write(txn, ledger, table_id)
    finally:
        env.close()
    return into


def dataset(txn: lmdb.Transaction, db: lmdb._Database, table_id: int) -> DatasetRecord:
    return DatasetRecord.decode(txn.get(dataset_key(table_id, "math"), db=db))


def edit_dataset(change: Callable[[DatasetRecord], None]) -> Write:
    def write(txn: lmdb.Transaction, db: lmdb._Database, table_id: int) -> None:
        ds = dataset(txn, db, table_id)
        change(ds)
        txn.put(dataset_key(table_id, "math"), ds.encode(), db=db)

    return write


def epoch_counts(epoch: int, owned: int, **row: int) -> Write:
    """Epoch `epoch`'s record of prompts owned and counts by state, written over."""

    def write(txn: lmdb.Transaction, db: lmdb._Database, table_id: int) -> None:
        txn.put(counts_key(table_id, "math", epoch), encode_counts(owned, row), db=db)

    return write


def prompt(txn: lmdb.Transaction, db: lmdb._Database, table_id: int, index: int) -> PromptRecord:
    return PromptRecord.decode(txn.get(prompt_key(table_id, "math", 0, index), db=db))


def drop_expiry(txn: lmdb.Transaction, db: lmdb._Database, table_id: int) -> None:
    assert txn.delete(expiry_key(table_id, prompt(txn, db, table_id, 2).expires, "math", 0, 2), db=db)


def expiry_of_trained(txn: lmdb.Transaction, db: lmdb._Database, table_id: int) -> None:
    txn.put(expiry_key(table_id, time.time() + 60, "math", 0, 0), b"", db=db)


def queue_names_trained(txn: lmdb.Transaction, db: lmdb._Database, table_id: int) -> None:
    txn.put(queue_key(table_id, "math", 0), place(0, 0), db=db)


def group_of_no_prompt(txn: lmdb.Transaction, db: lmdb._Database, table_id: int) -> None:
    txn.put(group_entry_key(table_id, "math/1/3@0"), group_entry("math", 1, 3, 0), db=db)


def undecodable(txn: lmdb.Transaction, db: lmdb._Database, table_id: int) -> None:
    txn.put(dataset_key(table_id, "math"), b'{"name": "math", "size":', db=db)


def prompt_of_no_dataset(txn: lmdb.Transaction, db: lmdb._Database, table_id: int) -> None:
    txn.put(prompt_key(table_id, "gone", 0, 1), PromptRecord("trained", 0).encode(), db=db)


DAMAGE: list[tuple[str, Write, list[str]]] = [
    ("undecodable", undecodable, ["dataset record 'math' does not decode"]),
    (
        "counts",
        epoch_counts(0, 4, claimed=1, generated=1, trained=2),
        ["dataset math: epoch 0 counts 2 trained prompt(s), but 1 prompt record(s) are trained"],
    ),
    (
        "negative",
        edit_dataset(lambda ds: ds.totals.update(dropped=-1)),
        [
            "dataset math: its totals count -1 dropped prompt(s); a count is never negative",
            "dataset math: its totals count -1 dropped prompt(s), but 0 prompt record(s) are dropped",
        ],
    ),
    (
        "pending negative",
        epoch_counts(1, 4, dropped=5),
        [
            "dataset math: epoch 1 counts 5 prompt(s) claimed, generated, trained or dropped, of its 4",
            "dataset math: epoch 1 counts 5 dropped prompt(s), but 0 prompt record(s) are dropped",
        ],
    ),
    (
        "owned",
        epoch_counts(1, 3),
        [
            "dataset math: epoch 1 owns 3 prompt(s); it owns all its 4",
            "dataset math: its epochs own 7 prompt(s), but its owned_total is 8",
        ],
    ),
    (
        "counted",
        edit_dataset(lambda ds: setattr(ds, "counted", 1)),
        ["dataset math: counted is 1; every one of its 2 epoch(s) is counted"],
    ),
    (
        "cursor",
        edit_dataset(lambda ds: setattr(ds, "cursor_position", 9)),
        ["dataset math: the cursor (epoch 1, position 9) is outside its 2 epoch(s) of 4 prompt(s)"],
    ),
    ("no expiry", drop_expiry, ["dataset math: prompt 0/2 is claimed, but its claim has no expiry key"]),
    ("stray expiry", expiry_of_trained, ["dataset math: an expiry key names prompt 0/0, which is trained"]),
    (
        "queue",
        queue_names_trained,
        [
            "dataset math: queue entry 0 names prompt 0/0, which is trained, not pending",
            "dataset math: prompt 0/3 is pending at attempt 1, but no queue entry names it",
        ],
    ),
    (
        "group entry",
        group_of_no_prompt,
        ["dataset math: group entry math/1/3@0 names prompt 1/3, which has no readable record"],
    ),
    (
        "prompt of no dataset",
        prompt_of_no_dataset,
        ["1 prompt record(s) of dataset 'gone', which has no dataset record"],
    ),
]


def test_an_intact_ledger_checks_clean(ledger_dir: Path) -> None:
    assert report(ledger_dir) == {"": [], "default": [], "t": []}


@pytest.mark.parametrize(
    ("damage", "expected"), [(write, lines) for _, write, lines in DAMAGE], ids=[n for n, *_ in DAMAGE]
)
def test_check_names_the_dataset_and_prompt_of_each_damage_and_open_refuses_it(
    ledger_dir: Path, tmp_path: Path, damage: Write, expected: list[str]
) -> None:
    copy = damaged(ledger_dir, tmp_path / "copy", damage)
    found = report(copy)
    assert found[""] == [] and found["default"] == []
    assert len(found["t"]) == len(expected), found["t"]
    for line, want in zip(found["t"], expected, strict=True):
        assert line.startswith(want), (line, want)
    # The ledger is checked whole by the full open check; the quick one (the default) reads the
    # directory's structure only, and `expbuf check` above finds the damage either way.
    with pytest.raises(Damaged, match="expbuf check") as refused:
        Store(copy, check_at_open="full")
    assert expected[0] in str(refused.value)


def test_expbuf_check_prints_the_ledgers_problems_by_table(ledger_dir: Path, tmp_path: Path) -> None:
    copy = damaged(ledger_dir, tmp_path / "copy", drop_expiry)
    done = cli_forks.run("check", "--data", str(copy), timeout=120)
    assert done.returncode == 1 and not done.stderr, done.stderr
    assert done.stdout.splitlines() == [
        "default: ok",
        "t: 1 problem(s)",
        "  dataset math: prompt 0/2 is claimed, but its claim has no expiry key",
    ]
