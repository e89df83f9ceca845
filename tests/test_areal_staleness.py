"""ExpbufStalenessManager against AReaL's own StalenessManager and WorkflowExecutor, with a real
`expbuf serve`; the bound across a killed rollout process (AReaL#1388)."""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from expbuf.client import BufferClient

from helpers import Beside, ServerProcess, wait_for


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global InferenceEngineConfig, RolloutWorkflow, StalenessManager, WorkflowExecutor, ExpbufRemoteInfEngine
    global ExpbufStalenessManager, OneRow, Scored
    pytest.importorskip("areal")
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.workflow_api import RolloutWorkflow
    from areal.infra.staleness_manager import StalenessManager
    from areal.infra.workflow_executor import WorkflowExecutor

    from expbuf.client.areal import ExpbufRemoteInfEngine, ExpbufStalenessManager

    class Scored(RolloutWorkflow):  # a row of one generated token, its reward and versions, as AReaL's make
        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
            return {
                "input_ids": torch.tensor([[1, 2, 3, 4]], dtype=torch.int32),
                "attention_mask": torch.ones(1, 4, dtype=torch.bool),
                "loss_mask": torch.tensor([[0, 0, 1, 1]], dtype=torch.int32),
                "logprobs": torch.tensor([[0.0, 0.0, -0.5, -0.5]]),
                "versions": torch.tensor([[-1, -1, 0, 0]], dtype=torch.int32),
                "rewards": torch.tensor([1.0]),
            }

    class OneRow(RolloutWorkflow):
        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
            return {
                "input_ids": torch.ones(1, 3, dtype=torch.int32),
                "attention_mask": torch.ones(1, 3, dtype=torch.bool),
            }


class Version:
    def __init__(self, version: int = 0) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


def test_capacities_match_areals_manager_over_a_scripted_trace(child_server: ServerProcess) -> None:
    client = BufferClient(child_server.target)
    client.create_table("parity", group_size=1, max_staleness=2, batch_size=3)
    limits = dict(max_concurrent_rollouts=5, consumer_batch_size=3, max_staleness=2)
    version = Version()
    areal = StalenessManager(version, **limits)
    ours = ExpbufStalenessManager(child_server.target, "parity", **limits)
    ours.set_version(0)
    rng = random.Random(7)
    seen = []
    for _ in range(120):
        op = rng.choice(["submit", "submit", "submit", "accept", "accept", "reject", "version"])
        running = areal.get_stats().running
        if op == "submit" and areal.get_capacity() > 0:
            for m in (areal, ours):
                m.on_rollout_enqueued()
                m.on_rollout_submitted()
        elif op in ("accept", "reject") and running:
            for m in (areal, ours):
                (m.on_rollout_accepted if op == "accept" else m.on_rollout_rejected)()
        elif op == "version" and rng.random() < 0.3:
            version.version += 1
            ours.set_version(version.version)
        capacity = areal.get_capacity()
        assert ours.get_capacity() == capacity, (op, areal.get_stats())
        assert ours.get_stats() == areal.get_stats()
        seen.append((capacity, areal.get_stats().running))
    # the trace met both limits: staleness (no room while few run) and concurrency (5 running)
    assert any(c == 0 and r < 5 for c, r in seen) and any(r == 5 for _, r in seen)
    stats = areal.get_stats()
    counted = client.stats("parity")["parity"].submitted
    assert counted - (1 if ours._spare else 0) == stats.accepted + stats.running


def test_areals_executor_keeps_the_tables_bound_through_the_engine_seam(child_server: ServerProcess) -> None:
    client = BufferClient(child_server.target)
    client.create_table("seam", group_size=1, max_staleness=0, batch_size=2)
    config = InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=8)
    engine = ExpbufRemoteInfEngine(config, backend=None, expbuf={"client": child_server.target, "table": "seam"})
    engine.workflow_executor = WorkflowExecutor(config, inference_engine=engine)  # as initialize() does
    executor = engine.workflow_executor
    assert executor.staleness_manager is engine.expbuf_staleness
    executor.initialize(train_data_parallel_size=1)
    try:
        engine.set_version(0)
        for _ in range(5):
            executor.submit({}, workflow=OneRow())
        assert len(executor.wait(2, timeout=30)) == 2
        assert executor.wait(1, timeout=1.5, raise_timeout=False) == []  # (0 + 0 + 1) x 2 started, no more
        engine.set_version(1)
        assert client.stats("seam")["seam"].trainer_version == 1
        executor.submit({}, workflow=OneRow())  # a new input wakes AReaL's producer, as prepare_batch's do
        assert len(executor.wait(2, timeout=30)) == 2
        assert executor.wait(1, timeout=1.5, raise_timeout=False) == []
    finally:
        executor.destroy()


