"""Advantages on ingest: computed when groups complete, stored, and sampled with their groups."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from expbuf.client import BufferClient, BufferError, decode, trxp
from expbuf.client.trxp.codec.common import FLOAT32_MAX
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.config import load as load_config
from expbuf.server.store import Store
from expbuf.server.store.disk.stored_advantages import expand
from expbuf.server.store.schema.errors import InvalidRequest
from expbuf.server.store.schema.estimator_registry import ESTIMATORS, Estimator, register
from expbuf.server.store.schema.table_config import ConfigError, TableConfig

from conftest import payload
from helpers import group_items, make_experience, registered, take

pytestmark = pytest.mark.client_timeout(20)


def test_grpo_group_over_grpc(client: BufferClient) -> None:
    client.push(payload("grpo_group.trxp"))
    batch = next(client.sample(num_groups=1, max_batches=1, timeout=10, delivery="consume"))
    rewards = torch.tensor([e.reward for e in batch.experiences])
    want = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # torch's default std is unbiased
    for exp, value in zip(batch.experiences, want.tolist(), strict=True):
        expected = value * exp.action_mask.float()
        assert exp.advantages.dtype == torch.float32 and exp.advantages.shape == exp.action_mask.shape
        assert torch.allclose(exp.advantages, expected, atol=1e-6)
        assert torch.allclose(exp.returns, expected, atol=1e-6)
    got = client.get(batch.uids[:2], table="default")
    assert got == []  # consumed: gone
    assert client.stats()["default"].consumed == 8


def test_multi_turn_discount_over_grpc(client: BufferClient) -> None:
    client.create_table(
        "turns", group_by="run", estimator="multi_turn_discount", estimator_params={"turn_level_discount": 0.9}
    )
    client.push(payload("multi_turn.trxp"), table="turns")
    batch = next(client.sample("turns", num_groups=1, max_batches=1, timeout=10, delivery="consume"))
    rewards = [e.reward for e in batch.experiences]
    assert rewards == [0.0, 0.0, 1.0]
    for exp, value in zip(batch.experiences, [0.81, 0.9, 1.0], strict=True):
        assert torch.allclose(exp.advantages, value * exp.action_mask.float(), atol=1e-6)
        assert torch.allclose(exp.returns, exp.advantages)


def test_discounted_return_uses_token_level_rewards(client: BufferClient) -> None:
    client.create_table("rf", group_by="none", estimator="discounted_return", estimator_params={"gamma": 0.5})
    client.push(payload("rich_fields.trxp"), table="rf")
    (exp,) = next(client.sample("rf", num_groups=1, max_batches=1, timeout=10, delivery="consume")).experiences
    running, want = 0.0, []
    for r, m in zip(reversed(exp.token_level_reward.tolist()), reversed(exp.action_mask.tolist()), strict=True):
        running = r + 0.5 * running
        want.append(running * m)
    assert torch.allclose(exp.advantages, torch.tensor(want[::-1]), atol=1e-5)


def test_missing_reward_is_refused_naming_the_uid(client: BufferClient) -> None:
    with pytest.raises(BufferError) as info:
        client.push(payload("dpo.trxp"))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "uid 4/0/0/0/dpo0 has no reward" in info.value.details
    client.create_table("dpo", estimator="none")
    assert client.push(payload("dpo.trxp"), table="dpo").stored == ["4/0/0/0/dpo0"]


@pytest.fixture
def exploding() -> Iterator[str]:
    """An estimator that raises on any batch holding a reward of 13 (grpo otherwise): a
    computation that fails because of one group."""
    from expbuf.server.advantages.worker import estimators

    def explode(batch: estimators.FlatBatch, **args: object) -> estimators.Advantages:
        if bool((batch.rewards == 13.0).any()):
            raise ValueError("a reward of 13 is not computable")
        return estimators.grpo(batch, **args)

    with registered(Estimator("explode", ESTIMATORS["grpo"].params, ingest=explode)) as name:
        yield name


def test_failed_computation_fails_only_the_guilty_group_and_keeps_its_payloads(tmp_path: Path, exploding) -> None:
    """Groups computed together with a group that makes the estimator raise are retried
    one by one: only that group fails, and it keeps its payloads for Get and Delete."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator=exploding))
        store.put("t", group_items(1, 0, 3, reward=1.0) + group_items(1, 1, 3, reward=13.0) + group_items(1, 2, 3))
        assert AdvantageWorker(store).run_once() == 3
        stats = store.stats("t")
        assert (stats["groups_ready"], stats["groups_failed"], stats["ready"]) == (2, 1, 6)
        assert "group 1/1" in stats["last_failure"] and "reward of 13" in stats["last_failure"]
        guilty = [f"1/1/{run}/0/r{run}s0" for run in range(3)]
        payload_bytes, missing = store.get_payload("t", guilty)
        assert missing == [] and [e.reward for e in decode(payload_bytes)] == [13.0] * 3
        assert store.verify("t") == []
        assert store.delete("t", group_ids=["1/1"]) == 0  # a failed group is no longer live ...
        assert store.get_payload("t", guilty)[1] == guilty  # ... but its payloads go with it
        assert store.verify("t") == []
        store.create_table(TableConfig.of("lean", estimator=exploding, keep_failed=False))
        store.put("lean", group_items(2, 0, 2, reward=13.0))
        AdvantageWorker(store, retry_delays=()).run_once()  # no second try: a group alone fails at once
        assert store.get_payload("lean", ["2/0/0/0/r0s0"])[1] == ["2/0/0/0/r0s0"]
        assert store.verify("lean") == []


