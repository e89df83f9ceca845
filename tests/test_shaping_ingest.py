"""Reward shaping and advantage clipping in a table: on ingest, over gRPC, across restarts,
after the batch stage, in Stats and /metrics. References are written here from LightRFT's
FastExperienceMaker formulas, one experience at a time."""

from __future__ import annotations

import random
import statistics
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from expbuf.client import BufferClient, BufferError, decode, trxp
from expbuf.client.schema.experience import Experience
from expbuf.server.advantages.worker import AdvantageWorker
from expbuf.server.config import load as load_config
from expbuf.server.store import Store
from expbuf.server.store.schema.estimator_registry import Estimator
from expbuf.server.store.schema.table_config import ConfigError, TableConfig

from conftest import Servers
from helpers import make_experience, registered, take

pytestmark = pytest.mark.client_timeout(20)

SHAPING = {
    "overlong_buffer": True,
    "overlong_buffer_len": 4,
    "max_new_tokens": 12,
    "overlong_buffer_penalty_factor": 0.5,
    "reward_running_norm": True,
    "reward_running_norm_minus_mean": True,
    "reward_clip": 1.5,
    "advantage_clip": 1.0,
}


def wait_computed(client: BufferClient, table: str, groups: int) -> None:
    """Until `groups` groups of the table have their advantages (a push acks before that)."""
    deadline = time.monotonic() + 20
    while client.stats(table)[table].groups_ready < groups:
        assert time.monotonic() < deadline, "advantages not computed in time"
        time.sleep(0.02)


def groups(batch: int, rng: random.Random, count: int = 2, size: int = 4) -> list[Experience]:
    """`count` groups of `size` runs with random rewards and response lengths."""
    return [
        make_experience(batch, task, run, reward=rng.uniform(-3, 3), response=rng.randint(1, 12))
        for task in range(count)
        for run in range(size)
    ]


def penalised(exp: Experience) -> float:
    """DAPO's overlong penalty: expected length 12 - 4, penalty -(L - 8) / 4 * 0.5 when positive."""
    exceed = int(exp.action_mask.sum()) - (12 - 4)
    return exp.reward + min(-exceed / 4 * 0.5, 0.0)


def clip(value: float, limit: float) -> float:
    return max(-limit, min(limit, value))


def grpo(rewards: list[float]) -> list[float]:
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


@pytest.mark.parametrize("estimator", ["reinforce", "grpo", "discounted_return"])
def test_shaping_steps_on_ingest_match_the_seed_formulas(client: BufferClient, estimator: str) -> None:
    """Overlong penalty; running normalisation, one group at a time, over both pushes; reward
    clip; advantage clip; token-level values (discounted_return) clipped too. grpo's group
    step comes before the normalisation and the reward clip (LightRFT's group calculators)."""
    limit = 1.2 if estimator == "grpo" else 1.5  # grpo's values lie within +-1.5
    client.create_table("s", estimator=estimator, shaping=SHAPING | {"reward_clip": limit})
    rng, seen, want, counts = random.Random(7), [], {}, dict.fromkeys(("pen", "rclip", "aseen", "aclip"), 0)
    for batch in (1, 2):
        pushed = groups(batch, rng)
        client.push(pushed, table="s")
        wait_computed(client, "s", 2 * batch)
        for group in (pushed[:4], pushed[4:]):
            rewards = [penalised(e) for e in group]
            if estimator == "grpo":
                rewards = grpo(rewards)
            seen += rewards  # the moments take in the group's values before they are normalised
            mean, std = statistics.fmean(seen), statistics.stdev(seen)
            normed = [(r - mean) / std for r in rewards]
            for exp, value in zip(group, normed, strict=True):
                value = clip(value, limit)
                want[exp.eid.uid] = clip(value, 1.0)
                tokens = len(exp.action_mask) if estimator == "discounted_return" else 1
                counts["aseen"] += tokens
                counts["aclip"] += tokens * (abs(value) > 1.0)
            counts["rclip"] += sum(abs(r) > limit for r in normed)
        counts["pen"] += sum(len(e.action_mask) > 8 for e in pushed)
    assert 0 < counts["pen"] < 16 and 0 < counts["rclip"] < 16 and 0 < counts["aclip"] < counts["aseen"]
    stats = client.stats("s")["s"]
    assert stats.overlong_penalised == counts["pen"]
    assert (stats.rewards_seen, stats.rewards_clipped) == (16, counts["rclip"])
    assert (stats.advantages_seen, stats.advantages_clipped) == (counts["aseen"], counts["aclip"])
    assert stats.reward_running_mean == pytest.approx(statistics.fmean(seen))
    assert stats.reward_running_std == pytest.approx(statistics.stdev(seen))
    batch = next(client.sample("s", num_groups=4, max_batches=1, timeout=10, delivery="consume"))
    assert len(batch.experiences) == 16
    for exp in batch.experiences:
        assert exp.advantages.tolist() == pytest.approx([want[exp.eid.uid]] * len(exp.action_mask), abs=1e-5)