def test_each_data_parallel_ranks_engine_runs_its_share_of_the_concurrency_as_areals_own(
    child_server: ServerProcess,
) -> None:
    """AReaL's executor gives each of dp ranks max_concurrent_rollouts // dp; an engine a rank kept
    the whole limit, dp times it at once over the ranks (a helper's audit: 32 against 8)."""
    BufferClient(child_server.target).create_table("ranks", group_size=1, max_staleness=4, batch_size=64)
    config = InferenceEngineConfig(consumer_batch_size=64, max_head_offpolicyness=4, max_concurrent_rollouts=8)
    plain = WorkflowExecutor(config, inference_engine=Version())
    plain.initialize(train_data_parallel_size=4)
    theirs = plain.get_capacity()
    plain.destroy()
    engine = ExpbufRemoteInfEngine(config, backend=None, expbuf={"client": child_server.target, "table": "ranks"})
    engine.workflow_executor = WorkflowExecutor(config, inference_engine=engine)  # as initialize() does
    executor = engine.workflow_executor
    executor.initialize(train_data_parallel_size=4)
    try:
        engine.set_version(0)
        assert executor.get_capacity() == theirs == 2
    finally:
        executor.destroy()
        engine.expbuf_staleness.close()


def test_a_checkpoint_recovered_from_behind_the_bound_says_how_to_reset_the_table(
    child_server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """The table's trainer version only moves forward: AReaL recovering version 7 of a job that
    reached 10 (max_head_offpolicyness 2) had its pushes dropped as stale and its trainer waiting
    until the versions passed 10, with no word (a helper's audit). It is said, with the command."""
    BufferClient(child_server.target).create_table("recover", group_size=1, max_staleness=2, batch_size=2)
    manager = ExpbufStalenessManager(
        child_server.target, "recover", max_concurrent_rollouts=4, consumer_batch_size=2, max_staleness=2
    )
    manager.set_version(10)
    with caplog.at_level(logging.WARNING, logger="expbuf.client.areal.staleness"):
        manager.on_version_recovered(9)
        assert not caplog.records  # within the bound: nothing to say
        manager.on_version_recovered(7)
    (record,) = caplog.records
    assert "expbuf table reset-offpolicy recover --version 7" in record.getMessage()


def test_a_produce_only_workflow_is_held_to_the_tables_bound(child_server: ServerProcess) -> None:
    """A produce-only ExpbufWorkflow returns None once its group is in the table, which AReaL's
    executor counts as a rejected rollout: its grant was finished with nothing accepted, its room
    came back, and the bound counted none of the groups produced: 10 submitted, 10 produced at a
    bound of 2 (a helper's audit). Its groups count as accepted in the table now."""
    from expbuf.client.areal import ExpbufWorkflow

    client = BufferClient(child_server.target)
    client.create_table("produced", group_size=2, max_staleness=0, batch_size=2, estimator="none")
    config = InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=8)
    engine = ExpbufRemoteInfEngine(config, backend=None, expbuf={"client": child_server.target, "table": "produced"})
    engine.workflow_executor = WorkflowExecutor(config, inference_engine=engine)
    executor = engine.workflow_executor
    executor.initialize(train_data_parallel_size=1)
    workflow = ExpbufWorkflow(Scored(), child_server.target, "produced", group_size=2, produce_only=True)
    try:
        engine.set_version(0)
        for _ in range(10):
            executor.submit({}, workflow=workflow)
        manager = executor.staleness_manager
        wait_for(lambda: manager.get_stats().rejected == 2, "the bound's two rollouts to be produced", 30)
        time.sleep(1.5)  # as long again: a rollout past the bound would start
        stats = client.stats("produced")["produced"]
        assert (manager.get_stats().rejected, stats.groups_ready, stats.submitted) == (2, 2, 2)
    finally:
        executor.destroy()


