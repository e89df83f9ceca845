"""An estimator is one registered record: registered in one call, a table validates against
it and a real Store computes, stores and samples with its two stages."""

from __future__ import annotations

import dataclasses
import logging
import statistics
from pathlib import Path

import pytest
import torch

from expbuf.client import BufferClient, decode, trxp
from expbuf.client.errors import ExpbufError
from expbuf.server.advantages.batch_stage import finish_batch
from expbuf.server.advantages.worker import AdvantageWorker, compute, estimators
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import BatchStageFailed, InvalidRequest
from expbuf.server.store.schema.estimator_registry import ESTIMATORS, Estimator, Param, register
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import ConfigError, TableConfig, batch_stage, group_step_first

from conftest import Servers
from helpers import group_items, make_experience, registered, scrape, take, wait_for


def scaled_centred(b: estimators.FlatBatch, scale: float) -> estimators.Advantages:
    """scale * (r - the group's mean reward), left pending for the batch stage."""
    count = torch.zeros(b.num_groups, dtype=torch.float64).index_add_(0, b.group, torch.ones_like(b.rewards))
    total = torch.zeros(b.num_groups, dtype=torch.float64).index_add_(0, b.group, b.rewards)
    return estimators.Advantages(scalar=scale * (b.rewards - (total / count)[b.group]))


def minus_batch_max(rows: estimators.SampledRows, scale: float) -> torch.Tensor:
    """The pending values less the batch's largest one."""
    return rows.pending - rows.pending.max()


SCALED = Estimator(
    "scaled_centred",
    {"scale": Param(2.0, low=0.0, low_open=True)},
    ingest=scaled_centred,
    batch=minus_batch_max,
    group_step=True,
)


def test_a_registered_estimator_runs_end_to_end_through_a_store(tmp_path: Path) -> None:
    """One registration: the table takes its name and parameter, the worker runs its ingest
    stage, a sample runs its batch stage over the sampled batch."""
    rewards = {0: [1.0, 2.0, 6.0], 1: [0.0, 4.0, 5.0]}
    with registered(SCALED) as name, Store(tmp_path, batch_stage=finish_batch) as store:
        config = TableConfig.of("t", group_size=3, estimator=name, estimator_params={"scale": 0.5})
        assert batch_stage(config) and group_step_first(config)
        store.create_table(config)
        store.put("t", [trxp.from_experience(make_experience(1, t, run, reward=r)) for t, rs in rewards.items()
                        for run, r in enumerate(rs)])  # fmt: skip
        assert AdvantageWorker(store).run_once() == 2
        batch = take(store, "t", num_groups=2)
        pending = [0.5 * (r - statistics.fmean(rs)) for rs in rewards.values() for r in rs]
        want = {f"1/{i // 3}/{i % 3}/0/r{i % 3}s0": p - max(pending) for i, p in enumerate(pending)}
        for exp in decode(batch.payload):
            assert exp.advantages.tolist() == pytest.approx([want[exp.eid.uid]] * 4)
        assert store.verify("t") == []


class Recorded(Exception):
    """The recording estimator has seen its inputs (meta tensors hold no values to go on with)."""


@pytest.mark.parametrize("token_level", [False, True], ids=["records", "tokens"])
def test_an_estimator_is_handed_every_input_on_the_device_it_is_told(tmp_path: Path, token_level: bool) -> None:
    """Whatever the device: the ingest stage is told it (`batch.device`), every tensor of its batch
    is on it, and so is a tensor it makes without naming a device (as SCALED above does), where on
    CUDA one left on the CPU failed every group. The meta device stands in for CUDA here."""
    seen: list[dict[str, torch.device]] = []

    def record(b: estimators.FlatBatch) -> estimators.Advantages:
        inputs = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
        seen.append({name: t.device for name, t in inputs.items() if isinstance(t, torch.Tensor)})
        seen[-1] |= {"told": b.device, "made": torch.zeros(3).device, "made like": torch.tensor([1.0]).device}
        raise Recorded

    recording = Estimator("recording", ingest=record, needs_reward=not token_level, token_level=token_level)
    with registered(recording) as name, Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", group_size=2, estimator=name))
        store.put("t", group_items(1, 0, 2, reward=1.0))
        (job,) = store.compute_backlog()
        with pytest.raises(Recorded):
            compute(job, device=torch.device("meta"))
    (devices,) = seen
    assert {"rewards", "group", "lengths", "told", "made"} <= set(devices)
    assert ("mask" in devices and "token_rewards" in devices) == token_level
    assert set(devices.values()) == {torch.device("meta")}, devices


