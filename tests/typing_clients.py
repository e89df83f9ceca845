"""What mypy sees of the clients' declared calls (rpc/declare.py): tests/typecheck.py checks this
file, and each `assert_type` fails the check where a client's method is not the call's signature
and result (a coroutine of it for an asyncio client). It is read by mypy, never run."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, assert_type

from expbuf.client import AsyncBufferClient, BufferClient, Experience, Prompt
from expbuf.client.results import ExperiencePage, FailedRuns, FieldBatch, GetResult, TableInfo
from expbuf.client.schema.prompts import Claim, DatasetInfo
from expbuf.client.shards.blocking import AsyncShardedBufferClient, LiveResult, ShardedBufferClient


def blocking(client: BufferClient, prompt: Prompt) -> None:
    assert_type(client.put_values(["k"], [b"v"], table="t"), int)
    assert_type(client.get_values(["k"], only_own=True), list[bytes | None])
    assert_type(client.fail_runs(["0/0/0/0/r0s0"], "t", reasons=["timeout"]), FailedRuns)
    assert_type(client.create_table("t", exist_ok=True, group_size=8), TableInfo)
    assert_type(client.get_partials(["0/0"]), list[Experience])
    assert_type(client.report_prompts({prompt: [1.0]}), int)
    assert_type(client.read_part("lease", 0, 2, ["tokens"], balance="count"), FieldBatch)
    assert_type(client.get_part("lease", 0, 2, equal=True), GetResult)
    assert_type(client.claim("t", "math", 4, wait=1.0), Claim)
    assert_type(client.create_dataset("t", "math", 100, epochs=2), DatasetInfo)
    assert_type(client.list_experiences("t", states=["ready"]), ExperiencePage)
    assert_type(client.writers("t", 1), tuple[int, bool])
    assert_type(client.reset_offpolicy("t"), dict[str, int])


async def awaiting(client: AsyncBufferClient, prompt: Prompt) -> None:
    put = assert_type(client.put_values(["k"], [b"v"], table="t"), Coroutine[Any, Any, int])  # as `async def`'s
    assert_type(await put, int)
    assert_type(await client.fail_runs(["0/0/0/0/r0s0"], reasons=["timeout"]), FailedRuns)
    assert_type(await client.create_table("t", preset="queue"), TableInfo)
    assert_type(await client.get_partials(["0/0"], "t"), list[Experience])
    assert_type(await client.report_prompts([(prompt, [1.0])]), int)
    assert_type(await client.read_part("lease", 0, 2, ["tokens"], share=0, of=2), FieldBatch)
    assert_type(await client.claim("t", "math", lease_seconds=60.0), Claim)


async def sharded(client: ShardedBufferClient, aio: AsyncShardedBufferClient) -> None:
    assert_type(client.fail_runs(["0/0/0/0/r0s0"]), FailedRuns)
    assert_type(client.claim("t", "math"), Claim)
    assert_type(client.read_fields(["u"], ["tokens"], share=(0, 3), of=4), FieldBatch)
    assert_type(client.reset_offpolicy("t"), dict[str, dict[str, int]])  # each shard's answer
    assert_type(client.shard_stats("t"), LiveResult)
    assert_type(await aio.put_values(["k"], [b"v"]), int)
    assert_type(await aio.read_part("lease", 0, 2, ["tokens"]), FieldBatch)
    assert_type(await aio.ledger("t", "math"), DatasetInfo)
    assert_type(await aio.reset_offpolicy("t"), dict[str, dict[str, int]])
    assert_type(await aio.shard_stats(), LiveResult)


def refused(client: BufferClient, aio: AsyncBufferClient, shards: ShardedBufferClient) -> None:
    """Calls a client's real signature refuses: each ignore is needed (warn_unused_ignores)."""
    client.fail_runs(["0/0/0/0/r0s0"], "t", ["timeout"])  # type: ignore[call-arg]  # reasons is keyword-only
    client.get_values(["k"], "t", True)  # type: ignore[call-arg]  # so is only_own
    client.read_part("lease", 0, 2, ["tokens"], bogus=1)  # type: ignore[call-arg]
    client.claim("t", "math", count="4")  # type: ignore[arg-type]
    aio.put_values(["k"], [b"v"]).bit_length()  # type: ignore[attr-defined]  # a coroutine, not yet its int
    shards.writers("t", 1)  # type: ignore[attr-defined]  # a client of one server's only
    client.shard_stats()  # type: ignore[attr-defined]  # a sharded client's only
