"""Small hostile payloads that cost the server far more than their size, against an `expbuf serve` child.

Both use pickle memo references: one shared list referenced four times per level over
30 levels (1.5 KB that a tree walk visits 4**30 times), and one 512 KiB string
referenced 300 times (which re-pickling without a memo expands to 150 MiB). Each must be
refused with INVALID_ARGUMENT at a cost bounded by its size, and the server must stay
healthy. The child's address space is capped, so a regression cannot take the machine's
memory with it.
"""

from __future__ import annotations

import copy
import resource
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from expbuf.client import trxp
from expbuf.client.rpc import wire
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc

from faultkit import channel, computed, cpu_seconds, group, healthy, peak_rss_bytes, reset_peak_rss, stats, stub
from helpers import ServerProcess

pytestmark = pytest.mark.faults


CPU_BOUND_SECONDS = 5.0  # generous: a refusal costs milliseconds
RSS_BOUND_BYTES = 64 << 20
HEADROOM_BYTES = 1536 << 20


def capped(server: ServerProcess) -> ServerProcess:
    """Cap the child's address space a little above what it maps now."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            limit = int(line.split()[1]) * 1024 + HEADROOM_BYTES
            resource.prlimit(server.proc.pid, resource.RLIMIT_AS, (limit, limit))
            return server
    raise AssertionError("no VmSize for the server")


def with_meta(**extra: object) -> bytes:
    """A one-experience TRXP payload whose info carries `extra`."""
    (item,) = group("hostile", 0, size=1)
    meta = copy.deepcopy(item.meta)
    meta["info"].update(extra)
    return trxp.build([trxp.RawItem(meta, item.tensors)])


def memo_tower(levels: int = 30, fanout: int = 4) -> list:
    """A list holding the same list `fanout` times, `levels` deep: tiny pickled, 4**30 nodes as a tree."""
    node: list = []
    for _ in range(levels):
        node = [node] * fanout
    return node


def refuse(buffer: pb_grpc.ExperienceBufferStub, payload: bytes) -> grpc.RpcError | None:
    """The push's error; None if it was stored."""
    try:
        buffer.Push(pb.PushRequest(payload=payload), timeout=10)
    except grpc.RpcError as exc:
        return exc
    return None


def test_memo_reference_tower_is_refused_within_a_cpu_bound(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    payload = with_meta(tower=memo_tower())
    assert len(payload) < 2048
    server = capped(serve(str(tmp_path / "data"), fresh=True))
    before = cpu_seconds(server.proc.pid)
    with channel(server.target) as chan:
        buffer = stub(chan)
        exc = refuse(buffer, payload)
        spent = cpu_seconds(server.proc.pid) - before
        assert exc is not None, "the hostile payload was stored"
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (
            f"a {len(payload)}-byte push got {exc.code().name} ({exc.details()}); the server has spent {spent:.1f} "
            "CPU-seconds on it"
        )
        assert spent < CPU_BOUND_SECONDS, f"refusing a {len(payload)}-byte payload cost {spent:.1f} CPU-seconds"
        assert healthy(chan)
        assert stats(buffer).pushed == 0
    assert server.stop(signal.SIGTERM) == 0


def test_memo_expansion_bomb_is_refused_with_bounded_memory(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    chunk = "x" * (512 << 10)
    payload = with_meta(pad=[chunk] * 300)  # 150 MiB once every reference is written out
    assert len(payload) < 1 << 20
    server = capped(serve(str(tmp_path / "data"), fresh=True))
    with channel(server.target) as chan:
        buffer = stub(chan)
        assert healthy(chan)
        before = reset_peak_rss(server.proc.pid)
        exc = refuse(buffer, payload)
        grown = peak_rss_bytes(server.proc.pid) - before
        what = f"a {len(payload) >> 10} KiB push raised the server's peak RSS by {grown >> 20} MiB"
        assert exc is not None, f"{what} and was stored"
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{exc.code().name}: {exc.details()}"
        assert grown < RSS_BOUND_BYTES, what
        assert healthy(chan)
        s = stats(buffer)
        assert s.pushed == 0 and s.bytes == 0, s


@pytest.mark.parametrize("estimator", ["opmd", "rloo", "reinforce"])
def test_huge_rewards_stop_no_table(child_server: ServerProcess, estimator: str) -> None:
    """Rewards past float32 (finite in float64) are refused at push by name, storing nothing;
    rewards at float32's bounds whose advantages overflow fail their group alone; every Sample
    of the table goes on (the review saw 9 of 9 fail INTERNAL after one reward of 1e300). The
    estimators' tables share one server (conftest's `child_server`)."""
    table = f"huge_{estimator}"
    with channel(child_server.target) as chan:
        buffer = stub(chan)
        config = wire.table_to_proto({"name": table, "group_size": 2, "estimator": estimator})
        buffer.CreateTable(pb.CreateTableRequest(config=config), timeout=10)

        def rewarded(task: int, rewards: tuple[float, ...]) -> bytes:
            items = group("huge", task, size=len(rewards))
            for item, reward in zip(items, rewards, strict=True):
                item.meta["reward"] = reward
            return trxp.build(items)

        for task, reward in enumerate((1e300, -1e300, 3.5e38, float(2**128), 10**39)):
            with pytest.raises(grpc.RpcError) as info:
                buffer.Push(pb.PushRequest(table=table, payload=rewarded(task, (1.0, reward))), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "field 'reward'" in info.value.details() and "float32" in info.value.details()
        assert stats(buffer, table).pushed == 0
        bound = 3.4028234663852886e38
        buffer.Push(pb.PushRequest(table=table, payload=rewarded(10, (bound, -bound))), timeout=10)
        for task in range(11, 14):
            buffer.Push(pb.PushRequest(table=table, payload=rewarded(task, (1.0, 0.0))), timeout=10)
        computed(buffer, table)  # the module's first push loads the child's torch
        for delivery in (pb.DELIVERY_REPLAY, pb.DELIVERY_LEASE, pb.DELIVERY_CONSUME):
            request = pb.SampleRequest(
                table=table, num_groups=1, delivery=delivery, lease_seconds=60, wait_seconds=5, max_batches=1
            )
            (reply,) = list(buffer.Sample(iter([request]), timeout=30))
            assert all(item.tensors["advantages"] for item in trxp.parse(reply.payload))
        s = stats(buffer, table)
        assert s.groups_ready + s.groups_leased + s.groups_failed + s.consumed // 2 == 4
        assert healthy(chan)
