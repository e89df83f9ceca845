"""Refusals with the right status and a message that names the problem, settings kept in
range, maintenance that one table cannot stop, leases bound to their table and token.
Real LMDB, real gRPC on loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import lmdb
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expbuf.client import AlreadyExistsError, BufferClient, BufferError, trxp
from expbuf.client.rpc.wire import WireError
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer, StartupError
from expbuf.server.config import ServerConfig
from expbuf.server.store import Store
from expbuf.server.store.schema.errors import StorageFull, StoreClosed, TableFull, TooLarge
from expbuf.server.store.schema.table_config import MAX_SECONDS, ConfigError, TableConfig

from conftest import Servers
from helpers import StoppedClock, group_items, make_experience, take, wait_for


def refused(call: object, *args: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    return info.value


def sample(stub: pb_grpc.ExperienceBufferStub, **fields: object) -> grpc.RpcError:
    request = pb.SampleRequest(**{"num_groups": 1, **fields})
    return refused(stub.Sample, iter([request]), timeout=10)


# ---- table settings --------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("tombstone_seconds", 1e10),
        ("tombstone_seconds", math.inf),
        ("tombstone_seconds", math.nan),
        ("group_timeout_seconds", 1e10),
        ("group_timeout_seconds", -1.0),
        ("group_size", 2**32 - 1),
        ("max_times_sampled", 2**32 - 1),
        ("capacity_experiences", 2**64 - 1),
    ],
)
def test_table_settings_out_of_range_are_refused(stub, setting: str, value: float) -> None:
    config = pb.TableConfig(name="bad", **{setting: value})
    error = refused(stub.CreateTable, pb.CreateTableRequest(config=config), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "table 'bad'" in error.details() and setting in error.details()


@pytest.mark.parametrize(("field", "value"), [("group_by", 99), ("when_full", 7), ("on_group_timeout", 3)])
def test_unknown_enum_values_are_refused(stub, field: str, value: int) -> None:
    config = pb.TableConfig(name="bad", **{field: value})
    error = refused(stub.CreateTable, pb.CreateTableRequest(config=config), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field} is {value}" in error.details()


def test_unknown_settings_are_refused_everywhere(client: BufferClient, stub, tmp_path: Path) -> None:
    with pytest.raises(WireError, match="group_sise"):
        client.create_table("t", group_sise=8)
    newer = pb.TableConfig(name="t").SerializeToString() + bytes([0xA8, 0x06, 0x01])  # field 101 = 1
    raw = grpc.insecure_channel(client.target).unary_unary("/expbuf.v1.ExperienceBuffer/CreateTable")
    error = refused(raw, bytes([0x0A, len(newer)]) + newer, timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "[101]" in error.details()
    toml = tmp_path / "expbuf.toml"
    toml.write_text('[[tables]]\nname = "t"\ngroup_sise = 8\n')
    from expbuf.server.config import load

    with pytest.raises(ConfigError, match="group_sise"):
        load(str(toml))
    assert "t" not in client.stats()


@pytest.mark.parametrize(
    "settings",
    [
        {"drop_zero_variance": 1},
        {"keep_failed": 0},
        {"evict_stale": 1},
        {"group_timeout_seconds": True},
        {"priority_decay": True},
        {"shaping": {"reward_clip": True}},
        {"estimator_params": {"epsilon": True}},
        {"samples_per_insert": 10**400},
        {"estimator_params": {"epsilon": 10**400}},
        {"estimator_params": {1: 2.0}},
    ],
    ids=repr,
)
def test_a_setting_of_another_type_is_refused_by_name_not_read_as_one(
    client: BufferClient, settings: dict, tmp_path: Path
) -> None:
    """protobuf takes 1 for true and True for 1.0: drop_zero_variance=1 was stored true and
    group_timeout_seconds=True as 1 second, where a TOML block with the same values is refused;
    an int past a double's range raised OverflowError (a traceback from the command line)."""
    name = next(iter(settings))
    with pytest.raises(WireError, match=name if name != "estimator_params" else "estimator"):
        client.create_table("typed", **settings)
    assert "typed" not in client.stats()


