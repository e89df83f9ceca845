"""The trainer's version: stored only with a batch, only forward, bounded in its jumps with
evict_stale, and set back only by an admin's reset (RPC, clients, CLI)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from expbuf.client import AsyncBufferClient, BufferClient, BufferError, trxp
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient
from expbuf.server.store import Store
from expbuf.server.store.rules.staleness import VersionJump
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import group_items


def table(**settings: object) -> TableConfig:
    return TableConfig.of(name="t", estimator="none", group_size=2, **settings)


def push(store: Store, task: int, version: int) -> None:
    store.put("t", group_items("b", task, 2, version=version))


def test_a_lower_version_keeps_the_stored_one(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(table())
        assert store.set_trainer_version("t", 5) == 5
        assert store.set_trainer_version("t", 3) == 5  # kept, and the reply says so
        push(store, 0, 5)
        batch = store.sample(TakeSpec("t", num_groups=1, trainer_version=0))
        assert batch is not None and batch.trainer_version == 5
        assert store.stats("t")["trainer_version"] == 5
        assert store.set_trainer_version("t", 6) == 6


def test_a_samples_version_is_stored_only_with_a_batch(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(table(max_staleness=0, evict_stale=True))
        store.set_trainer_version("t", 0)
        push(store, 0, 0)
        # not enough for two groups: nothing taken, so nothing stored and nothing evicted
        assert store.sample(TakeSpec("t", num_groups=2, trainer_version=1), timeout=0.3) is None
        stats = store.stats("t")
        assert (stats["trainer_version"], stats["dropped_stale"], stats["ready"]) == (0, 0, 2)
        push(store, 1, 1)
        batch = store.sample(TakeSpec("t", num_groups=1, trainer_version=1))
        assert batch is not None and batch.versions == [1, 1]  # the stale group left before selection
        stats = store.stats("t")
        assert (stats["trainer_version"], stats["dropped_stale"], stats["ready"]) == (1, 1, 0)
        assert store.verify("t") == []


def test_with_evict_stale_a_jump_past_the_data_is_refused(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(table(max_staleness=2, evict_stale=True))
        store.set_trainer_version("t", 0)
        for task in range(5):
            push(store, task, 0)
        for jump in (10, 2**63 - 1):
            with pytest.raises(VersionJump, match=r"jumps past 3.*reset-offpolicy t --version"):
                store.set_trainer_version("t", jump)
            with pytest.raises(VersionJump):
                store.sample(TakeSpec("t", num_groups=1, trainer_version=jump))
        stats = store.stats("t")
        assert (stats["trainer_version"], stats["ready"], stats["dropped_stale"]) == (0, 10, 0)
        assert store.set_trainer_version("t", 3) == 3  # newest pushed 0 + max_staleness 2 + 1
        assert store.stats("t")["dropped_stale"] == 5
        assert store.reset_offpolicy("t", 2**40) == (2**40, 0)  # an admin sets any version
    with Store(tmp_path) as store:  # without evict_stale nothing is evicted: any jump may go
        store.create_table(TableConfig.of(name="u", estimator="none", max_staleness=2))
        assert store.set_trainer_version("u", 2**63 - 1) == 2**63 - 1


def test_a_reset_sets_the_version_back_and_forgets_admitted_rollouts(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(table(max_staleness=1, batch_size=2))
        store.set_trainer_version("t", 3)
        spent = store.admit("t", 100)
        assert spent.count == (1 + 3 + 1) * 2
        store.finish_grant("t", spent.grant_id)
        store.set_trainer_version("t", 0)  # a job started over: kept at 3, and no room
        assert store.admit("t", 1).count == 0
        assert store.reset_offpolicy("t", 0) == (0, 0)
        open_grant = store.admit("t", 3)
        assert open_grant.count == 3  # (1 + 0 + 1) * 2 = 4 of room
        assert store.reset_offpolicy("t") == (None, 3)  # unset; the open grant stays counted
        stats = store.stats("t")
        assert (stats["trainer_version"], stats["submitted"]) == (None, 3)
        assert store.finish_grant("t", open_grant.grant_id, accepted=1) == 2
        assert store.stats("t")["submitted"] == 1
        assert store.verify("t") == []


def test_the_reset_over_rpc_clients_and_cli_needs_the_admin_scope(start_server: Servers) -> None:
    tokens = {"trainer": frozenset({"sample"}), "ops": frozenset({"push", "sample", "admin"})}
    server = start_server(tokens=tokens)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="ops", timeout=10) as ops, BufferClient(target, token="trainer") as trainer:
        ops.create_table("t", estimator="none", group_size=2, max_staleness=1, batch_size=2)
        assert trainer.set_trainer_version(4, "t") == 4
        assert trainer.set_trainer_version(1, "t") == 4
        with pytest.raises(BufferError) as denied:
            trainer.reset_offpolicy("t", 1)
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert ops.reset_offpolicy("t", 1) == {"trainer_version": 1, "submitted": 0}
        assert ops.stats("t")["t"].trainer_version == 1
        ops.push(trxp.build(group_items("b", 0, 2, version=1)), table="t")
        batch = next(trainer.sample("t", num_groups=1, max_batches=1, trainer_version=0, delivery="consume"))
        assert batch.uids and trainer.stats("t")["t"].trainer_version == 1

        async def reset_async() -> dict[str, int]:
            async with AsyncBufferClient(target, token="ops") as client:
                return await client.reset_offpolicy("t")

        assert asyncio.run(reset_async()) == {"trainer_version": -1, "submitted": 0}
    cli = [sys.executable, "-m", "expbuf.server.cli", "table", "reset-offpolicy", "t", "--target", target]
    done = subprocess.run([*cli, "--token", "ops", "--version", "7"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "table t: trainer version 7, 0 rollouts of open grants counted" in done.stdout
    denied_cli = subprocess.run([*cli, "--token", "trainer"], capture_output=True, text=True, timeout=60)
    assert denied_cli.returncode == 1 and "PERMISSION_DENIED" in denied_cli.stderr
    with BufferClient(target, token="ops") as ops:
        assert ops.stats("t")["t"].trainer_version == 7


def test_the_sharded_clients_reset_every_shard(tmp_path: Path, start_server: Servers) -> None:
    servers = [start_server(tmp_path / name) for name in ("a", "b")]
    targets = [f"127.0.0.1:{s.port}" for s in servers]
    with ShardedBufferClient(targets) as client:
        client.create_table("t", estimator="none", group_size=2, max_staleness=1, batch_size=2)
        client.set_trainer_version(5, "t")
        reset = client.reset_offpolicy("t", 2)
        assert len(reset) == 2 and all(r == {"trainer_version": 2, "submitted": 0} for r in reset.values())

    async def reset_async() -> dict[str, dict[str, int]]:
        async with AsyncShardedBufferClient(targets) as client:
            return await client.reset_offpolicy("t", 3)

    assert list(asyncio.run(reset_async()).values()) == [{"trainer_version": 3, "submitted": 0}] * 2
    with ShardedBufferClient(targets) as client:
        assert client.set_trainer_version(1, "t") == 3
    for target in targets:
        with BufferClient(target) as shard:
            assert shard.stats("t")["t"].trainer_version == 3
