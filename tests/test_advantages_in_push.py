"""Advantages computed by the push that completes a group (estimators with one value per
experience, no batch stage, on the CPU): the values the worker stores, bit for bit, in the
push's own transaction (computed before it on the pushing thread where the push fills whole
groups), with nothing left queued; the tables and groups left to the worker,
a computation that fails failing only its group there, and groups an older directory left
computing still computed by the worker."""

from __future__ import annotations

import math
import random
import threading
from pathlib import Path

import pytest
import torch

from expbuf.client import trxp
from expbuf.server.advantages.estimators import Advantages, FlatBatch, grpo
from expbuf.server.advantages.worker import AdvantageWorker, computed_in_push
from expbuf.server.store import FAILED, READY, ComputeJob, ItemRecord, Store
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.kinds import Compute, Computed
from expbuf.server.store.rules.pushed_advantages import IN_PUSH_LIMIT
from expbuf.server.store.schema.estimator_registry import ESTIMATORS, Estimator
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items, make_experience, registered


def records(store: Store, table: str) -> dict[str, ItemRecord]:
    """Every record of a table, tombstones included, as stored."""
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    with store.environment.read() as txn, txn.cursor(db=store.db["items"]) as cur:
        found = cur.set_range(prefix)
        out = {}
        while found and cur.key().startswith(prefix):
            out[bytes(cur.key()[len(prefix) :]).decode()] = ItemRecord.decode(cur.value())
            found = cur.next()
    return out


def pushes(seed: int, *, steps: int = 1) -> list[list[trxp.RawItem]]:
    """Groups of 6 experiences (task runs x steps) with random rewards, some all equal, pushed
    three groups at a time, one group split across two pushes."""
    rng = random.Random(seed)
    items = []
    for task in range(9):
        equal = rng.random() < 0.2
        for i in range(6):
            run, step = divmod(i, steps) if steps > 1 else (i, 0)
            reward = 0.5 if equal else rng.choice([0.0, 1.0, rng.uniform(-2, 2)])
            exp = make_experience(seed, task, run, step=step, reward=reward, response=rng.randint(1, 9))
            items.append(trxp.from_experience(exp))
    return [items[:16], items[16:36], items[36:]]


CASES = [
    ("grpo", {}, {}),
    ("grpo", {"epsilon": 1e-3}, {"advantage_clip": 0.7}),
    ("grpo", {"std_threshold": 0.3}, {}),
    ("grpo", {}, {"reward_running_norm": True, "reward_running_norm_minus_mean": True}),
    ("grpo", {}, {"reward_clip": 0.8, "overlong_buffer": True, "overlong_buffer_len": 3, "max_new_tokens": 8}),
    ("step_wise_grpo", {"enable_step_norm": True}, {}),
    ("reinforce", {}, {"reward_running_norm": True}),
    ("opmd", {"opmd_baseline": "logavgexp", "tau": 0.5}, {}),
    ("asymre", {"baseline_shift": 0.3}, {}),
    ("rec", {"std_normalize": True}, {}),
    ("drgrpo", {}, {}),
    ("multi_turn_discount", {"turn_level_discount": 0.9}, {}),
]


@pytest.mark.usefixtures("records_layout")  # rows: test_rows_advantages.py
@pytest.mark.parametrize(("name", "params", "shaping"), CASES)
def test_a_push_stores_the_values_the_worker_would(tmp_path: Path, name: str, params: dict, shaping: dict) -> None:
    steps = 3 if name in ("step_wise_grpo", "multi_turn_discount") else 1
    config = TableConfig.of("t", estimator=name, estimator_params=params, shaping=shaping, group_size=6, device="cpu")
    assert computed_in_push(config, cuda=False)
    with Store(tmp_path / "push") as in_push, Store(tmp_path / "worker") as by_worker:
        worker = AdvantageWorker(in_push)
        in_push.in_push = worker.in_push
        for store in (in_push, by_worker):
            store.create_table(config)
            for items in pushes(7, steps=steps):
                store.put("t", items)
        assert in_push.compute_backlog() == [] and worker.run_once() == 0  # nothing left for the worker
        assert AdvantageWorker(by_worker).run_once() == 9
        got, want = records(in_push, "t"), records(by_worker, "t")
        assert {uid: (r.state, r.advantage, r.shaped_reward) for uid, r in got.items()} == {
            uid: (r.state, r.advantage, r.shaped_reward) for uid, r in want.items()
        }
        assert any(r.state == READY and r.advantage not in (None, 0.0) for r in got.values())
        stats, expected = in_push.stats("t"), by_worker.stats("t")
        if "std_threshold" in params:
            assert stats["dropped_std_threshold"] == 3  # the groups with equal rewards
        for key in ("ready", "computing", "groups_dropped", "dropped_std_threshold", "reward_moments",
                    "advantages_seen", "advantages_clipped", "rewards_clipped", "overlong_penalised"):  # fmt: skip
            assert stats.get(key) == expected.get(key), key


