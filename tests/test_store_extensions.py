"""Table extensions (server/store/rules/extensions.py): a new hook is one class and one registration,
named in the tables that run it (each its own instance), and runs at a real Store's events
inside the request's transaction, once per step with all the groups the step moved; stale-group
eviction and the prompt ledger are the store's own extensions, run only on the tables whose
settings call for them. An extension written for the hooks of earlier releases (one call per
group moved, positional arguments) is called through an adapter, and its registration warns."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from expbuf.client import BufferClient, InvalidArgumentError, trxp
from expbuf.server.app import ExpbufServer, StartupError
from expbuf.server.config import ServerConfig, load
from expbuf.server.store import (
    DatasetRecord,
    Entry,
    Inserted,
    Moved,
    Pushed,
    Resent,
    Retired,
    Store,
    TableExtension,
    Taken,
)
from expbuf.server.store.core.table_state.events import Groups
from expbuf.server.store.core.table_state.state import TableState
from expbuf.server.store.disk.records import GroupRecord
from expbuf.server.store.ledger.rules import Ledger
from expbuf.server.store.rules.extensions import ExtensionKinds
from expbuf.server.store.rules.staleness import StaleEviction
from expbuf.server.store.schema.errors import ConfigError, InvalidRequest, StoreError
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from conftest import payload
from helpers import group_items
from test_partial_rollouts import rollout, split


class Journal(TableExtension):
    """Writes down what it hears."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        self.events.append(("push", list(event.gkeys), event.holder, event.call))

    def on_resent(self, tt: TableState, event: Resent) -> None:
        self.events.append(("resend", list(event.gkeys), event.holder, event.call))

    def on_inserted(self, tt: TableState, event: Inserted) -> None:
        self.events.append(("insert", tt.config.name, len(event.uids)))

    def on_moved(self, tt: TableState, event: Moved) -> None:
        assert all(grp.state == event.now for _, grp in event.groups)
        self.events.append(("moved", event.was, event.now, [gkey for gkey, _ in event.groups]))

    def on_taken(self, tt: TableState, event: Taken) -> None:
        self.events.append(("taken", [gkey for gkey, _ in event.groups], event.delivery))

    def on_retired(self, tt: TableState, event: Retired) -> None:
        self.events.append(("retired", [(gkey, grp.state) for gkey, grp in event.groups], event.state))


class EarlierJournal(TableExtension):
    """Writes down what it hears through the hooks of earlier releases: one call per group moved."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_push(self, tt: TableState, gkeys: Sequence[str]) -> None:
        self.events.append(("push", list(gkeys)))

    def on_resend(self, tt: TableState, gkeys: Sequence[str]) -> None:
        self.events.append(("resend", list(gkeys)))

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
        leased = store.sample(TakeSpec("t", num_groups=1, delivery="lease"))
        assert store.nack(leased.lease_id) == 2
        assert store.sample(TakeSpec("t", num_groups=1)) is not None  # consumed
    assert journal.events == [
        ("push", [gkey], "", "push"),
        ("moved", "pending", "ready", [gkey]),
        ("insert", "t", 2),
        ("moved", "ready", "leased", [gkey]),
        ("taken", [gkey], "lease"),
        ("moved", "leased", "ready", [gkey]),
        ("retired", [(gkey, "ready")], "consumed"),
        ("taken", [gkey], "consume"),
    ]


def test_each_step_raises_one_event_for_all_the_groups_it_moves(tmp_path: Path) -> None:
    """A push that fills three groups completes them in one Moved (where the hooks of earlier
    releases heard one update per group); a lease, its end and a delete each raise one event."""
    with Store(tmp_path / "data", extensions={"journal": Journal}) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, extensions=["journal"]))
        store.create_table(TableConfig.of("g", estimator="grpo", group_size=2, extensions=["journal"]))
        journal, queued = journal_of(store, "t"), journal_of(store, "g")
        items = [item for task in range(3) for item in group_items(0, task, 2)]
        gkeys = store.put("t", items).completed_groups
        assert len(gkeys) == 3
        leased = store.sample(TakeSpec("t", num_groups=3, delivery="lease"))
        assert store.nack(leased.lease_id) == 6
        assert store.delete("t", group_ids=gkeys) == 6
        assert [e for e in journal.events if e[0] in ("moved", "taken", "retired")] == [
            ("moved", "pending", "ready", gkeys),
            ("moved", "ready", "leased", sorted(gkeys, key=leased.group_ids.index)),
            ("taken", sorted(gkeys, key=leased.group_ids.index), "lease"),
            ("moved", "leased", "ready", sorted(gkeys, key=leased.group_ids.index)),
            ("retired", [(gkey, "ready") for gkey in gkeys], "deleted"),
        ]
        computing = store.put("g", items).completed_groups
        assert queued.events[1] == ("moved", "pending", "computing", computing)
        (job,) = store.compute_backlog()  # the groups wait in the compute queue, in order
        assert job.groups == computing
        store.finish_compute("g", dict.fromkeys(job.records, 0.5), ready=computing)
        assert queued.events[-1] == ("moved", "computing", "ready", computing)
        assert store.compute_backlog() == [] and store.verify("t") == [] and store.verify("g") == []


class Calls(TableExtension):
    """Writes down each call of a hook: the hook, what it says of the step, how many groups."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        self.calls.append(("pushed", event.call, len(event.gkeys)))

    def on_resent(self, tt: TableState, event: Resent) -> None:
        self.calls.append(("resent", event.call, len(event.gkeys)))

    def on_inserted(self, tt: TableState, event: Inserted) -> None:
        self.calls.append(("inserted", "", len(event.uids)))

    def on_moved(self, tt: TableState, event: Moved) -> None:
        self.calls.append(("moved", f"{event.was} -> {event.now}", len(event.groups)))

    def on_taken(self, tt: TableState, event: Taken) -> None:
        self.calls.append(("taken", event.delivery, len(event.groups)))

    def on_retired(self, tt: TableState, event: Retired) -> None:
        self.calls.append(("retired", event.state, len(event.groups)))

    def take(self) -> list[tuple[str, str, int]]:
        """The calls since the last take."""
        calls, self.calls = self.calls, []
        return calls


