"""Off-policy control: the trainer's version, the version index, admission and rate limits."""

from __future__ import annotations

import asyncio
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
from expbuf.server.store import Store
from expbuf.server.tables import TableConfig

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