def test_a_toml_table_with_an_int_past_a_doubles_range_is_refused_by_name(tmp_path: Path) -> None:
    """tomllib reads an int of any size: math.isfinite raised OverflowError on it, and the start
    ended in a traceback."""
    from expbuf.server.config import load

    for setting in ("group_timeout_seconds", "samples_per_insert", "priority_decay"):
        toml = tmp_path / f"{setting}.toml"
        toml.write_text(f'[[tables]]\nname = "t"\n{setting} = 1{"0" * 400}\n')
        with pytest.raises(ConfigError, match=setting):
            load(str(toml))
    toml.write_text(f'[[tables]]\nname = "t"\nestimator_params = {{ epsilon = 1{"0" * 400} }}\n')
    with pytest.raises(ConfigError, match="epsilon"):
        load(str(toml))


def test_estimator_parameters_read_back_as_given_and_a_default_given_is_one_left_out(client: BufferClient) -> None:
    """A choice (std_cal_level = "batch") read back as 1.0, and a table made again with exist_ok
    and a parameter at its default ({"epsilon": 1e-6} against {}) was refused as other settings,
    as was a server whose [[tables]] block named it."""
    client.create_table("named", group_size=2, estimator_params={"std_cal_level": "batch", "epsilon": 0.5})
    (info,) = [t for t in client.list_tables() if t.name == "named"]
    assert info.estimator_params == {"std_cal_level": "batch", "epsilon": 0.5}
    client.create_table("plain", group_size=2)
    client.create_table("plain", group_size=2, estimator_params={"epsilon": 1e-6}, exist_ok=True)
    with pytest.raises(AlreadyExistsError, match="estimator_params"):
        client.create_table("plain", group_size=2, estimator_params={"epsilon": 1e-3}, exist_ok=True)
    with pytest.raises(ConfigError, match="std_cal_level"):  # a TOML block's true was "batch": a flag's alone
        TableConfig.of("x", estimator_params={"std_cal_level": True})
    assert TableConfig.of("x", estimator="step_wise_grpo", estimator_params={"enable_step_norm": True})