def test_a_step_over_many_groups_calls_each_hook_once_not_once_a_group(tmp_path: Path) -> None:
    """A push that fills 16 groups, a lease of them, its confirm, a consuming take, runs reported
    failed that complete 16 groups and advantages stored for 16: each step calls a hook once with
    all its groups (a release before called on_update 16 times a step, once a group)."""
    many = 16
    with Store(tmp_path / "data", extensions={"calls": Calls}) as store:
        for name, estimator in (("t", "none"), ("g", "grpo")):
            store.create_table(
                TableConfig.of(name, estimator=estimator, group_size=2, min_group_size=1, extensions=["calls"])
            )
        (calls,) = (ext for ext in store.extensions_of("t") if isinstance(ext, Calls))
        (computed,) = (ext for ext in store.extensions_of("g") if isinstance(ext, Calls))

        def batch(first: int) -> list:
            return [item for task in range(first, first + many) for item in group_items(0, task, 2)]

        assert len(store.put("t", batch(0)).completed_groups) == many
        assert calls.take() == [
            ("pushed", "push", many),
            ("moved", "pending -> ready", many),
            ("inserted", "", 2 * many),
        ]
        leased = store.sample(TakeSpec("t", num_groups=many, delivery="lease"))
        assert leased is not None and len(set(leased.group_ids)) == many
        assert calls.take() == [("moved", "ready -> leased", many), ("taken", "lease", many)]
        assert store.ack(leased.lease_id) == 2 * many  # the confirm
        assert calls.take() == [("retired", "consumed", many)]
        store.put("t", batch(many))
        calls.take()
        assert store.sample(TakeSpec("t", num_groups=many)) is not None  # consumed as taken
        assert calls.take() == [("retired", "consumed", many), ("taken", "consume", many)]

        halves = [items[0] for items in (group_items(1, task, 2) for task in range(many))]
        store.put("t", halves)  # one run of each group: they stay pending
        assert calls.take() == [("pushed", "push", many), ("inserted", "", many)]
        failed = [f"1/{task}/1/0/r1s0" for task in range(many)]
        assert len(store.fail_runs("t", failed, ["gone"] * many).completed_groups) == many
        assert calls.take() == [("pushed", "FailRuns", many), ("moved", "pending -> ready", many)]

        gkeys = store.put("g", batch(0)).completed_groups
        assert computed.take() == [
            ("pushed", "push", many),
            ("moved", "pending -> computing", many),
            ("inserted", "", 2 * many),
        ]
        (job,) = store.compute_backlog()
        store.finish_compute("g", dict.fromkeys(job.records, 0.5), ready=gkeys)
        assert computed.take() == [("moved", "computing -> ready", many)]
        assert store.verify("t") == [] and store.verify("g") == []


