"""Format 10 (issue 64): opening a format-9 directory makes each of its tables of layout records a
table of layout rows, in the open's one transaction (core/whole_table/to_rows.py). A records table
driven through random steps beside a rows table of the same settings (test_rows_pending's
RandomSteps), then upgraded at a restart, goes on as that rows table does: every reply, batch, stat
and event alike, and `verify` clean, through the same random steps after it."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
from test_rows_pending import RandomSteps, Watched

from expbuf.server.store import Store
from expbuf.server.store.disk import layout


def format_9(root: Path) -> None:
    """A closed directory marked format 9: what this release's records tables are, as a format-9
    release wrote them."""
    env = lmdb.open(str(root), max_dbs=layout.MAX_DBS)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"format", b"9", db=env.open_db(b"meta", txn=txn))
    finally:
        env.close()


class Upgraded(RandomSteps):
    """RandomSteps whose records table is made rows at one restart (`upgrade`)."""

    def upgrade(self) -> None:
        assert self.store.table("t").storage.layout == "records"
        self.store.close()
        format_9(self.root)
        self.store = Store(self.root, clock=self.clock, extensions={"watched": Watched})
        self.worker = self.attach()
        self.held = [h for h in self.held if h[0] == "lease"]  # a start gives held batches back
        self.log.append("upgrade")
        assert self.store.table("t").storage.layout == "rows"
        self.check()


@pytest.mark.parametrize(
    ("settings", "seed"),
    [
        ({"group_size": 4}, 21),
        ({"group_size": 8, "min_group_size": 3, "group_timeout_seconds": 10, "drop_zero_variance": True}, 22),
        ({"group_size": 4, "estimator": "grpo", "min_group_size": 2, "group_timeout_seconds": 10}, 23),
        ({"group_size": 4, "priority_decay": 0.5, "max_times_sampled": 3, "min_group_size": 2}, 24),
        (
            {
                "group_size": 4,
                "priority_decay": 1.0,
                "reuse_cooldown_seconds": 5,
                "max_times_sampled": 4,
                "group_timeout_seconds": 10,
                "min_group_size": 2,
            },
            25,
        ),
        ({"group_size": 8, "capacity_experiences": 40, "min_group_size": 4}, 26),
        ({"group_size": 4, "evict_stale": True, "max_staleness": 1, "group_timeout_seconds": 8}, 27),
    ],
)
def test_a_records_table_upgraded_to_rows_goes_on_as_a_rows_table(
    tmp_path: Path, settings: dict[str, object], seed: int
) -> None:
    steps = Upgraded(tmp_path, settings, seed)
    try:
        for _ in range(80):
            steps.step()
        steps.upgrade()
        for _ in range(170):
            steps.step()
    finally:
        steps.store.close()