def test_a_group_an_estimator_keeps_failing_on_fails_named_logged_and_counted(
    start_server: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """A computation that raises for every group is tried again after a pause (the cause may
    pass: a GPU out of memory), then fails its groups: each try is logged with the error and
    counted in the metrics, and the group's failure is in Stats."""

    def broken(b: estimators.FlatBatch) -> estimators.Advantages:
        raise RuntimeError("Expected all tensors to be on the same device")

    caplog.set_level(logging.INFO, logger="expbuf")
    server = start_server()
    with registered(Estimator("broken", ingest=broken)) as name, BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("b", group_size=2, estimator=name)
        client.push(trxp.build(group_items(1, 0, 2, reward=1.0)), table="b")
        wait_for(lambda: client.stats("b")["b"].groups_failed == 1, "the group failed")
        assert "same device" in client.stats("b")["b"].last_failure
    metrics = scrape(server.metrics_port)
    failures = {
        labels: count for (metric, labels), count in metrics.items() if metric == "expbuf_advantage_failures_total"
    }
    assert failures == {
        (("estimator", name), ("outcome", "retried"), ("table", "b")): 2.0,
        (("estimator", name), ("outcome", "failed"), ("table", "b")): 1.0,
    }
    tries = [
        line for r in caplog.records if r.name == "expbuf.advantages" and "same device" in (line := r.getMessage())
    ]
    assert sum("trying again" in line for line in tries) == 2 and sum("group 1/0" in line for line in tries) == 1


def unlucky(rows: estimators.SampledRows, scale: float) -> torch.Tensor:
    """SCALED's batch stage, but raising on a batch that holds a reward of 13, or rewards of 5 and 7
    together (an estimator's bug that some data trips)."""
    rewards = set(rows.rewards.tolist())
    if 13.0 in rewards or {5.0, 7.0} <= rewards:
        raise ValueError(f"unlucky rewards {sorted(rewards)}")
    return minus_batch_max(rows, scale)


def pushed_groups(client: BufferClient, table: str, rewards: list[float]) -> list[str]:
    """A group of 2 runs of each reward (task i of batch 1, in order), computed; their ids."""
    for task, reward in enumerate(rewards):
        client.push(trxp.build(group_items(1, task, 2, reward=reward)), table=table)
    wait_for(lambda: client.stats(table)[table].ready == 2 * len(rewards), "the groups were not computed")
    return [f"1/{task}" for task in range(len(rewards))]


def test_a_batch_stage_that_raises_fails_the_groups_it_raises_on_and_the_stream_goes_on(
    start_server: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """A table's batch stage that raised on a sampled batch failed the Sample INTERNAL, and its
    batch went back to the buffer to be taken, and to fail, again: every Sample of the table
    failed for good, the groups after it never served. The groups the stage raises on alone fail
    now, named in last_failure and logged; the others of the batch go back; the stream goes on to
    its next batch. Where no group raises alone (the batch together does), the batch's groups
    fail."""
    caplog.set_level(logging.ERROR, logger="expbuf")
    server = start_server()
    estimator = dataclasses.replace(SCALED, name="unlucky", batch=unlucky)
    with registered(estimator) as name, BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("u", group_size=2, estimator=name)
        ok, bad, after = pushed_groups(client, "u", [1.0, 13.0, 2.0])
        served = [b.group_ids for b in client.sample("u", num_groups=2, max_batches=1, delivery="consume", timeout=10)]
        assert served == [[ok, ok, after, after]]  # the batch of ok and bad: bad failed, ok taken again
        wait_for(lambda: client.stats("u")["u"].consumed == 4, "the batch served was not consumed")
        stats = client.stats("u")["u"]
        assert (stats.groups_failed, stats.ready, stats.leased) == (1, 0, 0), stats
        assert stats.last_failure == f"group {bad}: its batch stage raised ValueError: unlucky rewards [13.0]"
        with pytest.raises(ExpbufError, match=r"batch stage raised ValueError: unlucky rewards \[13.0\], over group"):
            client.get([f"{bad}/0/0/r0s0"], table="u")  # kept (keep_failed), but a Get runs the stage too

        client.create_table("v", group_size=2, estimator=name)
        five, seven, one, two = pushed_groups(client, "v", [5.0, 7.0, 1.0, 2.0])
        served = [b.group_ids for b in client.sample("v", num_groups=2, max_batches=1, delivery="consume", timeout=10)]
        assert served == [[one, one, two, two]]
        wait_for(lambda: client.stats("v")["v"].consumed == 4, "the batch served was not consumed")
        stats = client.stats("v")["v"]
        assert (stats.groups_failed, stats.ready, stats.leased) == (2, 0, 0), stats
        assert stats.last_failure == f"group {seven}: its batch stage raised ValueError: unlucky rewards [5.0, 7.0]"
    logged = [r.getMessage() for r in caplog.records if "batch stage" in r.getMessage()]
    assert len(logged) == 2 and f"group(s) {bad} fail" in logged[0] and f"group(s) {five}, {seven} fail" in logged[1]


@pytest.mark.parametrize("layout", ["records", "rows"])
def test_a_held_batch_whose_stage_raised_fails_those_groups_and_gives_the_others_back(
    tmp_path: Path, layout: str
) -> None:
    """The store's side of the above, in each layout: a held batch's stage raises BatchStageFailed
    naming the group it raises on alone, with what it raised; Store.fail_stage fails that group and
    gives the others back, uncounted as sampled, every index and counter consistent."""
    with (
        registered(dataclasses.replace(SCALED, name="unlucky", batch=unlucky)) as name,
        Store(tmp_path, batch_stage=finish_batch) as store,
    ):
        store.create_table(TableConfig.of("t", layout=layout, group_size=2, estimator=name))
        store.put("t", [item for task, r in enumerate([1.0, 13.0, 2.0]) for item in group_items(1, task, 2, reward=r)])
        assert AdvantageWorker(store).run_once() == 3
        batch = store.sample(TakeSpec("t", num_groups=2), hold=True)
        assert batch is not None and batch.group_ids == ["1/0", "1/0", "1/1", "1/1"]
        with pytest.raises(BatchStageFailed) as raised:
            batch.finish()
        assert raised.value.failed == {"1/1": "its batch stage raised ValueError: unlucky rewards [13.0]"}
        assert store.fail_stage(batch.lease_id, "t", raised.value.failed) == 2
        stats = store.stats("t")
        assert [stats[name] for name in ("groups_failed", "ready", "leased", "sampled")] == [1, 4, 0, 0], stats
        assert stats["last_failure"] == "group 1/1: its batch stage raised ValueError: unlucky rewards [13.0]"
        assert store.verify("t") == []
        again = take(store, "t", num_groups=2)
        assert again is not None and again.group_ids == ["1/0", "1/0", "1/2", "1/2"]
        again.finish()


def test_a_registered_estimator_is_validated_by_its_record() -> None:
    with registered(SCALED) as name:
        assert name in ESTIMATORS
        with pytest.raises(ConfigError, match="estimator scaled_centred parameter scale is '0'; allowed: > 0"):
            TableConfig.of("t", estimator=name, estimator_params={"scale": 0})
        with pytest.raises(ConfigError, match=r"has no parameter\(s\) tau \(it takes: scale\)"):
            TableConfig.of("t", estimator=name, estimator_params={"tau": 1.0})
        with pytest.raises(ValueError, match="scaled_centred is registered already"):
            register(SCALED)
    with pytest.raises(ConfigError, match="estimator is 'scaled_centred'; expected one of grpo,"):
        TableConfig.of("t", estimator=name)


def test_a_push_without_reward_is_refused_by_the_record(tmp_path: Path) -> None:
    with registered(SCALED) as name, Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator=name))
        with pytest.raises(InvalidRequest, match=r"computes advantages with scaled_centred, which needs one$"):
            store.put("t", group_items(1, 0, 2, reward=None))
