"""A group deleted and pushed again while the advantage worker computes it: the values the worker
computed for the group it read are not stored in the group there now, whose members or content
differ, and do not fail it; the group waits, computing, for the worker's next pass, which computes
it as it is. Each layout (the `table_layout` fixture)."""

from __future__ import annotations

from pathlib import Path

import pytest

from expbuf.client import decode, trxp
from expbuf.server.advantages import estimators
from expbuf.server.advantages.batch_stage import finish_batch
from expbuf.server.advantages.worker import AdvantageWorker, compute
from expbuf.server.store import Store
from expbuf.server.store.schema.estimator_registry import Estimator
from expbuf.server.store.schema.table_config import TableConfig

from helpers import make_experience, registered, take


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


SHAPED = {"reward_running_norm": True, "reward_clip": 0.5}


def shaped_outcome(store: Store, groups: int) -> tuple[dict[str, object], dict[str, list[float]]]:
    """What shaping counted and kept of a table `t`, and the advantages it serves, by uid."""
    stats = store.stats("t")
    batch = take(store, "t", num_groups=groups)
    assert batch is not None
    got = {exp.eid.uid: exp.advantages.tolist() for exp in decode(batch.payload)}
    return {k: stats[k] for k in ("rewards_seen", "rewards_clipped", "reward_moments", "groups_ready")}, got


@pytest.mark.usefixtures("table_layout")
@pytest.mark.parametrize("estimator", ["grpo", "reinforce", "reinforceplusplus"])
def test_shaping_takes_in_a_group_pushed_again_while_computed_once(tmp_path: Path, estimator: str) -> None:
    """Reward shaping's counts and running moments take in each group stored, once, in completion
    order: a computation that read a group since deleted and pushed again stores nothing, so its
    moments and counts (which took the old group in) are not kept, and the next pass computes the
    groups as they are. The same as a table that never held the old group, for a group step
    (grpo), the rewards (reinforce) and a batch stage (reinforceplusplus)."""
    config = TableConfig.of(name="t", group_by="task", group_size=2, estimator=estimator, shaping=SHAPED)
    with Store(tmp_path / "race", batch_stage=finish_batch) as store:
        store.create_table(config)
        store.put("t", runs(0, {0: 1.0, 1: 0.0}) + runs(1, {0: 3.0, 1: 0.0}))
        (job,) = store.compute_backlog()
        computed = compute(job)
        store.delete("t", group_ids=["1/0"])
        store.put("t", runs(0, {0: 0.0, 1: 2.0}))
        store.finish_compute(job.table, *computed, places=job.queued())
        assert AdvantageWorker(store).run_once() == 2
        got = shaped_outcome(store, 2)
    with Store(tmp_path / "once", batch_stage=finish_batch) as store:
        store.create_table(config)
        store.put("t", runs(1, {0: 3.0, 1: 0.0}))
        store.put("t", runs(0, {0: 0.0, 1: 2.0}))
        assert AdvantageWorker(store).run_once() == 2
        want = shaped_outcome(store, 2)
    assert got[0]["rewards_seen"] == 4 and got[0]["reward_moments"][2] == pytest.approx(4)
    assert got == want


@pytest.mark.usefixtures("table_layout")
def test_shaping_moments_tried_group_by_group_skip_a_group_pushed_again(tmp_path: Path) -> None:
    """A computation that fails together is tried group by group, each group starting from the
    moments the one before left: a group deleted and pushed again meanwhile leaves none, its values
    not stored."""

    def apart(batch: estimators.FlatBatch) -> estimators.Advantages:
        if batch.num_groups > 1:
            raise ValueError("one group at a time")
        return estimators.reinforce(batch)

    with registered(Estimator("apart", ingest=apart)) as name:
        config = TableConfig.of(name="t", group_by="task", group_size=2, estimator=name, shaping=SHAPED)
        with Store(tmp_path / "race") as store:
            store.create_table(config)
            store.put("t", runs(0, {0: 1.0, 1: 0.0}) + runs(1, {0: 3.0, 1: 0.0}) + runs(2, {0: -2.0, 1: 1.0}))
            (job,) = store.compute_backlog()
            store.delete("t", group_ids=["1/0"])
            store.put("t", runs(0, {0: 0.0, 1: 2.0}))
            worker = AdvantageWorker(store)
            worker._compute(job)  # the job read before the group was pushed again
            assert worker.run_once() == 1
            got = shaped_outcome(store, 3)
        with Store(tmp_path / "once") as store:
            store.create_table(config)
            store.put("t", runs(1, {0: 3.0, 1: 0.0}) + runs(2, {0: -2.0, 1: 1.0}))
            store.put("t", runs(0, {0: 0.0, 1: 2.0}))
            assert AdvantageWorker(store).run_once() == 3
            want = shaped_outcome(store, 3)
    assert got == want