def test_a_failure_of_every_group_is_retried_before_it_fails(
    tmp_path: Path, exploding, caplog: pytest.LogCaptureFixture
) -> None:
    """When every group fails (here: the estimator fails for a while, whatever the data),
    the groups stay computing and are tried again; they fail only after the last try. A try that
    computed nothing is not timed (expbuf_advantage_seconds counted each), and an error of several
    lines is logged on one (a helper's audit)."""
    from expbuf.server.advantages.worker import estimators

    explode = ESTIMATORS[exploding].ingest_stage()
    passing = {"fail": True}

    def for_a_while(batch: estimators.FlatBatch, **args: object) -> estimators.Advantages:
        if passing["fail"]:
            raise RuntimeError("out of memory\ntried to allocate 2 GiB")
        return explode(batch, **args)

    register(dataclasses.replace(ESTIMATORS[exploding], ingest=for_a_while), replace=True)
    timed: list[int] = []
    with Store(tmp_path) as store, caplog.at_level("WARNING", logger="expbuf"):
        store.create_table(TableConfig.of("t", estimator=exploding))
        store.put("t", group_items(1, 0, 3) + group_items(1, 1, 3))
        worker = AdvantageWorker(
            store, retry_delays=(0.0, 0.0), on_computed=lambda job, _: timed.append(len(job.groups))
        )
        worker.run_once()
        assert store.stats("t")["groups_computing"] == 2  # not failed: tried again later
        assert timed == []
        said = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
        assert said and all("\n" not in line and "out of memory\\ntried" in line for line in said), said
        passing["fail"] = False
        worker.run_once()
        assert store.stats("t")["groups_ready"] == 2
        assert timed == [2]
        passing["fail"] = True
        store.put("t", group_items(1, 2, 3))
        for _ in range(3):
            worker.run_once()
        stats = store.stats("t")
        assert (stats["groups_failed"], stats["groups_computing"]) == (1, 0)
        assert "out of memory" in stats["last_failure"]


def test_failed_computation_over_grpc_and_the_server_keeps_serving(client: BufferClient, exploding) -> None:
    client.create_table("boom", estimator=exploding)
    client.push(trxp.build(group_items(3, 0, 4, reward=13.0) + group_items(3, 1, 4)), table="boom")
    with pytest.raises(BufferError) as info:
        next(client.sample("boom", num_groups=2, max_batches=1, timeout=2, delivery="consume"))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED  # the good group alone is ready
    stats = client.stats("boom")["boom"]
    assert (stats.groups_failed, stats.groups_ready) == (1, 1) and "group 3/0" in stats.last_failure
    kept = client.get([f"3/0/{run}/0/r{run}s0" for run in range(4)], table="boom")
    assert len(kept) == 4 and kept.missing_uids == []
    client.push(payload("mixed_batch.trxp"))
    assert len(next(client.sample(num_groups=2, max_batches=1, timeout=10, delivery="consume")).uids) == 8


