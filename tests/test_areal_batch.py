"""ExpbufBatchSource.prepare_batch checked by AReaL's own trajectory format check, batching and
actor (its advantage computation, with and without the table's advantages)."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from expbuf.client import EID, BufferClient, BufferError, ExpbufError, UnavailableError

from helpers import Beside, ServerProcess


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global areal, PPOActorConfig, StalenessManager, check_trajectory_format, concat_padded_tensors
    global StatefulDataLoader, EXPBUF_ADVANTAGES, ExpbufBatchSource, ExpbufStalenessManager
    global KeepExpbufAdvantages, from_areal
    pytest.importorskip("areal")
    import areal
    from areal.api.cli_args import PPOActorConfig
    from areal.infra.staleness_manager import StalenessManager
    from areal.infra.workflow_executor import check_trajectory_format
    from areal.utils.data import concat_padded_tensors
    from torchdata.stateful_dataloader import StatefulDataLoader

    from expbuf.client.areal import (
        EXPBUF_ADVANTAGES,
        ExpbufBatchSource,
        ExpbufStalenessManager,
        KeepExpbufAdvantages,
        from_areal,
    )


def ppo_actor() -> type:
    """AReaL's PPOActor, without areal.trainer's __init__ (its other trainers import packages,
    loggers and datasets, that the actor does not use)."""
    if "areal.trainer" not in sys.modules:
        package = types.ModuleType("areal.trainer")
        package.__path__ = [str(Path(areal.__file__).parent / "trainer")]
        sys.modules["areal.trainer"] = package
    from areal.trainer.ppo.actor import PPOActor

    return PPOActor


def group_rows(version: int, first: int, size: int = 4) -> dict[str, torch.Tensor]:
    """A group of `size` rows of different lengths, made with AReaL's concat_padded_tensors."""
    rows = []
    for run in range(size):
        prompt, response = 2 + run % 2, 3 + run
        n = prompt + response
        res = {
            "input_ids": torch.arange(first, first + n, dtype=torch.int32),
            "loss_mask": torch.tensor([0] * prompt + [1] * response, dtype=torch.int32),
            "logprobs": torch.tensor([0.0] * prompt + [-0.5] * response, dtype=torch.float32),
            "versions": torch.tensor([-1] * prompt + [version] * response, dtype=torch.int32),
            "attention_mask": torch.ones(n, dtype=torch.bool),
            "rewards": torch.tensor(float(run % 2), dtype=torch.float32),
        }
        rows.append({k: v.unsqueeze(0) for k, v in res.items()})
    return concat_padded_tensors(rows)


