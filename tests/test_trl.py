"""expbuf.client.trl against a real server, checked with TRL 1.16's own classes: its
RolloutSample, its `_score_group` (the advantages TRL computes itself), its queue dataset and
config; the whole AsyncGRPOTrainer runs in tests/test_trl_trainer.py."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from expbuf.client import EID, BufferClient, ExpbufError, Experience
from expbuf.client.kit.lease_keeper import LeaseKeeper
from expbuf.client.rpc.connection import DEFAULT_TIMEOUT

from conftest import Servers
from helpers import servers, wait_ready
from trl_cpu import EOS, MARKS, PAD, until


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global AsyncGRPOConfig, RolloutQueueDataset, RolloutGroup, RolloutSample, TrainingSequence
    global _AsyncRolloutLoop, ExpbufRolloutWorker, group_experiences, group_id, rollout_samples, LeaseBook
    global ack_lag, Reporter, TurnRecord, _chain_to_sequences
    import trl_cpu

    trl_cpu.import_frameworks()
    pytest.importorskip("trl")
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset
    from trl.experimental.async_grpo.async_rollout_worker import (
        RolloutGroup,
        RolloutSample,
        TrainingSequence,
        TurnRecord,
        _AsyncRolloutLoop,
        _chain_to_sequences,
    )

    from expbuf.client.trl import ExpbufRolloutWorker, group_experiences, group_id, rollout_samples
    from expbuf.client.trl.leases import LeaseBook, ack_lag
    from expbuf.client.trl.reporter import Reporter


pytestmark = pytest.mark.client_timeout(DEFAULT_TIMEOUT)  # BufferClient's own


def trl_args(tmp_path: Path, **settings: object) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, **settings)


def started(worker: ExpbufRolloutWorker, args: AsyncGRPOConfig, version: int = 1) -> ExpbufRolloutWorker:
    """The worker as AsyncGRPOTrainer starts it: train begins (its callback), the first weight
    sync sets version 1, then start()."""
    worker.callback.on_train_begin(args, None, None)
    worker.update_model_version(version)
    worker.start()
    return worker


def group(task: int, rewards: list[float], version: int, mark: int = 0) -> list[Experience]:
    """A group as TRL's GRPOTrainer holds it: a shared prompt, right-padded completions with
    their masks (a hole where a tool answered), the sampler's log-probs; each completion
    carries its own mark token."""
    completions, masks, logps = [], [], []
    for run in range(len(rewards)):
        completions.append([6, 7, MARKS + mark + run, EOS, PAD][: 4 + run % 2])
        masks.append([1, 0, 1, 1, 0][: 4 + run % 2])
        logps.append([-0.5, 0.0, -0.25 * (run + 1), -0.125, 0.0][: 4 + run % 2])
    return group_experiences(
        EID(batch="trl", task=task), [3, 4, 5], completions, rewards,
        completion_mask=masks, old_log_probs=logps, model_version=version,
    )  # fmt: skip


def trl_score(rewards: list[float]) -> list[RolloutSample]:
    """TRL's own group scoring (`_AsyncRolloutLoop._score_group`) of one group with these rewards."""
    loop = object.__new__(_AsyncRolloutLoop)
    loop.reward_funcs = [lambda **_: list(rewards)]
    loop.reward_func_names = ["given"]
    loop._env_reward_types = []
    n = len(rewards)
    sequences = [[TrainingSequence([3, 6], [0, 1], [0.0, -0.5], f"r{i}")] for i in range(n)]
    scored = RolloutGroup(
        prompts=[[]] * n, reward_kwargs={}, completions=[[]] * n, completions_ids=[[6]] * n,
        completions_sequences=sequences, tool_call_counts=[0] * n, tool_failure_counts=[0] * n, model_version=0,
        group_id=0, env_rewards=[None] * n, rollout_rewards=[None] * n,
    )  # fmt: skip
    return asyncio.run(loop._score_group(scored))


