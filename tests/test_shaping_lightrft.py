"""Reward shaping served by a live server against LightRFT's own path (transcribed in
lightrft_reference.py, LightRFT's PyPI release holding no code): the group step before
the running normalisation and the reward clip, clip then whitening, the first reward, and
running moments that depend on the groups' completion order only."""

from __future__ import annotations

import math
import random
import threading
import time

import grpc
import pytest
import torch
from lightrft_reference import Config, ExperienceMaker

from expbuf.client import BufferClient, BufferError
from expbuf.client.rpc import wire
from expbuf.client.schema.experience import Experience
from expbuf.server.store.schema.table_config import ConfigError, TableConfig

from helpers import make_experience

pytestmark = pytest.mark.client_timeout(20)

TOL = 2e-5  # LightRFT keeps its running moments in float32


def wait_computed(client: BufferClient, table: str, groups: int) -> None:
    deadline = time.monotonic() + 20
    while client.stats(table)[table].groups_ready < groups:
        assert time.monotonic() < deadline, "advantages not computed in time"
        time.sleep(0.02)


def make_groups(rng: random.Random, count: int, size: int, batch: int = 1) -> list[list[Experience]]:
    """`count` groups (tasks) of `size` runs, random rewards and response lengths."""
    return [
        [
            make_experience(batch, task, run, reward=round(rng.uniform(-2, 4), 3), response=rng.randint(1, 6))
            for run in range(size)
        ]
        for task in range(count)
    ]


def served(client: BufferClient, table: str, groups: int) -> tuple[list[Experience], list[int]]:
    """Every experience of the table in one batch (FIFO: the groups in completion order),
    and the tasks in that order."""
    batch = next(client.sample(table, num_groups=groups, max_batches=1, timeout=10, delivery="consume"))
    order = list(dict.fromkeys(int(e.eid.task) for e in batch.experiences))
    return batch.experiences, order


def reference(config: Config, experiences: list[Experience], micro_batch: int) -> dict[str, list[float]]:
    """LightRFT's advantages of these experiences, in this order, as one rollout batch."""
    maker = ExperienceMaker(config)
    got = maker.make([e.reward for e in experiences], [e.action_mask.int().tolist() for e in experiences], micro_batch)
    return {e.eid.uid: a.tolist() for e, a in zip(experiences, got, strict=True)}


def values(experiences: list[Experience]) -> dict[str, list[float]]:
    return {e.eid.uid: e.advantages.tolist() for e in experiences}


def assert_close(got: dict[str, list[float]], want: dict[str, list[float]], tol: float = TOL) -> None:
    assert got.keys() == want.keys()
    for uid, row in want.items():
        assert got[uid] == pytest.approx(row, abs=tol), uid


def test_grpo_clips_after_its_group_step(client: BufferClient) -> None:
    """The audit's case: rewards [0, 1, 10], reward clip 5. LightRFT normalises the group
    first, so the clip does not bite: [-0.666, -0.484, 1.150] (clipping first gave
    [-0.756, -0.378, 1.134])."""
    client.create_table("c", estimator="grpo", estimator_params={"epsilon": 1e-9}, shaping={"reward_clip": 5.0})
    pushed = [make_experience(1, 0, run, reward=r, response=1) for run, r in enumerate((0.0, 1.0, 10.0))]
    client.push(pushed, table="c")
    experiences, _ = served(client, "c", 1)
    got = values(experiences)
    assert_close(got, reference(Config("grpo", 3, reward_clip=5.0), pushed, 3))
    assert [got[e.eid.uid][0] for e in pushed] == pytest.approx([-0.666, -0.484, 1.150], abs=1e-3)


@pytest.mark.parametrize(
    ("estimator", "lightrft", "minus_mean"),
    [("grpo", "grpo", False), ("grpo", "grpo", True), ("rloo", "rloo", True)],
)
def test_running_normalisation_after_the_group_step(
    client: BufferClient, estimator: str, lightrft: str, minus_mean: bool
) -> None:
    """The moments take in the group step's values, one group at a time, then the clips:
    grpo's values change with the normalisation, as LightRFT's do."""
    shaping = {
        "reward_running_norm": True,
        "reward_running_norm_minus_mean": minus_mean,
        "reward_clip": 1.2,
        "advantage_clip": 1.0,
    }
    params = {"epsilon": 1e-9} if estimator == "grpo" else {}
    client.create_table("n", estimator=estimator, estimator_params=params, shaping=shaping)
    rng = random.Random(3)
    pushed = [e for group in make_groups(rng, 5, 4) for e in group]
    client.push(pushed, table="n")
    experiences, _ = served(client, "n", 5)
    config = Config(lightrft, 4, reward_running_norm=True, reward_running_norm_minus_mean=minus_mean)
    config.reward_clip, config.advantage_clip = 1.2, 1.0
    want = reference(config, experiences, 4)
    assert_close(values(experiences), want)
    unnormalised = reference(Config(lightrft, 4, reward_clip=1.2, advantage_clip=1.0), experiences, 4)
    gap = max(abs(a[0] - b[0]) for a, b in zip(want.values(), unnormalised.values(), strict=True))
    assert gap > 0.05  # the normalisation has an effect