@pytest.mark.parametrize("refused", ["other settings", "extension"])
def test_a_start_refused_for_one_of_its_tables_creates_none_of_them(tmp_path: Path, refused: str) -> None:
    """[[tables]] blocks were created one at a time, so a start refused for a later block (its
    settings differ from the stored table's, an extension kind the server has not registered) left
    the blocks before it created: the operator's corrected config then met tables made from one
    they had not meant to run, and refused in its turn where a block was edited. The blocks are
    created together, or none of them."""
    data = tmp_path / "data"
    with Store(data) as store:
        store.create_table(TableConfig.of("b", group_size=2, estimator="none"))
    later = (
        TableConfig.of("b", group_size=4, estimator="none")
        if refused == "other settings"
        else TableConfig.of("c", estimator="none", extensions=["unknown_kind"])
    )
    tables = (TableConfig.of("a", estimator="none"), later)
    with pytest.raises(StartupError, match=r"already exists with other settings|unknown_kind"):
        ExpbufServer(ServerConfig(data=str(data), port=0, metrics_port=0, tables=tables))
    with Store(data) as store:
        assert "a" not in [table.name for table in store.list_tables()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a server without CUDA")
def test_a_table_block_asking_for_cuda_on_a_server_without_it_is_refused_before_any_data_directory(
    tmp_path: Path,
) -> None:
    """A [[tables]] block asking for CUDA on a server without it refused the start once the data
    directory was made: a start refused for a port in use leaves none, and so does this one."""
    data = tmp_path / "data"
    tables = (TableConfig.of("g", estimator="grpo", device="cuda"),)
    with pytest.raises(StartupError, match="device is 'cuda', but this server has no CUDA device"):
        ExpbufServer(ServerConfig(data=str(data), port=0, metrics_port=0, tables=tables))
    assert not data.exists()


def test_a_table_stored_with_an_old_out_of_range_setting_still_loads(tmp_path: Path) -> None:
    """An earlier release accepted tombstone_seconds = 1e10; such a table loads with the
    longest allowed value, and the lease upkeep of every table runs."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("old", estimator="none"))
        store.put("old", group_items(1, 0, 2))
        lease = take(store, "old", num_groups=1, delivery="lease", lease_seconds=0.01)
        assert lease is not None
    env = lmdb.open(str(tmp_path), max_dbs=32)
    with env.begin(write=True, db=env.open_db(b"tables")) as txn:
        record = json.loads(txn.get(b"old"))
        record["config"]["tombstone_seconds"] = 1e10
        txn.put(b"old", json.dumps(record).encode())
    env.close()
    with Store(tmp_path, clock=lambda: time.time() + 60) as store:
        assert store.table("old").retention.tombstone_seconds == MAX_SECONDS
        done = store.tick()
        assert (done["leases_expired"], done["failed"]) == (1, 0)


@pytest.mark.parametrize("layout", ["records", "rows"])
def test_one_damaged_table_does_not_stop_the_upkeep_of_the_others(tmp_path: Path, caplog, layout: str) -> None:
    """A table whose timeout index names a group whose record (a rows table's head) is gone: its
    timeout passes over the group, logged once with the way out, fails nothing, and the other tables'
    upkeep goes on. A records table's failed its upkeep at every pass (its other groups never timed
    out)."""
    now = [time.time()]
    with Store(tmp_path, clock=lambda: now[0]) as store:
        hurt = TableConfig.of("hurt", estimator="none", group_size=4, group_timeout_seconds=1)
        store.create_table(dataclasses.replace(hurt, storage=dataclasses.replace(hurt.storage, layout=layout)))
        store.create_table(TableConfig.of("fine", estimator="none"))
        store.put("fine", group_items(1, 0, 2))
        take(store, "fine", num_groups=1, delivery="lease", lease_seconds=0.01)
        # a timeout index entry whose group record is gone (a damaged directory)
        pending = store.environment.db["pending"]
        store.environment.submit(lambda txn: txn.put(b"\x00\x00\x00\x02" + bytes(8) + b"9/9", b"", db=pending))
        now[0] += 5
        with caplog.at_level(logging.ERROR, logger="expbuf.store"):
            first, second = store.tick(), store.tick()
        assert store.stats("fine")["ready"] == 2
        messages = [r.getMessage() for r in caplog.records]
        assert (first["leases_expired"], first["failed"], second["failed"]) == (1, 0, 0)
        assert store.maintenance_failures == 0
        passed = [m for m in messages if "pending group 9/9 passed over by its timeout" in m]
        assert len(passed) == 1 and "Delete the group by its id" in passed[0]


def test_an_upkeep_pass_whose_batch_fills_the_map_times_out_its_groups_when_run_again(tmp_path: Path) -> None:
    """A pass whose batch meets a full map is run again once the map has grown: it times out the
    groups the undone attempt timed out, and says so. The attempt had already marked the pass's
    sweep done and the table idle (in memory, which the abort did not undo), so the pass run again
    visited nothing, and the table's groups waited for the next sweep (30 s) or write."""
    clock = StoppedClock()
    with Store(tmp_path, clock=clock, map_size=1 << 20) as store:
        config = TableConfig.of("t", estimator="none", group_size=4, group_timeout_seconds=5)
        store.create_table(dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout="rows")))
        store.put("t", [trxp.from_experience(make_experience(0, task, 0, reward=1.0)) for task in range(600)])
        size = store.environment.env.info()["map_size"]
        clock.now += 10
        done = store.tick()
        assert store.environment.env.info()["map_size"] > size  # the pass's batch filled the map
        assert done["groups_timed_out"] == 600 and store.stats("t")["groups_pending"] == 0


