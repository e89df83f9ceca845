"""ExpbufWorkflow run by AReaL's own WorkflowExecutor, with a scripted inference engine, against
a real `expbuf serve`."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import pytest
import torch

from expbuf.client import BufferClient
from expbuf.server.app import ExpbufServer

from conftest import Servers
from helpers import ServerProcess


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global InferenceEngineConfig, ModelRequest, ModelResponse, RolloutWorkflow, InteractionWithTokenLogpReward
    global WorkflowExecutor, ExpbufWorkflow, to_areal, ScriptedRLVR, ScriptedAgent, RejectingRLVR
    pytest.importorskip("areal")
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.io_struct import ModelRequest, ModelResponse
    from areal.api.workflow_api import RolloutWorkflow
    from areal.experimental.openai.types import InteractionWithTokenLogpReward
    from areal.infra.workflow_executor import WorkflowExecutor

    from expbuf.client.areal import ExpbufWorkflow, to_areal

    class ScriptedRLVR(RolloutWorkflow):
        """One row per episode, in the layout and dtypes of AReaL's RLVRWorkflow."""

        def __init__(self, reward: float = 1.0) -> None:
            self.reward = reward
            self.calls = 0

        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
            self.calls += 1
            resp = await engine.agenerate(ModelRequest(input_ids=data["prompt"]))
            seq = resp.input_tokens + resp.output_tokens
            res = {
                "input_ids": torch.tensor(seq, dtype=torch.int32),
                "loss_mask": torch.tensor([0] * resp.input_len + [1] * resp.output_len, dtype=torch.int32),
                "logprobs": torch.tensor([0.0] * resp.input_len + resp.output_logprobs, dtype=torch.float32),
                "versions": torch.tensor([-1] * resp.input_len + resp.output_versions, dtype=torch.int32),
                "attention_mask": torch.ones(len(seq), dtype=torch.bool),
                "rewards": torch.tensor(self.reward * (self.calls % 2), dtype=torch.float32),
            }
            return {k: v.unsqueeze(0) for k, v in res.items()}

    class ScriptedAgent(RolloutWorkflow):
        """Two turns of an agent, as AReaL's concat interactions: the second turn's input adds a
        tool reply (tokens 7, 7) that the model did not generate."""

        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, InteractionWithTokenLogpReward]:
            first = await engine.agenerate(ModelRequest(input_ids=data["prompt"]))
            turn1 = InteractionWithTokenLogpReward(model_response=first, reward=0.0, chat_template_type="concat")
            second = await engine.agenerate(ModelRequest(input_ids=first.input_tokens + first.output_tokens + [7, 7]))
            turn2 = InteractionWithTokenLogpReward(
                model_response=second, reward=1.0, parent=turn1, chat_template_type="concat"
            )
            return {f"{id(self)}-a": turn1, f"{id(self)}-b": turn2}

    class RejectingRLVR(ScriptedRLVR):
        """ScriptedRLVR whose episodes of the given call numbers (from 1) are rejected (None)."""

        def __init__(self, rejected: set[int]) -> None:
            super().__init__()
            self.rejected = rejected

        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
            row = await super().arun_episode(engine, data)
            return None if self.calls in self.rejected else row


class ScriptedEngine:
    """An inference engine whose answers are a function of the prompt: 2 + len(prompt) tokens
    counting up from 10 * the prompt's first token, stamped with the engine's version."""

    def __init__(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        n = 2 + len(req.input_ids)
        out = [10 * req.input_ids[0] + i for i in range(n)]
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=out,
            output_logprobs=[-0.1 * (i + 1) for i in range(n)],
            output_versions=[self.version] * n,
        )


def run_executor(workflow: RolloutWorkflow, prompts: list[list[int]], version: int = 5) -> tuple[list, Any]:
    config = InferenceEngineConfig(consumer_batch_size=len(prompts), max_head_offpolicyness=1)
    config.check_trajectory_format = True
    executor = WorkflowExecutor(config, ScriptedEngine(version))
    executor.initialize(train_data_parallel_size=1)
    try:
        for prompt in prompts:
            executor.submit({"prompt": prompt}, workflow=workflow)
        return executor.wait(len(prompts), timeout=60), executor.staleness_manager.get_stats()
    finally:
        executor.destroy()


