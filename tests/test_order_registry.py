"""A new order is one class and one registration: it declares an index of its own, which the
store opens, keeps and checks without naming it; requests name the order over the wire."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from expbuf.client import BufferClient
from expbuf.client.rpc import wire
from expbuf.server import cli
from expbuf.server.app import ExpbufServer
from expbuf.server.config import ServerConfig
from expbuf.server.store import KeyedIndex, Order, ReadyGroup, ReadyIndex, Store, register, u64, unregister, version_key
from expbuf.server.store.core.ordering.indexes import ReadyOrder
from expbuf.server.store.core.ordering.orders import ORDERS
from expbuf.server.store.schema.errors import InvalidRequest
from expbuf.server.store.schema.sample_spec import SpecError
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.services import index_builds
from expbuf.server.store.tables import integrity

from helpers import both_layouts, group_items, make_experience, take

UNKNOWN = 1 << 62  # where a group of unknown version sorts: after every known one


class OldestVersion(KeyedIndex):
    """Lowest model version first (unknown last), ties in ready order -> group key."""

    databases = ("oldver",)
    what = "the oldest-version index (oldver)"

    def row(self, group: ReadyGroup) -> tuple[bytes, bytes]:
        version = UNKNOWN if group.version is None else group.version
        return version_key(version) + u64(group.rseq), group.gkey


class OldestVersionFirst(Order):
    """The stalest groups first: the ones a staleness bound would drop next."""

    name = "oldest_version_first"
    index = OldestVersion

    def candidates(self, ready: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        return ready.of(OldestVersion).scan(reverse=False)


@contextlib.contextmanager
def registered_order(order: type[Order]) -> Iterator[str]:
    """An order registered for the length of a test; yields its name."""
    register(order)
    try:
        yield order.name
    finally:
        unregister(order.name)


def fill(store: Store) -> None:
    """Groups 1/0 .. 1/3 of versions 5, 2, unknown, 3 (in that ready order)."""
    store.create_table(TableConfig.of("t", estimator="none", group_size=2))
    for task, version in enumerate((5, 2, None, 3)):
        store.put("t", group_items(1, task, 2, version=version))


def test_a_registered_order_samples_from_its_own_index(tmp_path: Path) -> None:
    with registered_order(OldestVersionFirst) as name, Store(tmp_path) as store:
        fill(store)
        assert "oldver" in store.environment.db
        first = take(store, "t", num_groups=2, order=name, delivery="replay")
        assert first.group_ids == ["1/1"] * 2 + ["1/3"] * 2
        fresh = take(store, "t", num_groups=2, order=name, min_model_version=3, delivery="replay")
        assert fresh.group_ids == ["1/3"] * 2 + ["1/0"] * 2  # the order's candidates that are fresh
        leased = take(store, "t", num_groups=1, order=name, delivery="lease", lease_seconds=60)
        assert leased.group_ids == ["1/1"] * 2
        assert take(store, "t", num_groups=3, order=name).group_ids == ["1/3"] * 2 + ["1/0"] * 2 + ["1/2"] * 2
        store.nack(leased.lease_id, "t")  # back into every index, the order's own included
        assert store.verify("t") == []
        assert take(store, "t", num_groups=1, order=name).group_ids == ["1/1"] * 2


def test_a_requeued_group_moves_in_the_orders_index(tmp_path: Path) -> None:
    """Reuse changes a replayed group's priority and place through the indexes' move hook."""
    config = TableConfig.of("t", estimator="none", group_size=2, priority_decay=1.0)
    with registered_order(OldestVersionFirst) as name, Store(tmp_path) as store:
        store.create_table(config)
        for task in range(3):
            store.put("t", group_items(1, task, 2, version=4))
        assert take(store, "t", num_groups=1, order=name, delivery="replay").group_ids == ["1/0"] * 2
        assert store.verify("t") == []
        order = [take(store, "t", num_groups=1, order=name, delivery="replay").group_ids[0] for _ in range(3)]
        assert order == ["1/1", "1/2", "1/0"]  # the replayed group went behind the others of its version


def test_integrity_checks_the_orders_index_and_names_it(tmp_path: Path) -> None:
    with registered_order(OldestVersionFirst) as name, Store(tmp_path) as store:
        fill(store)
        take(store, "t", num_groups=1, order=name, delivery="replay")  # a rows table keeps it from then
        env = store.environment
        with env.env.begin(write=True) as txn:
            key, _ = next(iter(txn.cursor(db=env.db["oldver"])))
            txn.delete(key, db=env.db["oldver"])
        problems = store.verify("t")
        assert problems == [
            "ready group 1/1 is missing from the oldest-version index (oldver)",
            "the oldest-version index (oldver) holds 3 groups, 4 belong in it",
        ]


def test_a_dropped_table_leaves_nothing_in_the_orders_index(tmp_path: Path) -> None:
    with registered_order(OldestVersionFirst), Store(tmp_path) as store:
        fill(store)
        assert store.drop_table("t") == 8
        with store.environment.read() as txn:
            assert txn.stat(store.environment.db["oldver"])["entries"] == 0
        with store.environment.read() as txn:
            assert not any(integrity.scan(txn, store.environment.db, 0.0).values())  # strays included
        oldver = store.environment.db["oldver"]
        store.environment.submit(lambda txn: txn.put(b"\x00\x00\x00\x63" + bytes(16), b"9/9", db=oldver))
        with store.environment.read() as txn:
            found = integrity.scan(txn, store.environment.db, 0.0)
        assert found[""] == ["1 entries of the oldver database belong to no table"]


def test_the_index_is_built_at_open_and_dropped_when_no_order_reads_it(tmp_path: Path) -> None:
    """A directory written before the order was registered gets its index at the next open;
    one opened without the order drops it, so no index is read after changes it missed."""
    with Store(tmp_path) as store:
        fill(store)
        with store.environment.read() as txn:
            assert txn.get(b"indexes", db=store.environment.db["meta"]) is None  # the built-in orders' set
    with registered_order(OldestVersionFirst) as name, Store(tmp_path) as store:
        assert store.verify("t") == []
        assert take(store, "t", num_groups=1, order=name).group_ids == ["1/1"] * 2
    with Store(tmp_path) as store:
        assert "oldver" not in store.environment.db
        assert take(store, "t", num_groups=1, order="fifo").group_ids == ["1/0"] * 2
        with store.environment.env.begin() as txn, pytest.raises(lmdb.NotFoundError):
            store.environment.env.open_db(b"oldver", txn=txn, create=False)
    with registered_order(OldestVersionFirst) as name, Store(tmp_path) as store:
        assert store.verify("t") == []
        assert take(store, "t", num_groups=2, order=name).group_ids == ["1/3"] * 2 + ["1/2"] * 2


def test_registration_refuses_what_the_store_could_not_keep(tmp_path: Path) -> None:
    class Clash(OldestVersionFirst):
        name = "clash"

        index = type("AnotherOnOldver", (OldestVersion,), {})  # another index on the same database

    class OwnDatabase(OldestVersion):
        databases = ("items",)

    class Own(OldestVersionFirst):
        name = "own"
        index = OwnDatabase

    class Nameless(OldestVersionFirst):
        name = "Not A Name"

    with registered_order(OldestVersionFirst):
        with pytest.raises(ValueError, match="order oldest_version_first is registered already"):
            register(OldestVersionFirst)
        with pytest.raises(ValueError, match=r"order clash: database\(s\) oldver belong to OldestVersion"):
            register(Clash)
    with pytest.raises(ValueError, match="lower case letters"):
        register(Nameless)
    with pytest.raises(TypeError, match="is not an Order class"):
        register(OldestVersion)  # type: ignore[arg-type]
    with registered_order(Own), pytest.raises(ValueError, match=r"the store's own database\(s\) items"):
        Store(tmp_path)
    assert set(ORDERS) == {"fifo", "lifo", "uniform", "priority"}


def test_an_order_registered_after_the_store_opened_is_refused_by_name(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        fill(store)
        refused = pytest.raises(InvalidRequest, match=r"the index OldestVersion \(oldver\) is not open in this store")
        with registered_order(OldestVersionFirst) as name, refused:
            take(store, "t", num_groups=1, order=name)
        assert store.verify("t") == []
        with pytest.raises(SpecError, match="order is 'oldest_version_first'; expected one of fifo, lifo, uniform"):
            take(store, "t", num_groups=1, order=name)


def test_a_registered_order_over_a_real_server(tmp_path: Path) -> None:
    """The client sends a built-in order as the enum and any other name as `order_name`."""
    assert wire.order_fields("lifo") == {"order": wire.ORDER["lifo"]}
    assert wire.order_fields("oldest_version_first") == {"order_name": "oldest_version_first"}
    with registered_order(OldestVersionFirst) as name:
        server = ExpbufServer(ServerConfig(data=str(tmp_path / "data"), port=0, metrics_port=-1)).start()
        try:
            with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
                client.create_table("t", group_size=2, estimator="none")
                for task, version in enumerate((5, 2, None, 3)):
                    client.push([make_experience(1, task, run, version=version) for run in range(2)], "t")

                def one(order: str, groups: int) -> list[str]:
                    return next(iter(client.sample("t", num_groups=groups, order=order, max_batches=1))).group_ids

                assert one(name, 2) == ["1/1"] * 2 + ["1/3"] * 2
                assert one("lifo", 1) == ["1/2"] * 2
                with pytest.raises(
                    ValueError, match=f"order is 'newest_reward_first'; this server samples in .*{name}"
                ):
                    one("newest_reward_first", 1)  # refused by the client, from the server's orders, before the stream
                assert one(name, 1) == ["1/0"] * 2
        finally:
            server.stop(grace=1)


def test_lmdb_names_the_index_database_as_declared(tmp_path: Path) -> None:
    """The index lives in an LMDB database under the declared name, readable by any LMDB reader
    (a rows table's from the first request in its order)."""
    with registered_order(OldestVersionFirst) as name, Store(tmp_path) as store:
        fill(store)
        take(store, "t", num_groups=1, order=name, delivery="replay")
    env = lmdb.open(str(tmp_path), max_dbs=64, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            rows = list(txn.cursor(db=env.open_db(b"oldver", txn=txn, create=False)))
        assert [bytes(value) for _, value in rows] == [b"1/1", b"1/3", b"1/0", b"1/2"]
    finally:
        env.close()


def test_check_says_the_next_start_builds_the_index_of_an_order_registered_since(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not damage: `expbuf check` with an order registered that the directory's server never had
    names the index the next start builds, exit 0."""
    with Store(tmp_path) as store:
        fill(store)
    with registered_order(OldestVersionFirst):
        assert cli.main(["check", "--data", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{tmp_path}: no oldver database(s), the index of a registered order: the next expbuf serve builds it"
    ]
    assert cli.main(["check", "--data", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == ["default: ok", "t: ok"]


class LazyOldestVersion(OldestVersion):
    """The same index, kept by a table only from its first read, and built then."""

    databases = ("lazyold",)
    lazy = True
    what = "the lazy oldest-version index (lazyold)"


class LazyOldestVersionFirst(Order):
    name = "lazy_oldest_version_first"
    index = LazyOldestVersion

    def candidates(self, ready: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        return ready.of(LazyOldestVersion).scan(reverse=False)


def test_a_build_under_way_starts_over_when_the_index_was_dropped_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lazy order registered after its table was made: the table lacks its index. A build of it
    cut short, then an open without the order (the index dropped) and one with it again: the old
    cursor is forgotten, so the build in the background starts from the first ready group and the
    index misses none."""
    with Store(tmp_path) as store:
        fill(store)
    with monkeypatch.context() as held, registered_order(LazyOldestVersionFirst):
        held.setattr(index_builds.IndexBuilds, "start", lambda self: None)  # no build from this open
        store = Store(tmp_path)
        table_id, config = store.catalog.lookup("t")
        assert not store.environment.submit(
            lambda txn: store.catalog.state(txn, table_id, config).build_index(LazyOldestVersion, limit=2)
        ).kept
        assert store.verify("t") == []
        store.close()
    with Store(tmp_path) as store:
        assert "lazyold" not in store.environment.db
    with registered_order(LazyOldestVersionFirst) as name, Store(tmp_path) as store:
        assert store.verify("t") == []
        assert take(store, "t", num_groups=4, order=name, wait_seconds=60).group_ids == [
            f"1/{task}" for task in (1, 3, 0, 2) for _ in range(2)
        ]
        assert store.verify("t") == []


def test_a_registered_order_takes_from_a_rows_table_as_from_a_records_one(tmp_path: Path) -> None:
    """A rows table (issue 64) keeps an order's own index, eager or lazy, from the first request that
    reads it, and gives the batches a records table of the same data gives; an open without the order
    drops the index, and the rows table keeps it again from the next request in it."""

    def fill_both(store: Store) -> None:
        both_layouts(store, "t", estimator="none", group_size=2)
        for task, version in enumerate((5, 2, None, 3, 2, 7)):
            for table in ("t", "t_rows"):
                store.put(table, group_items(1, task, 2, version=version))

    def alike(store: Store, **spec: object) -> list[str]:
        got = [take(store, table, **spec).group_ids for table in ("t", "t_rows")]
        assert got[1] == got[0]
        assert store.verify("t") == [] and store.verify("t_rows") == []
        return got[0]

    with (
        registered_order(OldestVersionFirst) as eager,
        registered_order(LazyOldestVersionFirst) as lazy,
        Store(tmp_path) as store,
    ):
        fill_both(store)
        assert alike(store, num_groups=1) == ["1/0"] * 2  # fifo, from the runs: no index written
        assert alike(store, num_groups=2, order=eager, delivery="replay") == ["1/1"] * 2 + ["1/4"] * 2
        assert alike(store, num_groups=1, order=lazy, min_model_version=3) == ["1/3"] * 2
        leased = {t: take(store, t, num_groups=1, order=eager, delivery="lease") for t in ("t", "t_rows")}
        assert alike(store, num_groups=2, order=lazy) == ["1/4"] * 2 + ["1/5"] * 2
        for table, batch in leased.items():
            store.nack(batch.lease_id, table)  # back into the indexes the table keeps
        assert alike(store, num_groups=1, order=eager, delivery="replay") == ["1/1"] * 2
    with Store(tmp_path) as store:
        assert alike(store, num_groups=1, order="lifo") == ["1/2"] * 2  # both indexes dropped
    with registered_order(OldestVersionFirst) as eager, Store(tmp_path) as store:
        assert alike(store, num_groups=1, order=eager) == ["1/1"] * 2


class NewestFirst(Order):
    """An order of its own over the ready index: the newest completed group first."""

    name = "newest_first"
    index = ReadyOrder

    def candidates(self, ready: ReadyIndex, rng: random.Random) -> Iterator[bytes]:
        return ready.of(ReadyOrder).scan(reverse=True)


def test_an_order_over_the_ready_index_is_refused_by_name_on_a_rows_table(tmp_path: Path) -> None:
    """A rows table keeps its ready order as runs, not in the ready index: an order that reads that
    index takes from a records table and is refused on a rows table, which it leaves as it was."""
    with registered_order(NewestFirst) as name, Store(tmp_path) as store:
        both_layouts(store, "t", estimator="none", group_size=2)
        for table in ("t", "t_rows"):
            store.put(table, group_items(1, 0, 2) + group_items(1, 1, 2))
        assert take(store, "t", num_groups=1, order=name).group_ids == ["1/1"] * 2
        with pytest.raises(InvalidRequest, match="table of layout rows keeps its ready order as runs"):
            take(store, "t_rows", num_groups=1, order=name)
        assert store.stats("t_rows")["ready"] == 4 and store.verify("t_rows") == []
