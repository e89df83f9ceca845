"""The clients' error types and the asyncio batch's coroutine methods, against a real server."""

from __future__ import annotations

import asyncio
import inspect
import pickle
from pathlib import Path

import grpc
import pytest

from expbuf.client import (
    AlreadyExistsError,
    AsyncBufferClient,
    BufferClient,
    BufferError,
    DeadlineExceededError,
    ExpbufError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from expbuf.client.client import AsyncBatch
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ServerConfig

from conftest import BAD_DIR, payload


@pytest.fixture
def target(tmp_path: Path) -> str:
    server = ExpbufServer(ServerConfig(data=str(tmp_path), port=0, metrics_port=0)).start()
    yield f"127.0.0.1:{server.port}"
    server.stop(grace=1)


def test_each_status_a_caller_handles_has_its_type(target: str) -> None:
    with BufferClient(target, retries=0) as client:
        client.create_table("g", group_size=8)
        client.push(payload("grpo_group.trxp"), table="g")
        cases = [
            (lambda: client.push((BAD_DIR / "bad_magic.bin").read_bytes()), InvalidArgumentError),
            (lambda: client.stats("nope"), NotFoundError),
            (lambda: client.create_table("g", group_size=4), AlreadyExistsError),
            (lambda: next(client.sample("default", num_groups=1, timeout=0.2)), DeadlineExceededError),
        ]
        for call, kind in cases:
            with pytest.raises(kind) as raised:
                call()
            error = raised.value
            assert type(error) is kind and error.code == kind.status and error.details
            assert isinstance(error, ExpbufError) and isinstance(error, BufferError)  # the old name still catches
            back = pickle.loads(pickle.dumps(error))  # crosses processes (Ray, multiprocessing) intact
            assert type(back) is kind and (back.code, back.details) == (error.code, error.details)
    assert type(ExpbufError(grpc.StatusCode.FAILED_PRECONDITION, "x")) is FailedPreconditionError
    assert type(ExpbufError(grpc.StatusCode.DATA_LOSS, "x")) is ExpbufError  # no subclass: the base


def test_async_batch_ack_is_a_coroutine_function(target: str) -> None:
    async def run() -> dict:
        async with AsyncBufferClient(target) as client:
            await client.push(payload("grpo_group.trxp"))
            async for batch in client.sample(num_groups=1, delivery="lease", max_batches=1, timeout=10):
                assert isinstance(batch, AsyncBatch) and inspect.iscoroutinefunction(batch.ack)
                assert inspect.iscoroutinefunction(batch.nack)
                assert await batch.ack() == len(batch.uids)
            return (await client.stats())["default"]

    stats = asyncio.run(run())
    assert stats.leased == 0 and stats.consumed == 8
