"""A group that could never be sent in one Sample reply is refused at push, naming the limit,
and nothing of it is stored; every group that is accepted can be sampled."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from expbuf.client import BufferClient, trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import TooLarge

from conftest import Servers
from helpers import make_experience

LIMIT = 64 << 10


def group_payload(task: int, response: int, runs: range = range(4)) -> bytes:
    return trxp.build([trxp.from_experience(make_experience(0, task, run, response=response)) for run in runs])


def test_every_accepted_group_is_delivered_and_the_others_are_refused(start_server: Servers) -> None:
    server = start_server(max_message_bytes=LIMIT)
    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        accepted, refused = [], []
        for task, response in enumerate(range(500, 1300, 25)):  # groups from well below to above the limit
            try:
                stub.Push(pb.PushRequest(payload=group_payload(task, response)), timeout=30)
                accepted.append(task)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                assert f"max_message_bytes = {LIMIT}" in exc.details() and "never be delivered" in exc.details()
                refused.append(task)
        assert accepted and refused and max(accepted) < min(refused)
        assert stub.Stats(pb.StatsRequest(table="default"), timeout=10).tables[0].pushed == 4 * len(accepted)
    with BufferClient(f"127.0.0.1:{server.port}") as client:  # a batch too large would fail the stream
        sizes = [
            len(batch.payload)
            for batch in client.sample(num_groups=1, max_batches=len(accepted), timeout=10, delivery="consume")
        ]
    assert len(sizes) == len(accepted)
    assert LIMIT * 0.8 < max(sizes) <= LIMIT, "the bound refuses groups far below the limit"


def test_a_group_that_grows_past_the_limit_is_refused_at_the_push_that_would_do_it(tmp_path: Path) -> None:
    from expbuf.server.store.schema.table_config import TableConfig

    with Store(tmp_path, max_reply_bytes=LIMIT) as store:
        store.create_table(TableConfig.of(name="g8", group_size=8))
        first = group_payload(0, 600, range(3))
        store.put("g8", trxp.parse(first))
        with pytest.raises(TooLarge, match=f"group 0/0 would take .* max_message_bytes = {LIMIT}"):
            store.put("g8", trxp.parse(group_payload(0, 600, range(3, 6))))
        stats = store.stats("g8")
        assert (stats["pushed"], stats["pending"]) == (3, 3)  # the refused push stored nothing
        store.put("g8", trxp.parse(first))  # a retry of what is stored is still a duplicate
        store.put("g8", trxp.parse(group_payload(0, 100, range(3, 8))))  # smaller members complete it
        assert store.stats("g8")["groups_pending"] == 0
