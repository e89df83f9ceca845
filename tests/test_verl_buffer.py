"""ExpbufReplayBuffer driven by verl's own loader and sampling, on a real TransferQueue (a local
Ray cluster) and a real `expbuf serve` on loopback (skipped where verl or transferqueue is absent)."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from expbuf.client import EID, BufferClient, Experience, TableStats
from expbuf.server.config import load

from helpers import Beside, ServerProcess
from pages import code_blocks, page
from test_verl import agent_loop_rows, dispatch


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global verl, tq, ray, compose, initialize_config_dir, DictConfig, OmegaConf, TensorDict, KVBatchMeta
    global ReplayBufferAsync, PPOTrainer, get_trainer_cls, list_of_dict_to_tensordict, ExpbufExternalTrainer
    global ExpbufReplayBuffer, from_verl, put_rows, rows_of
    import test_verl

    test_verl.import_frameworks()
    verl = pytest.importorskip("verl")
    tq = pytest.importorskip("transfer_queue")
    import ray
    from hydra import compose, initialize_config_dir
    from omegaconf import DictConfig, OmegaConf
    from tensordict import TensorDict
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer, get_trainer_cls
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from expbuf.client.verl import ExpbufExternalTrainer, ExpbufReplayBuffer, from_verl
    from expbuf.client.verl.rows import put_rows, rows_of


TRAIN = "train"


@pytest.fixture(scope="module")
def transfer_queue(ray_cluster: ModuleType) -> Iterator[None]:
    """A real TransferQueue (controller and one storage unit as Ray actors on the session's cluster)."""
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield
    tq.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(str(tmp_path_factory.mktemp("verl-data")))
    try:
        yield proc
    finally:
        proc.stop(signal.SIGTERM)


@pytest.fixture
def client(server: ServerProcess) -> Iterator[BufferClient]:
    with BufferClient(server.target) as c:
        yield c


OPEN: list[ExpbufReplayBuffer] = []
CHILDREN: list[BaseProcess] = []


@pytest.fixture(autouse=True)
def empty_queue(transfer_queue: None) -> Iterator[None]:
    """Each test starts with an empty train partition; the buffers and child trainers it started
    are closed and ended after it."""
    yield
    while OPEN:
        OPEN.pop().close()
    while CHILDREN:
        child = CHILDREN.pop()
        if child.exitcode is None:
            child.kill()
            child.join(30)
    keys = list((tq.kv_list(TRAIN) or {}).get(TRAIN, {}))
    if keys:
        tq.kv_clear(keys=keys, partition_id=TRAIN)


def build(target: str, table: str, threshold: int | None = 2, **expbuf: object) -> ExpbufReplayBuffer:
    """The replay buffer as verl's own PPOTrainer._build_replay_buffer makes it from its config."""
    config = OmegaConf.create(
        {
            "trainer": {
                "v1": {
                    "trainer_mode": "colocate_async",
                    "colocate_async": {"parameter_sync_step": 1},
                    "sampler": {
                        "custom_sampler": {"path": "pkg://expbuf.client.verl", "name": "ExpbufReplayBuffer"},
                        "max_off_policy_threshold": threshold,
                        "max_off_policy_strategy": "drop",
                        "sampler_kwargs": {"expbuf": {"target": target, "table": table, **expbuf}},
                    },
                }
            }
        }
    )
    trainer = SimpleNamespace(config=config, trainer_mode="colocate_async", _add_prompts_to_generate=lambda n: n)
    buffer = PPOTrainer._build_replay_buffer(trainer)
    assert type(buffer) is ExpbufReplayBuffer and isinstance(buffer, ReplayBufferAsync)
    buffer.poll_interval = 0.2
    OPEN.append(buffer)
    return buffer


def wait_for(check: Callable[[], bool], what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stats(client: BufferClient, table: str) -> TableStats:
    return client.stats(table)[table]


def group_rows(uid: str) -> list:
    listing = tq.kv_list(TRAIN)[TRAIN]
    return rows_of(TRAIN, sorted(k for k in listing if k.startswith(uid + "_")), listing)


def step_end(meta: KVBatchMeta) -> None:
    """What verl's fit loop does once a step has trained its batch."""
    tq.kv_clear(keys=meta.keys, partition_id=meta.partition_id)


def test_mirror_pushes_finished_groups_retires_trained_ones_and_restores_after_a_crash(
    server: ServerProcess, client: BufferClient
) -> None:
    client.create_table("verl_mirror", group_by="task", group_size=0, estimator="none")
    buffer = build(server.target, "verl_mirror")
    first = [dispatch(1), dispatch(1)]
    expected = {uid: from_verl(group_rows(uid)) for uid in first}
    wait_for(lambda: stats(client, "verl_mirror").groups_ready == 2, "both groups pushed once finished")
    assert stats(client, "verl_mirror").pushed == 6

    again = build(server.target, "verl_mirror")  # a second process seeing the same groups: pushes are duplicates
    again.sync_once()
    after = stats(client, "verl_mirror")
    assert (after.pushed, after.duplicates, after.groups_ready) == (6, 6, 2)
    again.close()

    meta, _ = buffer.sample(global_steps=1, partition_id=TRAIN, batch_size=2)
    assert {k.split("_")[0] for k in meta.keys} == set(first) and len(meta.keys) == 6
    for uid, exps in expected.items():
        stored = client.get([e.eid.uid for e in exps], "verl_mirror")
        assert not stored.missing_uids
        for want, got in zip(exps, stored, strict=True):
            assert got.eid.tid == f"verl/{uid}"
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.action_mask, want.action_mask)
            assert got.info["model_version"] == 0 and got.reward == want.reward
    wait_for(lambda: stats(client, "verl_mirror").trainer_version == 1, "the trainer version")

    step_end(meta)  # trained: the mirror deletes them from expbuf
    wait_for(lambda: stats(client, "verl_mirror").groups_ready == 0, "trained groups retired")

    second = [dispatch(2), dispatch(2)]
    rows_before = {uid: group_rows(uid) for uid in second}
    wait_for(lambda: stats(client, "verl_mirror").groups_ready == 2, "finished groups pushed before sampling")
    buffer.close()
    keys = list(tq.kv_list(TRAIN)[TRAIN])
    tq.kv_clear(keys=keys, partition_id=TRAIN)  # the crash: TransferQueue's memory is gone

    restarted = build(server.target, "verl_mirror")
    meta, _ = restarted.sample(global_steps=2, partition_id=TRAIN, batch_size=2)
    assert {k.split("_")[0] for k in meta.keys} == set(second)
    after = stats(client, "verl_mirror")
    assert (after.groups_ready, after.groups_leased) == (2, 0)  # read back, not leased: a crash now loses none
    for uid, rows in rows_before.items():
        back = group_rows(uid)
        assert [r.key for r in back] == [r.key for r in rows]
        for want, got in zip(rows, back, strict=True):
            for name in ("prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores", "input_ids"):
                assert torch.equal(got.fields[name], want.fields[name]), name
            assert got.fields["raw_prompt"] == want.fields["raw_prompt"]
            assert got.fields["extra_fields"] == want.fields["extra_fields"]
    step_end(meta)
    wait_for(lambda: stats(client, "verl_mirror").groups_ready == 0, "restored groups retired once trained")

    stale, fresh = dispatch(1), dispatch(4)  # at step 4 a group dispatched at step 1 spans 4 > 2 versions
    wait_for(lambda: stats(client, "verl_mirror").groups_ready == 2, "both pushed")
    meta, metrics = restarted.sample(global_steps=4, partition_id=TRAIN, batch_size=1)
    assert {k.split("_")[0] for k in meta.keys} == {fresh} and metrics["training/off_policy/evicted_samples"] == 1
    wait_for(lambda: stats(client, "verl_mirror").groups_ready == 1, "the group verl evicted leaves expbuf")
    assert client.get([f"verl/{stale}/0/0/0"], "verl_mirror").missing_uids == [f"verl/{stale}/0/0/0"]
    restarted.close()


def test_a_trained_group_pushed_again_after_a_restart_is_a_duplicate(
    server: ServerProcess, client: BufferClient
) -> None:
    """verl restarts from a checkpoint saved before the step that trained a group: TransferQueue holds
    the group again, finished, and the restarted mirror pushes it. The mirror retired it as trained, so
    expbuf keeps its tombstones and the push is a duplicate: no second copy is held or restored."""
    client.create_table("verl_repush", group_by="task", group_size=0, estimator="none")
    buffer = build(server.target, "verl_repush")
    uid = dispatch(1)
    wait_for(lambda: stats(client, "verl_repush").groups_ready == 1, "the finished group pushed")
    rows = group_rows(uid)
    meta, _ = buffer.sample(global_steps=1, partition_id=TRAIN, batch_size=1)
    step_end(meta)  # trained
    wait_for(lambda: stats(client, "verl_repush").groups_ready == 0, "the trained group retired")
    assert stats(client, "verl_repush").consumed == 3  # retired as trained, its tombstones kept
    buffer.close()

    put_rows(TRAIN, rows)  # the checkpoint from before that step brings it back
    tag = {"is_prompt": True, "status": "finished", "global_steps": 1}
    tq.kv_batch_put(keys=[uid], partition_id=TRAIN, tags=[tag])
    restarted = build(server.target, "verl_repush")
    restarted.sync_once()
    after = stats(client, "verl_repush")
    assert (after.pushed, after.duplicates, after.groups_ready) == (3, 3, 0)
    meta, _ = restarted.sample(global_steps=1, partition_id=TRAIN, batch_size=1)  # verl trains it again, once
    assert {key.split("_")[0] for key in meta.keys} == {uid}
    step_end(meta)
    restarted.sync_once()
    assert stats(client, "verl_repush").groups_ready == 0


def explorer_group(task: str, version: int, rewards: list[float]) -> list[Experience]:
    """A group as a Trinity explorer pushes it (eid batch/task/run)."""
    return [
        Experience(
            tokens=torch.tensor([5, 6, 7, 8 + run, 9]),
            eid=EID("explore", task, run, 0, f"s{run}"),
            prompt_length=2,
            reward=reward,
            logprobs=torch.tensor([-0.1, -0.2, -0.3]),
            action_mask=torch.tensor([True, False, True]),
            info={"model_version": version},
        )
        for run, reward in enumerate(rewards)
    ]


def test_source_leases_fresh_whole_groups_into_transfer_queue_and_acks_after_the_step(
    server: ServerProcess, client: BufferClient, caplog: pytest.LogCaptureFixture
) -> None:
    client.create_table("verl_source", group_by="task", group_size=2, estimator="grpo", max_staleness=1)
    client.set_trainer_version(4, "verl_source")  # all three fresh when pushed; at step 6 one is stale
    client.push(explorer_group("stale", 4, [0.0, 1.0]), "verl_source")
    client.push(explorer_group("a", 5, [0.0, 1.0]), "verl_source")
    client.push(explorer_group("b", 6, [1.0, 0.0]), "verl_source")
    with caplog.at_level(logging.WARNING):
        build(server.target, "verl_source", threshold=3, mode="source").close()
    assert "max_off_policy_threshold = 2" in caplog.text
    buffer = build(server.target, "verl_source", threshold=2, mode="source")

    meta, _ = buffer.sample(global_steps=6, partition_id=TRAIN, batch_size=2)
    assert isinstance(meta, KVBatchMeta) and meta.partition_id == TRAIN
    assert {k.split("_")[0] for k in meta.keys} == {"explore/a", "explore/b"}  # the stale group is not taken
    assert sorted(k.rsplit("_", 2)[1] for k in meta.keys) == ["0", "0", "1", "1"]
    assert all(t["min_global_steps"] in (5, 6) for t in meta.tags)
    data = tq.kv_batch_get(keys=meta.keys, partition_id=TRAIN)
    for name in ("prompts", "responses", "input_ids", "response_mask", "rollout_log_probs", "rm_scores", "advantages"):
        assert name in data, name
    rows = rows_of(TRAIN, meta.keys, dict(zip(meta.keys, meta.tags, strict=True)))
    for row in rows:
        assert row.fields["response_mask"].tolist() == [1, 0, 1]
        reward = row.fields["rm_scores"][-1].item()
        sign = 1.0 if reward > 0 else -1.0
        assert row.fields["advantages"][0].item() * sign > 0  # GRPO: above the group mean is positive
        assert row.fields["advantages"][1].item() == 0.0  # zero where the mask is
    assert stats(client, "verl_source").groups_leased == 2

    step_end(meta)
    wait_for(lambda: stats(client, "verl_source").groups_leased == 0, "leases acked after the step")
    assert stats(client, "verl_source").groups_ready == 1  # only the stale group is left
    buffer.close()


def test_source_leases_last_while_the_trainer_lives_and_go_back_when_it_closes(
    server: ServerProcess, client: BufferClient, caplog: pytest.LogCaptureFixture
) -> None:
    client.create_table("verl_renew", group_by="task", group_size=2, estimator="grpo")
    for task in ("a", "b", "c"):
        client.push(explorer_group(task, 1, [0.0, 1.0]), "verl_renew")
    buffer = build(server.target, "verl_renew", threshold=None, mode="source", lease_seconds=2)
    ended, trained, _ = (buffer.sample(global_steps=1, partition_id=TRAIN, batch_size=1)[0] for _ in range(3))
    time.sleep(5.0)  # two and a half leases; the server's lease upkeep runs every 0.5 s
    after = stats(client, "verl_renew")
    assert (after.groups_leased, after.leases_expired) == (3, 0)  # renewed: a long step keeps its groups

    # A lease that ended before its step did (the server out of reach for a whole lease; the lease id
    # is the buffer's alone) is said, and holds back neither the round nor the other leases.
    (lease,) = [lease for lease, keys in buffer._source_leases.items() if keys == set(ended.keys)]
    client.nack(lease, "verl_renew")
    with caplog.at_level(logging.ERROR):
        step_end(ended)
        step_end(trained)
        buffer.sync_once()
    assert f"lease {lease} ended before it was " in caplog.text  # acknowledged, or renewed: whichever came first
    after = stats(client, "verl_renew")
    assert (after.groups_leased, after.groups_ready, after.consumed) == (1, 1, 2)

    buffer.close()  # the third step never ended: its group goes back now
    after = stats(client, "verl_renew")
    assert (after.groups_leased, after.groups_ready, after.leases_expired) == (0, 2, 0)


def test_a_restart_as_training_ends_leaves_no_trained_step_unacked(tmp_path: Path) -> None:
    """The server goes away as the last step ends, for 1.5 s, and the trainer closes the buffer: its
    last round failed and close() gave back every lease, the trained step's too (or, that failing
    as well, left it to run out), so the trained group was served again. close() now makes its
    last round again while the server is unavailable, for the client's timeout."""
    data = str(tmp_path / "data")
    first = ServerProcess(data)
    port = first.port
    with BufferClient(first.target) as admin:
        admin.create_table("verl_close", group_by="task", group_size=2, estimator="grpo")
        admin.push(explorer_group("a", 1, [0.0, 1.0]), "verl_close")
    buffer = build(first.target, "verl_close", threshold=None, mode="source")
    meta, _ = buffer.sample(global_steps=1, partition_id=TRAIN, batch_size=1)
    assert first.stop(signal.SIGTERM) == 0, "".join(first.log)
    step_end(meta)  # trained: verl clears the step's keys
    restarted: list[ServerProcess] = []
    back = threading.Timer(1.5, lambda: restarted.append(ServerProcess(data, "--port", str(port))))
    back.start()
    try:
        buffer.close()
    finally:
        back.join()
    try:
        with BufferClient(restarted[0].target) as admin:
            after = stats(admin, "verl_close")
        assert (after.consumed, after.groups_leased, after.groups_ready) == (2, 0, 0), after
    finally:
        assert restarted[0].stop(signal.SIGTERM) == 0


def test_a_sample_waiting_for_groups_rides_out_a_server_restart(tmp_path: Path) -> None:
    """In source mode a sample waiting for groups met a server that restarts (away 1.5 s): it raised
    UnavailableError, which ended verl's training loop, where Trinity's reader waits (a helper's
    audit). The lease is asked for again while the server is away, for the client's timeout."""
    data = str(tmp_path / "data")
    first = ServerProcess(data)
    port = first.port
    with BufferClient(first.target) as admin:
        admin.create_table("verl_wait", group_by="task", group_size=2, estimator="grpo")
    buffer = build(first.target, "verl_wait", threshold=None, mode="source")
    restarted: list[ServerProcess] = []

    def away_then_back() -> None:
        assert first.stop(signal.SIGTERM) == 0, "".join(first.log)
        time.sleep(1.5)
        restarted.append(ServerProcess(data, "--port", str(port)))
        # once it is reached: a new channel shares the buffer's, in its reconnect backoff
        with BufferClient(restarted[0].target, wait_for_ready=True) as admin:
            admin.push(explorer_group("a", 1, [0.0, 1.0]), "verl_wait")

    back = Beside(away_then_back, delay=0.5)  # the sample waiting for groups by then
    back.start()
    try:
        meta, _ = buffer.sample(global_steps=1, partition_id=TRAIN, batch_size=1)
        assert {key.split("_")[0] for key in meta.keys} == {"explore/a"}
        step_end(meta)
        buffer.close()
    finally:
        back.join()
        for proc in restarted:
            assert proc.stop(signal.SIGTERM) == 0


def test_source_gives_each_group_of_a_table_grouped_finer_than_by_task_its_own_uid(
    server: ServerProcess, client: BufferClient
) -> None:
    """A table grouped by step holds one group per step of a task (its runs at that step): verl's
    GRPO groups by uid, so each leased group is one uid, and a group leased while another of its
    task is still in TransferQueue neither joins it nor overwrites its keys."""
    client.create_table("verl_steps", group_by="step", group_size=2, estimator="grpo")
    for task in ("a", "b"):
        client.push(
            [
                Experience(
                    tokens=torch.tensor([5, 6, 7, 8 + run, 9]), eid=EID("explore", task, run, step, "0"),
                    prompt_length=2, reward=float(run == step), info={"model_version": 1},
                )
                for step in (0, 1) for run in (0, 1)
            ],
            "verl_steps",
        )  # fmt: skip
    buffer = build(server.target, "verl_steps", threshold=None, mode="source")
    both, _ = buffer.sample(global_steps=1, partition_id=TRAIN, batch_size=2)
    first, _ = buffer.sample(global_steps=1, partition_id=TRAIN, batch_size=1)
    second, _ = buffer.sample(global_steps=1, partition_id=TRAIN, batch_size=1)
    metas, back = (both, first, second), []
    assert len({key for meta in metas for key in meta.keys}) == 8  # no key written twice
    assert len(tq.kv_list(TRAIN)[TRAIN]) == 8
    for meta in metas:
        rows = rows_of(TRAIN, meta.keys, dict(zip(meta.keys, meta.tags, strict=True)))
        groups: dict[str, set[str]] = {}
        for row in rows:
            groups.setdefault(row.fields["uid"], set()).add(row.fields["expbuf"]["eid"]["step"])
        assert len(groups) == len(meta.keys) // 2 and all(len(steps) == 1 for steps in groups.values()), groups
        assert all(len([r for r in rows if r.fields["uid"] == uid]) == 2 for uid in groups)
        back.extend(exp.eid.uid for exp in from_verl(rows))
    assert sorted(back) == sorted(f"explore/{t}/{run}/{step}/0" for t in "ab" for run in (0, 1) for step in (0, 1))
    for meta in metas:
        step_end(meta)
    wait_for(lambda: stats(client, "verl_steps").consumed == 8, "every lease acked after its step")
    buffer.close()


def test_a_missing_table_or_a_mirror_table_that_groups_otherwise_is_refused(
    server: ServerProcess, client: BufferClient, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        build(server.target, "no_such_table")
    client.create_table("by_run", group_by="run", group_size=2)
    with pytest.raises(ValueError, match="group_by = 'task' and group_size = 0"):
        build(server.target, "by_run")


# The child trainers are forked from one process that has imported what they run, not started anew
# (some 8 s each of verl, Ray and TransferQueue). Python 3.11's forkserver does not take this
# folder onto its path, so it preloads the installed packages; each child imports
# verl_trainer_child itself (0.2 s).
TRAINERS = multiprocessing.get_context("forkserver")
PRELOAD = [
    "ray",
    "transfer_queue",
    "expbuf.client.verl",
    "verl.trainer.ppo.ray_trainer",
    "verl.trainer.ppo.v1.trainer_base",
]


def run_trainer(server: ServerProcess, table: str, log: Path, *steps: int) -> BaseProcess:
    """The child trainer (tests/verl_trainer_child.py) on this cluster's TransferQueue."""
    import verl_trainer_child  # here: it imports this module

    TRAINERS.set_forkserver_preload(PRELOAD)  # before the first start, which starts the forkserver
    gcs = ray.get_runtime_context().gcs_address
    args = (gcs, server.target, table, steps, str(log), str(log.with_suffix(".err")))
    child = TRAINERS.Process(target=verl_trainer_child.run, args=args)
    child.start()
    CHILDREN.append(child)
    return child


def exit_code(child: BaseProcess, seconds: float) -> int | None:
    """The child's exit status once it has ended, None if it runs still after `seconds`."""
    child.join(seconds)
    return child.exitcode


def child_log(log: Path) -> str:
    return log.with_suffix(".err").read_text()[-3000:]


def kill_when_ready(child: BaseProcess, log: Path) -> dict[str, list[str]]:
    """SIGKILL the child trainer at its kill point; what its log says, by kind of line."""
    wait_for(lambda: (log.exists() and "ready" in log.read_text()) or child.exitcode is not None, "the kill point", 120)
    assert child.exitcode is None, child_log(log)
    child.kill()
    assert exit_code(child, 30) == -signal.SIGKILL
    return logged(log)


def logged(log: Path) -> dict[str, list[str]]:
    """The child trainer's log: the uids of its `trained`, `pushed` and `sampled` lines."""
    lines = [line.split() for line in log.read_text().split("\n")]
    return {
        kind: [words[1] for words in lines if words and words[0] == kind] for kind in ("trained", "pushed", "sampled")
    }


def lose_transfer_queue() -> None:
    """TransferQueue's memory dies with the trainer (verl's checkpoint holds none of these keys)."""
    keys = list((tq.kv_list(TRAIN) or {}).get(TRAIN, {}))
    tq.kv_clear(keys=keys, partition_id=TRAIN)


def test_a_trainer_killed_between_checkpoints_loses_no_pushed_group_and_trains_none_twice(
    server: ServerProcess, client: BufferClient, tmp_path: Path
) -> None:
    client.create_table("verl_crash", group_by="task", group_size=0, estimator="none")
    log = tmp_path / "trainer.log"
    # Steps 1 and 2 train; the checkpoint is after step 2; at step 3 the trainer dies with two
    # finished groups pushed and not yet trained.
    before = kill_when_ready(run_trainer(server, "verl_crash", log, 1, 3, 3, 3), log)
    trained_before, pushed = before["trained"], set(before["pushed"])
    assert len(trained_before) == 4 and len(pushed) == 2
    lose_transfer_queue()

    # Resumed from the checkpoint: steps 3 to 5, new prompts at steps 3 and 4.
    log.write_text("")
    second = run_trainer(server, "verl_crash", log, 3, 5, 4)
    assert exit_code(second, 180) == 0, child_log(log)
    trained_after = logged(log)["trained"]
    assert len(trained_after) == len(set(trained_after)) == 6
    assert pushed <= set(trained_after), "a group pushed before the crash was lost"
    assert not set(trained_before) & set(trained_after), "a group was trained twice"
    wait_for(lambda: stats(client, "verl_crash").groups_ready == 0, "every trained group retired")
    assert stats(client, "verl_crash").groups_leased == 0


def test_two_crashes_in_a_row_give_every_pushed_untrained_group_back_at_the_next_start(
    server: ServerProcess, client: BufferClient, tmp_path: Path
) -> None:
    client.create_table("verl_twice", group_by="task", group_size=0, estimator="none")
    log = tmp_path / "trainer.log"
    # Steps 1 and 2 train; at step 3 the trainer dies with two groups pushed and sampled, not trained.
    first = kill_when_ready(run_trainer(server, "verl_twice", log, 1, 3, 3, 3), log)
    pushed = set(first["pushed"])
    assert len(first["trained"]) == 4 and len(pushed) == 2
    lose_transfer_queue()

    # The restart's first sample restores them and takes them for step 3; it dies again before training them.
    log.write_text("")
    second = kill_when_ready(run_trainer(server, "verl_twice", log, 3, 5, 2, 3), log)
    assert set(second["sampled"]) == pushed and not second["trained"], child_log(log)
    after = stats(client, "verl_twice")
    assert (after.groups_ready, after.groups_leased) == (2, 0), "the dead trainer holds groups"
    lose_transfer_queue()

    # The next start gets them back and trains them, with new prompts at steps 3 and 4.
    log.write_text("")
    third = run_trainer(server, "verl_twice", log, 3, 5, 4)
    assert exit_code(third, 180) == 0, child_log(log)
    trained = logged(log)["trained"]
    assert len(trained) == len(set(trained)) == 6
    assert pushed <= set(trained), "a group pushed before the crashes was lost"
    assert not set(first["trained"]) & set(trained), "a group was trained twice"
    wait_for(lambda: stats(client, "verl_twice").groups_ready == 0, "every trained group retired")
    assert stats(client, "verl_twice").groups_leased == 0


def test_the_docs_verl_lines_build_the_buffer_through_verls_loader(
    server: ServerProcess, client: BufferClient, tmp_path: Path
) -> None:
    section = page("frameworks/verl.md")
    yaml_lines = code_blocks(section, "yaml")[0]
    toml_lines = code_blocks(section, "toml")[0]
    (tmp_path / "expbuf.toml").write_text(toml_lines)
    (table,) = load(str(tmp_path / "expbuf.toml")).tables
    (settings,) = tomllib.loads(toml_lines)["tables"]
    client.create_table(settings.pop("name"), **settings)
    config = OmegaConf.merge(
        {"trainer": {"v1": {"trainer_mode": "colocate_async", "colocate_async": {}}}}, OmegaConf.create(yaml_lines)
    )
    config.trainer.v1.sampler.sampler_kwargs.expbuf.target = server.target
    config.trainer.v1.sampler.max_off_policy_strategy = "drop"
    trainer = SimpleNamespace(config=config, trainer_mode="colocate_async", _add_prompts_to_generate=lambda n: n)
    buffer = PPOTrainer._build_replay_buffer(trainer)
    OPEN.append(buffer)
    assert type(buffer) is ExpbufReplayBuffer and buffer.mode == "mirror" and buffer.table == table.name
    assert buffer.max_off_policy_threshold == buffer.table_config.max_staleness + 1  # the settings agree


def verl_config(*overrides: str) -> DictConfig:
    """verl's own ppo_trainer config, composed by Hydra as `verl.trainer.main_ppo` does."""
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def test_the_expbuf_external_trainer_generates_nothing_and_keeps_expbufs_advantages(
    server: ServerProcess, client: BufferClient
) -> None:
    client.create_table("verl_external", group_by="task", group_size=2, estimator="grpo", max_staleness=1)
    client.push(explorer_group("x", 3, [1.0, 0.0]), "verl_external")
    sampler = "trainer.v1.sampler"
    config = verl_config(
        "trainer.v1.trainer_mode=expbuf_external",
        "algorithm.adv_estimator=expbuf",
        f"{sampler}.max_off_policy_threshold=2",
        f"{sampler}.custom_sampler.path=pkg://expbuf.client.verl",
        f"{sampler}.custom_sampler.name=ExpbufReplayBuffer",
        f"+{sampler}.sampler_kwargs.expbuf.target={server.target}",
        f"+{sampler}.sampler_kwargs.expbuf.table=verl_external",
        f"+{sampler}.sampler_kwargs.expbuf.mode=source",
    )
    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)
    assert type(trainer) is ExpbufExternalTrainer
    OPEN.append(trainer.replay_buffer)
    assert trainer.prepare_step() == {}
    assert (tq.kv_list(TRAIN) or {}).get(TRAIN, {}) == {}  # no prompt was dispatched to verl's generation

    meta, _ = trainer.replay_buffer.sample(global_steps=4, partition_id=TRAIN, batch_size=1)
    stored = rows_of(TRAIN, meta.keys, dict(zip(meta.keys, meta.tags, strict=True)))
    old = [row.fields["rollout_log_probs"] for row in stored]  # what the old-log-prob step writes
    tq.kv_batch_put(
        keys=meta.keys,
        partition_id=TRAIN,
        fields=TensorDict({"old_log_probs": torch.nested.as_nested_tensor(old, layout=torch.jagged)}, [len(old)]),
    )
    trainer._compute_advantage(meta, {})  # verl's own advantage step, with the estimator `expbuf`
    after = rows_of(TRAIN, meta.keys, {})
    for before, now in zip(stored, after, strict=True):
        assert torch.equal(now.fields["advantages"], before.fields["advantages"])
        assert torch.equal(now.fields["returns"], before.fields["returns"])
    grpo = 0.5 / (0.5**0.5 + 1e-6)  # a 1/0 group: ±0.5 over the unbiased std 1/√2 (+ epsilon)
    assert sorted(row.fields["advantages"][0].item() for row in after) == pytest.approx([-grpo, grpo])

    with_kl = verl_config(
        "trainer.v1.trainer_mode=expbuf_external",
        f"{sampler}.custom_sampler.path=pkg://expbuf.client.verl",
        f"{sampler}.custom_sampler.name=ExpbufReplayBuffer",
        f"+{sampler}.sampler_kwargs.expbuf.target={server.target}",
        f"+{sampler}.sampler_kwargs.expbuf.table=verl_external",
        f"+{sampler}.sampler_kwargs.expbuf.mode=source",
        f"{sampler}.max_off_policy_threshold=2",
        "algorithm.adv_estimator=expbuf",
        "algorithm.use_kl_in_reward=true",
    )
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        get_trainer_cls("expbuf_external")(config=with_kl)


def test_a_trained_steps_keys_from_verls_checkpoint_are_neither_pushed_nor_restored(
    server: ServerProcess, client: BufferClient
) -> None:
    """verl saves its checkpoint after a step and clears the step's keys after that: the checkpoint
    brings the trained groups' trajectories back without their prompt keys."""
    client.create_table("verl_orphans", group_by="task", group_size=0, estimator="none")
    buffer = build(server.target, "verl_orphans")
    uid = dispatch(1)
    wait_for(lambda: stats(client, "verl_orphans").groups_ready == 1, "the finished group pushed")
    buffer.close()  # the crash came between the checkpoint and the step's kv_clear: the group was trained
    tq.kv_clear(keys=[uid], partition_id=TRAIN)  # as restored from the checkpoint: trajectories, no prompt

    restarted = build(server.target, "verl_orphans")
    other = dispatch(2)
    meta, _ = restarted.sample(global_steps=2, partition_id=TRAIN, batch_size=1)
    assert {k.split("_")[0] for k in meta.keys} == {other}
    restarted.sync_once()
    after = stats(client, "verl_orphans")
    assert (after.groups_leased, after.groups_ready, after.ready) == (0, 1, 3)  # the trained one is gone
    assert client.get([f"verl/{uid}/0/0/0"], "verl_orphans").missing_uids == [f"verl/{uid}/0/0/0"]
    listing = tq.kv_list(TRAIN)[TRAIN]
    assert uid not in listing and any(key.startswith(uid + "_") for key in listing)  # not put back as a group


def test_groups_a_dead_trainer_left_leased_are_restored(server: ServerProcess, client: BufferClient) -> None:
    """An older release's restore leased the groups it put back for an hour; its trainer died with them."""
    client.create_table("verl_stranded", group_by="task", group_size=0, estimator="none")
    buffer = build(server.target, "verl_stranded")
    stranded = dispatch(1)
    wait_for(lambda: stats(client, "verl_stranded").groups_ready == 1, "the finished group pushed")
    buffer.close()
    lose_transfer_queue()
    with BufferClient(server.target) as dead:
        (held,) = dead.sample("verl_stranded", num_groups=1, max_batches=1, lease_seconds=3600)
    assert held.groups == [f"verl/{stranded}"]

    restarted = build(server.target, "verl_stranded")
    newer = dispatch(2)
    meta, _ = restarted.sample(global_steps=2, partition_id=TRAIN, batch_size=1)
    assert {k.split("_")[0] for k in meta.keys} == {stranded}  # the older group first, as verl samples
    step_end(meta)
    wait_for(lambda: stats(client, "verl_stranded").groups_leased == 0, "the stranded group retired once trained")
    meta, _ = restarted.sample(global_steps=2, partition_id=TRAIN, batch_size=1)
    assert {k.split("_")[0] for k in meta.keys} == {newer}


def test_a_group_expbuf_cannot_store_is_logged_and_does_not_hold_back_the_others(
    server: ServerProcess, client: BufferClient, caplog: pytest.LogCaptureFixture
) -> None:
    client.create_table("verl_mixed", group_by="task", group_size=0, estimator="none")
    image = "image-0"
    rows = agent_loop_rows(image, 1, sessions=1)
    rows[0].fields["multi_modal_inputs"] = {"pixel_values": torch.zeros(2, 3)}
    tq.kv_batch_put(
        keys=[image], partition_id=TRAIN, tags=[{"is_prompt": True, "status": "finished", "global_steps": 1}]
    )
    tq.kv_batch_put(
        keys=[r.key for r in rows],
        partition_id=TRAIN,
        fields=list_of_dict_to_tensordict([r.fields for r in rows]),
        tags=[r.tag for r in rows],
    )
    text = dispatch(1)
    with caplog.at_level(logging.ERROR):
        build(server.target, "verl_mixed").sync_once()
    assert f"group {image} is not mirrored" in caplog.text and "processor" in caplog.text
    assert stats(client, "verl_mixed").groups_ready == 1
    assert not client.get([f"verl/{text}/0/0/0"], "verl_mixed").missing_uids
