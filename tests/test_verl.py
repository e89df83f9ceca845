"""expbuf.client.verl without a server: the conversion to and from verl V1's trajectory rows (built
with verl's own AgentLoopOutput), the padded layout, the settings, the `expbuf` advantage
estimator inside verl's compute_advantage, and the registration through VERL_USE_EXTERNAL_MODULES
(skipped where verl is absent)."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from expbuf.client import (
    EID,
    Experience,
    layout,
    trxp,
)


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global tq, AgentLoopMetrics, AgentLoopOutput, DataProto, compute_advantage, compute_position_id_with_mask
    global list_of_dict_to_tensordict, Row, advantage, from_verl, settings, to_verl
    pytest.importorskip("verl")
    tq = pytest.importorskip("transfer_queue")
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.utils.model import compute_position_id_with_mask
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from expbuf.client.verl import Row, advantage, from_verl, settings, to_verl


def agent_loop_rows(uid: str, global_steps: int, sessions: int = 2) -> list[Row]:
    """Rows as verl's agent loop writes them into TransferQueue (`AgentLoopWorkerTQ._agent_loop_postprocess`):
    session 1 is multi-turn, two outputs whose masks have tool-output holes."""
    rows = []
    for session in range(sessions):
        turns = 2 if session == 1 else 1
        for turn in range(turns):
            response = [7 + session, 8, 9, 10, 11][: 3 + turn]
            mask = [1, 0, 1, 1, 1][: len(response)] if session == 1 else [1] * len(response)
            output = AgentLoopOutput(
                prompt_ids=[1, 2, 3 + turn],
                response_ids=response,
                response_mask=mask,
                response_logprobs=[-0.5 - i / 8 for i in range(len(response))],
                reward_score=float(session),
                num_turns=2 * turns,
                metrics=AgentLoopMetrics(generate_sequences=0.25),
                extra_fields={
                    "min_global_steps": global_steps - 1,
                    "max_global_steps": global_steps - 1,
                    "reward_extra_info": {"acc": float(session)},
                },
            )
            field = output.as_dict()
            field.update(
                uid=uid,
                session_id=session,
                global_steps=global_steps,
                index=3,
                data_source="gsm8k",
                raw_prompt=[{"role": "user", "content": "2+2?"}],
            )
            field["loss_mask"] = field["response_mask"]
            field["input_ids"] = torch.cat([field["prompts"], field["responses"]])
            field["position_ids"] = torch.arange(field["input_ids"].shape[0])
            field["multi_modal_inputs"] = {}  # `_compute_multi_modal_inputs` of a text-only model
            n = field["responses"].shape[0]
            tag = {
                "status": "success",
                "prompt_len": 3,
                "response_len": n,
                "seq_len": 3 + n,
                "global_steps": global_steps,
                "min_global_steps": global_steps - 1,
                "max_global_steps": global_steps - 1,
            }
            rows.append(Row(f"{uid}_{session}_{turn}", tag, field))
    return rows


def dispatch(global_steps: int, sessions: int = 2) -> str:
    """A prompt as verl's trainer registers it in TransferQueue (pending), its sessions as verl's
    agent loop writes them (running), then the group's status `finished`; returns its uid."""
    uid = str(uuid.uuid4())
    tag = {"is_prompt": True, "status": "pending", "global_steps": global_steps}
    tq.kv_batch_put(keys=[uid], partition_id="train", tags=[tag])
    tq.kv_put(key=uid, partition_id="train", tag={"status": "running"})
    rows = agent_loop_rows(uid, global_steps, sessions)
    tq.kv_batch_put(
        keys=[r.key for r in rows],
        partition_id="train",
        fields=list_of_dict_to_tensordict([r.fields for r in rows]),
        tags=[r.tag for r in rows],
    )
    tq.kv_put(key=uid, partition_id="train", tag={"status": "finished"})
    return uid


