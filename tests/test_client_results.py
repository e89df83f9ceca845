"""What stats(), list_tables() and server_info() return: frozen dataclasses with typed fields, from
every client (blocking, asyncio, sharded and its asyncio twin) against real servers."""

from __future__ import annotations

import asyncio
import dataclasses
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from expbuf.client import (
    AsyncBufferClient,
    Batch,
    BufferClient,
    BufferStats,
    ServerInfo,
    ShapingInfo,
    TableInfo,
    TableStats,
)
from expbuf.client.results import AsyncBatch
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient
from expbuf.client.shards.common import ShardBatch
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ServerConfig

from conftest import payload
from helpers import make_experience


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[list[str]]:
    """Two servers on free ports: one alone, and both as the shards of a sharded client."""
    servers = [
        ExpbufServer(ServerConfig(data=str(tmp_path / name), port=0, metrics_port=0)).start() for name in ("a", "b")
    ]
    yield [f"127.0.0.1:{server.port}" for server in servers]
    for server in servers:
        server.stop(grace=1)


def runtime_types(annotation: object) -> tuple[type, ...]:
    """The classes a value of this annotation may have: `X | None` either; `Mapping[...]` any mapping."""
    if isinstance(annotation, types.UnionType):
        return tuple(t for arg in typing.get_args(annotation) for t in runtime_types(arg))
    return (typing.get_origin(annotation) or annotation,)  # type: ignore[return-value]


def assert_typed(value: object) -> None:
    """A frozen dataclass whose every field holds a value of its annotated type (a bool is no int)."""
    kind = type(value)
    assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, kind
    hints = typing.get_type_hints(kind)
    for f in dataclasses.fields(kind):
        got, allowed = getattr(value, f.name), runtime_types(hints[f.name])
        assert isinstance(got, allowed), f"{kind.__name__}.{f.name} = {got!r}, annotated {hints[f.name]}"
        assert not isinstance(got, bool) or bool in allowed, f"{kind.__name__}.{f.name} = {got!r}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, dataclasses.fields(kind)[0].name, None)


def check_one_server(stats: BufferStats, tables: list[TableInfo], info: ServerInfo) -> None:
    assert isinstance(stats, BufferStats) and list(stats) == ["default", "g4"] and not stats.missing
    for name, table in stats.items():
        assert isinstance(table, TableStats) and table.name == name
        assert_typed(table)
    g4 = stats["g4"]
    assert (g4.pushed, g4.pending, g4.groups_pending, g4.trainer_version, g4.last_failure) == (3, 3, 1, 2, "")
    assert (g4.min_model_version, g4.max_model_version) == (1, 1) and g4.live == 3
    assert [t.name for t in tables] == ["default", "g4"]
    for table in tables:
        assert isinstance(table, TableInfo) and isinstance(table.shaping, ShapingInfo)
        assert_typed(table)
        assert_typed(table.shaping)
    g4_info = tables[1]
    assert (g4_info.group_by, g4_info.group_size, g4_info.estimator, g4_info.max_staleness) == ("task", 4, "rloo", 3)
    assert (g4_info.shaping.reward_clip, g4_info.shaping.overlong_buffer_penalty_factor) == (5.0, 1.0)
    assert (g4_info.tombstone_seconds, g4_info.keep_failed) == (86400.0, True)  # the server's defaults, filled in
    assert isinstance(info, ServerInfo) and not info.shards and not info.missing
    assert_typed(info)
    assert info.trxp_version == "1" and info.storage_bytes > 0 and 0 < info.lmdb_map_used_ratio < 1
    assert {"fifo", "lifo", "uniform", "priority"} <= set(info.orders)


def populate(client: BufferClient, name: str = "g4") -> None:
    client.create_table(name, group_size=4, estimator="rloo", max_staleness=3, batch_size=8, shaping={"reward_clip": 5})
    client.set_trainer_version(2, name)
    client.push([make_experience(0, 0, run) for run in range(3)], table=name)


def test_every_field_of_the_replies_is_a_typed_attribute() -> None:
    """The result types carry every field the service sends, under its name, and nothing else."""
    assert {f.name for f in dataclasses.fields(TableStats)} == {f.name for f in pb.TableStats.DESCRIPTOR.fields}
    own = {f.name for f in dataclasses.fields(ServerInfo)} - {"shards", "missing"}
    assert own == {f.name for f in pb.ServerInfoReply.DESCRIPTOR.fields}
    assert {f.name for f in dataclasses.fields(ShapingInfo)} == {f.name for f in pb.Shaping.DESCRIPTOR.fields}


def test_the_clients_return_typed_results(targets: list[str]) -> None:
    with BufferClient(targets[0]) as client:
        populate(client)
        check_one_server(client.stats(), client.list_tables(), client.server_info())
        only = client.stats("g4")
        assert list(only) == ["g4"] and "default" not in only
        # A table's settings give back a table like it.
        settings = client.list_tables()[1].settings()
        twin = client.create_table(**settings | {"name": "twin"})
        assert isinstance(twin, TableInfo) and twin.shaping.reward_clip == 5.0
        assert client.list_tables()[2] == dataclasses.replace(client.list_tables()[1], name="twin")

    async def run() -> tuple[BufferStats, list[TableInfo], ServerInfo]:
        async with AsyncBufferClient(targets[0]) as client:
            await client.drop_table("twin")
            return await client.stats(), await client.list_tables(), await client.server_info()

    check_one_server(*asyncio.run(run()))


