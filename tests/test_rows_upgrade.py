"""Format 10 (issue 64): opening a format-9 directory makes each of its tables of layout records a
table of layout rows, in the open's one transaction (core/whole_table/to_rows.py). A records table
driven through random steps beside a rows table of the same settings (test_rows_pending's
RandomSteps), then upgraded at a restart, goes on as that rows table does: every reply, batch, stat
and event alike, and `verify` clean, through the same random steps after it."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest
from test_rows_pending import RandomSteps, Watched

from expbuf.client import BufferClient
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import ServerProcess, checked_after_a_kill, group_items, layouts_reply
from helpers import StoppedClock as Clock
from test_quarantine import damage

# The tables a test fills before the upgrade are records tables, as format 9 wrote them.
pytestmark = pytest.mark.usefixtures("records_layout")


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


def filled(root: Path, clock: Clock) -> dict[str, dict[str, object]]:
    """A format-9 directory of two records tables holding groups in each state a table keeps (ready,
    leased, held, consumed, pending, computing), 4,096 experiences each; returns their stats."""
    with Store(root, clock=clock) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_by="task", group_size=4))
        store.create_table(TableConfig.of("g", estimator="grpo", group_by="task", group_size=8))
        for batch in range(16):
            store.put("t", [item for task in range(64) for item in group_items(batch, task, 4)])
            store.put("g", [item for task in range(32) for item in group_items(batch, task, 8)][:-3])
        for spec in (
            TakeSpec(table="t", num_groups=256, delivery="consume", wait_seconds=0),
            TakeSpec(table="t", num_groups=10, delivery="lease", lease_seconds=600, wait_seconds=0),
        ):
            assert store.sample(spec) is not None
        assert store.sample(TakeSpec(table="t", num_groups=3, wait_seconds=0), hold=True) is not None
        found = {table: _stats(store, table) for table in ("t", "g")}
    format_9(root)
    return found


def _stats(store: Store, table: str) -> dict[str, object]:
    return {k: v for k, v in store.stats(table).items() if k != "next_rseq"}


def computed_all(stats: dict[str, Any]) -> dict[str, Any]:
    """A table's stats as they would be once its computing groups were computed (ready, and counted
    in by the rate limiter): what a start that served a while before it was killed may have done."""
    computing, groups = stats["computing"], stats["groups_computing"]
    return {
        **stats,
        "computing": 0,
        "groups_computing": 0,
        "ready": stats["ready"] + computing,
        "groups_ready": stats["groups_ready"] + groups,
        "rate_inserted": stats["rate_inserted"] + computing,
    }


def test_a_kill_during_the_upgrade_to_rows_leaves_format_9_or_rows_and_check_finds_no_damage(tmp_path: Path) -> None:
    """`expbuf serve` SIGKILLed at moments spread over its upgrade of a format-9 directory's records
    tables to rows (from the moment LMDB opens): each time `expbuf check` exits 0 saying either that
    the next start upgrades it or that every table is ok, and the next start serves every table with
    the stats it had, `verify` clean, the same batches as an upgrade never killed gives. Where in the
    upgrade a kill lands depends on the machine's load; the verdict may not."""
    clock = Clock()
    clock.now = time.time()  # a start that serves runs on the real clock: the lease taken must not expire in it
    source = tmp_path / "source"
    before = filled(source, clock)

    def served(data: Path) -> tuple[dict[str, dict[str, object]], object]:
        """What a start serves (its held batch given back, as `expbuf serve` gives it at its start)."""
        with Store(data, clock=clock) as store:
            assert all(store.table(table).storage.layout == "rows" for table in ("t", "g"))
            store.release_holds()
            assert all(store.verify(table) == [] for table in ("t", "g"))
            stats = {table: _stats(store, table) for table in ("t", "g")}
            taken = store.sample(TakeSpec(table="t", num_groups=2000, allow_partial=True, wait_seconds=0))
            return stats, layouts_reply(taken)

    reference = tmp_path / "reference"
    shutil.copytree(source, reference)
    with Store(reference, clock=clock) as store:
        assert {table: _stats(store, table) for table in ("t", "g")} == before  # as it was, held batch too
    want = served(reference)
    # A start killed after its upgrade may have served a while: its advantage worker computes g's
    # groups left computing. That is the state a start that serves leaves, as good as the other.
    computed = tmp_path / "computed"
    shutil.copytree(source, computed)
    server = ServerProcess(str(computed))
    try:
        with BufferClient(server.target) as client:
            deadline = time.monotonic() + 120
            while client.stats("g")["g"].computing:
                assert time.monotonic() < deadline, "".join(server.log)
                time.sleep(0.05)
    finally:
        assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
    served_a_while = served(computed)
    assert served_a_while[0]["g"]["computing"] == 0 < want[0]["g"]["computing"]
    assert served_a_while[1] == want[1] and served_a_while[0]["t"] == want[0]["t"]
    assert computed_all(served_a_while[0]["g"]) == computed_all(want[0]["g"])  # g's computing groups alone differ
    for trial, delay in enumerate((0.0, 0.05, 0.15, 0.3, 0.6, 1.2, 2.5)):
        data = tmp_path / f"copy{trial}"
        shutil.copytree(source, data)
        lines = checked_after_a_kill(data, delay, 9)
        ok = [[f"{table}: ok" for table in tables] for tables in (("g", "t"), ("default", "g", "t"))]  # served: default
        assert len(lines) == 1 or lines in ok, (trial, lines)
        got = served(data)  # as a start killed in its upgrade left it, or one that served (some of) g computed
        assert got[1] == want[1] and got[0]["t"] == want[0]["t"], trial
        assert computed_all(got[0]["g"]) == computed_all(want[0]["g"]), trial


