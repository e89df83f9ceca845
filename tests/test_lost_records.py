"""Records a data directory lost (server/store/rules/quarantine.py, core/verbs/retire.py): an
experience's record and its payload both gone, a ready group's record gone, a member's record gone
under a group that is evicted or whose lease ends. Each is met by the request that reaches it,
which quarantines what is lost, serves or retires the rest, and leaves the table's counters what
its records say, so `store.verify` finds nothing after it. The damage is made as
tests/test_quarantine.py makes it: a row deleted from one database, as a lost page would."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_lazy_indexes import kept_by, made_before

from expbuf.client import BufferClient, trxp
from expbuf.server.store import Store
from expbuf.server.store.disk import chunk_heads, layout
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.errors import TableFull
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import group_items, make_experience, wait_for
from test_quarantine import garble, hurt, lose, quarantine_logs, uids

# A records table's records lost apart from its payloads; a rows table keeps none to lose (its
# members are its segments' rows).
pytestmark = pytest.mark.usefixtures("records_layout")


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


@pytest.mark.parametrize("db", ["items", "groups"])
@pytest.mark.parametrize("order", ["fifo", "lifo", "priority"])  # each reaches 0/1 before its batch is full
def test_a_sample_fails_a_group_whose_record_does_not_decode_and_serves_the_others(
    start_server: Servers, caplog: pytest.LogCaptureFixture, db: str, order: str
) -> None:
    """A record a damaged page left undecodable, a member's or its group's: a sample over gRPC fails
    its group as one whose record is lost (the member quarantined, or the group's members kept for
    Get), named in the log and as the table's last failure, and serves the others; the table checks
    clean after it. The sample was refused INTERNAL (struct.error) every time it reached the group."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    server = start_server()
    store = server.store
    store.create_table(TableConfig.of("t", estimator="none", group_size=4))
    for task in range(3):
        store.put("t", group_items(0, task, 4, reward=float(task), priority=5.0 if task == 1 else 1.0))
    garble(store, "t", uids(1)[2] if db == "items" else "0/1", db)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        batch = next(iter(client.sample("t", num_groups=2, order=order, max_batches=1, timeout=5)))
        assert sorted(set(batch.group_ids)) == ["0/0", "0/2"]
    quarantined = int(db == "items")
    assert {name: n for name, n in counted(store).items() if name not in ("ready", "leased")} == {
        "failed": 4 - quarantined, "quarantined": quarantined, "damaged": quarantined, "groups_failed": 1,
    }  # fmt: skip
    assert "group 0/1" in store.stats("t")["last_failure"]
    assert any("0/1" in r.getMessage() and "does not decode" in r.getMessage() for r in caplog.records)
    assert store.get("t", uids(1)).keys() == set(uids(1)) - ({uids(1)[2]} if quarantined else set())
    assert store.verify("t") == []


# ---- a member's record lost under a group that is evicted or whose lease ends ------------------


@pytest.mark.parametrize("dbs", [("items",), ("items", "blobs")], ids=["record", "record-and-payload"])
@pytest.mark.parametrize("run", [0, 2], ids=["oldest", "middle"])
def test_an_eviction_buries_a_member_whose_record_is_lost_and_evicts_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, dbs: tuple[str, ...], run: int
) -> None:
    """A push into a full table (when_full=evict) evicts the oldest group, one of whose members'
    records is gone: that member is quarantined, logged, the others evicted, the push stored. It
    was refused INTERNAL ("experience ... is named but not stored"), the lost member's place in the
    insertion order read as the next oldest, and Stats failed alike on a table so left."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(
            TableConfig.of("t", estimator="none", group_size=4, capacity_experiences=12, when_full="evict")
        )
        for task in range(3):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        lost = uids(0)[run]
        for db in dbs:
            lose(store, "t", lost, db)
        assert store.put("t", group_items(0, 3, 4, reward=3.0)).stored == uids(3)
        stats = store.stats("t")
        assert (stats["evicted"], stats["quarantined"], stats["damaged"], stats["ready"]) == (3, 1, 1, 12)
        assert stats["bytes"] == stored_bytes(store, [1, 2, 3])
        assert f"experience {lost}" in stats["last_failure"]
        assert quarantine_logs(caplog, lost) == 1
        assert store.verify("t") == []


def test_a_stale_group_dropped_buries_a_member_whose_record_is_lost(tmp_path: Path) -> None:
    """A group that falls stale (evict_stale) and is dropped with a member's record lost: that
    member is quarantined, the others dropped, the sample served."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4, max_staleness=0, evict_stale=True))
        for task in range(3):
            store.put("t", group_items(0, task, 4, reward=float(task), version=task))
        lose(store, "t", uids(0)[1], "items")
        batch = store.sample(TakeSpec("t", num_groups=1, wait_seconds=0, trainer_version=2), hold=False)
        assert batch is not None and set(batch.group_ids) == {"0/2"}
        stats = store.stats("t")
        assert (stats["dropped"], stats["quarantined"], stats["damaged"], stats["ready"]) == (7, 1, 1, 0)
        assert store.verify("t") == []


