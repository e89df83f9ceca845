"""Each batched estimator against a plain per-group loop of its published formula."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

import pytest
import torch

from expbuf.server import estimators as est

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
TOL = 1e-5


@dataclass
class Exp:
    """One experience of a test batch, in plain Python."""

    group: int
    task: int
    run: int
    step: int
    reward: float
    mask: list[float]
    token_rewards: list[float] | None = None
    tokens: list[float] = field(default_factory=list)  # token rewards as the estimators see them

    def __post_init__(self) -> None:
        if self.token_rewards is not None:
            self.tokens = list(self.token_rewards)
        else:  # the scalar reward on the last generated token (the last token if none is)
            self.tokens = [0.0] * len(self.mask)
            generated = [i for i, m in enumerate(self.mask) if m]
            self.tokens[generated[-1] if generated else len(self.mask) - 1] = self.reward


def random_batch(seed: int, *, multi_step: bool = False) -> list[Exp]:
    """Groups of 1..16; some with equal rewards; masks with zeros; some token-level rewards."""
    rng = random.Random(seed)
    exps: list[Exp] = []
    run_id = 0
    for group in range(rng.randint(1, 12)):
        size = rng.randint(1, 16)
        equal = rng.random() < 0.25
        for member in range(size):
            steps = rng.randint(1, 4) if multi_step else 1
            for step in range(steps):
                length = rng.randint(1, 40)
                mask = [float(rng.random() < 0.8) for _ in range(length)]
                reward = 1.0 if equal else rng.choice([0.0, 1.0, rng.uniform(-2, 2)])
                token_rewards = [rng.uniform(-1, 1) for _ in range(length)] if rng.random() < 0.3 else None
                exps.append(Exp(group, group, run_id, step, reward, mask, token_rewards))
            run_id += 1
            del member
    rng.shuffle(exps)
    return exps


def flat(exps: list[Exp], device: str = "cpu") -> est.FlatBatch:
    f64 = torch.float64
    batch = est.FlatBatch(
        rewards=torch.tensor([e.reward for e in exps], dtype=f64),
        group=torch.tensor([e.group for e in exps]),
        lengths=torch.tensor([len(e.mask) for e in exps]),
        generated=torch.tensor([sum(e.mask) for e in exps], dtype=f64),
        mask=torch.tensor([m for e in exps for m in e.mask], dtype=f64),
        token_rewards=torch.tensor([r for e in exps for r in e.tokens], dtype=f64),
        task=torch.tensor([e.task for e in exps]),
        run=torch.tensor([e.run for e in exps]),
        step=torch.tensor([e.step for e in exps]),
    )
    return batch.to(device)


def groups_of(exps: list[Exp], key: str = "group") -> dict[int, list[Exp]]:
    out: dict[int, list[Exp]] = {}
    for e in exps:
        out.setdefault(getattr(e, key), []).append(e)
    return out


def check(exps: list[Exp], result: est.Advantages, batch: est.FlatBatch, want: dict[int, list[float]]) -> None:
    """want: id(exp) -> token-level advantages (= returns) expected for it."""
    adv, ret = result.tokens(batch)
    adv, ret = adv.cpu().tolist(), ret.cpu().tolist()
    offset = 0
    for e in exps:
        n = len(e.mask)
        expected = want[id(e)]
        assert len(expected) == n
        for got_a, got_r, w in zip(adv[offset : offset + n], ret[offset : offset + n], expected, strict=True):
            assert abs(got_a - w) <= TOL * max(1.0, abs(w)), (got_a, w)
            assert abs(got_r - w) <= TOL * max(1.0, abs(w)), (got_r, w)
        offset += n


def per_experience(exps: list[Exp], value: dict[int, float]) -> dict[int, list[float]]:
    return {id(e): [value[id(e)] * m for m in e.mask] for e in exps}


# ---- references: one plain loop per group, straight from the formulas ----------------


def ref_grpo(exps, eps=1e-6, over_batch=False, threshold=0.0):
    values = {}
    batch_std = statistics.stdev([e.reward for e in exps]) if len(exps) > 1 else 1.0
    for members in groups_of(exps).values():
        rewards = [e.reward for e in members]
        if len(rewards) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        skip = threshold > 0 and len(rewards) > 1 and std < threshold
        scale = batch_std if over_batch and len(rewards) > 1 else std
        for e in members:
            values[id(e)] = 0.0 if skip else (e.reward - mean) / (scale + eps)
    return per_experience(exps, values)


def ref_drgrpo(exps):
    values = {}
    for members in groups_of(exps).values():
        mean = statistics.fmean([e.reward for e in members]) if len(members) > 1 else 0.0
        for e in members:
            values[id(e)] = e.reward - mean
    return per_experience(exps, values)


def ref_rloo(exps):
    values = {}
    for members in groups_of(exps).values():
        total = sum(e.reward for e in members)
        for e in members:
            n = len(members)
            values[id(e)] = e.reward if n == 1 else e.reward - (total - e.reward) / (n - 1)
    return per_experience(exps, values)


def ref_reinforce_pp(exps, eps=1e-8):
    centred = {}
    for members in groups_of(exps).values():
        mean = statistics.fmean([e.reward for e in members]) if len(members) > 1 else 0.0
        for e in members:
            centred[id(e)] = e.reward - mean
    tokens = [centred[id(e)] for e in exps for m in e.mask if m]  # values under the mask
    mean = sum(tokens) / len(tokens) if tokens else 0.0
    var = sum((v - mean) ** 2 for v in tokens) / len(tokens) if tokens else 0.0
    var = var * len(tokens) / (len(tokens) - 1) if len(tokens) > 1 else var
    return per_experience(exps, {k: (v - mean) / math.sqrt(var + eps) for k, v in centred.items()})


def ref_reinforce(exps, gamma=1.0):
    want = {}
    for e in exps:
        returns = [0.0] * len(e.mask)
        running = 0.0
        for t in reversed(range(len(e.mask))):
            running = e.tokens[t] + gamma * running
            returns[t] = running
            running *= e.mask[t]
        want[id(e)] = [r * m for r, m in zip(returns, e.mask, strict=True)]
    return want


def ref_opmd(exps, tau=1.0, logavgexp=False):
    values = {}
    for members in groups_of(exps).values():
        rewards = [e.reward for e in members]
        if len(rewards) == 1:
            baseline = 0.0
        elif logavgexp:
            top = max(r / tau for r in rewards)
            baseline = tau * (top + math.log(sum(math.exp(r / tau - top) for r in rewards) / len(rewards)))
        else:
            baseline = statistics.fmean(rewards)
        for e in members:
            values[id(e)] = e.reward - baseline
    return per_experience(exps, values)


def ref_step_wise_grpo(exps, eps=1e-6):
    values = {}
    for members in groups_of(exps, "task").values():
        runs = groups_of(members, "run")
        last = {run: max(steps, key=lambda e: e.step).reward for run, steps in runs.items()}
        rewards = list(last.values())
        mean, std = (0.0, 1.0) if len(rewards) == 1 else (statistics.fmean(rewards), statistics.stdev(rewards))
        for run, steps in runs.items():
            for e in steps:
                values[id(e)] = (last[run] - mean) / (std + eps)
    return per_experience(exps, values)


def ref_multi_turn(exps, gamma=1.0):
    values = {}
    for steps in groups_of(exps, "run").values():
        running = 0.0
        for e in sorted(steps, key=lambda e: e.step, reverse=True):
            running = e.reward + gamma * running
            values[id(e)] = running
    return per_experience(exps, values)


CASES = [
    ("grpo", {}, lambda x: ref_grpo(x)),
    ("grpo", {"epsilon": 1e-3}, lambda x: ref_grpo(x, eps=1e-3)),
    ("grpo", {"std_over_batch": 1}, lambda x: ref_grpo(x, over_batch=True)),
    ("grpo", {"std_threshold": 0.3}, lambda x: ref_grpo(x, threshold=0.3)),
    ("drgrpo", {}, ref_drgrpo),
    ("rloo", {}, ref_rloo),
    ("reinforce++", {}, ref_reinforce_pp),
    ("reinforce", {}, lambda x: ref_reinforce(x)),
    ("reinforce", {"gamma": 0.9}, lambda x: ref_reinforce(x, gamma=0.9)),
    ("opmd", {}, lambda x: ref_opmd(x)),
    ("opmd", {"logavgexp_baseline": 1, "tau": 0.5}, lambda x: ref_opmd(x, tau=0.5, logavgexp=True)),
]
MULTI_STEP_CASES = [
    ("step_wise_grpo", {}, ref_step_wise_grpo),
    ("multi_turn_discount", {"turn_level_discount": 0.8}, lambda x: ref_multi_turn(x, gamma=0.8)),
    ("multi_turn_discount", {}, ref_multi_turn),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "params", "reference"), CASES + MULTI_STEP_CASES)
@pytest.mark.parametrize("seed", range(8))
def test_estimator_matches_reference(device: str, name: str, params: dict, reference, seed: int) -> None:
    exps = random_batch(seed, multi_step=(name, params, reference) in MULTI_STEP_CASES)
    batch = flat(exps, device)
    result = est.estimate(name, batch, params)
    check(exps, result, batch, reference(exps))


def test_grpo_threshold_can_drop_groups() -> None:
    exps = [Exp(0, 0, r, 0, 1.0 + 0.01 * r, [1.0]) for r in range(4)] + [
        Exp(1, 1, 9 + r, 0, r, [1.0]) for r in range(4)
    ]
    result = est.estimate("grpo", flat(exps), {"std_threshold": 0.1, "drop_below_threshold": 1})
    assert result.drop_groups.tolist() == [True, False]


def test_equal_rewards_give_zero_advantages() -> None:
    exps = [Exp(0, 0, r, 0, 0.5, [1.0, 0.0, 1.0]) for r in range(8)]
    adv, _ = est.estimate("grpo", flat(exps)).tokens(flat(exps))
    assert adv.abs().max() == 0


def test_unknown_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match="has no parameter"):
        est.estimate("grpo", flat([Exp(0, 0, 0, 0, 1.0, [1.0])]), {"gamma": 0.9})
