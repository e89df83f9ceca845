"""Table extensions (server/store/rules/extensions.py): a new hook is one class and one registration,
named in the tables that run it (each its own instance), and runs at a real Store's events
inside the request's transaction; the compute queue, stale-group eviction and the prompt ledger
are the store's own extensions, run only on the tables whose settings call for them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from expbuf.client import BufferClient, InvalidArgumentError
from expbuf.server.app import ExpbufServer, StartupError
from expbuf.server.config import ServerConfig, load
from expbuf.server.store import Store, TableExtension
from expbuf.server.store.core.compute import ComputeQueue
from expbuf.server.store.core.events import Groups
from expbuf.server.store.core.state import TableState
from expbuf.server.store.disk.records import GroupRecord
from expbuf.server.store.ledger.rules import Ledger
from expbuf.server.store.rules.extensions import ExtensionKinds
from expbuf.server.store.rules.staleness import StaleEviction
from expbuf.server.store.schema.errors import ConfigError, InvalidRequest, StoreError
from expbuf.server.store.schema.sample_spec import SampleSpec
from expbuf.server.store.schema.table_config import TableConfig

from conftest import payload
from helpers import group_items


class Journal(TableExtension):
    """Writes down what it hears."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        self.events.append(("push", list(gkeys)))

    def on_insert(self, tt: TableState, uids: Sequence[str]) -> None:
        self.events.append(("insert", tt.config.name, len(uids)))

    def on_update(self, tt: TableState, gkey: str, grp: GroupRecord, was: str) -> None:
        self.events.append(("update", gkey, was, grp.state))

    def on_sample(self, tt: TableState, groups: Groups) -> None:
        self.events.append(("sample", [gkey for gkey, _ in groups]))

    def on_retire(self, tt: TableState, groups: Groups, state: str) -> None:
        self.events.append(("retire", [(gkey, grp.state) for gkey, grp in groups], state))


def journal_of(store: Store, table: str) -> Journal:
    (journal,) = (ext for ext in store.extensions_of(table) if isinstance(ext, Journal))
    return journal


def test_a_named_extension_hears_a_real_stores_events(tmp_path: Path) -> None:
    with Store(tmp_path / "data") as store:
        store.register_extension("journal", Journal)
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, extensions=["journal"]))
        journal = journal_of(store, "t")
        pushed = store.put("t", group_items(0, 0, 2))
        (gkey,) = pushed.completed_groups
        leased = store.sample(SampleSpec("t", num_groups=1, delivery="lease"))
        assert store.nack(leased.lease_id) == 2
        assert store.sample(SampleSpec("t", num_groups=1)) is not None  # consumed
    assert journal.events == [
        ("push", [gkey]),
        ("update", gkey, "pending", "ready"),
        ("insert", "t", 2),
        ("update", gkey, "ready", "leased"),
        ("sample", [gkey]),
        ("update", gkey, "leased", "ready"),
        ("retire", [(gkey, "ready")], "consumed"),
        ("sample", [gkey]),
    ]


def test_an_extension_runs_only_on_the_tables_that_name_it_each_with_its_own_instance(tmp_path: Path) -> None:
    with Store(tmp_path / "data", extensions={"journal": Journal}) as store:
        for name, extensions in (("a", ["journal"]), ("b", []), ("c", ["journal"])):
            store.create_table(TableConfig.of(name, estimator="none", group_size=2, extensions=extensions))
        a, c = journal_of(store, "a"), journal_of(store, "c")
        assert a is not c and not [ext for ext in store.extensions_of("b") if isinstance(ext, Journal)]
        store.put("b", group_items(0, 0, 2))
        assert a.events == c.events == []  # b's push reached neither
        store.put("a", group_items(1, 0, 2))
        assert [e[0] for e in a.events] == ["push", "update", "insert"] and c.events == []
        store.create_table(TableConfig.of("a", estimator="none", group_size=2, extensions=["journal"]), exist_ok=True)
        assert journal_of(store, "a") is a  # the table found again keeps its instance and what it holds
        store.drop_table("c")
        store.create_table(TableConfig.of("c", estimator="none", group_size=2, extensions=["journal"]))
        assert journal_of(store, "c") is not c  # a new table, a new instance


class Refuser(TableExtension):
    """Refuses every push of a table named `closed`, and into a group named `0/1`."""

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        if "0/1" in gkeys:
            raise InvalidRequest("group 0/1 takes no pushes")

    def on_insert(self, tt: TableState, uids: Sequence[str]) -> None:
        if tt.config.name == "closed":
            raise InvalidRequest("table 'closed' takes no pushes")


def test_an_extension_runs_inside_the_requests_transaction(tmp_path: Path) -> None:
    """What an extension refuses is undone with the request: nothing of the push is stored."""
    with Store(tmp_path / "data", extensions={"refuser": Refuser}) as store:
        for name in ("closed", "open"):
            store.create_table(TableConfig.of(name, estimator="none", group_size=2, extensions=["refuser"]))
        with pytest.raises(InvalidRequest, match="takes no pushes"):
            store.put("closed", group_items(0, 0, 2))
        with pytest.raises(InvalidRequest, match="group 0/1 takes no pushes"):
            store.put("open", group_items(0, 0, 2) + group_items(0, 1, 2))
        store.put("open", group_items(0, 0, 2))
        assert store.stats("closed")["pushed"] == 0 and store.stats("closed")["ready"] == 0
        assert store.stats("open")["ready"] == 2
        assert store.verify("closed") == [] and store.verify("open") == []