CHILD = """
import sys
from expbuf.client.areal import ExpbufStalenessManager
m = ExpbufStalenessManager(sys.argv[1], "restart", max_concurrent_rollouts=100, consumer_batch_size=2,
                           max_staleness=1, grant_seconds=1.0)
m.set_version(3)
started = 0
while m.get_capacity() > 0:
    m.on_rollout_enqueued()
    m.on_rollout_submitted()
    started += 1
for _ in range(started - 2):
    m.on_rollout_accepted()
print(started, flush=True)
sys.stdin.read()
"""


def test_the_bound_holds_across_a_killed_rollout_process(child_server: ServerProcess) -> None:
    client = BufferClient(child_server.target)
    client.create_table("restart", group_size=1, max_staleness=1, batch_size=2)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, child_server.target], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        started = child.stdout.readline()
        assert started.strip() == "10", started  # (1 + 3 + 1) x 2; 8 accepted, 2 still running
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)

    limits = dict(max_concurrent_rollouts=100, consumer_batch_size=2, max_staleness=1)
    ours = ExpbufStalenessManager(child_server.target, "restart", **limits)
    assert ours.get_capacity() == 0  # the restarted process starts where the killed one was
    fresh = StalenessManager(Version(3), **limits)
    assert fresh.get_capacity() == 10  # AReaL's own manager after a restart: AReaL#1388's burst
    fresh.on_version_recovered(3)
    assert fresh.get_capacity() == 4  # its fix assumes every earlier rollout was consumed

    deadline = time.monotonic() + 20
    while ours.get_capacity() < 2 and time.monotonic() < deadline:  # each grant expires in its own upkeep pass
        time.sleep(0.2)
    assert ours.get_capacity() == 2  # the killed process's 2 running grants expired and came back
    ours.set_version(4)
    assert ours.get_capacity() == 4


def test_the_manager_rides_out_a_server_restart_and_takes_no_grant_twice(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """The server restarts (away 1.5 s) while AReaL's rollout thread asks for capacity and a
    rollout ends: each call raised UnavailableError, which ends AReaL's rollout thread, and a
    finish that failed forgot its grant, whose room stayed held until it expired. Each is made
    again while the server is unavailable; the admit under its grant's name, so the table counts
    each rollout once."""
    data = str(tmp_path / "data")
    servers = [serve(data)]
    port = servers[0].port
    with BufferClient(servers[0].target) as client:
        client.create_table("bound", group_size=1, max_staleness=0, batch_size=2)
    manager = ExpbufStalenessManager(
        servers[0].target, "bound", max_concurrent_rollouts=10, consumer_batch_size=2, max_staleness=0
    )
    assert manager.get_capacity() == 2  # (0 + 0 + 1) x 2; one grant taken ahead
    manager.on_rollout_enqueued()
    manager.on_rollout_submitted()  # on the grant taken ahead

    def restarted() -> None:
        assert servers[-1].stop(signal.SIGTERM) == 0, "".join(servers[-1].log)
        time.sleep(1.5)
        servers.append(serve(data, "--port", str(port)))

    away = Beside(restarted)
    away.start()
    try:
        time.sleep(0.3)  # stopped, or stopping
        assert manager.get_capacity() == 1  # one running; a grant taken ahead for the next
        manager.on_rollout_accepted()
    finally:
        away.join()
    with BufferClient(servers[-1].target) as client:
        stats = client.stats("bound")["bound"]
    assert (stats.submitted, stats.admitted) == (2, 2), stats
    assert manager.rollout_stat.running == 0 and manager.rollout_stat.accepted == 1
    manager.close()


def test_table_settings_must_agree_with_areals(child_server: ServerProcess) -> None:
    BufferClient(child_server.target).create_table("other", group_size=1, max_staleness=1, batch_size=4)
    with pytest.raises(ValueError, match="max_staleness 1 and batch_size 4; AReaL's max_head_offpolicyness is 2"):
        ExpbufStalenessManager(
            child_server.target, "other", max_concurrent_rollouts=4, consumer_batch_size=4, max_staleness=2
        )
