"""Records a data directory lost (server/store/rules/quarantine.py, core/verbs/retire.py): an
experience's record and its payload both gone, a ready group's record gone, a member's record gone
under a group that is evicted or whose lease ends. Each is met by the request that reaches it,
which quarantines what is lost, serves or retires the rest, and leaves the table's counters what
its records say, so `store.verify` finds nothing after it. The damage is made as
tests/test_quarantine.py makes it: a row deleted from one database, as a lost page would."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_quarantine import lose, uids

from expbuf.client import BufferClient
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import TableFull
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import group_items, make_experience


def counted(store: Store) -> dict[str, int]:
    stats = store.stats("t")
    return {name: stats[name] for name in ("ready", "leased", "failed", "quarantined", "damaged", "groups_failed")}


def stored_bytes(store: Store, tasks: list[int]) -> int:
    """The bytes of the payloads of these tasks' groups, read back from the store."""
    return sum(map(len, store.get("t", [uid for task in tasks for uid in uids(task)]).values()))


# ---- an experience whose record and payload are both lost ---------------------------------------


def test_a_member_lost_with_its_payload_leaves_the_table_s_bytes_and_a_push_that_fits_is_stored(
    tmp_path: Path,
) -> None:
    """The sample that buries a member whose record and payload are gone takes its bytes out of
    the table's counter: its record said how many, and nothing else does. They stayed counted, so
    Stats showed bytes the table no longer held and a push that fitted was refused as full."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("probe", estimator="none", group_size=4))
        for task in range(4):
            store.put("probe", group_items(0, task, 4, reward=float(task)))
        full = store.stats("probe")["bytes"]
        store.create_table(TableConfig.of("t", estimator="none", group_size=4, capacity_bytes=full))
        for task in range(4):
            store.put("t", group_items(0, task, 4, reward=float(task)), timeout=0)
        lost = uids(1)[2]
        lose(store, "t", lost, "items")
        lose(store, "t", lost, "blobs")
        batch = store.sample(TakeSpec("t", num_groups=2, wait_seconds=0), hold=False)
        assert batch is not None and sorted(set(batch.group_ids)) == ["0/0", "0/2"]
        assert counted(store) == {
            "ready": 4, "leased": 0, "failed": 3, "quarantined": 1, "damaged": 1, "groups_failed": 1,
        }  # fmt: skip
        assert store.stats("t")["bytes"] == stored_bytes(store, [3])
        assert store.verify("t") == []
        # Three groups fit beside the one left, as many as the table held at its fullest.
        for task in range(4, 7):
            store.put("t", group_items(0, task, 4, reward=float(task)), timeout=0)
        assert store.stats("t")["bytes"] == full
        with pytest.raises(TableFull, match="table 't'"):
            store.put("t", group_items(0, 7, 4), timeout=0)
        assert store.verify("t") == []


# ---- a ready group whose record is lost ----------------------------------------------------------


def ready_with_a_replayed_group(store: Store, version: int | None = 1) -> None:
    """Four ready groups, 0/1 the first a priority order takes, replayed once: its priority is now
    its own (lowered, reuse.py), no longer its members' highest. With a `version`, the version
    index holds them too."""
    store.create_table(TableConfig.of("t", estimator="none", group_size=4, priority_decay=0.5))
    for task in range(4):
        priority = 5.0 if task == 1 else 1.0
        store.put("t", group_items(0, task, 4, reward=float(task), priority=priority, version=version))
    replayed = store.sample(TakeSpec("t", num_groups=1, order="priority", delivery="replay"), hold=False)
    assert replayed is not None and set(replayed.group_ids) == {"0/1"}


@pytest.mark.parametrize("order", ["fifo", "lifo", "uniform", "priority"])
@pytest.mark.parametrize(
    ("version", "fresh"), [(1, None), (1, 1), (None, None)], ids=["any-version", "min-version", "no-version"]
)
def test_a_sample_fails_a_ready_group_whose_record_is_lost_and_serves_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, order: str, version: int | None, fresh: int | None
) -> None:
    """The sample that reaches a ready group whose record is gone (its members' records and
    payloads stored) fails it, named in the log and in Stats, and serves the other groups; the
    members keep their payloads for Get, as a group failed for damage does. It answered INTERNAL,
    "group 0/1 is named but not stored", every time it reached the group."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        ready_with_a_replayed_group(store, version)
        lose(store, "t", "0/1", "groups")
        assert any("group 0/1" in problem for problem in store.verify("t"))
        spec = TakeSpec("t", num_groups=4, wait_seconds=0, order=order, min_model_version=fresh, allow_partial=True)
        batch = store.sample(spec, hold=False)
        assert batch is not None and sorted(set(batch.group_ids)) == ["0/0", "0/2", "0/3"]
        assert counted(store) == {
            "ready": 0, "leased": 0, "failed": 4, "quarantined": 0, "damaged": 0, "groups_failed": 1,
        }  # fmt: skip
        assert "group 0/1" in store.stats("t")["last_failure"]
        assert any("table t" in r.getMessage() and "group 0/1" in r.getMessage() for r in caplog.records)
        assert store.stats("t")["bytes"] == 0
        assert store.get("t", uids(1)).keys() == set(uids(1))
        assert store.verify("t") == []
        assert store.sample(TakeSpec("t", num_groups=1, wait_seconds=0, order=order), hold=False) is None


def test_a_sample_left_short_by_a_lost_group_record_keeps_the_failure(tmp_path: Path) -> None:
    """Too few groups left for the batch once the lost one failed: no batch, the failure stands."""
    with Store(tmp_path) as store:
        ready_with_a_replayed_group(store)
        lose(store, "t", "0/1", "groups")
        assert store.sample(TakeSpec("t", num_groups=4, wait_seconds=0), hold=False) is None
        assert counted(store)["groups_failed"] == 1 and store.stats("t")["groups_ready"] == 3
        assert store.verify("t") == []


def test_a_sample_stream_past_a_lost_group_record_is_served_and_the_server_stays_healthy(
    start_server: Servers,
) -> None:
    """Through the server: the Sample stream is served the other groups, not refused INTERNAL; the
    failure shows in Stats, and the server answers its health check SERVING."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        client.create_table("t", estimator="none", group_size=4)
        for task in range(3):
            client.push([make_experience(0, task, run) for run in range(4)], "t")
        lose(server.store, "t", "0/1", "groups")
        served = [uid for batch in itertools.islice(client.sample("t", num_groups=1), 2) for uid in batch.uids]
        assert sorted(served) == sorted(uids(0) + uids(2))
        stats = client.stats("t").tables["t"]
        assert (stats.groups_failed, stats.groups_ready, stats.ready) == (1, 0, 0)
        assert "group 0/1" in stats.last_failure
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert server.store.verify("t") == []
