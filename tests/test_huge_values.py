"""Values a table cannot compute or serve in float32, the dtype a batch carries advantages in:
a reward beyond float32's range is refused at push, naming the field and the bound; an
estimator whose result overflows float32 fails that group alone; and a sample never fails
for a group it cannot serve. A real server on loopback, real LMDB, and raw gRPC beside the
Python client."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from expbuf.client import BufferClient, InvalidArgumentError, trxp
from expbuf.client.trxp.codec.common import FLOAT32_MAX
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer
from expbuf.server.store import Store
from expbuf.server.store.schema.estimator_registry import ESTIMATORS
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import group_items, make_experience

pytestmark = pytest.mark.client_timeout(20)

# In this order: each leaves the groups ready for the next.
DELIVERIES = {"replay": pb.DELIVERY_REPLAY, "lease": pb.DELIVERY_LEASE, "consume": pb.DELIVERY_CONSUME}
WAIT = 0.2  # a sample's wait for its second group: a partial batch after it where one failed


def group(task: int, rewards: list[float], batch: int = 1) -> bytes:
    """A group's TRXP bytes with these rewards, built without the encoder's checks (as another
    client, or Trinity-RFT's own serializer, would send them)."""
    items = [trxp.from_experience(make_experience(batch, task, run)) for run in range(len(rewards))]
    for item, reward in zip(items, rewards, strict=True):
        item.meta["reward"] = reward
    return trxp.build(items)


@pytest.mark.parametrize("reward", [1e300, -1e300, 3.5e38, 10**39])
def test_a_reward_beyond_float32_is_refused_at_push_by_name(client: BufferClient, reward: float) -> None:
    client.create_table("t", group_size=2, estimator="opmd")
    with pytest.raises(InvalidArgumentError) as info:
        client.push(group(0, [1.0, reward]), table="t")
    assert "field 'reward'" in info.value.details and "beyond float32's range" in info.value.details
    assert repr(FLOAT32_MAX) in info.value.details
    stats = client.stats("t")["t"]
    assert (stats.pushed, stats.pending, stats.ready) == (0, 0, 0)
    assert client.push(group(1, [1.0, FLOAT32_MAX]), table="t").stored  # the bound itself is a reward
    with pytest.raises(trxp.TrxpError, match=r"field .reward.*float32"):  # the client's encoder says it first
        client.push([make_experience(1, 2, 0, reward=reward)], table="t")


def settle(client: BufferClient, table: str) -> None:
    deadline = time.monotonic() + 30
    while client.stats(table)[table].computing and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_a_group_an_estimator_cannot_compute_in_float32_fails_alone(
    server: ExpbufServer, client: BufferClient, estimator: str
) -> None:
    """Rewards at float32's bounds: where the estimator's values overflow float32 (rloo's
    difference of two, say), that group fails, naming float32; a good group pushed with it is
    served by every delivery, over the Python client and raw gRPC alike, and no Sample fails."""
    client.create_table("t", group_size=2, estimator=estimator)
    client.push(group(0, [FLOAT32_MAX, -FLOAT32_MAX]), "t")
    client.push(group(1, [1.0, 0.0]), "t")
    settle(client, "t")
    stats = client.stats("t")["t"]
    assert stats.groups_ready + stats.groups_failed == 2 and stats.groups_ready >= 1
    if stats.groups_failed:
        assert "float32" in stats.last_failure and "group 1/0" in stats.last_failure
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.ExperienceBufferStub(channel)
        for name, delivery in DELIVERIES.items():
            request = pb.SampleRequest(
                table="t", num_groups=2, delivery=delivery, wait_seconds=WAIT, allow_partial=True
            )
            request.lease_seconds = 60
            replies = list(stub.Sample(iter([request]), timeout=20))
            assert replies and all(trxp.decode_reply(r.payload) for r in replies), name
            if name == "lease":
                for reply in replies:
                    client.nack(reply.lease_id, table="t")
            if name == "replay":
                for batch in client.sample("t", num_groups=2, delivery="replay", timeout=WAIT, allow_partial=True):
                    finite = [e.advantages is None or bool(e.advantages.isfinite().all()) for e in batch.experiences]
                    assert all(finite)
                    break


@pytest.mark.usefixtures("records_layout")  # it writes the item records an older release left
def test_a_stored_advantage_beyond_float32_fails_its_group_when_sampled(tmp_path: Path) -> None:
    """An advantage an older release stored beyond float32 (before values were checked as float32):
    the sample that finds it fails that group, names it, and serves the others. (The table
    computes nothing itself: the test writes the stored values, as that release left them.)"""
    with Store(tmp_path / "data") as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        store.put("t", group_items(1, 0, 2))
        store.put("t", group_items(1, 1, 2))

        def overflow(txn) -> None:
            tt = store.catalog.state(txn, *store.catalog.lookup("t"))
            grp = tt.existing_group("1/0")
            for uid, rec in tt.members(grp).items():
                rec.advantage = 1e300
                tt.put_item(uid, rec)
            tt.save()

        store.environment.submit(overflow)
        batch = store.sample(TakeSpec("t", num_groups=1))
        assert set(batch.group_ids) == {"1/1"}
        stats = store.stats("t")
        assert (stats["groups_failed"], stats["damaged"], stats["ready"]) == (1, 0, 0)
        assert "group 1/0" in stats["last_failure"] and "beyond float32" in stats["last_failure"]
        assert store.verify("t") == []