def take(worker: ExpbufRolloutWorker, count: int) -> list[RolloutSample]:
    return [worker.rollout_buffer.get(timeout=60) for _ in range(count)]


# ---- conversion ---------------------------------------------------------------------------


def test_group_experiences_takes_trls_padded_rows() -> None:
    prompt_ids = torch.tensor([[PAD, PAD, 3, 4], [PAD, 3, 4, 5]])  # left-padded
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    completion_ids = torch.tensor([[6, 7, 8, PAD, PAD], [6, 9, 10, 11, EOS]])  # right-padded
    completion_mask = torch.tensor([[1, 0, 1, 0, 0], [1, 1, 1, 1, 1]])  # a tool's token, then padding
    old = torch.tensor([[-0.5, 0.0, -0.25, 0.0, 0.0], [-1.0, -2.0, -3.0, -4.0, -5.0]])
    exps = group_experiences(
        EID(batch=7, task="q3", suffix="s"), prompt_ids, completion_ids, [1.0, 0.0],
        completion_mask=completion_mask, old_log_probs=old, prompt_mask=prompt_mask, model_version=4,
        prompt_text="t3 t4", completion_texts=["a", "b"],
    )  # fmt: skip
    assert [e.eid.uid for e in exps] == ["7/q3/0/0/s", "7/q3/1/0/s"]
    assert exps[0].tokens.tolist() == [3, 4, 6, 7, 8] and exps[0].prompt_length == 2
    assert exps[0].action_mask.tolist() == [True, False, True]
    assert exps[0].logprobs.tolist() == [-0.5, 0.0, -0.25]
    assert exps[1].tokens.tolist() == [3, 4, 5, 6, 9, 10, 11, EOS] and exps[1].prompt_length == 3
    assert [e.reward for e in exps] == [1.0, 0.0] and all(e.info == {"model_version": 4} for e in exps)
    assert (exps[1].prompt_text, exps[1].response_text) == ("t3 t4", "b")


def test_ragged_rows_keep_the_context_after_the_last_trained_token_as_trls_own_rows_do() -> None:
    """TRL's own rows of a multi-turn trace (`_chain_to_sequences`) end in context tokens the model
    did not generate (mask 0s): ragged rows are kept whole, where they were cut as padding, and
    the trainer's forwarded tokens and masked fraction came out short of TRL's own."""
    prompt = [1, 2, 3]
    turn = TurnRecord(prompt, [10, 11, 12, 13], [-0.5, -0.6, 0.0, 0.0], [1, 1, 0, 0])
    (own,), _ = _chain_to_sequences([turn], "r0", fork_threshold=8)
    at = len(prompt)
    (exp,) = group_experiences(
        EID(batch=0, task=0), [prompt], [own.input_ids[at:]], [1.0],
        completion_mask=[own.completion_mask[at:]], old_log_probs=[own.old_log_probs[at:]], model_version=0,
    )  # fmt: skip
    exp.advantages = exp.action_mask.float()
    (sample,) = rollout_samples([exp], ["g"])
    assert sample.input_ids.tolist() == own.input_ids
    assert sample.completion_mask.tolist() == own.completion_mask
    assert sample.old_log_probs.tolist() == pytest.approx(own.old_log_probs)
    (short,) = group_experiences(  # log-probs up to the last trained token: 0 over the context after it
        EID(batch=0, task=0), [prompt], [own.input_ids[at:]], [1.0],
        completion_mask=[own.completion_mask[at:]], old_log_probs=[own.old_log_probs[at : at + 2]],
    )  # fmt: skip
    assert short.tokens.tolist() == own.input_ids and short.logprobs.tolist() == pytest.approx([-0.5, -0.6, 0, 0])


