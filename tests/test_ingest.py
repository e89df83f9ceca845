"""Pushes validated and packed in worker processes: the same results and refusals as in
the server's own process, and a worker that dies is replaced."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from expbuf.client import BufferClient, BufferError
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ServerConfig

from conftest import BAD_DIR, MANIFEST, payload


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ExpbufServer]:
    srv = ExpbufServer(ServerConfig(data=str(tmp_path), port=0, metrics_port=-1, ingest_processes=1)).start()
    yield srv
    srv.stop(grace=1)


def test_pushes_through_worker_processes_store_and_refuse_alike(server: ExpbufServer) -> None:
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_by="none", estimator="none")
        want = [item["uid"] for item in MANIFEST["payloads"]["mixed_batch.trxp"]["items"]]
        assert client.push(payload("mixed_batch.trxp"), table="t").stored == want
        assert client.push(payload("mixed_batch.trxp"), table="t").duplicates == want
        with pytest.raises(BufferError) as info:
            client.push((BAD_DIR / "prompt_longer_than_tokens.bin").read_bytes(), table="t")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_length" in info.value.details
        assert client.stats("t")["t"]["pushed"] == len(want)


def test_a_worker_that_dies_is_replaced(server: ExpbufServer) -> None:
    pool = server.service.ingest._pool
    for pid in list(pool._processes):
        os.kill(pid, signal.SIGKILL)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_by="none", estimator="none")
        assert client.push(payload("grpo_group.trxp"), table="t").stored
        assert client.push(payload("multi_turn.trxp"), table="t").stored
    assert server.service.ingest._pool is not pool