class Version:
    def __init__(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


def push_groups(client: BufferClient, table: str, versions: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """One group per version; returns the rows of each, by their first token."""
    pushed = {}
    for task, version in enumerate(versions):
        rows = group_rows(version, first=100 * (task + 1))
        client.push(from_areal(rows, [EID(batch="b", task=task, run=r) for r in range(4)]), table=table)
        pushed[100 * (task + 1)] = rows
    return pushed


def test_prepare_batch_gives_areal_one_checked_dict_per_fresh_group(child_server: ServerProcess) -> None:
    client = BufferClient(child_server.target)
    client.create_table("train", group_size=4)
    pushed = push_groups(client, "train", [1, 3, 4])
    source = ExpbufBatchSource(child_server.target, "train", max_head_offpolicyness=1, version_provider=Version(4))
    loader = StatefulDataLoader(list(range(8)), batch_size=2)

    batch = source.prepare_batch(loader, workflow="unused", group_size=4)
    assert len(batch) == 2
    keys = set(batch[0])
    for traj in batch:
        assert check_trajectory_format(traj, batch_size=4, expected_keys=keys)
        rows = pushed[traj["input_ids"][0, 0].item()]  # the version-1 group is below 4 - 1
        assert rows["versions"].max().item() >= 3
        for key, value in rows.items():
            assert torch.equal(traj[key].to(value.dtype), value), key
    assert concat_padded_tensors(batch)["input_ids"].shape[0] == 8  # AReaL batches them as its own
    assert client.stats("train")["train"].trainer_version == 4

    stats = client.stats("train")["train"]
    assert stats.leased == 8  # held until the trainer is done with them
    later = ExpbufBatchSource(
        child_server.target, "train", max_head_offpolicyness=1, version_provider=Version(4), timeout=0.5
    )
    with pytest.raises(BufferError, match="DEADLINE_EXCEEDED"):
        later.prepare_batch(num_groups=1)  # what is left is the group of version 1, below 4 - 1
    source.ack()
    assert client.stats("train")["train"].leased == 0


def test_the_actor_option_trains_on_the_tables_advantages(child_server: ServerProcess) -> None:
    client = BufferClient(child_server.target)
    client.create_table("adv", group_size=4)
    push_groups(client, "adv", [2])
    source = ExpbufBatchSource(child_server.target, "adv", max_head_offpolicyness=0, advantages=True)
    source.set_version(2)
    (traj,) = source.prepare_batch(num_groups=1)
    assert check_trajectory_format(traj, batch_size=4)
    ours = traj[EXPBUF_ADVANTAGES].clone()

    PPOActor = ppo_actor()

    class Actor(KeepExpbufAdvantages, PPOActor):
        pass

    config = PPOActorConfig(experiment_name="e", trial_name="t", kl_ctl=0.0, reward_bias=0.0, reward_clip=20.0)
    (out,) = Actor(config, engine=None).compute_advantages([dict(traj)])
    assert torch.equal(out["advantages"], ours)
    assert EXPBUF_ADVANTAGES not in out
    # the table's values sit exactly where AReaL's shifted loss mask takes tokens
    assert torch.equal(out["advantages"] != 0, out["loss_mask"].bool())
    # grpo over rewards 0, 1, 0, 1: +-0.866 on every generated token of a run
    assert out["advantages"][out["loss_mask"].bool()].abs().unique().tolist() == pytest.approx([0.8660254], rel=1e-5)
    (plain,) = PPOActor(config, engine=None).compute_advantages([dict(traj)])
    assert not torch.equal(plain["advantages"], ours)  # AReaL's own would have been used otherwise


def test_set_version_reaches_the_table_when_areals_trainer_calls_it(child_server: ServerProcess) -> None:
    """AReaL's trainer calls set_version on its rollout engine after each weight update; the batch
    source, in that engine's place, tells the table then, so the rollout processes' bound (the
    table's, through AReaL's StalenessManager) moves with it, not at the next prepare_batch."""
    client = BufferClient(child_server.target)
    client.create_table("versioned", group_size=1, max_staleness=0, batch_size=2)
    source = ExpbufBatchSource(child_server.target, "versioned", max_head_offpolicyness=0)
    rollout = ExpbufStalenessManager(
        child_server.target, "versioned", max_concurrent_rollouts=100, consumer_batch_size=2, max_staleness=0
    )
    assert isinstance(rollout, StalenessManager)
    source.set_version(3)
    assert client.stats("versioned")["versioned"].trainer_version == 3
    assert (rollout.get_version(), rollout.get_capacity()) == (3, (0 + 3 + 1) * 2)
    source.set_version(4)
    assert source.get_version() == 4 and rollout.get_capacity() == (0 + 4 + 1) * 2


def test_close_closes_a_client_made_from_a_target_and_leaves_a_given_one_open(child_server: ServerProcess) -> None:
    """The batch source and the staleness manager made from a "HOST:PORT" target close the client
    they made at close() (its channels were left open while the adapter lived); a client the caller
    gave them stays the caller's, open."""
    given = BufferClient(child_server.target)
    given.create_table("closing", group_size=1, max_staleness=0, batch_size=2)
    limits = {"max_concurrent_rollouts": 4, "consumer_batch_size": 2, "max_staleness": 0}
    made = [
        ExpbufBatchSource(child_server.target, "closing", max_head_offpolicyness=0),
        ExpbufStalenessManager(child_server.target, "closing", **limits),
    ]
    kept = [
        ExpbufBatchSource(given, "closing", max_head_offpolicyness=0),
        ExpbufStalenessManager(given, "closing", **limits),
    ]
    for adapter in made + kept:
        adapter.close()
    for adapter in made:
        assert adapter.client.closed, adapter
        with pytest.raises(ExpbufError, match="Stats on a closed client"):
            adapter.client.stats("closing")
    assert not given.closed
    assert given.stats("closing")["closing"].consumed == 0
    given.close()


def test_a_trained_batch_whose_ack_fails_is_acked_later_and_never_served_again(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """The server goes away during a step: the next prepare_batch's ack of the trained batch
    fails (made again for the client's timeout) and raises. The batch was let go of and its lease
    left to run out (renewed while the source lived), so its groups were served again; it is now
    kept, acked at the next prepare_batch once the server is back (the trainer goes on after an
    UNAVAILABLE while its channel reconnects), and close() gives back only the batch no step used."""
    data = str(tmp_path / "data")
    server = serve(data)
    port = server.port
    with BufferClient(server.target) as client:
        client.create_table("acks", group_size=4)
        push_groups(client, "acks", [1, 1, 1])
    trainer = BufferClient(server.target, timeout=5)
    source = ExpbufBatchSource(trainer, "acks", max_head_offpolicyness=10, version_provider=Version(1))
    source.prepare_batch(num_groups=1)  # trained on
    assert server.stop(signal.SIGTERM) == 0, "".join(server.log)
    with pytest.raises(UnavailableError):
        source.prepare_batch(num_groups=1)  # its ack of the trained batch fails
    server = serve(data, "--port", str(port))
    for _ in range(20):  # a trainer goes on once the server is back
        with contextlib.suppress(UnavailableError):
            source.prepare_batch(num_groups=1)  # the trained batch acked first; another taken
            break
    source.close()  # that one goes back: no step used it
    trainer.close()
    with BufferClient(server.target) as client:
        stats = client.stats("acks")["acks"]
    assert (stats.consumed, stats.leased, stats.ready) == (4, 0, 8), stats


def test_a_batch_waited_for_and_a_version_told_ride_out_a_server_restart(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    """The server restarts (away 1.5 s) while prepare_batch waits for groups, and while the trainer
    tells it its version: each raised UnavailableError, which ended AReaL's training loop, where
    Trinity-RFT's reader waits for the server (a helper's audit). Each is made again while the
    server is unavailable, for the client's timeout."""
    data = str(tmp_path / "data")
    servers = [serve(data)]
    port = servers[0].port
    with BufferClient(servers[0].target) as client:
        client.create_table("restarts", group_size=4)
    source = ExpbufBatchSource(
        servers[0].target, "restarts", max_head_offpolicyness=10, version_provider=Version(1), timeout=60
    )

    def restarted(push: bool) -> None:
        assert servers[-1].stop(signal.SIGTERM) == 0, "".join(servers[-1].log)
        time.sleep(1.5)
        servers.append(serve(data, "--port", str(port)))
        if push:  # once it is reached: a new channel shares the source's, in its reconnect backoff
            with BufferClient(servers[-1].target, wait_for_ready=True) as client:
                push_groups(client, "restarts", [1])

    waiting = Beside(lambda: restarted(True), delay=0.5)  # prepare_batch waiting for groups by then
    waiting.start()
    try:
        assert len(source.prepare_batch(num_groups=1)) == 1
    finally:
        waiting.join()
    away = Beside(lambda: restarted(False))
    away.start()
    time.sleep(0.2)  # stopped, or stopping
    try:
        source.set_version(2)
    finally:
        away.join()
    with BufferClient(servers[-1].target) as client:
        assert client.stats("restarts")["restarts"].trainer_version == 2
    source.close()