def test_rollout_samples_are_trls_layout_of_an_experience() -> None:
    exps = group(0, [1.0, 0.0, 0.5], version=3)
    for exp in exps:
        exp.advantages = exp.action_mask.float() * 0.75
        exp.metrics = {"len": 4.0}
    samples = rollout_samples(exps, ["trl/0"] * 3)
    first = samples[0]
    assert first.input_ids.tolist() == [3, 4, 5, 6, 7, MARKS, EOS]
    assert first.completion_mask.tolist() == [0, 0, 0, 1, 0, 1, 1]
    assert first.old_log_probs.tolist() == [0.0, 0.0, 0.0, -0.5, 0.0, -0.25, -0.125]
    assert (first.advantage, first.model_version, first.group_id) == (0.75, 3, group_id("trl/0"))
    assert first.metrics == {"len": 4.0, "reward": 1.0, "reward_std": pytest.approx(0.408248290463863)}


def test_refusals_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="rewards has 1 rows for 2 completions"):
        group_experiences(EID(), [3], [[6], [7]], [1.0])
    with pytest.raises(ValueError, match="completion 0: completion_mask has 1 values for 2 tokens"):
        group_experiences(EID(), [3], [[6, 7]], [1.0], completion_mask=[[1]])
    exp = group(0, [1.0], version=0)[0]
    exp.advantages = exp.action_mask.float()
    no_logps = Experience(tokens=exp.tokens, eid=exp.eid, prompt_length=3, advantages=exp.advantages, info=exp.info)
    with pytest.raises(ValueError, match=f"experience {exp.eid}: no logprobs"):
        rollout_samples([no_logps], ["g"])
    exp.info = {}
    with pytest.raises(ValueError, match=r"info\['model_version'\] is None"):
        rollout_samples([exp], ["g"])
    exp.info = {"model_version": 0}
    exp.advantages = torch.arange(exp.advantages.numel(), dtype=torch.float32) * exp.action_mask
    with pytest.raises(ValueError, match="differ from token to token"):
        rollout_samples([exp], ["g"])


def test_group_ids_are_stable_and_distinct() -> None:
    ids = {group_id(f"trl/{task}") for task in range(10_000)}
    assert len(ids) == 10_000 and all(0 <= i < 2**63 for i in ids)
    assert group_id("trl/1") == group_id("trl/1")


# ---- the worker against a server ----------------------------------------------------------


@pytest.mark.parametrize("estimator", ["rec", "grpo"])
def test_the_advantage_is_the_tables_and_trls_own(client: BufferClient, tmp_path: Path, estimator: str) -> None:
    """`rec` with std_normalize and epsilon 1e-8 is TRL's `_score_group` (population std); the
    default `grpo` (unbiased std, epsilon 1e-6) is the table's formula."""
    params = {"std_normalize": "true", "epsilon": 1e-8} if estimator == "rec" else {}
    client.create_table("g", group_size=4, estimator=estimator, estimator_params=params)
    rewards = {0: [1.0, 0.0, 0.0, 1.0], 1: [0.5, 2.0, -1.0, 0.25], 2: [3.0, 3.0, 3.0, 3.0]}
    for task, rs in rewards.items():
        client.push(group(task, rs, version=1, mark=4 * task), table="g")
    worker = started(ExpbufRolloutWorker(client, "g", num_groups=3, wait_seconds=0.5), trl_args(tmp_path))
    try:
        samples = take(worker, 12)
    finally:
        worker.stop()
    by_group = defaultdict(list)
    for sample in samples:
        by_group[sample.group_id].append(sample)
    for task, rs in rewards.items():
        got = sorted(by_group[group_id(f"trl/{task}")], key=lambda s: int(s.input_ids[5]))  # by mark: run order
        r = torch.tensor(rs, dtype=torch.float64)
        if estimator == "rec":
            theirs = trl_score(rs)
            assert [s.advantage for s in got] == pytest.approx([s.advantage for s in theirs], abs=1e-6)
            assert [s.metrics["reward_std"] for s in got] == pytest.approx([s.metrics["reward_std"] for s in theirs])
        want = (r - r.mean()) / (r.std(unbiased=estimator == "grpo") + (1e-6 if estimator == "grpo" else 1e-8))
        assert [s.advantage for s in got] == pytest.approx(want.tolist(), abs=1e-6)
        assert [s.metrics["reward"] for s in got] == rs
        assert all(s.model_version == 1 for s in got)