# ---- sample requests ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"delivery": 99}, "delivery is 99"),
        ({"order": 99}, "order is 99"),
        ({"order_name": "fifo_please"}, "order is 'fifo_please'; expected one of fifo, lifo, uniform, priority"),
        ({"order_name": "x" * 100_000}, "order is 'xxxxxxxx"),
        ({"order": pb.ORDER_LIFO, "order_name": "fifo"}, "set order or order_name, not both"),
        ({"delivery": pb.DELIVERY_LEASE, "lease_seconds": math.nan}, "lease_seconds"),
        ({"delivery": pb.DELIVERY_LEASE, "lease_seconds": math.inf}, "lease_seconds"),
        ({"delivery": pb.DELIVERY_LEASE, "lease_seconds": 1e300}, "lease_seconds"),
        ({"delivery": pb.DELIVERY_LEASE, "lease_seconds": 1e12}, "lease_seconds"),
        ({"wait_seconds": math.nan}, "wait_seconds"),
        ({"wait_seconds": -1}, "wait_seconds"),
        ({"num_groups": 2**32 - 1}, "negative number"),
        ({"num_groups": 0}, "exactly one"),
    ],
)
def test_bad_sample_requests_are_invalid_argument(stub, fields: dict, names: str) -> None:
    error = sample(stub, **fields)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert names in error.details()


