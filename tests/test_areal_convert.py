"""AReaL's trajectory rows <-> TRXP experiences, with AReaL's own classes making the rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expbuf.client import EID, trxp


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global ModelResponse, InteractionWithTokenLogpReward, check_trajectory_format, concat_padded_tensors
    global TOKEN_VERSIONS, from_areal, to_areal, DTYPES
    pytest.importorskip("areal")
    from areal.api.io_struct import ModelResponse
    from areal.experimental.openai.types import InteractionWithTokenLogpReward
    from areal.infra.workflow_executor import check_trajectory_format
    from areal.utils.data import concat_padded_tensors

    from expbuf.client.areal import TOKEN_VERSIONS, from_areal, to_areal
    from expbuf.client.areal.convert import DTYPES


def agent_rows() -> dict[str, torch.Tensor]:
    """Two agent trajectories as AReaL's concat interactions export them: the second turn's
    input holds a tool reply (tokens 50, 51) that is not generated, a hole in the loss mask."""
    first = InteractionWithTokenLogpReward(
        model_response=ModelResponse(
            input_tokens=[1, 2, 3], output_tokens=[10, 11], output_logprobs=[-0.1, -0.2], output_versions=[3, 3]
        ),
        reward=0.0,
        chat_template_type="concat",
    )
    second = InteractionWithTokenLogpReward(
        model_response=ModelResponse(
            input_tokens=[1, 2, 3, 10, 11, 50, 51],
            output_tokens=[12, 13, 14],
            output_logprobs=[-0.3, -0.4, -0.5],
            output_versions=[4, 4, 5],
        ),
        reward=1.0,
        parent=first,
        chat_template_type="concat",
    )
    other = InteractionWithTokenLogpReward(
        model_response=ModelResponse(
            input_tokens=[7, 8], output_tokens=[20, 21, 22, 23], output_logprobs=[-1.0] * 4, output_versions=[6] * 4
        ),
        reward=-0.5,
    )
    return concat_padded_tensors([second.to_tensor_dict(), other.to_tensor_dict()])


def rlvr_rows() -> dict[str, torch.Tensor]:
    """Rows in the dtypes of AReaL's RLVR workflow, padded by AReaL's concat_padded_tensors."""

    def row(prompt: int, response: int, version: int, reward: float) -> dict[str, torch.Tensor]:
        n = prompt + response
        res = {
            "input_ids": torch.arange(100, 100 + n, dtype=torch.int32),
            "loss_mask": torch.tensor([0] * prompt + [1] * response, dtype=torch.int32),
            "logprobs": torch.tensor([0.0] * prompt + [-0.25] * response, dtype=torch.float32),
            "versions": torch.tensor([-1] * prompt + [version] * response, dtype=torch.int32),
            "attention_mask": torch.ones(n, dtype=torch.bool),
            "rewards": torch.tensor(reward, dtype=torch.float32),
        }
        return {k: v.unsqueeze(0) for k, v in res.items()}

    return concat_padded_tensors([row(3, 5, 2, 1.0), row(6, 2, 2, 0.0), row(1, 1, 1, 0.5)])


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].shape == b[key].shape, key
        assert torch.equal(a[key].to(b[key].dtype), b[key]), key


@pytest.mark.parametrize("make", [agent_rows, rlvr_rows])
def test_round_trip_is_exact(make) -> None:
    rows = make()
    back = to_areal(from_areal(rows))
    same(back, rows)
    assert back["input_ids"].dtype == rows["input_ids"].dtype
    assert all(back[k].dtype == dtype for k, dtype in DTYPES.items())
    assert check_trajectory_format(back, batch_size=rows["input_ids"].shape[0])


@pytest.mark.parametrize("make", [agent_rows, rlvr_rows])
def test_round_trip_through_the_wire(make) -> None:
    rows = make()
    exps = from_areal(rows, [EID(batch="areal", task=7, run=i) for i in range(rows["input_ids"].shape[0])])
    decoded = trxp.decode(trxp.encode(exps))
    same(to_areal(decoded), rows)


def test_prompt_ends_where_loss_mask_turns_one_and_holes_stay() -> None:
    exps = from_areal(agent_rows())
    agent, other = exps
    assert agent.prompt_length == 3
    assert agent.tokens.tolist() == [1, 2, 3, 10, 11, 50, 51, 12, 13, 14]
    assert agent.action_mask.tolist() == [True, True, False, False, True, True, True]
    # The response's versions 3 3 (tool) (tool) 4 4 5 as segments, a table's max_token_staleness reads.
    assert agent.version_segments == [[3, 0], [4, 4], [5, 6]] and other.version_segments == [[6, 0]]
    assert agent.logprobs.tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5])
    assert agent.reward == 1.0
    assert agent.info["model_version"] == 3  # the least version of a generated token
    assert agent.info[TOKEN_VERSIONS] == [[-1, 3], [3, 2], [-1, 2], [4, 2], [5, 1]]
    assert other.prompt_length == 2
    assert other.tokens.numel() == 6  # the padding of the wider row is not part of it
    assert other.info["model_version"] == 6


def test_advantages_come_with_the_next_token_shift() -> None:
    exps = from_areal(rlvr_rows())
    for e in exps:
        e.advantages = torch.arange(1, e.tokens.numel() - e.prompt_length + 1, dtype=torch.float32)
    out = to_areal(exps, advantages=True)
    first = out["expbuf_advantages"][0]
    # generated tokens sit at 3..7; AReaL's loss reads the value for token t + 1 at position t
    assert first.tolist() == [0, 0, 1, 2, 3, 4, 5, 0]
    assert torch.equal(torch.roll(out["loss_mask"], -1, -1)[0].bool(), first != 0)


def test_versions_without_their_code_come_from_model_version() -> None:
    exp = from_areal(rlvr_rows())[0]
    del exp.info[TOKEN_VERSIONS]
    del exp.info["version_segments"]
    assert to_areal([exp])["versions"][0].tolist() == [-1, -1, -1, 2, 2, 2, 2, 2]


def test_versions_without_their_code_come_from_version_segments() -> None:
    exp = from_areal(rlvr_rows())[0]
    del exp.info[TOKEN_VERSIONS]
    exp.info["version_segments"] = [[1, 0], [2, 3]]  # as another rollout worker than AReaL's stamps them
    assert to_areal([exp])["versions"][0].tolist() == [-1, -1, -1, 1, 1, 1, 2, 2]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["attention_mask"][0].__setitem__(0, False), "row 0: attention_mask is not right-padded"),
        (lambda r: r["loss_mask"][1].zero_(), "row 1: loss_mask has no 1"),
        (lambda r: r.__setitem__("values", torch.zeros(3, 8)), "carry ['values']"),
        (lambda r: r.__setitem__("rewards", torch.zeros(2)), "'rewards' has shape [2]"),
        (lambda r: r["logprobs"][2].__setitem__(0, -1.0), "row 2: logprobs are set within the prompt"),
        (lambda r: r.pop("loss_mask"), "lack ['loss_mask']"),
    ],
)
def test_bad_rows_are_refused_by_name(change, message: str) -> None:
    rows = rlvr_rows()
    change(rows)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        from_areal(rows)


@st.composite
def random_rows(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Rows of random lengths, prompts, holes and versions, padded by AReaL's concat_padded_tensors."""
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        prompt, response = draw(st.integers(0, 5)), draw(st.integers(1, 12))
        mask = [1, *draw(st.lists(st.integers(0, 1), min_size=response - 1, max_size=response - 1))]
        versions = [draw(st.integers(-1, 9)) if m else -1 for m in mask]
        n = prompt + response
        res = {
            "input_ids": torch.tensor(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))),
            "loss_mask": torch.tensor([0] * prompt + mask),
            "logprobs": torch.tensor([0.0] * prompt + [-0.5 * m for m in mask], dtype=torch.float32),
            "versions": torch.tensor([-1] * prompt + versions),
            "attention_mask": torch.ones(n, dtype=torch.bool),
            "rewards": torch.tensor(draw(st.floats(-10, 10, width=32)), dtype=torch.float32),
        }
        rows.append({k: v.unsqueeze(0) for k, v in res.items()})
    return concat_padded_tensors(rows)


