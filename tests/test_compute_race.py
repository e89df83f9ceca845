"""A group deleted and pushed again while the advantage worker computes it: the values the worker
computed for the group it read are not stored in the group there now, whose members or content
differ, and do not fail it; the group waits, computing, for the worker's next pass, which computes
it as it is. Each layout (the `table_layout` fixture)."""

from __future__ import annotations

from pathlib import Path

import pytest

from expbuf.client import decode, trxp
from expbuf.server.advantages.worker import AdvantageWorker, compute
from expbuf.server.store import Store
from expbuf.server.store.schema.table_config import TableConfig

from helpers import make_experience, take


def runs(task: int, rewards: dict[int, float]) -> list[trxp.RawItem]:
    """Runs of task `task` of batch 1 (run -> reward)."""
    return [trxp.from_experience(make_experience(1, task, run, reward=reward)) for run, reward in rewards.items()]


def advantages_of(store: Store, table: str, groups: int) -> dict[str, float]:
    """Each taken experience's advantage (its first token's), by uid."""
    batch = take(store, table, num_groups=groups)
    assert batch is not None
    return {exp.eid.uid: float(exp.advantages[-1]) for exp in decode(batch.payload)}


@pytest.mark.usefixtures("table_layout")
@pytest.mark.parametrize("again", ["other runs", "the same runs, other rewards"])
def test_values_of_a_group_pushed_again_while_computed_are_not_stored_in_it(tmp_path: Path, again: str) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", group_by="task", group_size=2))
        store.put("t", runs(0, {0: 1.0, 1: 0.0}) + runs(1, {0: 1.0, 1: 0.0}))
        (job,) = store.compute_backlog()
        computed = compute(job)
        assert store.delete("t", group_ids=["1/0"]) == 2
        repushed = {0: 1.0, 2: 0.0} if again == "other runs" else {0: 0.0, 1: 1.0}
        store.put("t", runs(0, repushed))
        store.finish_compute(job.table, *computed, places=job.queued())
        assert store.stats("t")["groups_computing"] == 1 and store.stats("t")["groups_ready"] == 1
        assert store.verify("t") == []
        assert AdvantageWorker(store).run_once() == 1
        got = advantages_of(store, "t", 2)
        # the group as pushed again: run 0's reward is 1.0 against 0.0 (other runs), 0.0 against 1.0
        first, second = (("1/0/0/0/", 1.0), ("1/0/2/0/", -1.0)) if again == "other runs" else (
            ("1/0/0/0/", -1.0), ("1/0/1/0/", 1.0))  # fmt: skip
        for prefix, sign in (first, second):
            (value,) = [value for uid, value in got.items() if uid.startswith(prefix)]
            assert value == pytest.approx(sign * 0.7071, abs=1e-3)
        assert store.verify("t") == []


@pytest.mark.usefixtures("table_layout")
def test_values_of_a_group_pushed_again_with_some_of_its_runs_are_not_stored_in_it(tmp_path: Path) -> None:
    """Pushed again with some of the same runs, unchanged, the rest reported failed: the group's
    members were all read, of the same content, but the values were computed for the group of four."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", group_by="task", group_size=4, min_group_size=2))
        store.put("t", runs(0, {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0}))
        (job,) = store.compute_backlog()
        computed = compute(job)
        store.delete("t", group_ids=["1/0"])
        store.put("t", runs(0, {0: 1.0, 1: 0.0}))
        store.fail_runs("t", ["1/0/2/0/r2s0", "1/0/3/0/r3s0"], ["oom", "oom"])
        store.finish_compute(job.table, *computed, places=job.queued())
        assert store.stats("t")["groups_computing"] == 1
        assert AdvantageWorker(store).run_once() == 1
        got = advantages_of(store, "t", 1)
        assert sorted(got.values()) == pytest.approx([-0.7071, 0.7071], abs=1e-3)  # the group of two's
        assert store.verify("t") == []


@pytest.mark.usefixtures("table_layout")
def test_the_worker_fails_no_group_pushed_again_while_it_computed(tmp_path: Path) -> None:
    """A job whose store of values finds one group pushed again: the groups alone, as the worker
    tries them after a batch fails, neither fail it nor store stale values in it."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="t", group_by="task", group_size=2))
        store.put("t", runs(0, {0: 1.0, 1: 0.0}) + runs(1, {0: 1.0, 1: 0.0}))
        (job,) = store.compute_backlog()
        store.delete("t", group_ids=["1/0"])
        store.put("t", runs(0, {0: 1.0, 2: 0.0}))
        worker = AdvantageWorker(store)
        worker._compute(job)  # the job read before the group was pushed again
        stats = store.stats("t")
        assert (stats["groups_failed"], stats["groups_ready"], stats["groups_computing"]) == (0, 1, 1)
        assert worker.run_once() == 1
        assert store.stats("t")["groups_ready"] == 2 and store.verify("t") == []