def test_running_moments_survive_a_restart(start_server: Servers) -> None:
    """The second push after a restart is normalised with the moments of both pushes."""
    rng = random.Random(3)
    first, second = groups(1, rng, count=1), groups(2, rng, count=1)
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("n", estimator="reinforce", shaping={"reward_running_norm": True})
        client.push(first, table="n")
        wait_computed(client, "n", 1)
    server.stop(grace=1)
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.push(second, table="n")
        wait_computed(client, "n", 2)
        batch = next(client.sample("n", num_groups=2, max_batches=1, timeout=10, delivery="consume"))
        stats = client.stats("n")["n"]
    rewards = [e.reward for e in first + second]
    std_first, std_both = statistics.stdev(rewards[:4]), statistics.stdev(rewards)
    want = {e.eid.uid: e.reward / std_first for e in first} | {e.eid.uid: e.reward / std_both for e in second}
    assert {e.eid.uid: float(e.advantages[0]) for e in batch.experiences} == pytest.approx(want, abs=1e-5)
    assert stats.reward_running_mean == pytest.approx(statistics.fmean(rewards))
    assert stats.reward_running_std == pytest.approx(std_both)


@pytest.fixture
def exploding() -> Iterator[str]:
    """reinforce, except that it raises on a batch holding a response of 7 tokens (a fact
    that shaping does not change): a computation that fails because of one group."""
    from expbuf.server.advantages.worker import estimators

    def explode(batch: estimators.FlatBatch) -> estimators.Advantages:
        if bool((batch.generated == 7).any()):
            raise ValueError("a response of 7 tokens is not computable")
        return estimators.reinforce(batch)

    with registered(Estimator("explode", ingest=explode)) as name:
        yield name


def test_moments_chain_through_retries_and_a_failed_try_leaves_them(tmp_path: Path, exploding: str) -> None:
    """A batched computation that fails is retried group by group: each group starts from
    the moments the one before produced, and neither the failed batch nor the failed group
    takes in its rewards."""
    rng = random.Random(5)
    good = [[make_experience(1, task, run, reward=rng.uniform(-3, 3)) for run in range(3)] for task in (0, 2)]
    guilty = [make_experience(1, 1, run, reward=50.0, response=7) for run in range(3)]
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("c", estimator=exploding, shaping={"reward_running_norm": True}))
        store.put("c", [trxp.from_experience(e) for e in good[0] + guilty + good[1]])
        assert AdvantageWorker(store).run_once() == 3
        stats = store.stats("c")
        assert (stats["groups_ready"], stats["groups_failed"]) == (2, 1)
        batch = take(store, "c", num_groups=2)
        assert batch is not None
        got = {e.eid.uid: float(e.advantages[0]) for e in decode(batch.payload)}
    first = [e.reward for e in good[0]]
    both = first + [e.reward for e in good[1]]
    want = {e.eid.uid: e.reward / statistics.stdev(first) for e in good[0]}
    want |= {e.eid.uid: e.reward / statistics.stdev(both) for e in good[1]}
    assert got == pytest.approx(want, abs=1e-5)
    assert stats["reward_moments"][0] == pytest.approx(statistics.fmean(both))


def test_advantage_clip_after_the_batch_stage(client: BufferClient) -> None:
    """grpo with std over the batch: the statistics are over the shaped (clipped) rewards of
    the sampled batch, and the clip applies to the finished advantages."""
    client.create_table(
        "b",
        estimator="grpo",
        estimator_params={"std_cal_level": "batch"},
        shaping={"reward_clip": 2.0, "advantage_clip": 0.6},
    )
    rng = random.Random(11)
    pushed = groups(1, rng, count=3)
    client.push(pushed, table="b")
    batch = next(client.sample("b", num_groups=3, max_batches=1, timeout=10, delivery="consume"))
    shaped = [clip(e.reward, 2.0) for e in pushed]
    std = statistics.stdev(shaped)
    finished = []
    for start_at in range(0, 12, 4):
        group = shaped[start_at : start_at + 4]
        finished += [(r - statistics.fmean(group)) / (std + 1e-6) for r in group]
    want = {e.eid.uid: clip(v, 0.6) for e, v in zip(pushed, finished, strict=True)}
    clipped = sum(abs(v) > 0.6 for v in finished)
    assert 0 < clipped < 12 and sum(abs(e.reward) > 2.0 for e in pushed) > 0
    assert {e.eid.uid: float(e.advantages[0]) for e in batch.experiences} == pytest.approx(want, abs=1e-5)
    stats = client.stats("b")["b"]
    assert (stats.advantages_seen, stats.advantages_clipped) == (12, clipped)