def assert_same(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


def test_verl_rows_survive_expbuf_exactly_with_multi_turn_holes() -> None:
    rows = agent_loop_rows("0c9e-41", global_steps=5)
    experiences = from_verl(rows)
    multi = experiences[2]
    assert multi.eid.uid == "verl/0c9e-41/1/1/0" and multi.eid.tid == "verl/0c9e-41"
    assert multi.action_mask.tolist() == [True, False, True, True]  # the tool output's hole is kept
    assert multi.prompt_length == 3 and multi.tokens.tolist() == [1, 2, 4, 8, 8, 9, 10]
    assert multi.reward == 1.0 and multi.token_level_reward is None
    assert multi.info["model_version"] == 4 and multi.info["reward_extra_info"] == {"acc": 1.0}
    assert multi.info["data_source"] == "gsm8k" and multi.info["index"] == 3
    back = to_verl(trxp.decode(trxp.encode(experiences)))  # through the wire format
    assert [r.key for r in back] == [r.key for r in rows]
    for want, got in zip(rows, back, strict=True):
        assert_same(want.fields, got.fields, want.key)
        assert want.tag == got.tag


def explorer_experiences() -> list[Experience]:
    """Experiences from outside verl: Trinity-style eids ('_' in the batch), a token-level reward,
    a reward that float32 cannot hold, text fields, masks with holes."""
    base = {"prompt_length": 2, "logprobs": torch.tensor([-0.1, -0.2, -0.3]), "info": {"model_version": 7, "k": [1]}}
    return [
        Experience(
            tokens=torch.tensor([5, 6, 7, 8, 9]),
            eid=EID("3/eval_math", "t%1", 0, 0, "a1b2c3"),
            reward=0.1,
            action_mask=torch.tensor([True, False, True]),
            response_text="four",
            metrics={"turns": 2.0},
            **base,
        ),
        Experience(
            tokens=torch.tensor([5, 6, 7, 8, 1]),
            eid=EID("3/eval_math", "t%1", 1, 0, "d4e5f6"),
            reward=2.0,
            token_level_reward=torch.tensor([0.5, 0.0, 1.5]),
            action_mask=torch.tensor([True, True, False]),
            advantages=torch.tensor([0.25, 0.25, 0.0]),
            returns=torch.tensor([0.25, 0.25, 0.0]),
            **base,
        ),
        Experience(
            tokens=torch.tensor([5, 6, 7, 8, 2]),
            eid=EID("3/eval_math", "t%1", 1, 1, "g7h8i9"),
            reward=None,
            messages=[{"role": "user", "content": "hi"}],
            **base,
        ),
    ]


def test_expbuf_experiences_survive_verl_exactly() -> None:
    experiences = explorer_experiences()
    rows = to_verl(experiences)
    assert [r.key for r in rows] == ["3/eval%5Fmath/t%251_0_0", "3/eval%5Fmath/t%251_1_0", "3/eval%5Fmath/t%251_1_1"]
    assert all("_" not in r.key.rsplit("_", 2)[0] for r in rows)  # verl splits keys at '_'
    first = rows[0].fields
    assert first["response_mask"].tolist() == [1, 0, 1] and first["loss_mask"].tolist() == [1, 0, 1]
    assert first["rm_scores"].tolist()[:2] == [0.0, 0.0] and first["rm_scores"].dtype == torch.float32
    assert first["prompts"].tolist() == [5, 6] and first["responses"].tolist() == [7, 8, 9]
    assert rows[1].fields["rm_scores"].tolist() == [0.5, 0.0, 1.5]
    assert rows[1].tag["min_global_steps"] == 7
    assert trxp_content(from_verl(rows)) == trxp_content(experiences)


def test_an_experiences_info_keys_of_a_rows_own_names_neither_write_over_the_row_nor_are_lost() -> None:
    """An experience's info was written over the row's own fields: info {"uid": ...} gave each run
    of a group a verl uid of its own (GRPO groups rows by uid: each run a group of one), info
    {"advantages": ...} replaced the tensor the trainer trains on, and the way back lost them, or
    crashed (a helper's audit). They ride apart now, and come back."""
    experiences = explorer_experiences()[1:]  # two runs of one task
    for run, exp in enumerate(experiences):
        exp.info = {**exp.info, "uid": f"dataset-row-{run}", "session_id": 40 + run, "advantages": [0.5], "x": 1}
    rows = to_verl(experiences, ["g"] * 2)
    assert len({row.fields["uid"] for row in rows}) == 1
    assert all(isinstance(row.fields["advantages"], torch.Tensor) for row in rows if "advantages" in row.fields)
    assert [row.fields["session_id"] for row in rows] != [40, 41] and [row.fields["x"] for row in rows] == [1, 1]
    back = from_verl(rows)
    assert [exp.info for exp in back] == [exp.info for exp in experiences]
    assert trxp_content(back) == trxp_content(experiences)


def test_rollouts_told_apart_by_suffix_alone_are_sessions_of_their_own_and_steps_go_in_order() -> None:
    """verl's GRPO takes a session's last index as its outcome. A group whose members all name one
    run and one step (expbuf's TorchRL storage wrote them so) was one session of four outputs: a
    GRPO group of one, each rollout given the last one's reward. Each is a session now (so is each
    of a group where two members name one run and step: TorchRL writers that shared a round), and a
    run's steps take their indexes in step order whatever order they came in (a helper's audit)."""
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    base = {"prompt_length": 2, "logprobs": torch.full((2,), -0.5), "action_mask": torch.ones(2, dtype=torch.bool)}
    rollouts = [
        Experience(tokens=torch.tensor([5, 6, 10 + n, 11]), eid=EID("0", "q", 0, 0, f"s{n}"), reward=float(n), **base)
        for n in range(4)
    ]
    rows = to_verl(rollouts, ["0/q"] * 4)
    assert [r.key.rsplit("_", 2)[1:] for r in rows] == [["0", "0"], ["1", "0"], ["2", "0"], ["3", "0"]]
    data = DataProto.from_dict(
        tensors={
            "responses": torch.stack([r.fields["responses"] for r in rows]),
            "response_mask": torch.stack([r.fields["response_mask"] for r in rows]),
            "token_level_rewards": torch.stack([r.fields["rm_scores"] for r in rows]),
        },
        non_tensors={"uid": np.array([r.fields["uid"] for r in rows], dtype=object)},
    )
    out = compute_advantage_for_multi_trajectories(data, batch_keys=[r.key for r in rows], adv_estimator="grpo")
    assert len(set(out.batch["advantages"][:, 0].tolist())) == 4  # one GRPO group of four rollouts

    shared = [  # two TorchRL writers that filled one round, each counting its own runs
        Experience(tokens=torch.tensor([5, 6, 7, 8]), eid=EID("0", "q", run, 0, f"w{n}"), reward=float(n), **base)
        for n, run in enumerate((0, 1, 0, 1))
    ]
    assert [r.key.rsplit("_", 2)[1:] for r in to_verl(shared, ["0/q"] * 4)] == [[str(n), "0"] for n in range(4)]

    steps = [
        Experience(tokens=torch.tensor([5, 6, 7, 8]), eid=EID("b", "q", run, step, "x"), reward=run + 0.5, **base)
        for run, step in ((1, 1), (0, 0), (1, 0), (0, 1))
    ]
    assert [r.key.rsplit("_", 2)[1:] for r in to_verl(steps)] == [["1", "1"], ["0", "0"], ["1", "0"], ["0", "1"]]
    assert trxp_content(from_verl(to_verl(steps))) == trxp_content(steps)


def trxp_content(experiences: list[Experience]) -> tuple[dict, bytes]:
    """What a TRXP payload says: its metadata as data (pickle's memo of shared objects aside) and its tensors."""
    payload = trxp.encode(experiences)
    meta_length, tensor_length = struct.unpack("<QQ", payload[5:21])
    meta = pickle.loads(payload[21 : 21 + meta_length])  # our own bytes, made just above
    return meta, payload[21 + meta_length : 21 + meta_length + tensor_length]


def test_what_verl_has_no_field_for_is_refused_by_name() -> None:
    pair = Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=1, chosen=torch.tensor([2]))
    with pytest.raises(ValueError, match="chosen"):
        to_verl([pair])
    row = agent_loop_rows("u", 1, sessions=1)[0]
    row.fields["multi_modal_inputs"] = {"pixel_values": torch.zeros(1)}
    with pytest.raises(ValueError, match="processor"):
        from_verl([row])
    short = agent_loop_rows("u", 1, sessions=1)[0]
    short.fields["rollout_log_probs"] = short.fields["rollout_log_probs"][:-1]
    with pytest.raises(ValueError, match="rollout_log_probs has 2 values for a response of 3 tokens"):
        from_verl([short])


