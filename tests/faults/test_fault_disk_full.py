"""A full LMDB map: pushes are refused whole with RESOURCE_EXHAUSTED, reads go on.

The server takes no map-size setting, so the service runs in-process over a Store whose
map may grow to 2 MiB only, behind a real gRPC server on a loopback port.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from expbuf.client import BufferClient, trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.server.store import Store

from faultkit import channel, service_over, stats, stub
from helpers import group_items

pytestmark = pytest.mark.faults

MAP_BYTES = 2 << 20
TABLE = "disk"


@pytest.fixture
def small_map(tmp_path: Path) -> Iterator[tuple[str, Store]]:
    """A gRPC server over a Store whose map cannot grow past MAP_BYTES; (target, store)."""
    with (
        Store(tmp_path / "data", map_size=MAP_BYTES // 2, max_map_size=MAP_BYTES) as store,
        service_over(store) as target,
    ):
        yield target, store


def test_full_map_refuses_pushes_whole_and_keeps_serving(tmp_path: Path, small_map: tuple[str, Store]) -> None:
    target, store = small_map
    with channel(target) as chan:
        buffer = stub(chan)
        config = pb.TableConfig(name=TABLE, estimator=pb.Estimator(name="none"))
        buffer.CreateTable(pb.CreateTableRequest(config=config), timeout=10)
        stored: list[str] = []
        refusal = None
        for task in range(200):  # about 72 KB a group: the map is full long before
            items = group_items("full", task, 4, response=2000)
            try:
                reply = buffer.Push(pb.PushRequest(table=TABLE, payload=trxp.build(items)), timeout=30)
            except grpc.RpcError as exc:
                refusal, refused = exc, [item.uid for item in items]
                break
            stored += reply.stored_uids
        assert refusal is not None, f"{len(stored)} experiences fitted in a {MAP_BYTES >> 20} MiB map"
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (refusal.code(), refusal.details())
        details = refusal.details()
        assert "full" in details.lower() and str(tmp_path / "data") in details, (
            f"the refusal should say the map or disk is full, and where: {details!r}"
        )
        assert stored, "the first push already failed"
        for task in range(10_000):  # small experiences, one a push, fill the pages the groups left
            try:
                reply = buffer.Push(
                    pb.PushRequest(
                        table=TABLE, payload=trxp.build(group_items("last", task, 1, response=500, prompt=500))
                    )
                )
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                break
            stored += reply.stored_uids

        get = buffer.Get(pb.GetRequest(table=TABLE, uids=refused), timeout=10)
        assert list(get.missing_uids) == refused, "a refused push left part of its group stored"
        get = buffer.Get(pb.GetRequest(table=TABLE, uids=stored), timeout=10)
        assert not get.missing_uids and len(trxp.parse(get.payload)) == len(stored)
        s = stats(buffer, TABLE)
        assert s.pushed == len(stored) and s.ready == len(stored) and s.groups_pending == 0, s
        assert buffer.ServerInfo(pb.ServerInfoRequest(), timeout=10).lmdb_map_used_ratio > 0.5
    # a trainer's Sample stream consumes every group of the full store, and pushes are taken again
    groups = sum(uid.startswith("full") for uid in stored) // 4 + sum(uid.startswith("last") for uid in stored)
    with BufferClient(target, timeout=30) as client:
        consumed = [
            uid
            for batch in client.sample(TABLE, num_groups=1, delivery="consume", max_batches=groups)
            for uid in batch.uids
        ]
        assert sorted(consumed) == sorted(stored)
    with channel(target) as chan:
        items = group_items("again", 0, 4, response=2000)
        assert stub(chan).Push(pb.PushRequest(table=TABLE, payload=trxp.build(items)), timeout=30).stored_uids
    assert store.verify(TABLE) == []