def test_only_one_value_estimators_on_the_cpu_are_computed_in_the_push() -> None:
    pushed = {name for name in ESTIMATORS if computed_in_push(TableConfig.of("t", estimator=name), cuda=False)}
    assert pushed == {
        "grpo", "step_wise_grpo", "reinforce", "opmd", "asymre", "rec", "drgrpo", "multi_turn_discount",
    }  # fmt: skip
    assert not computed_in_push(TableConfig.of("t", estimator="grpo"), cuda=True)  # "auto" takes the GPU there
    assert not computed_in_push(TableConfig.of("t", estimator="grpo", device="cuda"), cuda=True)
    assert computed_in_push(TableConfig.of("t", estimator="grpo", device="cpu"), cuda=True)
    batch_std = TableConfig.of("t", estimator="grpo", estimator_params={"std_cal_level": "batch"})
    assert not computed_in_push(batch_std, cuda=False)
    assert not computed_in_push(TableConfig.of("t", estimator="drgrpo", shaping={"advantages_norm": True}), cuda=False)


@pytest.mark.parametrize(
    "config",
    [
        TableConfig.of("t", estimator="reinforce++_baseline", group_size=4),  # a batch stage
        TableConfig.of("t", estimator="rloo", group_size=4),  # reads the tokens
        TableConfig.of("t", estimator="grpo", estimator_params={"std_cal_level": "batch"}, group_size=4),
    ],
)
def test_other_tables_are_left_to_the_worker(tmp_path: Path, config: TableConfig) -> None:
    with Store(tmp_path) as store:
        worker = AdvantageWorker(store)
        store.in_push = worker.in_push
        store.create_table(config)
        store.put("t", group_items(1, 0, 4, reward=1.0) + group_items(1, 1, 4, reward=2.0))
        assert store.stats("t")["computing"] == 8
        assert worker.run_once() == 2 and store.stats("t")["ready"] == 8


def test_a_push_completing_more_than_the_limit_leaves_them_to_the_worker(tmp_path: Path) -> None:
    size = 64
    with Store(tmp_path) as store:
        worker = AdvantageWorker(store)
        store.in_push = worker.in_push
        store.create_table(TableConfig.of("t", estimator="grpo", group_size=size, device="cpu"))
        groups = IN_PUSH_LIMIT // size
        few = [item for task in range(groups) for item in group_items(1, task, size, reward=float(task % 3))]
        store.put("t", few)
        assert store.stats("t")["ready"] == len(few)
        many = [item for task in range(groups + 1) for item in group_items(2, task, size, reward=float(task % 3))]
        store.put("t", many)
        assert store.stats("t")["computing"] == len(many)
        assert worker.run_once() == groups + 1 and store.stats("t")["ready"] == len(few) + len(many)


def _fails_on_reward_7(b: FlatBatch, **_: object) -> Advantages:
    if bool((b.rewards == 7.0).any()):
        raise RuntimeError("no estimate for reward 7")
    return grpo(b, 1e-6, None, "group")


def _nan_on_reward_7(b: FlatBatch, **_: object) -> Advantages:
    out = grpo(b, 1e-6, None, "group")
    out.scalar = torch.where(b.rewards == 7.0, math.nan, out.scalar)
    return out


@pytest.mark.usefixtures("records_layout")  # it reads the item records
@pytest.mark.parametrize(
    ("stage", "reason"),
    [(_fails_on_reward_7, "no estimate for reward 7"), (_nan_on_reward_7, "non-finite advantage")],
)
def test_a_failing_estimator_fails_only_its_group_never_the_push(tmp_path: Path, stage: object, reason: str) -> None:
    with registered(Estimator("flaky", ingest=stage, group_step=True)) as name, Store(tmp_path) as store:
        worker = AdvantageWorker(store, retry_delays=())
        store.in_push = worker.in_push
        store.create_table(TableConfig.of("t", estimator=name, group_size=2, device="cpu"))
        good = [trxp.from_experience(make_experience(1, 0, run, reward=float(run))) for run in range(2)]
        bad = [trxp.from_experience(make_experience(1, 1, run, reward=7.0 - run)) for run in range(2)]
        result = store.put("t", good + bad)
        assert sorted(result.completed_groups) == ["1/0", "1/1"]  # the push itself stands
        assert store.stats("t")["computing"] == 4  # the computation failed: both groups to the worker
        worker.run_once()
        states = {uid: rec.state for uid, rec in records(store, "t").items()}
        assert states == {"1/0/0/0/r0s0": READY, "1/0/1/0/r1s0": READY, "1/1/0/0/r0s0": FAILED, "1/1/1/0/r1s0": FAILED}
        stats = store.stats("t")
        assert stats["groups_failed"] == 1 and reason in stats["last_failure"]
        store.put("t", group_items(2, 0, 2, reward=3.0) + group_items(2, 1, 2, reward=1.0))  # later pushes unharmed
        assert store.stats("t")["ready"] == 6