def test_lease_ids_and_ids_are_checked(stub) -> None:
    error = refused(stub.Ack, pb.AckRequest(lease_id=""), timeout=10)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "lease_id is empty")
    error = refused(stub.Nack, pb.NackRequest(lease_id="x" * 10_000), timeout=10)
    assert error.code() == grpc.StatusCode.NOT_FOUND and len(error.details()) < 300
    error = refused(stub.Get, pb.GetRequest(uids=["u" * 1000]), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "uids" in error.details()
    error = refused(stub.Seal, pb.SealRequest(group_id=""), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "group_id" in error.details()
    error = refused(stub.Push, pb.PushRequest(table="t" * 10_000, payload=trxp.build(group_items(1, 0, 1))))
    assert error.code() == grpc.StatusCode.NOT_FOUND and len(error.details()) < 300


def test_a_lease_is_bound_to_its_table(client: BufferClient) -> None:
    client.create_table("a", estimator="none")
    client.create_table("b", estimator="none")
    client.push(trxp.build(group_items(1, 0, 2)), table="a")
    batch = next(client.sample("a", num_groups=1, delivery="lease", max_batches=1))
    with pytest.raises(BufferError) as info:
        client.ack(batch.lease_id, table="b")
    assert info.value.code == grpc.StatusCode.NOT_FOUND and "not a lease of table 'b'" in info.value.details
    assert batch.ack() == 2


def test_a_lease_is_bound_to_the_token_that_took_it(start_server: Servers) -> None:
    tokens = {"pusher": frozenset({"push", "admin"}), "one": frozenset({"sample"}), "two": frozenset({"sample"})}
    srv = start_server(tokens=tokens)
    target = f"127.0.0.1:{srv.port}"
    with (
        BufferClient(target, token="pusher") as pusher,
        BufferClient(target, token="one") as one,
        BufferClient(target, token="two") as two,
    ):
        pusher.create_table("t", estimator="none")
        pusher.push(trxp.build(group_items(1, 0, 2)), table="t")
        batch = next(one.sample("t", num_groups=1, delivery="lease", max_batches=1))
        for call in (two.ack, two.nack):
            with pytest.raises(BufferError) as info:
                call(batch.lease_id, table="t")
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert one.ack(batch.lease_id, table="t") == 2


# ---- capacity and failures -------------------------------------------------------


def test_eviction_never_takes_a_pending_group(tmp_path: Path) -> None:
    """A group takes its group_size places as it opens: pushes that open groups evict the oldest
    ready groups for them, never a pending one, and are refused where only pending ones are left."""
    with Store(tmp_path) as store:
        store.create_table(
            TableConfig.of("ring", estimator="none", group_size=4, capacity_experiences=8, when_full="evict")
        )
        pending = group_items(1, 0, 4)
        store.put("ring", pending[:2])  # 1/0 takes 4 places
        store.put("ring", group_items(1, 1, 4))  # fits: 4 + 4
        store.put("ring", group_items(1, 2, 4))  # evicts the ready group 1/1, never the pending 1/0
        assert store.stats("ring")["evicted"] == 4
        assert store.put("ring", pending[2:]).completed_groups == ["1/0"]  # its places are its own
        assert store.stats("ring")["evicted"] == 4
        store.put("ring", group_items(1, 4, 4)[:2])  # evicts 1/2
        store.put("ring", group_items(1, 5, 4)[:2])  # evicts the ready 1/0
        assert store.stats("ring")["pending"] == 4 and store.stats("ring")["evicted"] == 12
        with pytest.raises(TableFull, match="its groups still open hold 4 places") as full:
            store.put("ring", group_items(1, 6, 4))  # only pending groups are left: none is evicted
        held = store.stats("ring")["bytes"]  # what it holds, then its bound: "(8 experiences, 0 bytes)" read as held
        assert f"is full: it holds 4 experiences of {held} bytes, its capacity is 8 experiences, and this push" in str(
            full.value
        )
        assert store.stats("ring")["pending"] == 4
        assert store.verify("ring") == []


@pytest.mark.parametrize("layout", ["records", "rows"])
@pytest.mark.parametrize("when_full", ["evict", "block"])
@pytest.mark.parametrize("bound", ["experiences", "bytes"])
def test_runs_that_finish_open_groups_are_stored_whatever_the_table_holds(
    tmp_path: Path, layout: str, when_full: str, bound: str
) -> None:
    """GRPO's workers push each run as it ends, so several groups are open at once: a group takes
    its group_size places as it opens, and its later runs need none. Counted a place a run, groups
    left open filled the table, and the runs that would complete them were refused (evict: at once;
    block: at their deadline) for good, nothing pending being evicted. So it was with capacity_bytes
    after the places were fixed (an audit: a table of 6000 bytes, three groups of 4 open, locked):
    a push that opens a group makes room for the bytes of the open groups' runs to come too."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("sized", estimator="none", group_size=4))
        store.put("sized", group_items(1, 0, 4))  # every run here is as large as these
        run_bytes = store.stats("sized")["bytes"] // 4
        capacity = {"capacity_experiences": 8} if bound == "experiences" else {"capacity_bytes": 8 * run_bytes}
        config = TableConfig.of("t", estimator="none", group_size=4, when_full=when_full, **capacity)
        store.create_table(dataclasses.replace(config, storage=dataclasses.replace(config.storage, layout=layout)))
        a, b, c = (group_items(1, task, 4) for task in range(3))
        refused = []
        for runs in (a[:3], b[:3], c[:2]):  # two groups open take all 8 places, with 6 experiences held
            try:
                store.put("t", runs, timeout=0.2)
            except TableFull as exc:  # a third group: no room (a pending group is never evicted)
                refused.append(str(exc))
        assert store.put("t", a[3:]).completed_groups == ["1/0"]
        assert store.put("t", b[3:]).completed_groups == ["1/1"]
        assert len(refused) == 1 and "its groups still open hold 2 places" in refused[0]
        gone = group_items(1, 9, 4)
        dropped = store.fail_runs("t", [item.uid for item in gone], ["timeout"] * 4).dropped_groups
        assert dropped == ["1/9"] and store.stats("t")["evicted"] == 0  # a group that opens and ends takes no place
        if when_full == "evict":
            store.put("t", c[:2])  # evicts the oldest ready group for its places
            assert store.stats("t")["evicted"] == 4
        assert store.verify("t") == []
        if bound == "bytes":  # a group the table cannot hold whole: its first run refused as too large, not stored
            store.create_table(TableConfig.of("small", estimator="none", group_size=4, capacity_bytes=3 * run_bytes))
            with pytest.raises(TooLarge, match=r"opening 1 groups of 4 places each \(their runs to come about"):
                store.put("small", a[:1])
            assert store.stats("small")["pending"] == 0
            store.create_table(TableConfig.of("joins", estimator="none", group_size=4, capacity_bytes=8 * run_bytes))
            store.put("joins", a[:1])
            huge = group_items(1, 0, 4, response=20 * run_bytes)[1:2]  # a run of the open group larger than the table
            with pytest.raises(TooLarge, match=r"exceed its capacity .* on their own"):
                store.put("joins", huge)  # a run joining an open group is not bounded by bytes, but by the whole
            assert store.stats("joins")["pending"] == 1
            # groups opened by a report of failed runs (no run to size them by): their runs are bounded
            # by the bytes as soon as a group the table holds can free room (the review: 3.75 times over)
            reported = TableConfig.of("reported", estimator="none", group_size=4, min_group_size=2, when_full=when_full)
            store.create_table(dataclasses.replace(reported, capacity=dataclasses.replace(config.capacity)))
            opened = [group_items(2, task, 4) for task in range(10)]
            for runs in opened:
                store.fail_runs("reported", [runs[0].uid], ["oom"])
            for run in (run for runs in opened for run in runs[1:]):
                with contextlib.suppress(TableFull):
                    store.put("reported", [run], timeout=0.05)
            assert store.stats("reported")["bytes"] <= 8 * run_bytes


def test_push_larger_than_a_blocking_table_is_refused_at_once(client: BufferClient) -> None:
    client.create_table("small", capacity_experiences=3, estimator="none")
    with pytest.raises(BufferError) as info:
        client.push(trxp.build(group_items(1, 0, 4)), table="small", timeout=30)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "on their own" in info.value.details


def test_the_longest_uid_works_in_every_grouping(tmp_path: Path) -> None:
    """Uids up to the documented 400 bytes are stored, grouped, leased, consumed and
    forgotten whatever the grouping (no index key passes LMDB's limit)."""
    suffix = "s" * (trxp.MAX_UID_BYTES - len("b/t/0/0/"))
    with Store(tmp_path) as store:
        for by in ("task", "run", "step", "none"):
            store.create_table(TableConfig.of(f"by_{by}", estimator="none", group_by=by, tombstone_seconds=1))
            exp = make_experience("b", "t", 0)
            exp.eid.suffix = suffix
            item = trxp.from_experience(exp)
            assert len(item.uid.encode()) == trxp.MAX_UID_BYTES
            store.put(f"by_{by}", [item])
            lease = take(store, f"by_{by}", num_groups=1, delivery="lease")
            assert store.ack(lease.lease_id) == 1
            assert store.verify(f"by_{by}") == []


def test_full_disk_or_map_names_the_place(tmp_path: Path) -> None:
    with Store(tmp_path, map_size=1 << 20, max_map_size=1 << 20) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_by="none"))
        with pytest.raises(StorageFull) as info:
            for task in range(1000):
                store.put("t", [trxp.from_experience(make_experience(1, task, 0, response=4000, prompt=4000))])
        assert str(tmp_path) in str(info.value) and "max_map_size" in str(info.value)
        assert store.verify("t") == []


class PanicsAtWrite:
    """The store's LMDB environment, whose write transactions fail as LMDB's do once it has
    panicked (a failed write of its meta page: an I/O error), until `panics` is cleared."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env, self.panics = env, True

    def begin(self, *args: Any, **kwargs: Any) -> lmdb.Transaction:
        if self.panics and kwargs.get("write"):
            raise lmdb.PanicError("mdb_txn_begin: MDB_PANIC: Update of meta page failed or environment had fatal error")
        return self.env.begin(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


def test_a_store_whose_environment_panics_refuses_every_write_at_once(tmp_path: Path) -> None:
    """LMDB's panic (or a map it could not grow) outside any request killed the writer thread: the
    request and every later one waited for good, and the server could not be stopped. Each is now
    refused at once, naming why, and the store says it is broken."""
    with Store(tmp_path) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_by="none"))
        writer = store.environment.writer
        panicking = PanicsAtWrite(writer.env)
        writer.env = panicking
        try:
            for _ in range(2):
                with pytest.raises(StoreClosed, match=r"can take no more writes .*MDB_PANIC"):
                    store.put("t", group_items(1, 0, 1), timeout=5)
            assert store.broken is not None and "PanicError" in store.broken
        finally:
            panicking.panics = False
            writer.env = panicking.env


def test_a_server_whose_store_panics_says_not_serving(start_server: Servers) -> None:
    """Its health turns NOT_SERVING (a load balancer stops sending, an orchestrator restarts it),
    where it said SERVING while every write hung; `expbuf serve` then stops it, exiting 3."""
    server = start_server()
    writer = server.store.environment.writer
    panicking = PanicsAtWrite(writer.env)
    writer.env = panicking
    try:
        with BufferClient(f"127.0.0.1:{server.port}", retries=0, timeout=10) as client:
            with pytest.raises(BufferError) as refused:
                client.push([make_experience(1, 0, 0)])
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            wait_for(
                lambda: (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    == health_pb2.HealthCheckResponse.NOT_SERVING
                ),
                "health NOT_SERVING",
                30,
            )
        assert server.broken is not None
    finally:
        panicking.panics = False
        writer.env = panicking.env


def test_refusals_name_their_table_and_bound_metric_labels(server: ExpbufServer, stub, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="expbuf.service"):
        refused(stub.CreateTable, pb.CreateTableRequest(config=pb.TableConfig(name="bad!")), timeout=10)
        refused(stub.Push, pb.PushRequest(table="nope" * 10, payload=b"junk"), timeout=10)
    lines = [r.getMessage() for r in caplog.records]
    assert any("refused CreateTable on table bad!" in line for line in lines)
    labels = {
        s.labels["table"] for m in server.metrics.registry.collect() if m.name == "expbuf_refused" for s in m.samples
    }
    assert labels == {"unknown"}


def test_too_large_and_table_full_are_distinct() -> None:
    assert not issubclass(TooLarge, TableFull)


def test_tables_of_the_first_format_open_under_todays_estimator_names(tmp_path: Path) -> None:
    """Table records without a version were written before the estimators took
    Trinity-RFT's names: they open as the estimator they meant."""
    with Store(tmp_path):
        pass
    old = {
        "old_pp": ("reinforce++", {"epsilon": 1e-8}, "reinforce++_baseline", {"epsilon": 1e-8}),
        "old_rf": ("reinforce", {"gamma": 0.9}, "discounted_return", {"gamma": 0.9}),
        "old_grpo": ("grpo", {"std_over_batch": 1.0, "std_threshold": 0.0}, "grpo", {"std_cal_level": 1.0}),
        "old_opmd": ("opmd", {"tau": 2.0, "logavgexp_baseline": 1.0}, "opmd", {"tau": 2.0, "opmd_baseline": 1.0}),
    }
    env = lmdb.open(str(tmp_path), max_dbs=32)
    with env.begin(write=True, db=env.open_db(b"tables")) as txn:
        for index, (name, (estimator, params, _, _)) in enumerate(old.items()):
            config = {"name": name, "estimator": estimator, "estimator_params": params}
            txn.put(name.encode(), json.dumps({"id": 100 + index, "config": config, "created": 0}).encode())
    env.close()
    with Store(tmp_path) as store:
        for name, (_, _, estimator, params) in old.items():
            assert (store.table(name).advantages.estimator, store.table(name).advantages.params) == (estimator, params)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a server without CUDA")
def test_a_cuda_table_is_refused_without_cuda(stub) -> None:
    config = pb.TableConfig(name="gpu", estimator=pb.Estimator(name="grpo", device="cuda"))
    error = refused(stub.CreateTable, pb.CreateTableRequest(config=config), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "no CUDA device" in error.details()


def test_the_streams_of_one_table_are_capped(start_server: Servers) -> None:
    """Trainers of one table cannot take every Sample stream: past max_table_streams they are
    refused, naming the table and the setting, while another table still gets its own."""
    srv = start_server(workers=8, max_table_streams=2)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel, BufferClient(f"127.0.0.1:{srv.port}") as client:
        stub = pb_grpc.ExperienceBufferStub(channel)
        client.create_table("a", estimator="none")
        client.create_table("b", estimator="none")
        waiting = [
            stub.Sample(iter([pb.SampleRequest(table="a", num_groups=1, wait_seconds=30)]), timeout=30)
            for _ in range(2)
        ]
        deadline = time.monotonic() + 10
        while srv.service.table_streams._open.get("a", 0) < 2:
            assert time.monotonic() < deadline, "the two streams never opened"
            time.sleep(0.02)
        error = sample(stub, table="a", wait_seconds=1)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "table 'a'" in error.details() and "max_table_streams = 2" in error.details()
        client.push(trxp.build(group_items(1, 0, 2)), table="b")
        assert len(next(client.sample("b", num_groups=1, max_batches=1, timeout=5, delivery="consume")).uids) == 2
        for call in waiting:
            call.cancel()
        while srv.service.table_streams._open.get("a", 0):  # their slots come back
            assert time.monotonic() < deadline + 10, "the cancelled streams kept their slots"
            time.sleep(0.02)
        client.push(trxp.build(group_items(1, 1, 2)), table="a")
        assert len(next(client.sample("a", num_groups=1, max_batches=1, timeout=5, delivery="consume")).uids) == 2


def test_a_push_whose_token_rewards_are_not_finite_stores_nothing(start_server: Servers) -> None:
    """A push whose token-level rewards hold NaN is refused invalid_payload naming the field, stores
    none of its experiences (its good ones neither), and the server takes the next push."""
    server = start_server()
    items = group_items(1, 0, 2)
    nan = trxp.raw_of(torch.tensor([0.0, float("nan"), 1.0, 0.0]))  # make_experience's 4 response tokens
    items[1].tensors["token_level_reward"] = nan
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        with pytest.raises(BufferError, match=r"item 1 .*field 'token_level_reward' holds NaN or infinity") as info:
            client.push(trxp.build(items))
        assert info.value.reason == "invalid_payload"
        assert client.stats()["default"].pushed == 0
        assert len(client.push(trxp.build(group_items(1, 0, 2))).stored) == 2


def test_storage_info_read_beside_growths_of_the_map_never_fails(tmp_path: Path) -> None:
    """What ServerInfo and every metrics scrape read of the map (its size and use) was read outside
    the readers' gate, across the writer's resize: mdb_env_stat failed InvalidParameterError, a
    scrape or a ServerInfo with it, about once a growth (a helper's audit: 31 in 30 rounds)."""
    failures: list[BaseException] = []
    for round_ in range(5):
        with Store(tmp_path / str(round_), map_size=64 << 10, max_map_size=1 << 30) as store:
            store.create_table(TableConfig.of("t", estimator="none", group_by="none"))
            stop = threading.Event()

            def scrape(store: Store = store, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    try:
                        store.environment.storage_info()
                    except Exception as exc:  # what a scrape would have failed with
                        failures.append(exc)

            threads = [threading.Thread(target=scrape) for _ in range(2)]
            for thread in threads:
                thread.start()
            items = [trxp.from_experience(make_experience(round_, task, 0, response=60000)) for task in range(40)]
            for at in range(0, len(items), 4):
                store.put("t", items[at : at + 4])
            stop.set()
            for thread in threads:
                thread.join()
            assert store.environment.storage_info()["map_size"] >= 16 << 20  # it grew some eight times
    assert failures == []