def leased_with_a_lost_member(store: Store, delivery: str, *, hold: bool, how: str = "lost") -> tuple[str, TakeSpec]:
    """Group 0/0 taken under a lease (held for a stream with `hold`), then a member's record lost (or
    cut so that it no longer decodes: `how`, test_quarantine.hurt)."""
    store.create_table(TableConfig.of("t", estimator="none", group_size=4))
    for task in range(3):
        store.put("t", group_items(0, task, 4, reward=float(task)))
    spec = TakeSpec("t", num_groups=1, wait_seconds=0, delivery=delivery, lease_seconds=10)
    batch = store.sample(spec, hold=hold)
    assert batch is not None and batch.lease_id and set(batch.group_ids) == {"0/0"}
    hurt(store, "t", uids(0)[1], how)
    return batch.lease_id, spec


@pytest.mark.parametrize("how", ["lost", "cut", "cut in its group"])
@pytest.mark.parametrize("call", ["ack", "confirm"])
def test_a_lease_consumed_buries_a_member_whose_record_is_lost_and_consumes_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, call: str, how: str
) -> None:
    """An ack of a lease, or a stream's confirmation of a consumed batch, whose group lost a
    member's record: that member is quarantined, the others consumed. The lost member stayed
    counted leased, its bytes and its place in the insertion order kept, and Stats of the table
    then failed INTERNAL on the place. A record a damaged page cut (`cut`) is met as a lost one,
    named as the table's last failure: both were refused INTERNAL (struct.error), the lease left
    as it was. One cut inside its group's name became a tombstone of a group cut short, unseen."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        delivery = "lease" if call == "ack" else "consume"
        lease_id, spec = leased_with_a_lost_member(store, delivery, hold=call == "confirm", how=how)
        assert (store.ack(lease_id) if call == "ack" else store.confirm(lease_id, spec)) == 4
        stats = store.stats("t")
        assert (stats["consumed"], stats["quarantined"], stats["damaged"], stats["leased"]) == (3, 1, 1, 0)
        assert stats["bytes"] == stored_bytes(store, [1, 2])
        assert quarantine_logs(caplog, uids(0)[1]) == 1
        why = "its record is not stored" if how == "lost" else "its record does not decode"
        assert stats["last_failure"] == f"group 0/0: experience {uids(0)[1]} quarantined: {why}"
        assert store.verify("t") == []


@pytest.mark.parametrize("met_by", ["ack", "a sample"])
def test_what_reads_every_record_passes_over_one_cut_elsewhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, met_by: str
) -> None:
    """Two reads go through every record of the table: the recount of its bytes after a member's
    record was lost (an ack), and the members of a ready group whose own record was lost, remade
    (a sample). A record of another group cut short of the size's bytes (33) made either raise
    struct.error: the ack refused INTERNAL at every try, the sample alike. They pass over it, its
    bytes counted as a lost record's (none), and the sample that reaches its group meets it as
    lost: the member quarantined, the others served or kept as that meeting has them."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    cut = uids(2)[0]
    with Store(tmp_path) as store:
        if met_by == "ack":
            lease_id, _ = leased_with_a_lost_member(store, "lease", hold=False)
        else:
            store.create_table(TableConfig.of("t", estimator="none", group_size=4))
            for task in range(3):
                store.put("t", group_items(0, task, 4, reward=float(task)))
            lose(store, "t", "0/0", "groups")
        kept = stored_bytes(store, [1, 2]) - len(store.get("t", [cut])[cut])
        garble(store, "t", cut, "items", keep=20)
        if met_by == "ack":
            assert store.ack(lease_id) == 4
            assert store.stats("t")["bytes"] == kept
        else:
            batch = store.sample(TakeSpec("t", num_groups=1, wait_seconds=0), hold=False)
            assert batch is not None and set(batch.group_ids) == {"0/1"}
        batch = store.sample(TakeSpec("t", num_groups=2, wait_seconds=0, allow_partial=True), hold=False)
        assert (batch and set(batch.group_ids)) == ({"0/1"} if met_by == "ack" else None)  # 0/2 fails
        stats = store.stats("t")
        assert (stats["groups_failed"], stats["quarantined"]) == (1 + (met_by != "ack"), 1 + (met_by == "ack"))
        assert quarantine_logs(caplog, cut) == 1
        assert store.verify("t") == []