@settings(max_examples=60, deadline=None)
@given(random_rows())
def test_round_trip_is_exact_for_any_rows(rows: dict[str, torch.Tensor]) -> None:
    exps = from_areal(rows)
    same(to_areal(trxp.decode(trxp.encode(exps))), rows)
    for exp, versions, mask in zip(exps, rows["versions"], rows["loss_mask"], strict=True):
        stamped = versions[mask.bool() & (versions >= 0)]
        assert exp.info.get("model_version") == (int(stamped.min()) if stamped.numel() else None)
        response = versions[exp.prompt_length : exp.tokens.numel()].tolist()
        known = [v for v in response if v >= 0]
        segments = exp.info.get("version_segments")
        if not known or known != sorted(known):
            assert segments is None
            continue
        for offset, version in enumerate(response):  # each stamped token's version is its segment's
            if version >= 0:
                assert [v for v, at in segments if at <= offset][-1] == version


def test_an_experience_scored_by_token_level_rewards_brings_their_sum_as_areals_reward() -> None:
    """Pushed with token-level rewards and no reward (verl's and Trinity-RFT's form, which the
    token-reward estimators take), an experience gave AReaL's `rewards` 0.0: its actor computed
    no advantage from it, and nothing said so (a helper's audit). One with neither is refused."""
    exps = from_areal(rlvr_rows())
    for at, exp in enumerate(exps):  # a reward on each response's last token, one of them negative
        level = torch.zeros(exp.tokens.numel() - exp.prompt_length)
        level[-1] = [1.0, -2.0, 0.5][at]
        exp.reward, exp.token_level_reward = None, level
    want = [1.0, -2.0, 0.5]
    assert to_areal(exps)["rewards"].tolist() == want
    exps[0].token_level_reward = None
    with pytest.raises(ValueError, match="no reward, nor token-level rewards"):
        to_areal(exps)