@pytest.mark.parametrize(
    ("shaping", "message"),
    [
        ({"reward_clip": -1.0}, "table 'bad': shaping reward_clip is -1.0; allowed: a finite number >= 0"),
        ({"advantage_clip": float("nan")}, "table 'bad': shaping advantage_clip is nan"),
        ({"overlong_buffer_len": -4}, "shaping overlong_buffer_len is -4; allowed: an integer >= 0"),
        (
            {"overlong_buffer": True, "overlong_buffer_len": 16, "max_new_tokens": 16},
            "needs 0 < overlong_buffer_len < max_new_tokens, got 16 and 16",
        ),
    ],
)
def test_out_of_range_shaping_is_refused_over_grpc(client: BufferClient, shaping: dict, message: str) -> None:
    with pytest.raises(BufferError) as info:
        client.create_table("bad", shaping=shaping)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details
    assert "bad" not in client.stats() and client.server_info().version


def test_unknown_shaping_setting_is_refused_naming_it(client: BufferClient) -> None:
    with pytest.raises(ValueError, match=r"unknown shaping setting\(s\): rewardclip; known: reward_clip"):
        client.create_table("typo", shaping={"rewardclip": 1.0})
    assert client.create_table("ok", shaping={"reward_clip": 5}).shaping.reward_clip == 5.0


def test_shaping_in_toml(tmp_path: Path) -> None:
    path = tmp_path / "expbuf.toml"
    path.write_text('[[tables]]\nname = "t"\nshaping = { reward_clip = 5.0, advantage_clip = 2 }\n')
    (table,) = load_config(path).tables
    assert (table.advantages.shaping.reward_clip, table.advantages.shaping.advantage_clip) == (5.0, 2)
    path.write_text('[[tables]]\nname = "t"\nshaping = { overlong_buffer = true, max_new_tokens = 8 }\n')
    with pytest.raises(ConfigError, match="table 't': shaping overlong_buffer needs 0 < overlong_buffer_len"):
        load_config(path)
    path.write_text('[[tables]]\nname = "t"\nshaping = { reward_clipp = 5.0 }\n')
    with pytest.raises(ConfigError, match=r"table 't': unknown shaping setting\(s\): reward_clipp"):
        load_config(path)


def test_stats_and_metrics_show_the_counts(start_server: Servers) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("m", estimator="reinforce", shaping=SHAPING)
        pushed = [make_experience(1, 0, run, reward=float(run), response=4 + 2 * run) for run in range(4)]
        client.push(pushed, table="m")  # responses of 4, 6, 8, 10 tokens: one beyond 12 - 4
        wait_computed(client, "m", 1)
        stats = client.stats("m")["m"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert stats.overlong_penalised == 1 and stats.rewards_seen == 4 and stats.advantages_seen == 4
    assert samples[("expbuf_shaping_overlong_penalised_total", (("table", "m"),))] == 1
    for step in ("reward", "advantage"):
        labels = (("step", step), ("table", "m"))
        seen, clipped = getattr(stats, f"{step}s_seen"), getattr(stats, f"{step}s_clipped")
        assert samples[("expbuf_shaping_seen_total", labels)] == seen
        assert samples[("expbuf_shaping_clipped_total", labels)] == clipped
        assert samples[("expbuf_shaping_clipped_ratio", labels)] == pytest.approx(clipped / seen)
    assert stats.advantages_clipped > 0
    assert samples[("expbuf_reward_running_mean", (("table", "m"),))] == pytest.approx(stats.reward_running_mean)
    assert samples[("expbuf_reward_running_std", (("table", "m"),))] == pytest.approx(stats.reward_running_std)


def test_a_group_whose_group_step_fails_takes_nothing_in(tmp_path: Path) -> None:
    """grpo's group step comes first: a group it cannot compute (rewards of 1e308, whose sum
    overflows) fails, and the running moments take in the other groups' values only, in
    completion order. (A push refuses such rewards now; the items go to the store directly,
    as an older release could have stored them.)"""
    rng = random.Random(6)
    good = [[make_experience(1, task, run, reward=rng.uniform(-3, 3)) for run in range(3)] for task in (0, 2)]
    huge = [trxp.from_experience(make_experience(1, 1, run, reward=0.0)) for run in range(3)]
    for run, item in enumerate(huge):
        item.meta["reward"] = 1e308 * (run < 2)
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("g", estimator="grpo", shaping={"reward_running_norm": True}))
        store.put("g", [trxp.from_experience(e) for e in good[0]] + huge + [trxp.from_experience(e) for e in good[1]])
        assert AdvantageWorker(store).run_once() == 3
        stats = store.stats("g")
        assert (stats["groups_ready"], stats["groups_failed"]) == (2, 1)
        batch = take(store, "g", num_groups=2)
        assert batch is not None
        got = {e.eid.uid: float(e.advantages[0]) for e in decode(batch.payload)}
    first, second = grpo([e.reward for e in good[0]]), grpo([e.reward for e in good[1]])
    want = {e.eid.uid: v / statistics.stdev(first) for e, v in zip(good[0], first, strict=True)}
    want |= {e.eid.uid: v / statistics.stdev(first + second) for e, v in zip(good[1], second, strict=True)}
    assert got == pytest.approx(want, abs=1e-5)
    assert stats["reward_moments"][0] == pytest.approx(statistics.fmean(first + second))
