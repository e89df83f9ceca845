"""Each estimator through expbuf's whole advantage path (build_batch, the ingest stage, the
stored form, the batch stage, expand) against Trinity-RFT 0.6.0's own advantage function on
the same experiences; expbuf's own estimators against their published formulas."""

from __future__ import annotations

import logging
import math
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from expbuf.client import EID, BufferClient, Experience, trxp
from expbuf.server.advantages.batch_stage import finish_batch
from expbuf.server.advantages.worker import build_batch, encode_results
from expbuf.server.advantages.worker import estimators as est
from expbuf.server.store import ItemRecord
from expbuf.server.store.disk.stored_advantages import expand
from expbuf.server.store.schema.estimator_registry import ESTIMATORS
from expbuf.server.store.schema.table_config import ConfigError, TableConfig, estimator_args

from conftest import Servers, payload

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
TOL = 1e-6
# Trinity-RFT's verl-style functions take a verl DataProto; its group functions take Experiences.
VERL_STYLE = {"grpo_verl", "rloo", "opmd_verl", "asymre_verl", "reinforceplusplus"}


@dataclass
class Exp:
    """One experience of a test batch, in plain Python."""

    task: int
    run: int
    step: int
    reward: float
    mask: list[bool]
    token_rewards: list[float] | None = None
    suffix: str = "s"  # several experiences of one step (its model calls) differ by it

    @property
    def uid(self) -> str:
        return f"0/{self.task}/{self.run}/{self.step}/{self.suffix}"

    def build(self, cls: type = Experience, eid_cls: type = EID) -> object:
        """An Experience of the given class (expbuf's or Trinity-RFT's)."""
        n = len(self.mask)
        return cls(
            eid=eid_cls(batch=0, task=self.task, run=self.run, step=self.step, suffix=self.suffix),
            tokens=torch.arange(3 + n, dtype=torch.int32),
            prompt_length=3,
            logprobs=torch.full((n,), -0.5),
            action_mask=torch.tensor(self.mask, dtype=torch.bool),
            reward=self.reward,
            token_level_reward=None if self.token_rewards is None else torch.tensor(self.token_rewards),
        )

    def record(self) -> ItemRecord:
        """The item record the store keeps for it."""
        return ItemRecord(
            state="computing",
            group=f"0/{self.task}",
            seq=0,
            digest=bytes(16),
            size=0,
            created=0.0,
            tid=f"0/{self.task}",
            rid=f"0/{self.task}/{self.run}",
            step=self.step,
            response_length=len(self.mask),
            generated=sum(self.mask),
            reward=self.reward,
        )


def multi_turn_mask(rng: random.Random, length: int) -> list[bool]:
    """Turns of generated tokens separated by runs of zeros (tool output, user turns)."""
    mask, on = [], True
    while len(mask) < length:
        mask += [on] * rng.randint(1, 6)
        on = not on
    return mask[:length]


def random_batch(seed: int, *, multi_step: bool = False, min_size: int = 1) -> list[Exp]:
    """Groups of min_size..16, some with equal rewards, multi-turn masks with zeros; with an
    odd seed every experience also has token-level rewards."""
    rng = random.Random(seed)
    token_level = seed % 2 == 1
    exps: list[Exp] = []
    for task in rng.sample(range(100), rng.randint(1, 6)):
        size = rng.randint(min_size, 16)
        equal = rng.random() < 0.25
        for run in range(size):
            for step in range(rng.randint(1, 4) if multi_step else 1):
                length = rng.randint(1, 30)
                reward = 0.5 if equal else rng.choice([0.0, 1.0, rng.uniform(-2, 2)])
                token_rewards = [rng.uniform(-1, 1) for _ in range(length)] if token_level else None
                exps.append(Exp(task, run, step, reward, multi_turn_mask(rng, length), token_rewards))
    return exps


