"""Table settings from AReaL's config, checked against AReaL's own actor and interaction cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_areal_batch import ppo_actor

from expbuf.client import EID, BufferClient
from expbuf.server.config import load

from helpers import ServerProcess
from pages import code_blocks, page


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global GenerationHyperparameters, InferenceEngineConfig, NormConfig, PPOActorConfig, ModelResponse
    global InteractionCache, InteractionWithTokenLogpReward, concat_padded_tensors, ExpbufBatchSource
    global KeepExpbufAdvantages, from_areal, table_settings, trainer_side
    import test_areal_batch

    test_areal_batch.import_frameworks()
    pytest.importorskip("areal")
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NormConfig, PPOActorConfig
    from areal.api.io_struct import ModelResponse
    from areal.experimental.openai.cache import InteractionCache
    from areal.experimental.openai.types import InteractionWithTokenLogpReward
    from areal.utils.data import concat_padded_tensors

    from expbuf.client.areal import ExpbufBatchSource, KeepExpbufAdvantages, from_areal, table_settings, trainer_side


def actor_config(**changes: object) -> PPOActorConfig:
    settings = dict(
        experiment_name="e",
        trial_name="t",
        kl_ctl=0.0,
        reward_clip=1.5,
        overlong_reward_penalty=True,
        overlong_tokens=4,
        overlong_penalty_factor=0.5,
        max_new_tokens=10,
    )
    return PPOActorConfig(**{**settings, **changes})


def test_settings_follow_areals_config(child_server: ServerProcess) -> None:
    rollout = InferenceEngineConfig(consumer_batch_size=6, max_head_offpolicyness=2)
    settings = table_settings(rollout, GenerationHyperparameters(n_samples=8), actor_config())
    assert settings == {
        "group_by": "task",
        "max_staleness": 2,
        "batch_size": 6,
        "group_size": 8,
        "estimator": "reinforce",
        "shaping": {
            "reward_clip": 1.5,
            "overlong_buffer": True,
            "overlong_buffer_len": 4,
            "max_new_tokens": 10,
            "overlong_buffer_penalty_factor": 0.5,
        },
    }
    created = BufferClient(child_server.target).create_table("cfg", **settings)
    assert (created.max_staleness, created.batch_size, created.group_size) == (2, 6, 8)
    assert trainer_side(actor_config()) == []
    found = trainer_side(actor_config(kl_ctl=0.1, reward_scaling=2.0, adv_norm=NormConfig()))
    assert [f.split("=")[0].split(" ")[0] for f in found] == ["kl_ctl", "reward_bias", "adv_norm"]
    # a turn discount: AReaL clips and penalises each turn's discounted return, where the table shaped
    # each turn's reward before it discounted (0, 0, 2 at 0.9 clipped at 1.5: AReaL's 1.5 each, the
    # table's 1.215, 1.35, 1.5: a helper's audit), so the table shapes nothing and AReaL does
    turns = table_settings(rollout, actor=actor_config(), turn_discount=0.9)
    assert "shaping" not in turns and turns["estimator"] == "multi_turn_discount"
    found = trainer_side(actor_config(), turn_discount=0.9)
    assert [f.split("=")[0].split(" ")[0] for f in found] == ["reward_clip", "overlong_reward_penalty"]


def test_table_shaping_gives_areals_actor_advantages(child_server: ServerProcess) -> None:
    """AReaL's actor (no KL, no critic) makes every generated token's advantage the shaped
    reward; a table made with table_settings alone (its shaping, and `reinforce`: advantage =
    reward) agrees. It left the estimator the table's default, grpo: group-normalised values where
    trainer_side said they were AReaL's (a helper's audit)."""
    client = BufferClient(child_server.target)
    config = actor_config()
    settings = table_settings(InferenceEngineConfig(), GenerationHyperparameters(n_samples=4), config)
    client.create_table("shaped", **settings)
    rows = []
    for run, (response, reward) in enumerate([(3, 1.0), (8, 1.0), (10, 3.0), (9, -4.0)]):
        prompt = 2
        n = prompt + response
        rows.append(
            {
                "input_ids": torch.arange(run * 50, run * 50 + n).unsqueeze(0),
                "loss_mask": torch.tensor([[0] * prompt + [1] * response]),
                "logprobs": torch.tensor([[0.0] * prompt + [-0.3] * response]),
                "versions": torch.tensor([[-1] * prompt + [0] * response]),
                "attention_mask": torch.ones(1, n, dtype=torch.bool),
                "rewards": torch.tensor([reward]),
            }
        )
    group = concat_padded_tensors(rows)
    client.push(from_areal(group, [EID(batch="s", task=0, run=r) for r in range(4)]), table="shaped")
    (traj,) = ExpbufBatchSource(client, "shaped", max_head_offpolicyness=0, advantages=True).prepare_batch(num_groups=1)

    PPOActor = ppo_actor()

    class Actor(KeepExpbufAdvantages, PPOActor):
        pass

    (theirs,) = PPOActor(config, engine=None).compute_advantages([dict(traj)])
    (ours,) = Actor(config, engine=None).compute_advantages([dict(traj)])
    mask = theirs["loss_mask"].bool()
    assert torch.allclose(ours["advantages"][mask], theirs["advantages"][mask], atol=1e-6)
    # the overlong penalty and the clip both acted: 8 of 10 tokens costs 0.25, 3.0 clips to 1.5
    assert sorted({round(v, 4) for v in theirs["advantages"][mask].tolist()}) == [-1.5, 0.75, 1.0, 1.5]


def test_turn_discount_is_areals_interaction_cache(child_server: ServerProcess) -> None:
    client = BufferClient(child_server.target)
    settings = table_settings(InferenceEngineConfig(consumer_batch_size=1), turn_discount=0.9)
    client.create_table("turns", **settings)
    rewards = [None, 0.5, 0.0, 2.0]
    cache = InteractionCache()
    exps = []
    for step, reward in enumerate(rewards):
        interaction = InteractionWithTokenLogpReward(
            model_response=ModelResponse(
                input_tokens=[1, 2, step], output_tokens=[5, 6], output_logprobs=[-0.1, -0.2], output_versions=[0, 0]
            ),
            reward=reward,
        )
        exps += from_areal(interaction.to_tensor_dict(), [EID(batch="t", task=0, run=0, step=step)])
        cache[f"i{step}"] = interaction
    client.push(exps, table="turns")  # group_size 0: the push is the group
    discounted = [i.reward for i in cache.apply_reward_discount(turn_discount=0.9).values()]

    batch = next(client.sample("turns", num_groups=1, timeout=30, max_batches=1, delivery="consume"))
    got = sorted(batch.experiences, key=lambda e: e.eid.step)
    assert [e.advantages[0].item() for e in got] == pytest.approx(discounted, rel=1e-6)
    assert discounted[0] == pytest.approx(0.5 * 0.9 + 2.0 * 0.9**3)


def test_the_docs_areal_page_runs_as_written(child_server: ServerProcess, capsys: pytest.CaptureFixture) -> None:
    code = code_blocks(page("frameworks/areal.md"), "python")[0]
    exec(compile(code.replace("10.0.0.5:50051", child_server.target), "frameworks/areal.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "[]"
    (table,) = [t for t in BufferClient(child_server.target).list_tables() if t.name == "areal_grpo"]
    assert (table.group_size, table.max_staleness, table.batch_size) == (8, 2, 32)
    assert table.shaping.reward_clip == 20.0


def test_the_docs_areal_toml_is_what_table_settings_gives(tmp_path: Path) -> None:
    (tmp_path / "expbuf.toml").write_text(code_blocks(page("frameworks/areal.md"), "toml")[0])
    (table,) = load(str(tmp_path / "expbuf.toml")).tables
    settings = table_settings(
        InferenceEngineConfig(consumer_batch_size=32, max_head_offpolicyness=2),
        GenerationHyperparameters(n_samples=8),
        PPOActorConfig(experiment_name="e", trial_name="t"),
    )
    assert settings["shaping"] == {"reward_clip": 20.0}
    flat = table.settings()
    names = ("group_by", "group_size", "max_staleness", "batch_size", "estimator")
    assert {name: flat[name] for name in names} == {name: settings[name] for name in names}
    assert table.advantages.shaping.reward_clip == 20.0