def test_groups_completed_together_are_one_job_and_survive_restart(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        for task in range(3):
            store.put("default", group_items(1, task, 4, reward=float(task)) + group_items(2, task, 2))
        assert take(store, "default", num_groups=1) is None  # not before advantages are stored
        assert store.stats("default")["groups_computing"] == 6
    with Store(tmp_path) as store:
        (job,) = store.compute_backlog()
        assert len(job.groups) == 6 and len(job.records) == 18 and job.blobs == {}  # grpo needs no payloads
        assert AdvantageWorker(store).run_once() == 6
        assert store.verify("default") == []
        batch = take(store, "default", num_groups=6)
        assert batch is not None and store.stats("default")["computing"] == 0
        for exp in decode(batch.payload):
            assert exp.advantages is not None and exp.returns is not None


def test_zero_variance_and_std_threshold(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of(name="dapo", drop_zero_variance=True))
        store.create_table(TableConfig.of(name="thr", estimator_params={"std_threshold": 0.2}))
        for name in ("default", "dapo", "thr"):
            store.put(name, group_items(1, 0, 4, reward=1.0))  # all equal
            store.put(name, trxp.parse(payload("grpo_group.trxp")))
        AdvantageWorker(store).run_once()
        kept = decode(take(store, "default", num_groups=1).payload)
        assert all(e.advantages.abs().max() == 0 for e in kept)  # kept, with zero advantages
        assert store.stats("dapo")["groups_dropped"] == 1 and store.stats("dapo")["ready"] == 8
        assert store.stats("thr")["groups_dropped"] == 1 and store.stats("thr")["ready"] == 8
        for name in ("default", "dapo", "thr"):
            assert store.verify(name) == []


def test_reward_checks_at_the_store(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        with pytest.raises(InvalidRequest, match="uid 1/0/0/0/r0s0 has no reward"):
            store.put("default", group_items(1, 0, 2, reward=None))
        store.create_table(TableConfig.of(name="rf", estimator="discounted_return"))
        with pytest.raises(InvalidRequest, match="or token_level_reward"):
            store.put("rf", group_items(1, 0, 2, reward=None))
        assert store.put("rf", trxp.parse(payload("rich_fields.trxp"))).stored


def spread_group(task: int, size: int) -> list[trxp.RawItem]:
    """A group whose rewards and response lengths differ from run to run."""
    return [
        trxp.from_experience(make_experience(5, task, run, reward=float((3 * run + task) % 4), response=2 + run))
        for run in range(size)
    ]


def wait_computed(client: BufferClient, table: str) -> None:
    """Wait until no group of the table is waiting for its advantages."""
    for _ in range(500):
        stats = client.stats(table)[table]
        if stats.groups_computing == 0:  # set by the push itself, before its ack
            return
        time.sleep(0.01)
    raise AssertionError(f"advantages of table {table} not computed")


BATCH_LEVEL = [
    ("grpo", {"std_cal_level": "batch"}),
    ("step_wise_grpo", {"std_cal_level": "batch"}),
    ("reinforceplusplus", {"gamma": 0.9}),
    ("reinforce++_baseline", {}),
]


@pytest.mark.parametrize(("estimator", "params"), BATCH_LEVEL)
def test_batch_statistics_do_not_depend_on_arrival(client: BufferClient, estimator: str, params: dict) -> None:
    groups = [spread_group(task, size) for task, size in enumerate([4, 1, 3, 5])]
    for table in ("together", "apart"):
        client.create_table(table, estimator=estimator, estimator_params=params, group_size=0)
    client.push(trxp.build([item for group in groups for item in group]), table="together")
    for group in groups:  # one group at a time, each computed before the next arrives
        client.push(trxp.build(group), table="apart")
        wait_computed(client, "apart")
    wait_computed(client, "together")
    sampled = {}
    for table in ("together", "apart"):
        batch = next(client.sample(table, num_groups=4, max_batches=1, timeout=10, delivery="consume"))
        sampled[table] = {e.eid.uid: e.advantages for e in batch.experiences}
    assert sorted(sampled["together"]) == sorted(sampled["apart"])
    for uid, advantages in sampled["together"].items():
        assert torch.allclose(advantages, sampled["apart"][uid], atol=1e-6), uid
    assert any(a.abs().max() > 0.1 for a in sampled["together"].values())


def test_non_finite_result_fails_its_group(client: BufferClient) -> None:
    client.create_table("huge", estimator="rloo")  # each reward less the others' mean: 2 * float32's largest
    overflow = [trxp.from_experience(make_experience(6, 0, run, reward=(-1) ** run * FLOAT32_MAX)) for run in range(2)]
    client.push(trxp.build(overflow + group_items(6, 1, 2, reward=1.0)), table="huge")
    wait_computed(client, "huge")
    stats = client.stats("huge")["huge"]
    assert stats.groups_failed == 1 and "6/0" in stats.last_failure
    assert "non-finite" in stats.last_failure and "float32" in stats.last_failure
    batch = next(client.sample("huge", num_groups=1, max_batches=1, timeout=10, delivery="consume"))
    assert {e.eid.tid for e in batch.experiences} == {"6/1"}
    assert all(torch.isfinite(e.advantages).all() for e in batch.experiences)


def test_out_of_range_parameter_is_invalid_argument(client: BufferClient, tmp_path: Path) -> None:
    with pytest.raises(BufferError) as info:
        client.create_table("bad", estimator="opmd", estimator_params={"tau": 0.0})
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "table 'bad': estimator opmd parameter tau is '0.0'; allowed: > 0" in info.value.details
    assert "bad" not in client.stats()
    client.create_table("good", estimator="opmd", estimator_params={"tau": 0.5, "opmd_baseline": "logavgexp"})
    toml = tmp_path / "expbuf.toml"
    toml.write_text('[[tables]]\nname = "t"\nestimator = "reinforceplusplus"\nestimator_params = { gamma = 0 }\n')
    with pytest.raises(
        ConfigError, match=r"table 't': estimator reinforceplusplus parameter gamma is '0'; allowed: 0 < x <= 1"
    ):
        load_config(str(toml))


def test_get_finishes_the_batch_it_returns(client: BufferClient) -> None:
    client.create_table("rpp", estimator="reinforceplusplus", group_size=3)
    client.push(trxp.build(spread_group(0, 3) + spread_group(1, 2)), table="rpp")
    wait_computed(client, "rpp")
    ready = [f"5/0/{run}/0/r{run}s0" for run in range(3)]
    pending = ["5/1/0/0/r0s0"]
    got = {e.eid.uid: e for e in client.get(ready + pending, table="rpp")}
    assert got[pending[0]].advantages is None  # its group is not complete: nothing computed yet
    tokens = torch.cat([got[uid].advantages[got[uid].action_mask] for uid in ready])
    assert abs(tokens.mean().item()) < 1e-4 and abs(tokens.std().item() - 1) < 1e-3  # whitened over these three


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, None])
def test_expand_puts_the_value_under_the_mask(dtype: torch.dtype | None) -> None:
    mask = [1, 0, 1, 1, 0]
    tensors = {} if dtype is None else {"action_mask": trxp.raw_of(torch.tensor(mask, dtype=dtype))}
    out = expand((-0.75, 5), tensors)
    want = [-0.75 * m for m in mask] if dtype is not None else [-0.75] * 5
    assert trxp.tensor_of(out["advantages"]).tolist() == want
    assert out["returns"] == out["advantages"]