def ours(name: str, params: dict, exps: list[Exp], device: str = "cpu") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """uid -> (advantages, returns) as a trainer samples them, all experiences in one batch."""
    config = TableConfig.of(name="t", estimator=name, estimator_params=params, device=device)
    records = [e.record() for e in exps]
    items = [trxp.from_experience(e.build()) for e in exps] if ESTIMATORS[name].token_level else None
    batch, group_keys = build_batch(records, items)
    result = est.estimate(name, batch.to(device), estimator_args(config))
    assert bool(result.finite(batch).all())
    dropped = set()
    if result.drop_groups is not None:
        dropped = {group_keys[i] for i in result.drop_groups.nonzero().squeeze(1).tolist()}
    kept = [i for i, rec in enumerate(records) if rec.group not in dropped]
    stored = [
        v if isinstance(v, bytes) else (v, records[i].response_length)
        for i, v in enumerate(encode_results(result, batch))
    ]
    finished = finish_batch(config, [records[i] for i in kept], [stored[i] for i in kept])
    out = {}
    for i, value in zip(kept, finished, strict=True):
        mask = trxp.raw_of(torch.tensor(exps[i].mask, dtype=torch.bool))
        tensors = expand(value, {"action_mask": mask})
        out[exps[i].uid] = (trxp.tensor_of(tensors["advantages"]), trxp.tensor_of(tensors["returns"]))
    return out


def trinity_verl_data(exps: list):  # Trinity-RFT Experiences -> verl DataProto
    """The DataProto Trinity-RFT's trainer builds (trainer/verl/utils.py to_data_proto): the
    token-level rewards when every experience has them, else the reward on the last token."""
    import numpy as np
    from verl import DataProto

    width = max(len(e.action_mask) for e in exps)
    rewards = torch.zeros(len(exps), width)
    mask = torch.zeros(len(exps), width, dtype=torch.bool)
    every = all(e.token_level_reward is not None for e in exps)
    for i, e in enumerate(exps):
        n = len(e.action_mask)
        mask[i, :n] = e.action_mask
        if every:
            rewards[i, :n] = e.token_level_reward
        elif n:  # an empty response holds no token to put its reward on (Trinity's trainer: 0)
            rewards[i, n - 1] = e.reward
    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask},
        non_tensors={"uid": np.array([e.eid.tid for e in exps], dtype=object)},
    )


def trinity_advantages(name: str, params: dict, exps: list) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """uid -> (advantages, returns) from Trinity-RFT's registered function of that name, on
    Trinity-RFT Experiences."""
    registry = pytest.importorskip("trinity.algorithm.advantage_fn")
    fn = registry.ADVANTAGE_FN.get(name)(**params)
    if name not in VERL_STYLE:
        out, _ = fn(exps)
        return {x.eid.uid: (x.advantages, x.returns) for x in out}
    pytest.importorskip("verl")
    data, _ = fn(trinity_verl_data(exps))
    advantages, returns = data.batch["advantages"], data.batch["returns"]
    out = {}
    for i, e in enumerate(exps):
        n = len(e.action_mask)
        out[e.eid.uid] = (advantages[i, :n], returns[i, :n] * e.action_mask)  # expbuf serves masked returns
    return out