@pytest.mark.parametrize("call", ["nack", "expiry", "give-back", "replay"])
def test_a_lease_ended_back_fails_a_group_whose_member_s_record_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, call: str
) -> None:
    """A lease that would put its group back in the buffer (a nack, its expiry, a stream giving back
    a batch it did not send, a confirmed replay) fails the group one of whose members' records is
    lost, as a sample would: the member quarantined, the others kept for Get. Each answered
    INTERNAL ("experience ... is named but not stored"), the group left leased."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    now = [1000.0]
    with Store(tmp_path, clock=lambda: now[0]) as store:
        delivery = "replay" if call == "replay" else "lease"
        lease_id, spec = leased_with_a_lost_member(store, delivery, hold=call in ("give-back", "replay"))
        if call == "nack":
            assert store.nack(lease_id) == 0
        elif call == "expiry":
            now[0] += 11
            store.tick()
        elif call == "give-back":
            assert store.give_back(lease_id, "t") == 0
        else:
            assert store.confirm(lease_id, spec) == 0
        assert counted(store) == {
            "ready": 8, "leased": 0, "failed": 3, "quarantined": 1, "damaged": 1, "groups_failed": 1,
        }  # fmt: skip
        assert quarantine_logs(caplog, uids(0)[1]) == 1
        assert store.get("t", uids(0)).keys() == set(uids(0)) - {uids(0)[1]}
        assert store.verify("t") == []
        batch = store.sample(TakeSpec("t", num_groups=2, wait_seconds=0), hold=False)
        assert batch is not None and sorted(set(batch.group_ids)) == ["0/1", "0/2"]


@pytest.mark.parametrize("how", ["lost", "cut"])
def test_through_the_server_an_evicting_push_and_an_ack_over_lost_records_succeed(
    start_server: Servers, how: str
) -> None:
    """Through the server: the push that evicts a group with a lost member is stored, and the ack
    of a lease whose group lost one is answered, neither INTERNAL; Stats counts the quarantined.
    So too where the records are cut so that they no longer decode: the ack was refused INTERNAL
    (struct.error), and every ack of the lease after it."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        client.create_table("t", estimator="none", group_size=4, capacity_experiences=12, when_full="evict")
        for task in range(3):
            client.push([make_experience(0, task, run) for run in range(4)], "t")
        stream = client.sample("t", num_groups=1, delivery="lease", order="lifo", window=1, prefetch=0)
        batch = next(stream)
        stream.close()  # the batch handed over stays leased
        assert set(batch.group_ids) == {"0/2"}
        hurt(server.store, "t", uids(0)[0], how)
        hurt(server.store, "t", uids(2)[3], how)
        assert client.push([make_experience(0, 3, run) for run in range(4)], "t").stored == uids(3)
        assert batch.ack() == 4
        stats = client.stats("t").tables["t"]
        assert (stats.evicted, stats.consumed, stats.quarantined, stats.damaged) == (3, 3, 2, 2)
    assert server.store.verify("t") == []


# ---- a member's record lost under a group that is cooling, completing or computing ------------