def test_stale_groups_stay_in_the_table_and_trls_queue_drops_what_went_stale(
    client: BufferClient, tmp_path: Path
) -> None:
    """The worker leases only groups within max_staleness of the trainer's version (the rest
    stay, for `evict_stale` or a replay); TRL's RolloutQueueDataset drops a queued sample whose
    version fell behind while it waited, by the version the worker put on it."""
    client.create_table("s", group_size=2)
    for version in range(6):
        client.push(group(version, [1.0, 0.0], version=version, mark=2 * version), table="s")
    args = trl_args(tmp_path, max_staleness=2)
    worker = started(ExpbufRolloutWorker(client, "s", num_groups=8, wait_seconds=0.5), args, version=5)
    try:
        assert until(lambda: worker.rollout_buffer.qsize() == 6)  # versions 3, 4 and 5
        live = client.list_experiences("s").experiences
        assert sorted(e.model_version for e in live if e.state == "ready") == [0, 0, 1, 1, 2, 2]
        version = 6  # the trainer moved on: version 3 is now 3 behind
        worker.update_model_version(version)
        metrics: dict[str, list[float]] = defaultdict(list)
        dataset = RolloutQueueDataset(
            worker.rollout_buffer, lambda: version, worker.check_health, 60, metrics, max_staleness=2
        )
        kept = list(itertools.islice(dataset, 4))
        assert sum(metrics["sample/dropped_stale_total"]) == 2
        assert {s["group_id"] for s in kept} == {group_id("trl/4"), group_id("trl/5")}
        assert until(lambda: client.stats("s")["s"].trainer_version == 6)
    finally:
        worker.stop()


def test_stop_gives_back_every_batch_not_yet_due(client: BufferClient, tmp_path: Path) -> None:
    client.create_table("b", group_size=2)
    for task in range(3):
        client.push(group(task, [1.0, 0.0], version=1, mark=2 * task), table="b")
    worker = started(ExpbufRolloutWorker(client, "b", num_groups=1, wait_seconds=0.5), trl_args(tmp_path))
    take(worker, 3)  # a lease and a half taken, nothing trained yet
    assert client.stats("b")["b"].leased > 0
    worker.stop()
    stats = client.stats("b")["b"]
    assert (stats.leased, stats.ready, stats.consumed) == (0, 6, 0)


def test_a_lease_is_acked_once_the_steps_that_trained_it_ended(client: BufferClient, tmp_path: Path) -> None:
    """With one micro-batch per step, a batch whose last sample was taken during step 1 is
    acked at the end of step 3 (leases.py); with two, at the end of step 2."""
    client.create_table("a", group_size=2)
    for task in range(2):
        client.push(group(task, [1.0, 0.0], version=1, mark=2 * task), table="a")
    worker = started(ExpbufRolloutWorker(client, "a", num_groups=2, wait_seconds=0.5), trl_args(tmp_path))
    try:
        take(worker, 4)
        for step in (1, 2):
            worker.callback.on_step_end(None, None, None)
            assert until(lambda: worker.reporter.pending() == 0)
            assert client.stats("a")["a"].consumed == 0, f"acked at the end of step {step}"
        worker.callback.on_step_end(None, None, None)
        assert until(lambda: client.stats("a")["a"].consumed == 4)
    finally:
        worker.stop()
    assert [ack_lag(1), ack_lag(2), ack_lag(8)] == [3, 2, 2]