def whole_groups(client: BufferClient, table: str, groups: int) -> list[list]:
    batch = next(client.sample(table, num_groups=groups, timeout=30, max_batches=1, delivery="consume"))
    by_group: dict[str, list] = {}
    for exp in batch.experiences:
        by_group.setdefault(exp.eid.tid, []).append(exp)
    return [sorted(g, key=lambda e: (e.eid.run, e.eid.step)) for g in by_group.values()]


def test_groups_reach_expbuf_and_areal_gets_its_trajectories(child_server: ServerProcess) -> None:
    client = BufferClient(child_server.target)
    client.create_table("rlvr", group_size=4)
    inner = ScriptedRLVR()
    prompts = [[1, 2], [3, 4, 5], [6]]
    trajectories, stats = run_executor(ExpbufWorkflow(inner, child_server.target, "rlvr", group_size=4), prompts)
    assert inner.calls == 12 and stats.accepted == 3

    groups = whole_groups(client, "rlvr", 3)
    assert sorted(len(g) for g in groups) == [4, 4, 4]
    by_prompt = {t["input_ids"][0, 0].item(): t for t in trajectories}
    for group in groups:
        assert [e.eid.run for e in group] == [0, 1, 2, 3]
        assert len({e.eid.task for e in group}) == 1
        assert re.fullmatch(r"[0-9a-f]{24}", group[0].eid.task)  # an ordered_id: the table's keys in push order
        assert all(e.info["model_version"] == 5 for e in group)
        assert all(e.advantages is not None for e in group)  # the table's grpo ran on the group
        returned = by_prompt[group[0].tokens[0].item()]
        # what AReaL trained on is what the table holds, run for run
        back = to_areal(group)
        for key, value in returned.items():
            assert torch.equal(back[key].to(value.dtype), value), key


def test_agent_groups_by_import_path_for_another_trainer(child_server: ServerProcess) -> None:
    client = BufferClient(child_server.target)
    client.create_table("agent", group_size=16, estimator="multi_turn_discount")
    workflow = ExpbufWorkflow(
        "test_areal_workflow.ScriptedAgent", child_server.target, "agent", group_size=2, produce_only=True
    )
    trajectories, stats = run_executor(workflow, [[1, 2], [3]])
    assert trajectories == [None, None] and stats.rejected == 2  # AReaL trains on nothing here

    for group in whole_groups(client, "agent", 2):  # 2 runs x 2 turns, sealed below group_size 16
        assert [(e.eid.run, e.eid.step) for e in group] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        first, second = group[0], group[1]
        assert second.tokens[: first.tokens.numel()].tolist() == first.tokens.tolist()
        hole = second.action_mask.tolist()
        assert hole[: first.action_mask.numel()] == [True] * first.action_mask.numel()
        assert hole[first.action_mask.numel() : first.action_mask.numel() + 2] == [False, False]
        # multi_turn_discount: turn 0's return takes turn 1's reward (discount 1.0)
        assert first.advantages[first.action_mask].unique().tolist() == [1.0]


def test_a_workflow_that_is_not_one_is_refused(child_server: ServerProcess) -> None:
    BufferClient(child_server.target).create_table("t")
    with pytest.raises(TypeError, match="must be a RolloutWorkflow"):
        ExpbufWorkflow("collections.OrderedDict", child_server.target, "t")
    with pytest.raises(ValueError, match="table 'missing' does not exist"):
        ExpbufWorkflow(ScriptedRLVR(), child_server.target, "missing")


def test_groups_of_one_from_areals_own_grouping_are_refused(child_server: ServerProcess) -> None:
    """AReaL's GroupedRolloutWorkflow around ExpbufWorkflow (AReaL's group size left at n) runs
    it once per sample: each run would be a group of its own. The rollouts fail, nothing is stored."""
    from areal.infra.remote_inf_engine import GroupedRolloutWorkflow

    client = BufferClient(child_server.target)
    client.create_table("grouped", group_size=4)
    wrapped = GroupedRolloutWorkflow(
        ExpbufWorkflow(ScriptedRLVR(), child_server.target, "grouped"), 4, logging.getLogger()
    )
    trajectories, stats = run_executor(wrapped, [[1, 2]])
    assert trajectories == [None] and stats.rejected == 1
    assert client.stats("grouped")["grouped"].pushed == 0


