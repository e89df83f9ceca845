"""The server's cost grows with the tables in use, not with all tables: an upkeep pass visits
only the tables written to since they were last idle or with work that will fall due (and
every table once per sweep), and /metrics leaves out tables that never held anything."""

from __future__ import annotations

from pathlib import Path

from expbuf.client import BufferClient, trxp
from expbuf.server.store import Store
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.services.upkeep import SWEEP_SECONDS

from conftest import Servers
from helpers import group_items, scrape, take

IDLE_TABLES = 150


def test_a_pass_visits_only_the_active_tables(tmp_path: Path) -> None:
    now = [1_000_000.0]
    with Store(tmp_path, clock=lambda: now[0]) as store:
        for i in range(IDLE_TABLES):
            store.create_table(TableConfig.of(f"idle{i}", estimator="none"))
        store.create_table(TableConfig.of("timed", estimator="none", group_size=4, group_timeout_seconds=10))
        store.create_table(TableConfig.of("consumed", estimator="none", tombstone_seconds=60))
        every = IDLE_TABLES + 3  # with the default table
        first = store.tick()  # the first pass is a sweep: it visits every table, and works on none
        assert (first["tables_visited"], first["tables_worked"]) == (every, 0)
        assert store.tick()["tables_visited"] == 0  # nothing was written since

        store.put("timed", group_items(0, 0, 2))  # an incomplete group: it may time out
        store.put("consumed", group_items(0, 0, 2))
        done = store.tick()
        assert (done["tables_visited"], done["tables_worked"]) == (2, 0)  # written to, nothing due yet
        assert take(store, "consumed", num_groups=1) is not None  # tombstones, remembered for 60 s
        done = store.tick()
        assert (done["tables_visited"], done["tables_worked"]) == (1, 0)  # the group waits for its timeout
        now[0] += 10
        done = store.tick()
        assert (done["tables_visited"], done["tables_worked"], done["groups_timed_out"]) == (1, 1, 1)
        assert store.tick()["tables_visited"] == 0

        now[0] += SWEEP_SECONDS  # a sweep finds the tombstones the sample left (it did not mark the table)
        done = store.tick()
        assert (done["tables_visited"], done["tables_worked"]) == (every, 0)
        assert store.tick()["tables_visited"] == 1  # they wait in the active tables now
        now[0] += 21  # 61 s since the tombstones were made, 21 since the sweep
        done = store.tick()
        assert (done["tables_visited"], done["tables_worked"], done["tombstones_pruned"]) == (1, 1, 2)
        assert store.tick()["tables_visited"] == 0
        assert store.stats("timed")["groups_pending"] == 0 and store.verify("consumed") == []


def test_metrics_export_the_tables_in_use(start_server: Servers) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        for i in range(IDLE_TABLES):
            client.create_table(f"idle{i}")
        client.create_table("used")
        client.push(trxp.build(group_items(0, 0, 2)), table="used")
    metrics = scrape(server.metrics_port)
    assert metrics[("expbuf_tables", ())] == IDLE_TABLES + 2
    tables = {dict(labels).get("table") for _, labels in metrics} - {None}
    assert tables == {"default", "used"}, f"tables that never held anything are exported: {sorted(tables)[:5]}"
    assert metrics[("expbuf_experiences_pushed_total", (("table", "used"),))] == 2