def test_a_replayed_group_cooling_fails_when_its_cooldown_ends_if_a_member_s_record_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A replayed group cooling down (reuse_cooldown_seconds) one of whose members' records is lost:
    the sample once its cooldown ends fails it, as a lease ending would, the member quarantined
    and the others kept for Get, and serves the other groups. It answered INTERNAL ("experience ...
    is named but not stored") each time, once the cooldown had ended."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    now = [1000.0]
    with Store(tmp_path, clock=lambda: now[0]) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4, reuse_cooldown_seconds=10.0))
        for task in range(3):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        spec = TakeSpec("t", num_groups=1, wait_seconds=0, delivery="replay")
        replayed = store.sample(spec, hold=False)
        assert replayed is not None and set(replayed.group_ids) == {"0/0"}
        lose(store, "t", uids(0)[1], "items")
        now[0] += 11
        batch = store.sample(TakeSpec("t", num_groups=3, wait_seconds=0, allow_partial=True), hold=False)
        assert batch is not None and sorted(set(batch.group_ids)) == ["0/1", "0/2"]
        assert counted(store) == {
            "ready": 0, "leased": 0, "failed": 3, "quarantined": 1, "damaged": 1, "groups_failed": 1,
        }  # fmt: skip
        assert f"experience {uids(0)[1]}" in store.stats("t")["last_failure"]
        assert quarantine_logs(caplog, uids(0)[1]) == 1
        assert store.get("t", uids(0)).keys() == set(uids(0)) - {uids(0)[1]}
        assert store.stats("t")["bytes"] == 0
        assert store.verify("t") == []


@pytest.mark.parametrize("call", ["push", "seal", "fail-runs", "timeout"])
def test_a_pending_group_completed_with_a_member_s_record_lost_fails_and_the_call_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, call: str
) -> None:
    """A pending group one of whose earlier members' records is lost, completed by the push of its
    last run (or sealed, its last run reported failed, its timeout's release): it fails, the member
    quarantined, the others kept for Get, and the call is answered. Each was refused INTERNAL
    ("experience ... is named but not stored"), the group left pending."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    now = [1000.0]
    with Store(tmp_path, clock=lambda: now[0]) as store:
        store.create_table(
            TableConfig.of("t", estimator="none", group_size=4, min_group_size=2, group_timeout_seconds=60.0)
        )
        store.put("t", group_items(0, 1, 4, reward=1.0))
        items = group_items(0, 0, 4)
        store.put("t", items[:3])
        lose(store, "t", uids(0)[1], "items")
        if call == "push":
            assert store.put("t", items[3:]).stored == uids(0)[3:]
        elif call == "seal":
            assert store.seal("t", "0/0") == 3
        elif call == "fail-runs":
            assert store.fail_runs("t", uids(0)[3:], ["gone"]).recorded == uids(0)[3:]
        else:
            now[0] += 61
            store.tick()
        kept = set(uids(0)[: 4 if call == "push" else 3]) - {uids(0)[1]}
        assert counted(store) == {
            "ready": 4, "leased": 0, "failed": len(kept), "quarantined": 1, "damaged": 1, "groups_failed": 1,
        }  # fmt: skip
        assert (store.stats("t")["pending"], store.stats("t")["groups_pending"]) == (0, 0)
        assert f"experience {uids(0)[1]}" in store.stats("t")["last_failure"]
        assert quarantine_logs(caplog, uids(0)[1]) == 1
        assert store.get("t", uids(0)).keys() == kept
        assert store.stats("t")["bytes"] == stored_bytes(store, [1])
        assert store.verify("t") == []
        batch = store.sample(TakeSpec("t", num_groups=2, wait_seconds=0, allow_partial=True), hold=False)
        assert batch is not None and set(batch.group_ids) == {"0/1"}


@pytest.mark.parametrize("how", ["lost", "cut"])
@pytest.mark.parametrize("when", ["before-backlog", "before-finish"])
def test_a_computing_group_with_a_member_s_record_lost_fails_and_the_others_are_computed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, when: str, how: str
) -> None:
    """A group waiting for its advantages (estimator grpo) one of whose members' records is lost,
    found by the advantage worker's read of the backlog or by the store of its advantages: the
    group fails, the member quarantined, the others kept for Get, and the other group is computed
    and ready. The read of the backlog was refused ("experience ... is named but not stored") at
    each of the worker's passes, every table's advantages held up; the store of the advantages
    alike, the group left computing. A record cut so that it no longer decodes (`cut`) is met as a
    lost one: the read of the backlog failed at it (struct.error) at every pass alike."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="grpo", group_size=4))
        for task in range(2):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        lost = uids(0)[1]
        if when == "before-backlog":
            hurt(store, "t", lost, how)
        (job,) = store.compute_backlog()
        if when == "before-finish":
            assert job.groups == ["0/0", "0/1"]
            hurt(store, "t", lost, how)
        else:
            assert job.groups == ["0/1"]
        store.finish_compute("t", dict.fromkeys(job.records, 0.5), ready=job.groups)
        assert counted(store) == {
            "ready": 4, "leased": 0, "failed": 3, "quarantined": 1, "damaged": 1, "groups_failed": 1,
        }  # fmt: skip
        assert store.stats("t")["groups_computing"] == 0
        assert f"experience {lost}" in store.stats("t")["last_failure"]
        assert quarantine_logs(caplog, lost) == 1
        assert store.get("t", uids(0)).keys() == set(uids(0)) - {lost}
        assert store.stats("t")["bytes"] == stored_bytes(store, [1])
        assert store.compute_backlog() == []
        assert store.verify("t") == []