def test_a_push_that_evicts_many_groups_retires_them_in_one_event(tmp_path: Path) -> None:
    """A full table in evict mode makes room for a push of 16 groups by evicting the 16 oldest
    ready ones in one step: one Retired event (a release before raised one a group evicted), the
    oldest first, the counters and indexes as the evictions left them."""
    many = 16
    with Store(tmp_path / "data", extensions={"calls": Calls, "journal": Journal}) as store:
        config = TableConfig.of(
            "t", estimator="none", group_size=2, capacity_experiences=2 * many + 2, when_full="evict",
            extensions=["calls", "journal"],
        )  # fmt: skip
        store.create_table(config)
        (calls,) = (ext for ext in store.extensions_of("t") if isinstance(ext, Calls))
        journal = journal_of(store, "t")
        old = [item for task in range(many + 1) for item in group_items(0, task, 2)]
        assert len(store.put("t", old).completed_groups) == many + 1
        calls.take()
        journal.events.clear()
        new = [item for task in range(100, 100 + many) for item in group_items(0, task, 2)]
        assert len(store.put("t", new).completed_groups) == many
        assert calls.take() == [
            ("pushed", "push", many),
            ("retired", "evicted", many),
            ("moved", "pending -> ready", many),
            ("inserted", "", 2 * many),
        ]
        (retired,) = [event for event in journal.events if event[0] == "retired"]
        assert [gkey for gkey, _ in retired[1]] == [f"0/{task}" for task in range(many)]
        stats = store.stats("t")
        assert (stats["evicted_total"], stats["ready"]) == (2 * many, 2 * many + 2)
        assert store.verify("t") == []


def test_a_push_of_many_pieces_is_heard_once(tmp_path: Path) -> None:
    """A push of the first pieces of 8 rollouts (8 groups), then the same push again: one Pushed
    event for the 8 groups, then one Resent once they are finished (a release before raised one
    a piece), the claim's check still heard before anything is stored."""
    many = 8
    with Store(tmp_path / "data", map_size=1 << 26, extensions={"calls": Calls}) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=1, extensions=["calls"]))
        (calls,) = (ext for ext in store.extensions_of("t") if isinstance(ext, Calls))
        cut = [split(rollout(task=task), [4, 8]) for task in range(many)]
        firsts = [trxp.from_experience(pieces[0]) for pieces in cut]
        assert len(store.put("t", firsts).partial) == many
        assert calls.take() == [("pushed", "push", many)]
        middles = [trxp.from_experience(pieces[1]) for pieces in cut]
        assert len(store.put("t", middles).partial) == many
        assert calls.take() == [("pushed", "push", many)]
        lasts = [trxp.from_experience(pieces[-1]) for pieces in cut]
        assert len(store.put("t", lasts).completed_groups) == many
        assert calls.take()[0] == ("pushed", "push", many)
        store.put("t", lasts)  # the rollouts finished: their last pieces sent again
        assert calls.take() == [("resent", "push", many)]
        assert store.verify("t") == []


def test_the_claims_a_call_ends_drop_their_incomplete_groups_in_one_event(tmp_path: Path) -> None:
    """A release of 8 claims, and 8 claims' ends found by the upkeep, each drop their attempts'
    incomplete groups together: one Retired each (the ledger retired them one by one before)."""
    many, now = 8, [1_000_000.0]
    with Store(tmp_path / "data", clock=lambda: now[0], extensions={"calls": Calls}) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, extensions=["calls"]))
        (calls,) = (ext for ext in store.extensions_of("t") if isinstance(ext, Calls))
        store.claims.create("t", DatasetRecord("math", size=many, max_attempts=3))
        for attempt in range(2):
            prompts, _ = store.claims.claim("t", "math", many, seconds=60)
            assert [p.attempt for p in prompts] == [attempt] * many
            store.put("t", [group_items(f"math/{p.epoch}", f"{p.index}@{p.attempt}", 1)[0] for p in prompts])
            calls.take()
            if attempt == 0:
                assert store.claims.release("t", "math", [(p.epoch, p.index, p.attempt) for p in prompts]) == many
            else:
                now[0] += 61
                store.tick()  # the claims ended
            assert calls.take() == [("retired", "dropped", many)]
        assert store.verify("t") == []


def test_a_push_fail_runs_and_seal_name_who_makes_them_in_the_event(tmp_path: Path) -> None:
    """Who pushes travels in the event (the table's state holds no request's parameters)."""
    with Store(tmp_path / "data", extensions={"journal": Journal}) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=4, extensions=["journal"]))
        journal = journal_of(store, "t")
        first = group_items(0, 0, 2)
        store.put_entries("t", [Entry.of(item) for item in first], holder="token-a")
        store.put_entries("t", [Entry.of(first[0])], holder="token-b")  # a copy
        store.fail_runs("t", ["0/1/9/0/r9s0"], ["gone"], holder="token-c")
        store.seal("t", "0/0", holder="token-d")
        assert [e for e in journal.events if e[0] in ("push", "resend")] == [
            ("push", ["0/0"], "token-a", "push"),
            ("resend", ["0/0"], "token-b", "push"),  # nothing new: no Pushed of no groups
            ("push", ["0/1"], "token-c", "FailRuns"),
            ("push", ["0/0"], "token-d", "Seal"),
        ]