def test_groups_an_older_directory_left_computing_are_computed_by_the_worker(tmp_path: Path) -> None:
    config = TableConfig.of("t", estimator="grpo", group_size=4, device="cpu")
    with Store(tmp_path) as older:  # a server that left every group to its worker, stopped before it ran
        older.create_table(config)
        older.put("t", group_items(1, 0, 4, reward=1.0) + group_items(1, 1, 2, reward=0.0))
        assert older.stats("t")["computing"] == 4
    with Store(tmp_path) as store:
        worker = AdvantageWorker(store)
        store.in_push = worker.in_push
        store.put("t", group_items(1, 1, 4, reward=2.0)[2:] + group_items(2, 0, 4, reward=3.0))
        stats = store.stats("t")
        assert (stats["ready"], stats["computing"]) == (8, 4)  # the pushed groups computed, the older one queued
        assert worker.run_once() == 1 and store.stats("t")["ready"] == 12
        assert all(rec.state == READY and rec.advantage is not None for rec in records(store, "t").values())


def test_a_running_normalisation_takes_groups_after_older_queued_ones(tmp_path: Path) -> None:
    """The running moments chain through the groups in the order they completed: a push waits
    for the worker to take the older groups, and the values are those of the worker alone."""
    config = TableConfig.of("t", estimator="grpo", group_size=3, device="cpu", shaping={"reward_running_norm": True})
    first = [*group_items(1, 0, 3, reward=1.0)[:2], trxp.from_experience(make_experience(1, 0, 2, reward=4.0))]
    second = [trxp.from_experience(make_experience(2, 0, run, reward=float(run * run))) for run in range(3)]
    with Store(tmp_path / "a") as store, Store(tmp_path / "b") as by_worker:
        for s in (store, by_worker):
            s.create_table(config)
            s.put("t", first)
        worker = AdvantageWorker(store)
        store.in_push = worker.in_push
        store.put("t", second)
        assert store.stats("t")["computing"] == 6  # queued behind the older group
        assert worker.run_once() == 2
        by_worker.put("t", second)
        AdvantageWorker(by_worker).run_once()
        assert {u: r.advantage for u, r in records(store, "t").items()} == {
            u: r.advantage for u, r in records(by_worker, "t").items()
        }
        store.put("t", [*group_items(3, 0, 3, reward=5.0)[:2], trxp.from_experience(make_experience(3, 0, 2))])
        assert store.stats("t")["computing"] == 0  # nothing older queued: computed in the push


def test_whole_groups_are_computed_before_the_transaction_on_the_pushing_thread(tmp_path: Path) -> None:
    """The writer only stores what the pushing thread computed for the groups the push fills;
    a push that completes other groups (one pushed in part before) is computed by the writer."""
    threads: list[str] = []
    with Store(tmp_path / "a") as store, Store(tmp_path / "b") as by_worker:
        worker = AdvantageWorker(store)

        def in_push(config: TableConfig) -> Compute | None:
            compute = worker.in_push(config)

            def noted(job: ComputeJob) -> Computed:
                threads.append(threading.current_thread().name)
                assert compute is not None
                return compute(job)

            return noted if compute is not None else None

        store.in_push = in_push
        config = TableConfig.of("t", estimator="grpo", group_size=4, device="cpu", shaping={"advantage_clip": 0.8})

        def group(batch: int, task: int) -> list[trxp.RawItem]:
            return [
                trxp.from_experience(make_experience(batch, task, run, reward=float(run * task))) for run in range(4)
            ]

        for s in (store, by_worker):
            s.create_table(config)
            s.put("t", group(1, 1)[:3])
            s.put("t", group(1, 2) + group(1, 1)[3:])  # completes 1/2 (whole here) and 1/1 (pushed in part before)
            s.put("t", group(1, 3))
        main = threading.current_thread().name
        assert threads[0] == main and threads[1] != main  # 1/2 ahead, then 1/2 and 1/1 by the writer
        assert threads[2:] == [main]  # a push of whole groups: computed once, ahead
        AdvantageWorker(by_worker).run_once()
        assert {u: (r.state, r.advantage) for u, r in records(store, "t").items()} == {
            u: (r.state, r.advantage) for u, r in records(by_worker, "t").items()
        }
        assert store.stats("t")["advantages_seen"] == by_worker.stats("t")["advantages_seen"] == 12