@pytest.mark.parametrize(
    ("estimator", "lightrft"), [("reinforce++_baseline", "reinforce_baseline"), ("reinforceplusplus", "reinforce")]
)
def test_clip_then_whitening_across_the_batch(client: BufferClient, estimator: str, lightrft: str) -> None:
    """LightRFT's reinforce_baseline and reinforce clip the advantages and then whiten them
    across the batch, so the values go past the clip; with running normalisation, one group
    per Experience. expbuf's whitening (verl's for reinforce++_baseline, Trinity-RFT's for
    reinforceplusplus) takes the unbiased variance over the batch's T generated tokens,
    LightRFT's the population variance: the values differ by the factor sqrt((T - 1) / T)
    and by nothing else."""
    shaping = {"reward_running_norm": True, "advantage_clip": 0.5}
    client.create_table("w", estimator=estimator, shaping=shaping)
    rng = random.Random(5)
    pushed = [e for group in make_groups(rng, 4, 3) for e in group]
    client.push(pushed, table="w")
    experiences, _ = served(client, "w", 4)
    tokens = sum(len(e.action_mask) for e in experiences)
    want = reference(Config(lightrft, 3, reward_running_norm=True, advantage_clip=0.5), experiences, 3)
    factor = math.sqrt((tokens - 1) / tokens)
    assert_close(values(experiences), {uid: [v * factor for v in row] for uid, row in want.items()}, 1e-4)
    assert max(abs(v) for row in want.values() for v in row) > 0.6  # past the clip, as LightRFT's


def test_first_reward_under_running_normalisation_is_zero(client: BufferClient) -> None:
    """LightRFT's running std after a single reward is infinite: the reward becomes 0. The
    second reward is normalised by the std of both."""
    client.create_table("f", group_by="none", estimator="reinforce", shaping={"reward_running_norm": True})
    first, second = make_experience(1, 0, 0, reward=3.0), make_experience(1, 1, 0, reward=5.0)
    client.push([first], table="f")
    wait_computed(client, "f", 1)
    client.push([second], table="f")
    experiences, _ = served(client, "f", 2)
    got = {e.eid.uid: e.advantages.tolist() for e in experiences}
    maker = ExperienceMaker(Config("reinforce", 1, reward_running_norm=True))
    lightrft_first = maker.make([3.0], [[1] * 4], 1)[0].tolist()
    assert got[first.eid.uid] == lightrft_first == [0.0] * 4
    assert got[second.eid.uid] == pytest.approx([5.0 / math.sqrt(2.0)] * 4, abs=1e-6)  # std of 3 and 5


def test_advantages_norm_whitens_the_sampled_batch(client: BufferClient) -> None:
    """advantages_norm whitens over the batch's generated tokens before the advantage clip,
    as LightRFT's BaseREINFORCECalculator does over its micro-batch (here the whole batch)."""
    client.create_table("a", estimator="rloo", shaping={"advantages_norm": True, "advantage_clip": 1.0})
    rng = random.Random(8)
    pushed = [e for group in make_groups(rng, 3, 4) for e in group]
    client.push(pushed, table="a")
    experiences, _ = served(client, "a", 3)
    want = reference(Config("rloo", 4, advantages_norm=True, advantage_clip=1.0), experiences, len(experiences))
    assert_close(values(experiences), want)
    assert sum(abs(v) == pytest.approx(1.0) for row in want.values() for v in row) > 0