@pytest.mark.parametrize("call", ["push", "stale"])
def test_a_claimed_prompt_s_group_leaving_with_a_member_s_record_lost_moves_its_prompt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, call: str
) -> None:
    """A claimed prompt's group one of whose members' records is lost, failed as its last run is
    pushed or dropped stale once generated: the prompt ledger reads the rewards of the members
    whose records are stored, the prompt is done with (dropped), and the call is answered. The
    ledger read every member (`zero_variance`, the prompt's statistics) and the call was refused
    ("experience ... is named but not stored")."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, max_staleness=0, evict_stale=True))
        store.claims.create("t", DatasetRecord("math", size=2, zero_variance="skip"))
        (prompt,), _ = store.claims.claim("t", "math", 1, seconds=60)
        runs = [
            trxp.from_experience(
                make_experience(f"math/{prompt.epoch}", f"{prompt.index}@{prompt.attempt}", run, reward=1.0, version=0)
            )
            for run in range(2)
        ]
        gkey = f"math/{prompt.epoch}/{prompt.index}@{prompt.attempt}"
        lost = f"{gkey}/0/0/r0s0"
        if call == "push":
            store.put("t", runs[:1])
            lose(store, "t", lost, "items")
            assert store.put("t", runs[1:]).completed_groups == [gkey]
        else:
            store.put("t", runs)
            store.put("t", group_items(0, 0, 2, version=1))  # a fresh group: the sample that drops the stale one
            lose(store, "t", lost, "items")
            batch = store.sample(TakeSpec("t", num_groups=1, wait_seconds=0, trainer_version=1), hold=False)
            assert batch is not None and batch.group_ids == ["0/0", "0/0"]
        stats = store.stats("t")
        assert (stats["quarantined"], stats["damaged"], stats["ready"], stats["pending"]) == (1, 1, 0, 0)
        assert quarantine_logs(caplog, lost) == 1
        (ds,) = store.claims.datasets("t", "math")
        assert {state: ds.total(state) for state in ("claimed", "generated", "dropped")} == {
            "claimed": 0, "generated": 0, "dropped": 1,
        }  # fmt: skip
        assert store.verify("t") == []


# ---- a lost record met by a background index build ----------------------------------------------


@pytest.mark.parametrize(
    ("order", "fresh", "index"),
    [("priority", None, "prio"), ("fifo", 1, "byver"), ("uniform", None, "slots")],
    ids=["priority", "min-version", "uniform"],
)
@pytest.mark.parametrize("lost", ["group", "member", "garbled-group"])
@pytest.mark.parametrize("when", ["request", "open"])
def test_an_index_built_over_a_lost_record_is_built_and_the_sample_serves_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, order: str, fresh: int | None, index: str, lost: str, when: str
) -> None:
    """A table that lacks an index (made by an earlier release) has it built in the background,
    from the open or for the first request in its order; a ready group whose record is lost (or
    one of whose members' records is) is met by the build or by the sample: the group fails, the
    build completes, and the sample is served the other groups. The build of the priority or the
    version index read each ready group's record and failed at the lost one ("group 0/1 is named
    but not stored"): the request waiting for it was refused INTERNAL, and each request after it
    tried the build again and was refused alike, the order never served. A group record cut inside
    its head (garbled-group) is met as a lost one: the build failed at it with a struct.error."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    store = Store(tmp_path)
    store.create_table(TableConfig.of("t", estimator="none", group_size=4))
    made_before(store)
    for task in range(4):
        store.put("t", group_items(0, task, 4, reward=float(task), priority=5.0 if task == 1 else 1.0, version=1))
    if lost == "garbled-group":
        garble(store, "t", "0/1", "groups", keep=16)
    else:
        lose(store, "t", "0/1" if lost == "group" else uids(1)[2], "groups" if lost == "group" else "items")
    assert index not in (kept_by(store) or set())
    if when == "open":  # the next open builds every index the table lacks, no request asking
        store.close()
        store = Store(tmp_path)
        wait_for(lambda: store.index_builds() == [], "the builds from the open", seconds=30)
        assert store.stats("t")["groups_failed"] == (lost != "member")  # the build met the lost group
    with store:
        spec = TakeSpec("t", num_groups=3, wait_seconds=30, order=order, min_model_version=fresh)
        batch = store.sample(spec, hold=False)
        assert batch is not None and sorted(set(batch.group_ids)) == ["0/0", "0/2", "0/3"]
        assert index in (kept_by(store) or set())
        # Nothing left to serve: a uniform draw may have passed the lost group by, and meets it now.
        assert store.sample(TakeSpec("t", num_groups=1, wait_seconds=0, order=order), hold=False) is None
        wait_for(lambda: store.index_builds() == [], "the builds' end", seconds=30)
        stats = store.stats("t")
        assert (stats["ready"], stats["groups_failed"], stats["quarantined"]) == (0, 1, lost == "member")
        assert "0/1" in stats["last_failure"]
        assert any("0/1" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
        assert not any("is named but not stored" in r.getMessage() for r in caplog.records)
        assert store.verify("t") == []


# ---- a chunked payload whose head is lost -------------------------------------------------------


def sets(store: Store) -> set[int]:
    """The chunk sets stored, by number."""
    with store.environment.read() as txn, txn.cursor(db=store.db["chunks"]) as cur:
        return {int.from_bytes(key[4:12], "big") for key in cur.iternext(values=False)}


@pytest.mark.parametrize(
    ("compression", "response"),
    # a section of some 6 MB, kept in chunks as it is; one of about 0.9 MB, within CHUNK_BYTES,
    # kept in chunks only by a table that compresses (past MIN_COMPRESSED)
    [("none", 700_000), ("zstd", 100_000)],
    ids=["chunks", "zstd-frames"],
)
@pytest.mark.parametrize("how", ["sample", "ack", "delete", "record-and-head"])
def test_an_experience_whose_head_is_lost_takes_its_chunks_when_it_leaves(
    tmp_path: Path, how: str, compression: str, response: int
) -> None:
    """An experience stored in chunks whose head (its value in `blobs`) is lost, its chunks left:
    the sample that quarantines it, the ack that consumes its group, the Delete that names it, and
    the retirement that buries it with its record lost, drop its chunk set (found by its mark,
    which names the experience) with it, and the table checks clean after it. The set stayed, its
    bytes held in the data file for good, and `expbuf check` reported it ("1 chunk set(s) belong to
    no stored payload and to no push"), exit code 1, until `expbuf repair` was run with the server
    stopped."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, compression=compression))
        for task in range(3):
            store.put("t", group_items(0, task, 2, reward=float(task), response=response))
        lost = uids(0, 2)[0]
        with store.environment.read() as txn:
            head = txn.get(layout.table_prefix(store.catalog.lookup("t")[0]) + lost.encode(), db=store.db["blobs"])
        assert head is not None and chunk_heads.is_head(head)
        own = chunk_heads.read_head(head).set_id
        assert len(sets(store)) == 6  # each experience's section in chunks
        leased = None
        if how == "ack":
            leased = store.sample(TakeSpec("t", num_groups=1, delivery="lease", lease_seconds=60), hold=False)
            assert leased is not None and set(leased.group_ids) == {"0/0"}
        lose(store, "t", lost, "blobs")
        if how == "record-and-head":
            lose(store, "t", lost, "items")
        if how in ("sample", "record-and-head"):
            batch = store.sample(TakeSpec("t", num_groups=2, wait_seconds=0), hold=False)
            assert batch is not None and sorted(set(batch.group_ids)) == ["0/1", "0/2"]
            assert (store.stats("t")["quarantined"], store.stats("t")["damaged"]) == (1, 1)
        elif how == "ack":
            assert leased is not None and store.ack(leased.lease_id) == 2
        else:
            assert store.delete("t", uids=[lost]) == 1
        assert own not in sets(store)
        # Left: the sample's failed group's other member, kept for Get; none of the consumed
        # group; the deleted experience's group and the others, whole.
        assert len(sets(store)) == {"sample": 1, "record-and-head": 1, "ack": 4, "delete": 5}[how]
        assert store.verify("t") == []


@pytest.mark.parametrize(("table_layout", "db", "how"), [("rows", "gdir", "lost")])
# a rows head cut in half keeps its hashes: its group fails with its members (test_rows_pending); a
# records table's group fails (test_a_computing_group_whose_own_record_is_lost_fails_...)
def test_a_computing_group_whose_own_record_is_lost_is_passed_over_and_every_other_group_computed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, table_layout: str, db: str
) -> None:
    """A group waiting for its advantages whose head (a rows table's group record) is lost: the
    advantage worker's read of the backlog raised at it ("group ... is named but not stored") at
    every pass, so no table's advantages were computed again. It passes over it, logged once (it is
    left to `expbuf check`), and the table's other group and another table's groups are computed."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        for table in ("t", "u"):
            config = TableConfig.of(table, estimator="grpo", group_size=4)
            store.create_table(
                dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout=table_layout))
            )
            for task in range(2):
                store.put(table, group_items(0, task, 4, reward=float(task)))
        if how == "lost":
            lose(store, "t", "0/0", db)
        else:
            garble(store, "t", "0/0", db)
        for _ in range(2):
            jobs = store.compute_backlog()
            assert {job.table: job.groups for job in jobs} == {"t": ["0/1"], "u": ["0/0", "0/1"]}
        logged = [
            r.getMessage() for r in caplog.records if "0/0" in r.getMessage() and "expbuf check" in r.getMessage()
        ]
        assert len(logged) == 1 and "table t" in logged[0]
        for job in jobs:
            store.finish_compute(job.table, dict.fromkeys(job.records, 0.5), ready=job.groups)
        assert (store.stats("t")["ready"], store.stats("u")["ready"]) == (4, 8)
        assert {job.table: job.groups for job in store.compute_backlog()} == {}


