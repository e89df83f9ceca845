"""What mypy sees of the clients' declared calls (rpc/declare.py): tests/typecheck.py checks this
file, and each `assert_type` fails the check where a client's method is not the call's signature
and result (a coroutine of it for an asyncio client). It is read by mypy, never run."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, assert_type

from expbuf.client import AsyncBufferClient, BufferClient
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient


def blocking(client: BufferClient) -> None:
    assert_type(client.put_values(["k"], [b"v"], table="t"), int)
    assert_type(client.get_values(["k"], only_own=True), list[bytes | None])
    assert_type(client.clear_values(["k"], "t"), int)


async def awaiting(client: AsyncBufferClient) -> None:
    put = assert_type(client.put_values(["k"], [b"v"], table="t"), Coroutine[Any, Any, int])  # as `async def`'s
    assert_type(await put, int)
    assert_type(await client.get_values(["k"], "t"), list[bytes | None])


async def sharded(client: ShardedBufferClient, aio: AsyncShardedBufferClient) -> None:
    assert_type(client.put_values(["k"], [b"v"]), int)
    assert_type(await aio.put_values(["k"], [b"v"]), int)
    assert_type(await aio.clear_values(["k"]), int)


def refused(client: BufferClient, aio: AsyncBufferClient) -> None:
    """Calls a client's real signature refuses: each ignore is needed (warn_unused_ignores)."""
    client.get_values(["k"], "t", True)  # type: ignore[call-arg]  # only_own is keyword-only
    client.put_values(["k"], [b"v"], bogus=1)  # type: ignore[call-arg]
    client.clear_values("k", table=1)  # type: ignore[arg-type]
    aio.put_values(["k"], [b"v"]).bit_length()  # type: ignore[attr-defined]  # a coroutine, not yet its int