def test_same_completion_order_gives_the_same_values(client: BufferClient) -> None:
    """Running normalisation depends on the order the groups complete, not on how they
    arrive: pushed concurrently from threads (the worker computing whichever groups have
    completed), one group at a time, or at once, the groups give the same values when they
    complete in the same order; and those are LightRFT's, with one group per Experience."""
    shaping = {"reward_running_norm": True, "reward_running_norm_minus_mean": True, "reward_clip": 1.5}
    for name in ("threads", "one_by_one", "at_once", "parts"):
        client.create_table(name, group_size=4, estimator="grpo", estimator_params={"epsilon": 1e-9}, shaping=shaping)
    rng = random.Random(13)
    groups = make_groups(rng, 8, 4)
    halves = [part for group in groups for part in (group[:2], group[2:])]
    rng.shuffle(halves)
    barrier, errors = threading.Barrier(4), []

    def push_some(parts: list[list[Experience]]) -> None:
        barrier.wait()
        try:
            for part in parts:
                client.push(part, table="threads")
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=push_some, args=(halves[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    concurrent, order = served(client, "threads", 8)
    in_order = [groups[task] for task in order]
    for done, group in enumerate(in_order, 1):
        client.push(group, table="one_by_one")
        wait_computed(client, "one_by_one", done)
    client.push([e for group in in_order for e in group], table="at_once")
    client.push([e for group in in_order for e in group[:3]], table="parts")
    client.push([group[3] for group in in_order], table="parts")
    want = values(concurrent)
    for name in ("one_by_one", "at_once", "parts"):
        experiences, seen = served(client, name, 8)
        assert seen == order, name
        assert values(experiences) == want, name  # equal to the last bit
    config = Config("grpo", 4, reward_running_norm=True, reward_running_norm_minus_mean=True, reward_clip=1.5)
    assert_close(want, reference(config, [e for group in in_order for e in group], 4))


def test_shaping_on_a_none_table_is_refused_naming_the_settings(client: BufferClient) -> None:
    with pytest.raises(ConfigError, match="table 'p': shaping reward_clip, advantage_clip needs an estimator"):
        TableConfig.of("p", estimator="none", shaping={"reward_clip": 1.0, "advantage_clip": 0.5})
    with pytest.raises(BufferError) as info:
        client.create_table("p", estimator="none", shaping={"advantage_clip": 0.5})
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "shaping advantage_clip needs an estimator" in info.value.details
    assert client.create_table("q", estimator="none", shaping={"overlong_buffer_penalty_factor": 2.0})
    # A `none` table an earlier release stored with shaping (taken and ignored) still opens.
    stored = TableConfig.from_stored({"name": "old", "estimator": "none", "shaping": {"reward_clip": 1.0}})
    assert stored.advantages.shaping.reward_clip == 0.0


@pytest.mark.parametrize(
    ("estimator", "message"),
    [
        ("grpo", "LightRFT skips advantages_norm for grpo"),
        ("discounted_return", "token-level values"),
        ("reinforceplusplus", "token-level values"),
    ],
)
def test_advantages_norm_refused_where_it_cannot_run(estimator: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"shaping advantages_norm is not available with {estimator}.*{message}"):
        TableConfig.of("x", estimator=estimator, shaping={"advantages_norm": True})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"shaping": {"reward_clip": "5"}}, "shaping reward_clip is '5'"),
        ({"shaping": {"advantages_norm": "yes"}}, "shaping advantages_norm is 'yes'"),
        ({"group_size": "4"}, "group_size is '4'"),
    ],
)
def test_client_errors_name_the_setting(settings: dict, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.table_to_proto({"name": "t", **settings})


def test_moments_are_float64_sums_of_the_groups() -> None:
    """The served values do not depend on which groups were computed together: a group's
    update of the moments is exact sums of its own values (math.fsum)."""
    from expbuf.server.advantages.moments import RunningMoments

    values = torch.tensor([0.1, 0.2, 0.3, 1e-9, 7.0], dtype=torch.float64)
    forward = RunningMoments().update(values)
    backward = RunningMoments().update(values.flip(0))
    assert forward == backward


@pytest.mark.parametrize(("gamma", "masked_last"), [(1.0, True), (0.9, False), (0.9, True)])
def test_reinforceplusplus_is_lightrfts_reinforce_with_the_reward_discounted_from_the_last_response_token(
    client: BufferClient, gamma: float, masked_last: bool
) -> None:
    """expbuf puts a reward on the last response token, LightRFT's compute_reward on the last
    generated one; each discounts from there. So apart from the variance factor the two agree at
    gamma = 1 or where the last response token is generated, and otherwise exactly as LightRFT's
    reinforce would with each reward discounted by gamma ** k, k the response's trailing tokens
    not generated (which moves every value, the batch whitening mixing them)."""
    client.create_table("g", estimator="reinforceplusplus", estimator_params={"gamma": gamma})
    rng = random.Random(11)
    pushed = [
        make_experience(1, task, 0, reward=round(rng.uniform(-2, 4), 3), response=rng.randint(3, 7))
        for task in range(8)
    ]
    trailing = {}
    for e in pushed:
        k = rng.randint(1, 2) if masked_last and int(e.eid.task) % 2 else 0  # half end on tool output
        if k:
            e.action_mask[-k:] = False
        trailing[e.eid.uid] = k
    client.push(pushed, table="g")
    experiences, _ = served(client, "g", 8)
    tokens = sum(int(e.action_mask.sum()) for e in experiences)
    factor = math.sqrt((tokens - 1) / tokens)
    config = Config("reinforce", 1, gamma=gamma)
    discounted = [
        make_experience(1, e.eid.task, 0, reward=e.reward * gamma ** trailing[e.eid.uid]) for e in experiences
    ]
    for one, e in zip(discounted, experiences, strict=True):
        one.eid, one.action_mask = e.eid, e.action_mask
    want = reference(config, discounted, 1)
    assert_close(values(experiences), {uid: [v * factor for v in row] for uid, row in want.items()}, 1e-4)
    as_pushed = reference(config, experiences, 1)  # LightRFT's reinforce of the same experiences
    gap = max(
        abs(a * factor - b)
        for uid, row in as_pushed.items()
        for a, b in zip(row, values(experiences)[uid], strict=True)
    )
    if gamma == 1.0 or not masked_last:
        assert gap < 1e-4
    else:
        assert gap > 0.1, gap