@pytest.mark.parametrize("how", ["lost", "cut"])
def test_a_computing_group_whose_own_record_is_lost_fails_its_members_kept_for_get(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A records table's group waiting for its advantages whose own record is lost, or cut so that it
    no longer decodes, stayed computing for good: the advantage worker passed over it at every pass,
    its members never ready nor failed, counted computing. It fails at the worker's first pass, its
    record remade from its members' (their payloads kept for Get, a retried push of one a duplicate),
    logged once and counted failed; values computed for it before the damage are not stored; the
    table's other groups are computed, and it checks clean."""
    caplog.set_level(logging.ERROR, "expbuf.store")
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="grpo", group_size=4))
        for task in range(3):
            store.put("t", group_items(0, task, 4, reward=float(task)))
        (before,) = store.compute_backlog()  # read before the damage
        assert before.groups == ["0/0", "0/1", "0/2"]
        (lose if how == "lost" else garble)(store, "t", "0/0", "groups")
        for _ in range(2):
            (job,) = store.compute_backlog()
            assert job.groups == ["0/1", "0/2"]
        assert store.stats("t")["groups_computing"] == 2
        stale = dict.fromkeys(before.records, 0.5)
        store.finish_compute("t", stale, ready=before.groups, places=before.queued(), table_id=before.table_id)
        stats = store.stats("t")
        names = ("computing", "ready", "failed", "groups_computing", "groups_failed")
        assert {name: stats[name] for name in names} == {
            "computing": 0, "ready": 8, "failed": 4, "groups_computing": 0, "groups_failed": 1,
        }  # fmt: skip
        assert "group 0/0: its record" in stats["last_failure"]
        logged = [r.getMessage() for r in caplog.records if "group 0/0 failed" in r.getMessage()]
        assert len(logged) == 1 and "kept for Get" in logged[0], logged
        assert store.get("t", uids(0)).keys() == set(uids(0))
        assert store.stats("t")["bytes"] == stored_bytes(store, [1, 2])
        assert store.compute_backlog() == []
        assert store.put("t", group_items(0, 0, 4, reward=0.0)).duplicates == uids(0)
        assert store.verify("t") == []