def test_only_extension_classes_are_registered_under_valid_names() -> None:
    kinds = ExtensionKinds()
    with pytest.raises(TypeError, match="not a TableExtension class"):
        kinds.register("x", object)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a TableExtension class"):
        kinds.register("x", Journal())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must start with a letter"):
        kinds.register("no name", Journal)
    kinds.register("journal", Journal)
    kinds.register("journal", Journal)  # the same kind again is no change
    with pytest.raises(ValueError, match=r"'journal' is registered already \(Journal\); pass replace=True"):
        kinds.register("journal", Refuser)
    kinds.register("journal", Refuser, replace=True)
    assert kinds.names() == ["journal"] and kinds.unknown(["journal", "x"]) == ["x"]
    with pytest.raises(ConfigError, match="extensions names 'journal' twice"):
        TableConfig.of("t", extensions=["journal", "journal"])
    with pytest.raises(ConfigError, match="extensions is 'journal'; expected a list"):
        TableConfig.of("t", extensions="journal")


def test_the_stores_own_extensions_run_only_on_the_tables_that_need_them(tmp_path: Path) -> None:
    with Store(tmp_path / "data") as store:
        store.create_table(TableConfig.of("g", estimator="grpo", group_size=2))
        store.create_table(TableConfig.of("runs", estimator="none", group_by="run"))
        store.create_table(TableConfig.of("s", estimator="none", group_by="none", max_staleness=0, evict_stale=True))
        kinds = {name: [type(ext) for ext in store.extensions_of(name)] for name in ("g", "runs", "s")}
        assert kinds == {"g": [ComputeQueue, Ledger], "runs": [], "s": [StaleEviction]}
        assert store.extensions_of("g")[1] is store.ledger  # the one ledger the claims read
        store.put("g", group_items(0, 0, 2))
        (job,) = store.compute_backlog()  # queued by the compute queue's on_update
        assert job.table == "g" and len(job.groups) == 1
        store.delete("g", group_ids=job.groups)  # leaves the queue by its on_retire
        assert store.compute_backlog() == []
        assert store.verify("g") == []


def test_an_unknown_name_is_refused_at_create_naming_it_and_the_registered_ones(tmp_path: Path) -> None:
    server = ExpbufServer(
        ServerConfig(data=str(tmp_path / "data"), port=0, metrics_port=0, ingest_processes=0),
        extensions={"journal": Journal},
    ).start()
    try:
        with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
            with pytest.raises(InvalidArgumentError, match=r"runs table extension\(s\) 'nope', which this server "
                               r"has not registered \(registered: journal\)"):  # fmt: skip
                client.create_table("t", extensions=["nope"])
            assert "t" not in [t.name for t in client.list_tables()]
            made = client.create_table("t", estimator="none", extensions=["journal"])
            assert made.extensions == ("journal",) and made.settings()["extensions"] == ["journal"]
            client.push(payload("grpo_group.trxp"), table="t")
        assert [e[0] for e in journal_of(server.store, "t").events][:1] == ["push"]
    finally:
        server.stop(grace=1)


def test_a_stored_table_naming_a_kind_not_registered_fails_the_open(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Store(data, extensions={"journal": Journal}) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, extensions=["journal"]))
        store.create_table(TableConfig.of("plain", estimator="none"))
        with store.environment.read() as txn:  # a table without extensions is stored as before
            assert "extensions" not in json.loads(txn.get(b"plain", db=store.db["tables"]))["config"]
    with pytest.raises(StoreError, match=r"table 't' runs table extension\(s\) 'journal', which this server has not "
                       r"registered \(registered: none\): register each kind"):  # fmt: skip
        Store(data)
    toml = tmp_path / "expbuf.toml"
    toml.write_text(f'data = "{data}"\nport = 0\nmetrics_port = 0\n')
    with pytest.raises(StartupError, match=r"table 't' runs table extension\(s\) 'journal'"):
        ExpbufServer(load(str(toml)))
    with Store(data, extensions={"journal": Journal}) as store:  # registered, it opens and runs
        store.put("t", group_items(0, 0, 2))
        assert [e[0] for e in journal_of(store, "t").events] == ["push", "update", "insert"]


def test_a_toml_table_names_its_extensions(tmp_path: Path) -> None:
    toml = tmp_path / "expbuf.toml"
    toml.write_text(
        f'data = "{tmp_path / "data"}"\nport = 0\nmetrics_port = 0\n\n'
        '[[tables]]\nname = "j"\nestimator = "none"\nextensions = ["journal"]\n'
    )
    config = load(str(toml))
    assert config.tables[0].extensions == ("journal",)
    with pytest.raises(StartupError, match=r"table 'j' runs table extension\(s\) 'journal'"):
        ExpbufServer(config)
    server = ExpbufServer(config, extensions={"journal": Journal})
    try:
        assert isinstance(server.store.extensions_of("j")[-1], Journal)
    finally:
        server.service.ingest.close()  # a server never started: its ingest processes end here
        server.store.close()


def test_store_extensions_register_runs_one_instance_on_every_table_for_one_release(tmp_path: Path) -> None:
    with Store(tmp_path / "data") as store:
        store.create_table(TableConfig.of("before", estimator="none", group_size=2))
        with pytest.warns(DeprecationWarning, match=r"Store.register_extension\(name, Kind\)"):
            journal = store.extensions.register(Journal())
        store.create_table(TableConfig.of("after", estimator="none", group_size=2))
        store.put("before", group_items(0, 0, 2))
        store.put("after", group_items(1, 0, 2))
        assert [e for e in journal.events if e[0] == "insert"] == [("insert", "before", 2), ("insert", "after", 2)]
        with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="not a TableExtension"):
            store.extensions.register(object())  # type: ignore[type-var]
