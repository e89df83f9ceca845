"""What a sharded client believes of a shard after a call whose deadline its caller chose
(push's `timeout`) passed unanswered: nothing either way, as the shard was given no more time than
the caller allowed. Two in-process shards on loopback, real LMDB; the plan alone where its
outcomes are answered here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from expbuf.client import BufferError
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient, ShardError
from expbuf.client.shards.steps import Call

from conftest import Servers
from test_sharding import groups, in_process_shards

# Shorter than any shard's answer to a push: the caller's own deadline passes first.
TOO_SHORT = 1e-4


def pushed_too_briefly(kind: type[ShardedBufferClient | AsyncShardedBufferClient], targets: dict[str, str]) -> tuple:
    """The error of a push of table t with a timeout too short to be answered, made by a client
    of `kind` that has reached both shards; and the shards that client then believes down."""
    items = groups(0, range(64), range(2))
    if kind is ShardedBufferClient:
        with ShardedBufferClient(targets, timeout=5.0) as client:
            client.create_table("t", group_size=2, estimator="none")
            with pytest.raises(ShardError) as failed:
                client.push(items, table="t", timeout=TOO_SHORT)
            return failed.value, set(client._down)

    async def push() -> tuple:
        async with AsyncShardedBufferClient(targets, timeout=5.0) as client:
            await client.create_table("t", group_size=2, estimator="none")
            with pytest.raises(ShardError) as failed:
                await client.push(items, table="t", timeout=TOO_SHORT)
            return failed.value, set(client._down)

    return asyncio.run(push())


@pytest.mark.parametrize("kind", [ShardedBufferClient, AsyncShardedBufferClient])
def test_a_push_past_its_callers_own_timeout_leaves_its_shards_believed_up(
    start_server: Servers, tmp_path: Path, kind: type[ShardedBufferClient | AsyncShardedBufferClient]
) -> None:
    """A push whose `timeout` passes before the shards answer fails DEADLINE_EXCEEDED for its
    caller, and the live shards stay believed up: the trainer's next calls go to them with the
    client's deadline and retries, not as probes of shards down (one short try). The shards the
    error names are those whose answer the deadline beat: on a loaded machine gRPC's timer may fire
    only after a shard's answer came, and that shard's part is then stored and answered."""
    targets, _ = in_process_shards(start_server, tmp_path)
    error, down = pushed_too_briefly(kind, targets)
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.shards and set(error.shards) <= set(targets)
    assert all(f"shard {shard} " in error.details for shard in error.shards), error.details
    assert down == set()


def test_a_callers_deadline_passing_leaves_a_shard_believed_down_so() -> None:
    """The plan alone: a shard believed down whose push passed its caller's timeout unanswered is
    still believed down (no answer came), and one that went away (UNAVAILABLE) is believed down."""
    late = BufferError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    gone = BufferError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    with ShardedBufferClient({"s0": "127.0.0.1:1", "s1": "127.0.0.1:2"}) as client:
        client._down.add("s0")
        plan = client._direct([Call(shard, "push", (b"", "t"), {"timeout": 0.5}) for shard in ("s0", "s1")])
        next(plan)
        with pytest.raises(StopIteration):
            plan.send([late, gone])
        assert client._down == {"s0", "s1"}


def test_a_call_to_a_shard_believed_down_goes_with_its_full_client_once_a_probe_finds_it_back() -> None:
    """The plan alone: a call that may degrade (a claim) to a shard believed down is made after a
    quick ServerInfo answers, with the shard's full client (a claim that counts the shard's part
    of a new epoch outlasts the probe's deadline: made as the probe, it never answered and the
    shard stayed down, its prompts never handed out); where the probe gets no answer, the call
    is not made and gets the probe's outcome."""
    gone = BufferError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    claim = Call("s0", "claim", ("t", "d", 4), quick=None)
    with ShardedBufferClient({"s0": "127.0.0.1:1", "s1": "127.0.0.1:2"}) as client:
        client._down.add("s0")
        plan = client._direct([claim, Call("s1", "claim", ("t", "d", 4), quick=None)])
        assert next(plan) == [Call("s0", "server_info", quick=True)]
        made = plan.send(["its info"])
        assert [(call.shard, call.quick) for call in made] == [("s0", False), ("s1", False)]
        with pytest.raises(StopIteration) as answered:
            plan.send(["claimed", "claimed too"])
        assert answered.value.value == ["claimed", "claimed too"] and client._down == set()

        client._down.add("s0")
        plan = client._direct([claim])
        assert next(plan) == [Call("s0", "server_info", quick=True)]
        with pytest.raises(StopIteration) as unmade:
            plan.send([gone])
        assert unmade.value.value == [gone] and client._down == {"s0"}