def test_padded_layout_round_trip_and_positions_match_verl() -> None:
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    responses = [torch.tensor([5, 6]), torch.tensor([7, 8, 9, 10])]
    masks = [torch.tensor([1, 0]), torch.tensor([1, 0, 0, 1])]
    batch = layout.padded_batch(prompts, responses, {"response_mask": masks}, pad_token_id=0)
    assert batch["prompts"].tolist() == [[1, 2, 3], [0, 0, 4]]  # left-padded
    assert batch["responses"].tolist() == [[5, 6, 0, 0], [7, 8, 9, 10]]  # right-padded
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert torch.equal(batch["position_ids"], compute_position_id_with_mask(batch["attention_mask"]))
    prompt_lengths, response_lengths, rows = layout.unpadded_rows(batch)
    assert (prompt_lengths, response_lengths) == ([3, 1], [2, 4])
    for name, want in (("prompts", prompts), ("responses", responses), ("response_mask", masks)):
        assert all(torch.equal(a, b) for a, b in zip(rows[name], want, strict=True)), name


def test_settings_read_sampler_kwargs_and_name_what_is_wrong() -> None:
    read = settings.read(
        {"expbuf": {"target": "10.0.0.5:50051", "table": "grpo", "mode": "source", "tls_ca": "/ca.pem"}}, env={}
    )
    assert (read.location.target, read.location.table, read.mode) == ("10.0.0.5:50051", "grpo", "source")
    assert read.location.tls is not None and read.location.tls.root_certificates == "/ca.pem"
    assert read.location.lease_seconds == 60  # source mode's lease, renewed while the trainer lives
    assert settings.read({"expbuf": {"target": "h:1", "table": "t", "lease_seconds": 5}}).location.lease_seconds == 5
    assert settings.read({"expbuf": {"target": "h:1", "table": "t", "token_env": "T"}}, env={"T": "s"}).location.token
    for kwargs, message in (
        ({}, "sampler_kwargs.expbuf is missing"),
        ({"expbuf": {"table": "t"}}, "expbuf.target is required"),
        ({"expbuf": {"target": "h:1", "table": "t", "mode": "copy"}}, "mode='copy'"),
        ({"expbuf": {"target": "h:1", "table": "t", "batch": 3}}, "expbuf.batch is unknown"),
        ({"expbuf": {"target": "h:1", "table": "t", "token": "s"}}, "expbuf.token is unknown"),
        ({"expbuf": {"target": "h:1", "table": "t", "lease_seconds": 0}}, "lease_seconds='0' must be a number > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            settings.read(kwargs, env={})


def test_off_policy_settings_that_agree_and_that_do_not() -> None:
    assert settings.staleness_disagreement(3, 2) is None
    assert settings.staleness_disagreement(None, None) is None
    assert "max_off_policy_threshold = 3" in settings.staleness_disagreement(2, 2)
    assert "max_staleness = 1" in settings.staleness_disagreement(2, None)
    assert settings.filter_disagreement(True, True) is None
    assert "drop_zero_variance=False" in settings.filter_disagreement(True, False)


def test_the_expbuf_estimator_returns_the_stored_advantages_inside_verls_compute_advantage() -> None:
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]])
    stored = torch.tensor([[0.5, 0.0, 0.5, 0.0], [-0.5, -0.5, -0.5, -0.5]])
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.zeros(2, 4), "response_mask": mask},
        non_tensors={"uid": np.array(["a", "a"], dtype=object)},
    )
    with advantage.holding(stored, stored * 2):
        out = compute_advantage(data, adv_estimator="expbuf")
    assert torch.equal(out.batch["advantages"], stored) and torch.equal(out.batch["returns"], stored * 2)
    with pytest.raises(RuntimeError, match="expbuf_external"):
        compute_advantage(data, adv_estimator="expbuf")


def test_verl_use_external_modules_registers_the_trainer_and_the_estimator() -> None:
    code = (
        "import verl\n"
        "from verl.trainer.ppo.v1.trainer_base import get_trainer_cls\n"
        "from verl.trainer.ppo.core_algos import get_adv_estimator_fn\n"
        "print(get_trainer_cls('expbuf_external').__module__, get_adv_estimator_fn('expbuf').__module__)\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "expbuf.client.verl"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["expbuf.client.verl.trainer", "expbuf.client.verl.advantage"]
