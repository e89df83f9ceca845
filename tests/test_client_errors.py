"""The clients' error types and the asyncio batch's coroutine methods, against a real server."""

from __future__ import annotations

import asyncio
import inspect
import pickle

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

from conftest import BAD_DIR, Servers, payload


@pytest.fixture
def target(start_server: Servers) -> str:
    return f"127.0.0.1:{start_server().port}"


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