def theirs(name: str, params: dict, exps: list[Exp]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Trinity-RFT's values for the test batch."""
    experience = pytest.importorskip("trinity.common.experience")
    return trinity_advantages(name, params, [e.build(experience.Experience, experience.EID) for e in exps])


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for uid, (want_a, want_r) in want.items():
        got_a, got_r = got[uid]
        for g, w in ((got_a, want_a), (got_r, want_r)):
            assert g.shape == w.shape, uid
            assert torch.allclose(g.double(), w.double(), atol=TOL, rtol=TOL), (uid, g, w)


TRINITY_CASES = [
    ("grpo", {}),
    ("grpo", {"epsilon": 1e-3}),
    ("grpo", {"std_threshold": 0.3}),
    ("grpo", {"std_threshold": 0.0}),
    ("grpo", {"std_cal_level": "batch"}),
    ("grpo_verl", {}),
    ("reinforce", {}),
    ("reinforceplusplus", {}),
    ("reinforceplusplus", {"gamma": 0.9}),
    ("rloo", {}),
    ("opmd", {}),
    ("opmd", {"opmd_baseline": "logavgexp", "tau": 0.5}),
    ("opmd_verl", {"opmd_baseline": "logavgexp", "tau": 2.0}),
    ("asymre", {}),
    ("asymre", {"baseline_shift": 0.3}),
    ("asymre_verl", {"baseline_shift": -0.2}),
]
MULTI_STEP_CASES = [
    ("step_wise_grpo", {}),
    ("step_wise_grpo", {"enable_step_norm": True, "epsilon": 1e-4}),
    ("step_wise_grpo", {"std_cal_level": "batch"}),
    ("step_wise_grpo", {"std_threshold": 0.2}),
]
# Trinity-RFT's rec raises on a group of one (its rewards are then undefined): groups of 2..16.
PAIRED_CASES = [("rec", {}), ("rec", {"std_normalize": True, "epsilon": 1e-3})]


@pytest.mark.parametrize(("name", "params"), TRINITY_CASES + MULTI_STEP_CASES + PAIRED_CASES)
@pytest.mark.parametrize("seed", range(4))
def test_matches_trinity(name: str, params: dict, seed: int) -> None:
    exps = random_batch(
        seed, multi_step=(name, params) in MULTI_STEP_CASES, min_size=2 if (name, params) in PAIRED_CASES else 1
    )
    assert_same(ours(name, params, exps), theirs(name, params, exps))


@pytest.mark.parametrize("device", DEVICES)
def test_device_gives_the_same_values(device: str) -> None:
    exps = random_batch(3)
    for name in ("grpo", "reinforceplusplus", "opmd_verl"):
        assert_same(ours(name, {}, exps, device), ours(name, {}, exps, "cpu"))


# ---- the defects Trinity-RFT's values exposed ------------------------------------------


def test_reinforce_reaches_earlier_turns_through_masked_tokens() -> None:
    exps = [Exp(0, 0, 0, 1.0, [True, True, False, False, True, True])]
    for name in ("reinforce", "discounted_return", "reinforceplusplus"):
        adv, _ = ours(name, {}, exps)[exps[0].uid]
        if name != "reinforceplusplus":
            assert adv.tolist() == [1, 1, 0, 0, 1, 1], name
        else:  # whitened: equal returns under the mask are all at the mean
            assert adv.tolist() == [0] * 6


def test_reinforceplusplus_gives_a_batch_of_equal_returns_none_as_trinity_does() -> None:
    """Trinity-RFT's masked_whiten divides by count + 1e-8 in float32, the count itself: every
    return of a batch of equal ones is at its mean. In float64 the 1e-8 stayed, and whitening put
    each token r * 1e-4 / count off it (0.025 for two tokens of reward 1000; a helper's audit)."""
    exps = [Exp(1, run, 0, 1000.0, [True, True]) for run in range(2)]
    got, want = ours("reinforceplusplus", {}, exps), theirs("reinforceplusplus", {}, exps)
    assert_same(got, want)
    assert all(adv.tolist() == [0.0, 0.0] for adv, _ in got.values())


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_returns_to_go_of_one_long_response_among_short_ones_match_trinity(gamma: float) -> None:
    """Returns summed over each response alone (a scan of the flat tokens), as Trinity's padded
    loop sums them: one response of 3,000 tokens beside 63 of 1 to 30, token-level rewards."""
    rng = random.Random(7)
    exps = []
    for run in range(64):
        length = 3000 if run == 5 else rng.randint(1, 30)
        rewards = [rng.uniform(-1, 1) for _ in range(length)]
        exps.append(Exp(run // 8, run % 8, 0, rng.uniform(-1, 1), multi_turn_mask(rng, length), rewards))
    for name in ("reinforceplusplus", "discounted_return"):
        got = ours(name, {"gamma": gamma}, exps)
        if name == "reinforceplusplus":  # Trinity sums 3,000 returns in float32: 2.3e-5 off float64's at 28
            want = theirs(name, {"gamma": gamma}, exps)
            assert sorted(got) == sorted(want)
            for uid, values in want.items():
                for g, w in zip(got[uid], values, strict=True):
                    assert g.shape == w.shape and float((g.double() - w.double()).abs().max()) < 1e-4, uid
        long = got[exps[5].uid][1]
        assert long.shape == (3000,) and bool(torch.isfinite(long).all())


def test_returns_to_go_take_memory_of_the_tokens_not_of_the_longest_response_times_the_experiences() -> None:
    """One response of 65,536 tokens among 4,095 of 10: a matrix of experiences x the longest
    response, twice, took 4 GiB more at its peak (a helper's audit: 2.2 GB in a server for 141 k
    tokens); the scan holds a few copies of the 106 k tokens."""
    code = (
        "import resource, torch\n"
        "from expbuf.server.advantages.estimators import FlatBatch, _returns_to_go\n"
        "lengths = torch.tensor([10] * 4095 + [65536])\n"
        "n, total = lengths.numel(), int(lengths.sum())\n"
        "ints = torch.zeros(n, dtype=torch.int64)\n"
        "b = FlatBatch(torch.zeros(n, dtype=torch.float64), ints, lengths, torch.zeros(n, dtype=torch.float64),"
        " ints, ints, ints, token_rewards=torch.ones(total, dtype=torch.float64))\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "returns = _returns_to_go(b, 0.99)\n"
        "assert returns.shape == (total,) and float(returns[-1]) == 1.0\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 256, f"{done.stdout.strip()} MiB more at the peak"


def test_reinforceplusplus_has_no_group_baseline_and_discounts() -> None:
    exps = [Exp(0, r, 0, float(r), [True, True]) for r in range(2)]
    got = ours("reinforceplusplus", {"gamma": 0.5}, exps)
    returns = [0.0, 0.0, 0.5, 1.0]  # per token of both experiences: gamma * r, then r
    mean, std = statistics.fmean(returns), statistics.stdev(returns)
    want = [(r - mean) / math.sqrt(std**2 + 1e-8) for r in returns]
    assert got[exps[0].uid][0].tolist() == pytest.approx(want[:2], abs=1e-6)
    assert got[exps[1].uid][0].tolist() == pytest.approx(want[2:], abs=1e-6)


def test_std_threshold_follows_trinity() -> None:
    spread = [Exp(0, r, 0, float(2 * r), [True]) for r in range(3)]  # [0, 2, 4]: std exactly 2
    assert ours("grpo", {"std_threshold": 2.0}, spread) == {}
    assert len(ours("grpo", {"std_threshold": 1.99}, spread)) == 3
    equal = [Exp(1, r, 0, 1.0, [True]) for r in range(3)]
    assert ours("grpo", {"std_threshold": 0.0}, equal) == {}  # 0 drops zero variance; unset is off
    assert len(ours("grpo", {}, equal)) == 3
    single = [Exp(2, 0, 0, 1.0, [True])]
    assert ours("grpo", {"std_threshold": 0.0}, single) == {}


def test_group_of_one_under_batch_std_is_scaled_by_the_batch() -> None:
    exps = [Exp(0, 0, 0, 5.0, [True]), Exp(1, 0, 0, 0.0, [True]), Exp(1, 1, 0, 4.0, [True])]
    got = ours("grpo", {"std_cal_level": "batch"}, exps)
    std = statistics.stdev([5.0, 0.0, 4.0])
    assert got[exps[0].uid][0].item() == pytest.approx(5.0 / (std + 1e-6), abs=1e-6)
    assert got[exps[0].uid][0].item() == pytest.approx(1.8898, abs=1e-4)


def test_rec_group_of_one_keeps_its_reward() -> None:
    exps = [Exp(0, 0, 0, 0.7, [True, False])]
    assert ours("rec", {}, exps)[exps[0].uid][0].tolist() == pytest.approx([0.7, 0.0])


# ---- expbuf's own estimators against their formulas ----------------------------------


def per_group(exps: list[Exp]) -> dict[int, list[Exp]]:
    out: dict[int, list[Exp]] = {}
    for e in exps:
        out.setdefault(e.task, []).append(e)
    return out


def trinity_trained(name: str, params: dict, exps: list[Exp]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Trinity-RFT's values as its trainer computes them: its Experiences through its own
    conversion to verl's DataProto (trainer/verl/utils.py to_data_proto), each reward at its
    response's end, then its registered function; each experience's response part."""
    registry = pytest.importorskip("trinity.algorithm.advantage_fn")
    experience = pytest.importorskip("trinity.common.experience")
    from trinity.trainer.verl.utils import to_data_proto

    built = [e.build(experience.Experience, experience.EID) for e in exps]
    data = to_data_proto(built, 0, None, logging.getLogger(__name__))
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    data, _ = registry.ADVANTAGE_FN.get(name)(**params)(data)
    found = {}
    for i, e in enumerate(built):  # the returns under the action mask, as expbuf stores them
        n = len(e.action_mask)
        found[e.eid.uid] = (data.batch["advantages"][i, :n], data.batch["returns"][i, :n] * e.action_mask)
    return found


@pytest.mark.parametrize("params", [{}, {"gamma": 0.9}])
def test_an_empty_response_gets_what_trinitys_trainer_gives_it(params: dict) -> None:
    """A run whose response is empty (its prompt alone: a push takes it) beside two that answered:
    reinforceplusplus's batch stage raised on its zero-length values, so every Sample of the table
    failed (a helper's audit). It gets no values, and the others what Trinity-RFT's trainer gives
    them, with it and without it (its batch whitening counts tokens: an empty response has none)."""
    name = "reinforceplusplus"
    exps = [Exp(0, 0, 0, 1.0, []), Exp(0, 1, 0, 0.0, [True, True, True]), Exp(0, 2, 0, 0.5, [True])]
    got, want = ours(name, params, exps), trinity_trained(name, params, exps)
    assert got[exps[0].uid][0].numel() == 0
    assert_same(got, want)
    assert_same(ours(name, params, exps[1:]), {e.uid: want[e.uid] for e in exps[1:]})


@pytest.mark.parametrize("name", ["grpo", "step_wise_grpo"])
def test_a_batch_std_past_float32s_range_is_served_at_its_largest(name: str) -> None:
    """Two groups of one, rewards 1e33 (a push takes them): the batch's std is 0, so each value is
    1e33 / 1e-6, past float32's range, in which a batch carries advantages. Packing it failed every
    Sample of the batch, again at each retry (a helper's audit); it is served at float32's largest
    (Trinity-RFT's value is infinite: no infinity is served)."""
    exps = [Exp(0, 0, 0, 1e33, [True, True]), Exp(1, 0, 0, 1e33, [True])]
    largest = torch.finfo(torch.float32).max
    assert torch.isinf(theirs(name, {"std_cal_level": "batch"}, exps)[exps[0].uid][0]).all()
    got = ours(name, {"std_cal_level": "batch"}, exps)
    assert [got[e.uid][0].tolist() for e in exps] == [[largest, largest], [largest]]


def test_drgrpo() -> None:
    exps = random_batch(5)
    got = ours("drgrpo", {}, exps)
    for members in per_group(exps).values():
        mean = statistics.fmean(e.reward for e in members) if len(members) > 1 else 0.0
        for e in members:
            want = torch.tensor([(e.reward - mean) * m for m in e.mask])
            assert torch.allclose(got[e.uid][0].double(), want.double(), atol=TOL)


def test_reinforce_pp_baseline_whitens_over_the_batch() -> None:
    exps = random_batch(6)
    got = ours("reinforce++_baseline", {}, exps)
    centred = {}
    for members in per_group(exps).values():
        mean = statistics.fmean(e.reward for e in members) if len(members) > 1 else 0.0
        centred.update({e.uid: e.reward - mean for e in members})
    tokens = [centred[e.uid] for e in exps for m in e.mask if m]
    mean, var = statistics.fmean(tokens), statistics.variance(tokens)
    for e in exps:
        want = torch.tensor([(centred[e.uid] - mean) / math.sqrt(var + 1e-8) * m for m in e.mask])
        assert torch.allclose(got[e.uid][0].double(), want.double(), atol=1e-5)


def test_multi_turn_discount_takes_a_runs_experiences_of_one_step_in_push_order() -> None:
    """Experiences of a run that share a step (a turn's several model calls) are its turns in the
    order they were pushed: the sort by step kept no order among them (torch's argsort, unstable
    past some 100 experiences), so their returns came out in any order."""
    exps = [Exp(0, 0, step, float(at), [True], suffix=f"{at:03d}") for at in range(120) for step in (at // 40,)]
    got = ours("multi_turn_discount", {"turn_level_discount": 0.5}, exps)
    running = 0.0
    for e in reversed(exps):
        running = e.reward + 0.5 * running
        assert float(got[e.uid][0][0]) == pytest.approx(running, rel=1e-6), e.uid


def test_discounted_return_and_multi_turn_discount() -> None:
    exps = random_batch(7, multi_step=True)
    got = ours("discounted_return", {"gamma": 0.9}, exps)
    for e in exps:
        running, want = 0.0, []
        for r in reversed(e.token_rewards):
            running = r + 0.9 * running
            want.append(running)
        want = torch.tensor(want[::-1]) * torch.tensor(e.mask)
        assert torch.allclose(got[e.uid][0].double(), want.double(), atol=1e-5)
    got = ours("multi_turn_discount", {"turn_level_discount": 0.8}, exps)
    runs: dict[tuple[int, int], list[Exp]] = {}
    for e in exps:
        runs.setdefault((e.task, e.run), []).append(e)
    for steps in runs.values():
        running = 0.0
        for e in sorted(steps, key=lambda x: -x.step):
            running = e.reward + 0.8 * running
            assert torch.allclose(got[e.uid][0].double(), torch.tensor(e.mask).double() * running, atol=TOL)


# ---- parameters ------------------------------------------------------------------------

OUT_OF_RANGE = [
    ("grpo", "epsilon", 0, "> 0"),
    ("grpo", "epsilon", -1e-6, "> 0"),
    ("grpo", "epsilon", True, "> 0"),
    ("grpo", "std_threshold", -0.1, ">= 0"),
    ("grpo", "std_cal_level", "task", "'group' (0) or 'batch' (1)"),
    ("grpo", "std_cal_level", 2, "'group' (0) or 'batch' (1)"),
    ("grpo_verl", "epsilon", math.inf, "> 0"),
    ("step_wise_grpo", "epsilon", 0.0, "> 0"),
    ("step_wise_grpo", "enable_step_norm", 0.5, "'false' (0) or 'true' (1)"),
    ("step_wise_grpo", "std_threshold", -1, ">= 0"),
    ("reinforceplusplus", "gamma", 0, "0 < x <= 1"),
    ("reinforceplusplus", "gamma", 1.01, "0 < x <= 1"),
    ("opmd", "tau", 0, "> 0"),
    ("opmd", "opmd_baseline", "max", "'mean' (0) or 'logavgexp' (1)"),
    ("opmd_verl", "tau", -2, "> 0"),
    ("asymre", "baseline_shift", math.nan, "a finite number"),
    ("asymre_verl", "baseline_shift", -math.inf, "a finite number"),
    ("rec", "epsilon", 0, "> 0"),
    ("rec", "std_normalize", 2, "'false' (0) or 'true' (1)"),
    ("reinforce++_baseline", "epsilon", 0, "> 0"),
    ("discounted_return", "gamma", 0, "0 < x <= 1"),
    ("multi_turn_discount", "turn_level_discount", 1.5, "0 < x <= 1"),
]


@pytest.mark.parametrize(("estimator", "param", "value", "allowed"), OUT_OF_RANGE)
def test_out_of_range_parameter_is_refused(estimator: str, param: str, value: object, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        TableConfig.of(name="t1", estimator=estimator, estimator_params={param: value})
    message = str(info.value)
    for part in ("table 't1'", f"estimator {estimator}", f"parameter {param}", f"allowed: {allowed}"):
        assert part in message


def test_parameters_are_stored_as_numbers_and_given_by_name() -> None:
    config = TableConfig.of(name="t", estimator="opmd", estimator_params={"opmd_baseline": "logavgexp"})
    assert config.advantages.params == {"opmd_baseline": 1.0}
    assert TableConfig.from_settings(config.settings()) == config
    assert estimator_args(config) == {"opmd_baseline": "logavgexp", "tau": 1.0}
    assert estimator_args(TableConfig.of(name="t", estimator="grpo"))["std_threshold"] is None
    with pytest.raises(ConfigError, match=r"estimator rloo has no parameter\(s\) gamma \(it takes: none\)"):
        TableConfig.of(name="t", estimator="rloo", estimator_params={"gamma": 0.9})


# ---- end to end: Trinity-RFT's own payloads through a real server -----------------------

E2E_CASES = [
    ("grpo", {}),
    ("grpo", {"std_cal_level": "batch"}),
    ("grpo_verl", {}),
    ("rloo", {}),
    ("opmd", {"opmd_baseline": "logavgexp"}),
    ("asymre_verl", {}),
    ("rec", {"std_normalize": True}),
    ("reinforceplusplus", {"gamma": 0.9}),
]


@pytest.fixture(scope="module")
def server_client(start_module_server: Servers) -> BufferClient:
    with BufferClient(f"127.0.0.1:{start_module_server().port}", timeout=20) as c:
        yield c


@pytest.mark.parametrize(("name", "params"), E2E_CASES)
def test_fixtures_over_grpc_match_trinity(server_client: BufferClient, name: str, params: dict) -> None:
    experience = pytest.importorskip("trinity.common.experience")
    table = f"{name}-{len(params)}".replace("+", "p")
    server_client.create_table(table, estimator=name, estimator_params=params)
    payloads = [payload("grpo_group.trxp"), payload("mixed_batch.trxp")]
    for data in payloads:
        server_client.push(data, table=table)
    batch = next(server_client.sample(table, num_groups=3, max_batches=1, timeout=10, delivery="consume"))
    exps = [e for data in payloads for e in experience.Experience.deserialize_many(data)]
    want = trinity_advantages(name, params, exps)
    got = {e.eid.uid: (e.advantages, e.returns) for e in batch.experiences}
    assert_same(got, want)


def test_step_wise_grpo_takes_the_highest_step_as_the_last() -> None:
    """A run's last step is its highest step number, wherever it lies among the pushed
    experiences (Trinity-RFT takes the last in its list, the same when a run's steps are
    listed in order, as its workflows list them)."""
    rewards = {0: 0.0, 1: 1.0, 2: 5.0}  # per run, the reward of its step 2 (pushed first)
    exps = [
        Exp(0, run, step, rewards[run] if step == 2 else -9.0, [True] * 3) for run in range(3) for step in (2, 0, 1)
    ]
    got = ours("step_wise_grpo", {}, exps)
    mean, std = statistics.fmean(rewards.values()), statistics.stdev(rewards.values())
    for e in exps:
        assert float(got[e.uid][0][0]) == pytest.approx((rewards[e.run] - mean) / (std + 1e-6), abs=1e-6)


@pytest.mark.parametrize(("name", "params"), MULTI_STEP_CASES)
def test_step_wise_grpo_takes_one_last_experience_a_run_where_its_last_step_made_several(
    name: str, params: dict
) -> None:
    """Trinity-RFT's step-wise workflows give every model call of a step an experience of that
    step and its reward: a run's last step may hold several, and Trinity takes the last listed
    (run 0's two calls at step 1 here; run 3's every experience at step 0). Counted each, the
    group's mean and std took both and run 0's advantage was their sum (1.46 against 0.87)."""
    calls = [
        Exp(0, 0, 0, 0.0, [True, True]), Exp(0, 0, 1, 1.0, [True, True], suffix="a"),
        Exp(0, 0, 1, 1.0, [True], suffix="b"),
        Exp(0, 1, 0, 0.0, [True, True]), Exp(0, 1, 1, 0.0, [True]),
        Exp(0, 2, 0, 0.0, [True]), Exp(0, 2, 1, 1.0, [True, True, True]),
        Exp(0, 3, 0, 0.5, [True], suffix="a"), Exp(0, 3, 0, 0.0, [True, True], suffix="b"),
        Exp(1, 0, 0, 2.0, [True], suffix="a"), Exp(1, 0, 0, 1.0, [True], suffix="b"),
        Exp(1, 1, 0, 0.0, [True, True]),
    ]  # fmt: skip
    assert_same(ours(name, params, calls), theirs(name, params, calls))


@pytest.mark.parametrize("name", ["grpo", "step_wise_grpo"])
@pytest.mark.parametrize("reward", [0.1, 0.7, 1 / 3])
def test_equal_rewards_have_zero_std_whatever_their_rounding(name: str, reward: float) -> None:
    """Rewards all equal have a std of exactly 0 and a mean of that reward, though their float sum
    rounds (0.1 * 3): std_threshold 0 drops the group, as Trinity-RFT's own function does, and
    without a threshold its advantages are 0."""
    equal = [Exp(0, r, 0, reward, [True, True]) for r in range(3)]
    spread = [Exp(1, r, 0, float(r), [True]) for r in range(2)]
    got = ours(name, {"std_threshold": 0.0}, equal + spread)
    assert sorted(got) == sorted(e.uid for e in spread)
    assert_same(got, theirs(name, {"std_threshold": 0.0}, equal + spread))
    nine = [Exp(2, r, 0, reward, [True, True]) for r in range(9)]  # a float32 mean rounds too: Trinity's std is not 0
    assert {uid: a.tolist() for uid, (a, _) in ours(name, {}, nine).items()} == {e.uid: [0.0, 0.0] for e in nine}