def test_leases_are_kept_through_a_step_longer_than_they_last(client: BufferClient, tmp_path: Path) -> None:
    client.create_table("r", group_size=2)
    for task in range(2):
        client.push(group(task, [1.0, 0.0], version=1, mark=2 * task), table="r")
    worker = ExpbufRolloutWorker(client, "r", num_groups=2, wait_seconds=0.5, lease_seconds=6)
    started(worker, trl_args(tmp_path))
    try:
        take(worker, 4)
        (batch,) = worker.book.held()
        first = batch.lease_expires
        renewed = lambda: (worker.leases.expires(batch.lease_id) or 0) > first + 6  # noqa: E731
        assert until(renewed), "the lease was not renewed twice"
        stats = client.stats("r")["r"]
        assert (stats.leased, stats.ready) == (4, 0)
        for _ in range(3):
            worker.callback.on_step_end(None, None, None)
        assert until(lambda: client.stats("r")["r"].consumed == 4)
    finally:
        worker.stop()


def test_the_lease_book_waits_for_the_last_sample_of_a_lease(client: BufferClient) -> None:
    client.create_table("l", group_size=2)
    client.push(group(0, [1.0, 0.0], version=1), table="l")
    batch = next(client.sample("l", num_groups=1, timeout=10, max_batches=1))
    book = LeaseBook(lag=2)
    book.hold(batch, 2)
    book.taken(batch.lease_id, None)
    assert [book.step_ended() for _ in range(3)] == [[], [], []]  # one sample still queued
    book.taken(batch.lease_id, None)
    assert book.step_ended() == []
    assert book.step_ended() == [batch] and book.held() == []
    batch.ack()


def test_update_model_version_sets_the_tables_trainer_version(client: BufferClient, tmp_path: Path) -> None:
    client.create_table("v", group_size=2)
    worker = started(ExpbufRolloutWorker(client, "v", wait_seconds=0.5), trl_args(tmp_path))
    try:
        assert until(lambda: client.stats("v")["v"].trainer_version == 1)
        worker.update_model_version(7)
        assert until(lambda: client.stats("v")["v"].trainer_version == 7)
    finally:
        worker.stop()


def test_check_health_is_the_servers(start_server: Servers, tmp_path: Path) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=2, retries=0) as client:
        client.create_table("h", group_size=2)
        worker = started(ExpbufRolloutWorker(client, "h", wait_seconds=0.5), trl_args(tmp_path))
        try:
            worker.check_health(60)
            server.stop(grace=1)
            worker.check_health(3600)  # down for less than that: waited out
            with pytest.raises(RuntimeError, match=rf"expbuf at 127.0.0.1:{server.port} has not answered for"):
                worker.check_health(0)
        finally:
            worker.stop()


def stopped(worker: ExpbufRolloutWorker) -> bool:
    """Whether the worker stopped on a failure (check_health says so)."""
    try:
        worker.check_health(3600)
    except RuntimeError:
        return True
    return False


def test_a_failure_stops_the_worker_and_check_health_says_why(client: BufferClient, tmp_path: Path) -> None:
    client.create_table("f", group_size=2)
    worker = started(ExpbufRolloutWorker(client, "f", wait_seconds=0.5), trl_args(tmp_path))

    try:
        client.drop_table("f")
        assert until(lambda: stopped(worker))
        with pytest.raises(RuntimeError, match=r"the expbuf rollout worker stopped: .*'f'"):
            worker.check_health(3600)
    finally:
        worker.stop()


def test_a_worker_whose_client_was_closed_under_it_stops_saying_so(target: str, tmp_path: Path) -> None:
    """A client closed under a running worker refuses every call (ExpbufError CANCELLED, naming it):
    the worker took that for a passing error and sampled, and reported, on and on (a review)."""
    given = BufferClient(target, timeout=10)
    given.create_table("c", group_size=2)
    worker = started(ExpbufRolloutWorker(given, "c", wait_seconds=0.5), trl_args(tmp_path))

    try:
        given.close()
        assert until(lambda: stopped(worker))
        with pytest.raises(RuntimeError, match="the expbuf rollout worker stopped: CANCELLED"):
            worker.check_health(3600)
    finally:
        worker.stop()


