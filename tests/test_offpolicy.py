"""Off-policy control: the trainer's version, the version index, admission and rate limits."""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from expbuf.client import AsyncBufferClient, BufferClient, BufferError, trxp
from expbuf.client.torch import ExperienceDataset
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ServerConfig
from expbuf.server.errors import InvalidRequest
from expbuf.server.sample_spec import SampleSpec
from expbuf.server.store import Entry, Store, layout
from expbuf.server.tables import TableConfig

from conftest import FIXTURES
from helpers import group_items, scrape


def start(data: Path) -> ExpbufServer:
    return ExpbufServer(ServerConfig(data=str(data), port=0, metrics_port=0)).start()


# ---- the trainer's version -----------------------------------------------------------------


def test_trainer_version_is_stored_shown_exported_and_measures_staleness(tmp_path: Path) -> None:
    server = start(tmp_path)
    try:
        target = f"127.0.0.1:{server.port}"
        with BufferClient(target, timeout=20) as c:
            c.create_table("t", estimator="none", group_size=2)
            assert c.stats("t")["t"]["trainer_version"] == -1
            assert c.set_trainer_version(3, "t") == 3
            assert c.stats("t")["t"]["trainer_version"] == 3
            with pytest.raises(BufferError) as bad:
                c._call(c._stub.SetTrainerVersion, _request("t", -2), retry=False)
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "version" in bad.value.details
            with pytest.raises(BufferError) as missing:
                c.set_trainer_version(1, "nope")
            assert missing.value.code == grpc.StatusCode.NOT_FOUND
            with pytest.raises(ValueError, match="version"):
                c.set_trainer_version(-1, "t")
            c.push(trxp.build(group_items(1, 0, 2, version=1)), table="t")
            c.push(trxp.build(group_items(1, 1, 2, version=4)), table="t")
            batch = next(c.sample("t", num_groups=2, max_batches=1, trainer_version=5))
            assert len(batch.uids) == 4
            assert c.stats("t")["t"]["trainer_version"] == 5
            assert asyncio.run(_async_set(target, 6)) == 6
            assert ExperienceDataset(c, "t").set_trainer_version(7) == 7
        m = scrape(server.metrics_port)
        assert m[("expbuf_trainer_version", (("table", "t"),))] == 7
        # trainer version 5: two experiences of version 1 (staleness 4), two of version 4 (1)
        assert m[("expbuf_sample_staleness_versions_count", (("table", "t"),))] == 4
        assert m[("expbuf_sample_staleness_versions_sum", (("table", "t"),))] == 10
        assert ("expbuf_trainer_version", (("table", "default"),)) not in m
    finally:
        server.stop(grace=1)
    server = start(tmp_path)  # durable: it comes back from the table's counters
    try:
        with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as c:
            assert c.stats("t")["t"]["trainer_version"] == 7
    finally:
        server.stop(grace=1)


def _request(table: str, version: int) -> pb.SetTrainerVersionRequest:
    return pb.SetTrainerVersionRequest(table=table, version=version)


async def _async_set(target: str, version: int) -> int:
    async with AsyncBufferClient(target, timeout=20) as c:
        return await c.set_trainer_version(version, "t")


def test_trainer_version_on_a_sample_spec_is_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="trainer_version"):
        SampleSpec("default", num_groups=1, trainer_version=-1)
    with Store(tmp_path) as store:
        store.create_table(TableConfig(name="t", estimator="none"))
        with pytest.raises(InvalidRequest, match="version"):
            store.set_trainer_version("t", True)  # type: ignore[arg-type]
        assert store.sample(SampleSpec("t", num_groups=1, trainer_version=2)) is None
        assert store.stats("t")["trainer_version"] == 2  # stored even when no batch was there


# ---- the version index -------------------------------------------------------------------


def test_min_model_version_finds_fresh_groups_behind_100k_stale_ones(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig(name="t", estimator="none", group_by="none"))
        one = Entry.of(group_items(0, 0, 1, response=1, prompt=1)[0])

        def push(prefix: str, count: int, version: int) -> None:
            store.put_entries("t", [replace(one, uid=f"{prefix}{i}", version=version) for i in range(count)])

        push("first", 1, 9)
        first = store.sample(SampleSpec("t", num_groups=1, delivery="lease", lease_seconds=60))
        for chunk in range(10):
            push(f"stale{chunk}-", 10_000, 1)
        push("last", 1, 9)
        store.put_entries("t", [replace(one, uid="unknown0", version=None)])  # at the back, no version
        # fifo: the first ready group is stale, the fresh one is 100k groups behind it
        assert store.sample(SampleSpec("t", num_groups=1, min_model_version=5)).group_ids == ["last0"]
        store.nack(first.lease_id)  # back to ready, at the front of the order
        # lifo: from the back, an unknown version and 100k stale groups lie before the fresh one
        assert store.sample(SampleSpec("t", num_groups=1, min_model_version=5, order="lifo")).group_ids == ["first0"]
        assert store.sample(SampleSpec("t", num_groups=1, min_model_version=5, order="uniform")) is None
        assert store.sample(SampleSpec("t", num_groups=1, order="lifo")).group_ids == ["unknown0"]
        assert store.sample(SampleSpec("t", num_groups=1, min_model_version=1, order="lifo")).group_ids == [
            "stale9-9999"
        ]


def test_fifo_and_lifo_merge_the_runs_of_every_fresh_version(tmp_path: Path) -> None:
    versions = [3, 7, 5, 7, 1, 5, 9, 3, 5]
    with Store(tmp_path) as store:
        store.create_table(TableConfig(name="t", estimator="none", group_by="none"))
        one = Entry.of(group_items(0, 0, 1, response=1, prompt=1)[0])
        for i, version in enumerate(versions):
            store.put_entries("t", [replace(one, uid=f"g{i}", version=version, priority=float(i % 3))])
        want = [f"g{i}" for i, v in enumerate(versions) if v >= 5]
        for order, expected in (("fifo", want), ("lifo", want[::-1])):
            batch = store.sample(
                SampleSpec("t", num_groups=len(want), min_model_version=5, order=order, delivery="replay")
            )
            assert batch.group_ids == expected
        by_priority = sorted(want, key=lambda g: (-(int(g[1:]) % 3), int(g[1:])))
        batch = store.sample(SampleSpec("t", num_groups=len(want), min_model_version=5, order="priority"))
        assert batch.group_ids == by_priority
        assert store.verify("t") == []


def test_a_directory_without_the_version_index_gets_it_at_open(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.create_table(TableConfig(name="t", estimator="none", group_by="none"))
        store.put("t", group_items(1, 0, 3, version=4))
        env = store.environment
        with env.env.begin(write=True) as txn:  # as format 2 left it: no version index
            txn.drop(env.db["byver"], delete=False)
            txn.put(b"format", b"2", db=env.db["meta"])
        problems = store.verify("t")
        assert "the version index holds 0 groups, 3 have a version" in problems
        assert sum("missing from the version index" in p for p in problems) == 3
    with Store(tmp_path) as store:
        assert store.verify("t") == []
        assert len(store.sample(SampleSpec("t", num_groups=3, min_model_version=4)).uids) == 3


def test_the_first_format_gets_the_version_index(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "datadir_v1" / "data.mdb", tmp_path / "data.mdb")
    with Store(tmp_path) as store:
        with store.environment.read() as txn:
            assert txn.stat(store.environment.db["byver"])["entries"] > 0
            assert txn.get(b"format", db=store.environment.db["meta"]) == str(layout.FORMAT).encode()
        for table in store.list_tables():
            assert store.verify(table.name) == [], table.name