def test_an_extension_with_the_hooks_of_earlier_releases_is_called_per_group_and_warned(tmp_path: Path) -> None:
    """For one release: its registration warns, naming the hooks that replace its own, and it
    hears what it heard before, an update per group moved."""
    with pytest.warns(DeprecationWarning, match=r"TableExtension hooks of earlier releases") as warned:
        store = Store(tmp_path / "data", extensions={"journal": EarlierJournal})
    (message,) = [str(w.message) for w in warned]
    for replaced in ("on_push(tt, gkeys) -> on_pushed(tt, event: Pushed)",
                     "on_update(tt, gkey, grp, was) -> on_moved(tt, event: Moved)",
                     "on_retire(tt, groups, state) -> on_retired(tt, event: Retired)"):  # fmt: skip
        assert replaced in message
    with store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, extensions=["journal"]))
        (journal,) = (ext for ext in store.extensions_of("t") if isinstance(ext, EarlierJournal))
        items = [item for task in range(2) for item in group_items(0, task, 2)]
        gkeys = store.put("t", items).completed_groups
        store.put("t", items[:1])
        taken = store.sample(TakeSpec("t", num_groups=2))
        assert taken is not None
        order = list(dict.fromkeys(taken.group_ids))
    assert journal.events == [
        ("push", gkeys),
        *[("update", gkey, "pending", "ready") for gkey in gkeys],
        ("insert", "t", 4),
        ("resend", [gkeys[0]]),  # a push of a copy alone: no push or insert of nothing
        ("retire", [(gkey, "ready") for gkey in order], "consumed"),
        ("sample", order),
    ]


class Both(Journal):
    """Overrides a hook of earlier releases beside its new one (for servers of either release)."""

    def on_update(self, tt: TableState, gkey: str, grp: GroupRecord, was: str) -> None:
        raise AssertionError("the new hook is the one called")


def test_an_extension_with_both_forms_of_a_hook_hears_the_new_one_and_is_not_warned(tmp_path: Path) -> None:
    kinds = ExtensionKinds()
    kinds.register("both", Both)  # no warning: pyproject's filterwarnings makes it an error
    with Store(tmp_path / "data", extensions={"both": Both}) as store:
        store.create_table(TableConfig.of("t", estimator="none", group_size=2, extensions=["both"]))
        store.put("t", group_items(0, 0, 2))
        (both,) = (ext for ext in store.extensions_of("t") if isinstance(ext, Both))
        assert ("moved", "pending", "ready", ["0/0"]) in both.events


def test_an_extension_runs_only_on_the_tables_that_name_it_each_with_its_own_instance(tmp_path: Path) -> None:
    with Store(tmp_path / "data", extensions={"journal": Journal}) as store:
        for name, extensions in (("a", ["journal"]), ("b", []), ("c", ["journal"])):
            store.create_table(TableConfig.of(name, estimator="none", group_size=2, extensions=extensions))
        a, c = journal_of(store, "a"), journal_of(store, "c")
        assert a is not c and not [ext for ext in store.extensions_of("b") if isinstance(ext, Journal)]
        store.put("b", group_items(0, 0, 2))
        assert a.events == c.events == []  # b's push reached neither
        store.put("a", group_items(1, 0, 2))
        assert [e[0] for e in a.events] == ["push", "moved", "insert"] and c.events == []
        store.create_table(TableConfig.of("a", estimator="none", group_size=2, extensions=["journal"]), exist_ok=True)
        assert journal_of(store, "a") is a  # the table found again keeps its instance and what it holds
        store.drop_table("c")
        store.create_table(TableConfig.of("c", estimator="none", group_size=2, extensions=["journal"]))
        assert journal_of(store, "c") is not c  # a new table, a new instance


class Refuser(TableExtension):
    """Refuses every push of a table named `closed`, and into a group named `0/1`."""

    def on_pushed(self, tt: TableState, event: Pushed) -> None:
        if "0/1" in event.gkeys:
            raise InvalidRequest("group 0/1 takes no pushes")

    def on_inserted(self, tt: TableState, event: Inserted) -> None:
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
        assert kinds == {"g": [Ledger], "runs": [], "s": [StaleEviction]}
        assert store.extensions_of("g")[0] is store.ledger  # the one ledger the claims read
        store.put("g", group_items(0, 0, 2))
        (job,) = store.compute_backlog()  # queued by the table core as the group became computing
        assert job.table == "g" and len(job.groups) == 1
        store.delete("g", group_ids=job.groups)  # and out of the queue as it left
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
        assert [e[0] for e in journal_of(store, "t").events] == ["push", "moved", "insert"]


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