def test_what_the_worker_refuses(client: BufferClient) -> None:
    with pytest.raises(ValueError, match="table 'nope' does not exist"):
        ExpbufRolloutWorker(client, "nope")
    client.create_table("tok", group_size=2, estimator="reinforceplusplus")
    with pytest.raises(ValueError, match="estimator reinforceplusplus, whose advantages differ from token to token"):
        ExpbufRolloutWorker(client, "tok")
    client.create_table("ok", group_size=2)
    with pytest.raises(RuntimeError, match=r"pass callbacks=\[worker.callback\]"):
        ExpbufRolloutWorker(client, "ok").start()


def test_a_ledger_prompt_names_the_group(client: BufferClient) -> None:
    client.create_table("p", group_size=2)
    client.create_dataset("p", "math", 4)
    (prompt,) = client.claim("p", "math", 1).prompts
    exps = group_experiences(prompt, [3, 4], [[6, EOS], [7, EOS]], [1.0, 0.0], old_log_probs=[[-1.0, -1.0]] * 2)
    assert [e.eid.uid for e in exps] == [prompt.eid(0).uid, prompt.eid(1).uid]
    client.push(exps, table="p")
    assert client.ledger("p", "math").total("generated") == 1


def test_a_batch_given_back_while_the_server_is_away_is_given_back_once_it_is_back(tmp_path: Path) -> None:
    """A broken stream's batch goes back when the server answers again, not at its lease's end."""
    data = str(tmp_path / "data")
    with servers() as start:
        server = start(data)
        port = server.port
        with BufferClient(server.target, timeout=5) as client:
            client.create_table("g", group_size=2)
            client.push(group(0, [1.0, 0.0], version=1), table="g")
            wait_ready(client, "g", 2)  # computed once the child's torch, which the push asked for, loads
            (batch,) = client.sample("g", num_groups=1, max_batches=1, timeout=10, lease_seconds=300)
            keeper = LeaseKeeper(client, "g", 300)
            failures: list[ExpbufError] = []
            reporter = Reporter(
                client, "g", keeper, answered=lambda: None, failed=failures.append, metric=lambda *_: None
            )
            server.proc.kill()
            server.proc.wait(30)
            reporter.give_back([batch])
            reporter.round()  # the server is away: the give-back waits for the next round
            assert reporter.pending() == 1
            start(data, "--port", str(port))
            assert until(lambda: (reporter.round(), reporter.pending())[1] == 0, 30)
            stats = client.stats("g")["g"]
            assert (stats.leased, stats.ready) == (0, 2) and not failures
            keeper.close()


def test_a_restart_as_training_ends_leaves_no_trained_batch_unacked(start_server: Servers, tmp_path: Path) -> None:
    """The server goes away as the last step ends, for 1.5 s: TRL's `finally` stops the worker, whose
    last round's ack failed and was never made again, so the trained groups' lease ran out and they
    were served again. stop() now makes its rounds again while acks are left and the server is
    unavailable, for the client's timeout."""
    server = start_server()
    port = server.port
    client = BufferClient(f"127.0.0.1:{port}", timeout=10)
    client.create_table("a", group_size=2)
    for task in range(2):
        client.push(group(task, [1.0, 0.0], version=1, mark=2 * task), table="a")
    worker = started(ExpbufRolloutWorker(client, "a", num_groups=2, wait_seconds=0.5), trl_args(tmp_path))
    take(worker, 4)
    for _ in range(2):
        worker.callback.on_step_end(None, None, None)
    start_server.stop(server)
    restarted = []
    back = threading.Timer(1.5, lambda: restarted.append(start_server(port=port)))
    back.start()
    try:
        worker.callback.on_step_end(None, None, None)  # step 3: the batch is due, its ack queued
        worker.callback.on_train_end(None, None, None)
        worker.stop()  # TRL's finally
    finally:
        back.join()
    assert worker.reporter.pending() == 0
    assert client.stats("a")["a"].consumed == 4
    client.close()