def test_a_long_backlog_does_not_keep_other_tables_waiting(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("a"))
        store.create_table(TableConfig.of("b"))
        store.put("b", group_items(2, 0, 2))
        worker = AdvantageWorker(store, batch_limit=4)
        for round_ in range(5):
            store.put("a", [item for task in range(3) for item in group_items(1, 10 * round_ + task, 2)])
            worker.run_once()
        assert store.stats("b")["groups_ready"] == 1


def test_a_stop_wakes_the_worker_waiting_for_groups(tmp_path: Path) -> None:
    """The advantage worker waits for the next commit with a timeout; a wake (its stop sends
    one) ends that wait at once, reporting no commit, so a stop does not wait out the timeout."""
    with Store(tmp_path) as store:
        generation, woke = store.generation, []
        waiter = threading.Thread(target=lambda: woke.append(store.wait_for_change(generation, 600)))
        waiter.start()
        deadline = time.monotonic() + 60
        while waiter.is_alive() and time.monotonic() < deadline:  # woken again if it was not waiting yet
            store.wake()
            waiter.join(0.05)
        assert woke == [False]


def test_a_table_dropped_while_its_groups_compute_leaves_nothing_behind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A table dropped while the worker computed its groups made the result's store fail: the worker
    took that for a passing failure of every group, logged it as one, and kept the table's tries and
    its wait before the next; a table made again under the name then waited that long (here a
    minute) for its first computation, its groups counted as tried before. The result now goes
    nowhere, quietly, and nothing of the dropped table is kept."""
    from expbuf.server.advantages.worker import estimators

    with Store(tmp_path) as store:
        drop = [True]

        def drops_its_table(batch: estimators.FlatBatch) -> estimators.Advantages:
            if drop.pop() if drop else False:
                store.drop_table("t")  # as a client's drop between the worker's read and its store
            return estimators.Advantages(scalar=batch.rewards - batch.rewards)

        estimator = Estimator("drops_its_table", ingest=drops_its_table, token_level=True)
        with registered(estimator) as name, caplog.at_level("INFO", logger="expbuf"):
            store.create_table(TableConfig.of("t", estimator=name, group_size=3))
            store.put("t", group_items(1, 0, 3))
            worker = AdvantageWorker(store, retry_delays=(60.0, 60.0))
            assert worker.run_once() == 1
            store.create_table(TableConfig.of("t", estimator=name, group_size=3))
            store.put("t", group_items(2, 0, 3))
            assert worker.run_once() == 1
            assert store.stats("t")["groups_ready"] == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("was dropped" in r.getMessage() for r in caplog.records)


def made_again(store: Store, name: str, rewards: list[float]) -> Callable[[], None]:
    """What a client does between the worker's read of table t's groups and its store: t dropped,
    made again, and the same group pushed to it anew with these rewards."""

    def drop_and_make() -> None:
        store.drop_table("t")
        store.create_table(TableConfig.of("t", estimator=name, group_size=3))
        store.put("t", [trxp.from_experience(make_experience(1, 0, run, reward=r)) for run, r in enumerate(rewards)])

    return drop_and_make


@pytest.mark.parametrize("outcome", ["stored", "raised"])
def test_a_computation_of_a_dropped_table_goes_nowhere_in_one_made_again_under_its_name(
    tmp_path: Path, outcome: str
) -> None:
    """Table t dropped and made again, with the same group pushed anew, while the worker computed the
    old t's groups: the late result was stored in the new t by name, at the place in its compute
    queue the old group had (its queue also starts at 0), so the new group was ready with the old
    group's values (here its old rewards) and never computed; a computation that raised held the new
    t back by the retry's wait (here a minute). Now the late result, or failure, is the old table's:
    the new group is computed at the worker's next pass, from its own rewards."""
    from expbuf.server.advantages.worker import estimators

    with Store(tmp_path) as store:
        before: list[Callable[[], None]] = []

        def rewards_as_values(batch: estimators.FlatBatch) -> estimators.Advantages:
            if before:
                before.pop()()
                if outcome == "raised":
                    raise RuntimeError("a fault that may pass")
            return estimators.Advantages(scalar=batch.rewards.clone())

        estimator = Estimator("rewards_as_values", ingest=rewards_as_values, token_level=True)
        with registered(estimator) as name:
            store.create_table(TableConfig.of("t", estimator=name, group_size=3))
            store.put(
                "t", [trxp.from_experience(make_experience(1, 0, run, reward=r)) for run, r in enumerate([0, 1, 2])]
            )
            before.append(made_again(store, name, [5.0, 6.0, 7.0]))
            worker = AdvantageWorker(store, retry_delays=(60.0, 60.0))
            assert worker.run_once() == 1
            assert worker.run_once() == 1  # the new t's group, computed now
            batch = take(store, "t", num_groups=1)
            assert batch is not None
            assert sorted(exp.advantages[0].item() for exp in decode(batch.payload)) == [5.0, 6.0, 7.0]