def test_rejected_runs_are_reported_failed_and_the_table_completes_or_drops_the_group(
    child_server: ServerProcess,
) -> None:
    client = BufferClient(child_server.target)
    client.create_table("areal_short", group_size=4, min_group_size=3)
    one_rejected = RejectingRLVR({4})
    run_executor(ExpbufWorkflow(one_rejected, child_server.target, "areal_short", group_size=4), [[1, 2]])
    (group,) = whole_groups(client, "areal_short", 1)
    assert [e.eid.run for e in group] == [0, 1, 2] and all(e.advantages is not None for e in group)
    two_rejected = RejectingRLVR({3, 4})
    run_executor(ExpbufWorkflow(two_rejected, child_server.target, "areal_short", group_size=4), [[3]])
    stats = client.stats("areal_short")["areal_short"]
    assert (stats.groups_dropped, stats.groups_ready, stats.pushed) == (1, 0, 5)  # 2 of 4: too few


def test_a_group_pushed_while_the_server_restarts_waits_for_it_and_is_stored(start_server: Servers) -> None:
    """The server is away for 1.5 s as a group's runs are pushed: the push raised UNAVAILABLE after
    gRPC's own retries (under a second), AReaL's executor counted the rollout rejected, and the
    generated group was lost. It waits for the server (for the client's timeout): the same uids
    pushed again are stored once."""
    server = start_server()
    port = server.port
    target = f"127.0.0.1:{port}"
    with BufferClient(target) as admin:
        admin.create_table("rlvr", group_size=4)
    workflow = ExpbufWorkflow(ScriptedRLVR(), target, "rlvr", group_size=4)
    start_server.stop(server)
    restarted: list[ExpbufServer] = []
    back = threading.Timer(1.5, lambda: restarted.append(start_server(port=port)))
    back.start()
    try:
        trajectories, stats = run_executor(workflow, [[1, 2]])
    finally:
        back.join()
    assert stats.accepted == 1 and len(trajectories) == 1
    with BufferClient(target) as client:
        assert [len(g) for g in whole_groups(client, "rlvr", 1)] == [4]


@pytest.mark.parametrize("settle", ["fail_runs", "seal"])
def test_a_group_settled_while_the_server_restarts_waits_for_it(start_server: Servers, settle: str) -> None:
    """A group with a rejected run is pushed, then its run reported failed (a table with
    min_group_size) or the group sealed short; the server goes away (1.5 s) as that call starts: it
    raised UNAVAILABLE, AReaL counted the rollout rejected, and the group, pushed, stayed pending for
    good (no group timeout), its runs never trained (a helper's audit). The call waits for the
    server, as the push before it does, and the group completes."""
    server = start_server()
    port = server.port
    target = f"127.0.0.1:{port}"
    with BufferClient(target) as admin:
        admin.create_table("settled", group_size=4, **({"min_group_size": 3} if settle == "fail_runs" else {}))
    workflow = ExpbufWorkflow(RejectingRLVR({4}), target, "settled", group_size=4)
    made = getattr(workflow.client, settle)
    restarted: list[ExpbufServer] = []
    backs: list[threading.Timer] = []

    def away_first(*args: Any, **kwargs: Any) -> Any:
        if not backs:  # the server goes away as the first call starts
            start_server.stop(server)
            backs.append(threading.Timer(1.5, lambda: restarted.append(start_server(port=port))))
            backs[0].start()
        return made(*args, **kwargs)

    setattr(workflow.client, settle, away_first)
    try:
        trajectories, stats = run_executor(workflow, [[1, 2]])
    finally:
        for back in backs:
            back.join()
    assert backs and stats.accepted == 1 and len(trajectories) == 1
    with BufferClient(target) as client:
        (group,) = whole_groups(client, "settled", 1)
    assert [e.eid.run for e in group] == [0, 1, 2]