def test_the_sharded_clients_merge_into_the_same_types(targets: list[str]) -> None:
    shards = {"s0": targets[0], "s1": targets[1]}
    with ShardedBufferClient(shards) as client:
        populate(client)
        client.push(payload("grpo_group.trxp"))
        stats, per_shard, info = client.stats(), client.shard_stats(), client.server_info()
        tables = client.list_tables()
    assert isinstance(stats, BufferStats) and not stats.missing
    g4 = stats["g4"]
    assert isinstance(g4, TableStats)
    assert_typed(g4)
    assert g4.pushed == sum(s["g4"].pushed for s in per_shard.values()) == 3
    assert stats["default"].pushed == sum(s["default"].pushed for s in per_shard.values()) == 8
    assert g4.trainer_version == 2  # set on every shard: the lowest is 2
    assert [t.name for t in tables] == ["default", "g4"] and all(isinstance(t, TableInfo) for t in tables)
    assert isinstance(info, ServerInfo) and set(info.shards) == {"s0", "s1"} and not info.missing
    assert_typed(info)
    assert info.storage_bytes == sum(s.storage_bytes for s in info.shards.values())
    assert info.uptime_seconds == min(s.uptime_seconds for s in info.shards.values())
    assert info.orders == info.shards["s0"].orders and "fifo" in info.orders  # what every shard has

    async def run() -> tuple[BufferStats, ServerInfo, list[TableInfo]]:
        async with AsyncShardedBufferClient(shards) as client:
            return await client.stats("g4"), await client.server_info(), await client.list_tables()

    async_stats, async_info, async_tables = asyncio.run(run())
    assert dataclasses.replace(async_stats["g4"], oldest_age_seconds=0) == dataclasses.replace(g4, oldest_age_seconds=0)
    assert list(async_stats) == ["g4"]
    assert isinstance(async_info, ServerInfo) and set(async_info.shards) == {"s0", "s1"}
    assert async_tables == tables


def test_merged_stats_take_each_field_by_its_meaning() -> None:
    zero = dict.fromkeys((f.name for f in dataclasses.fields(TableStats)), 0) | {"name": "t", "last_failure": ""}
    empty = TableStats(**zero | {"min_model_version": -1, "max_model_version": -1, "trainer_version": 4})
    held = TableStats(
        **zero
        | {
            "ready": 6,
            "pushed": 6,
            "min_model_version": 2,
            "max_model_version": 5,
            "trainer_version": 3,
            "oldest_age_seconds": 9.0,
            "last_failure": "boom",
            "reward_running_mean": 0.5,
            "reward_running_std": 2.0,
        }
    )
    merged = TableStats.merged([empty, held])
    assert (merged.ready, merged.pushed, merged.oldest_age_seconds, merged.last_failure) == (6, 6, 9.0, "boom")
    assert (merged.min_model_version, merged.max_model_version) == (2, 5)  # the empty shard holds no version
    assert merged.trainer_version == 3  # the lowest a shard holds
    assert (merged.reward_running_mean, merged.reward_running_std) == (0.5, 2.0)  # weighted by pushes
    unset = TableStats.merged([empty, dataclasses.replace(held, trainer_version=-1)])
    assert unset.trainer_version == -1


def test_merged_server_info_names_each_shard_whose_advantages_cannot_be_computed() -> None:
    """A shard's advantage worker failure, after the shard's name; none from shards without one."""
    ok = ServerInfo("1", "1", "cpu", 1 << 20, uptime_seconds=1.0, storage_bytes=1, lmdb_map_used_ratio=0.1)
    broken = dataclasses.replace(
        ok, advantage_device="", advantage_worker_failure="the advantage worker did not start: X"
    )
    merged = ServerInfo.merged({"s0": ok, "s1": broken, "s2": broken}, {})
    assert merged.advantage_worker_failure == (
        "s1: the advantage worker did not start: X; s2: the advantage worker did not start: X"
    )
    assert ServerInfo.merged({"s0": ok, "s1": ok}, {}).advantage_worker_failure == ""
    idle = dataclasses.replace(ok, advantage_device="", advantage_worker_state="not_needed")
    running = dataclasses.replace(ok, advantage_worker_state="running")
    assert ServerInfo.merged({"s0": running, "s1": idle}, {}).advantage_worker_state == "not_needed,running"


def test_results_that_hold_payloads_print_a_summary(targets: list[str]) -> None:
    """`print(batch)` names the table, the counts, the payload's size, the lease and partial, in
    one short line, from every client; a read's result its counts (the bytes were 3 times the payload)."""
    group = [make_experience(7, 0, run, response=600) for run in range(4)]  # about 23 KB as TRXP
    expected = "table='t', experiences=4, groups=1, payload_bytes={}, lease_id={!r}, partial=False"

    def check(batch: Batch, kind: str, extra: str = "") -> None:
        assert len(batch.payload) > 20_000
        assert repr(batch) == f"{kind}({expected.format(len(batch.payload), batch.lease_id)}{extra})"
        assert batch.lease_id and str(batch) == repr(batch)

    with BufferClient(targets[0]) as client:
        client.create_table("t", group_size=4, estimator="none")
        client.push(group, table="t")
        batch = next(client.sample("t", num_groups=1, delivery="lease", max_batches=1))
        check(batch, "Batch")
        found = client.get([e.eid.uid for e in group] + ["7/0/9/0/r9s0"], table="t")
        assert repr(found) == "GetResult(experiences=4, missing_uids=1)"
        batch.nack()

    async def run() -> AsyncBatch:
        async with AsyncBufferClient(targets[0]) as client:
            batch = await anext(aiter(client.sample("t", num_groups=1, delivery="lease", max_batches=1)))
            await batch.nack()
            return batch

    check(asyncio.run(run()), "AsyncBatch")
    with ShardedBufferClient({"s0": targets[0]}) as sharded:
        batch = next(sharded.sample("t", num_groups=1, delivery="lease", max_batches=1))
        assert isinstance(batch, ShardBatch)
        check(batch, "ShardBatch", ", shards=['s0']")
        batch.nack()