def test_an_upgraded_tables_tombstones_catch_a_retried_push_until_tombstone_seconds_after_they_retired(
    tmp_path: Path,
) -> None:
    """A records table's consumed groups keep their members' tombstones through the upgrade: a retried
    push of one is a duplicate until tombstone_seconds after the group was consumed (not after the
    upgrade), when the tombstones are forgotten and the same push is stored again."""
    clock = Clock()
    items = [item for task in range(8) for item in group_items(0, task, 4)]
    with Store(tmp_path, clock=clock) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_by="task", group_size=4, tombstone_seconds=60))
        store.put("t", items)
        assert store.sample(TakeSpec(table="t", num_groups=5, delivery="consume", wait_seconds=0)) is not None
    format_9(tmp_path)
    clock.now += 40
    with Store(tmp_path, clock=clock) as store:
        assert store.table("t").storage.layout == "rows"
        consumed = items[:20]
        assert store.put("t", consumed).duplicates == [item.uid for item in consumed]
        assert store.put("t", items[20:]).duplicates == [item.uid for item in items[20:]]  # ready still
        assert store.verify("t") == []
        clock.now += 15
        assert store.tick()["tombstones_pruned"] == 0  # 55 s after they were consumed
        clock.now += 10
        assert store.tick()["tombstones_pruned"] == 20
        assert store.stats("t")["consumed"] == 0
        pushed = store.put("t", consumed)
        assert pushed.duplicates == [] and store.stats("t")["ready"] == 12 + 20
        assert store.verify("t") == []


def test_an_upgraded_tables_quarantined_members_stay_quarantined_until_their_tombstones_are_forgotten(
    tmp_path: Path,
) -> None:
    """A records table's quarantined tombstones (a damaged member of a failed group, and a kept payload
    of its group found damaged later) are flagged quarantined in their rows segment: counted so, listed
    missing by Get, uncounted when their segment is forgotten, the total of the damaged kept."""
    clock = Clock()
    uids = [item.uid for item in group_items(0, 1, 4)]
    with Store(tmp_path, clock=clock) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_by="task", group_size=4, tombstone_seconds=60))
        store.put("t", [item for task in range(3) for item in group_items(0, task, 4)])
        damage(store, "t", uids[2])
        assert store.quarantine("t", [uids[2]]) == 1
        damage(store, "t", uids[0])  # a failed member whose payload was kept for Get
        assert store.quarantine("t", [uids[0]]) == 1
        before = _stats(store, "t")
        assert (before["quarantined"], before["failed"], before["damaged"], before["ready"]) == (2, 2, 2, 8)
    format_9(tmp_path)
    with Store(tmp_path, clock=clock) as store:
        assert store.table("t").storage.layout == "rows"
        assert _stats(store, "t") == before
        assert store.verify("t") == []
        assert store.get_payload("t", uids)[1] == [uids[0], uids[2]]
        clock.now += 61
        assert store.tick()["tombstones_pruned"] == 4
        after = store.stats("t")
        assert (after["quarantined"], after["failed"], after["damaged"], after["ready"]) == (0, 0, 2, 8)
        assert store.verify("t") == []
