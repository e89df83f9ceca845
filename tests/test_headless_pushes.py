"""A push to a rows table's pending group whose head (its directory entry) is lost while its runs are
stored, or to a records table's whose group record is: refused, naming the group and the way out,
nothing of the push stored, where it opened a new group under the same key (a rows table's resent run
stored and counted twice, a new spill over the old group's fragment; a records table's runs stored
left out of the new group, pending for good); through the store and through a server that stays
up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_damaged_group_delete import held
from test_rows_pending import EIGHTS, LARGE, run, uid

from expbuf.client import BufferClient, trxp
from expbuf.client.errors import DataLossError
from expbuf.server.store import Entry, Store
from expbuf.server.store.schema.errors import DamagedGroup
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import StoppedClock as Clock
from helpers import make_experience
from test_quarantine import lose

WAY_OUT = re.compile(r"group 0/1: .*`expbuf repair` removes it too.*Delete the group by its id")


@pytest.mark.parametrize(
    ("settings", "runs", "pushed"),
    [
        (EIGHTS, 3, [run(1, 0), run(2, 3)]),  # a resent run, beside another group's
        (EIGHTS, 3, [run(2, 3), run(1, 3)]),  # a new run
        (EIGHTS, 3, [run(1, n) for n in range(8)]),  # the whole group again, which it would complete
        (LARGE, 31, [run(1, 31), run(2, 3)]),  # a group whose rows spilled into fragments
    ],
)
def test_a_push_to_a_pending_group_whose_head_is_lost_is_refused_and_stores_nothing(
    tmp_path: Path, settings: dict, runs: int, pushed: list
) -> None:
    """The push opened a new group under the lost one's key: a resent run was stored and counted a
    second time, and the new group's rows could spill over the old one's fragment 0. It is refused
    (DATA_LOSS) naming the group and both ways out, nothing of it stored (the other group's run
    neither, as for any group a push is refused for); a Delete naming the group then removes it, and
    the same push is stored."""
    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout="rows", **settings))
        for at in range(0, runs, 4):
            store.put("t", [run(1, n) for n in range(at, min(at + 4, runs))])
        store.put("t", [run(2, n) for n in range(3)])
        lose(store, "t", "0/1", "gdir")
        before, frags = store.stats("t"), held(store, "t", "0/1")["frags"]
        with pytest.raises(DamagedGroup, match=WAY_OUT):
            store.put("t", pushed)
        assert store.stats("t") == before
        assert held(store, "t", "0/1")["frags"] == frags
        assert held(store, "t", "0/2")["blobs"] == 3
        assert store.delete("t", group_ids=["0/1"]) == runs
        assert store.put("t", pushed).stored == [Entry.of(item).uid for item in pushed]
        assert store.verify("t") == []


def test_a_push_that_opens_a_group_the_table_never_held_is_stored(tmp_path: Path) -> None:
    """A group whose key begins as a lost one's does (0/1 and 0/10) is no part of it: pushes to it are
    stored, while a push to the lost one is refused."""
    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout="rows", **EIGHTS))
        store.put("t", [run(1, n) for n in range(3)])
        lose(store, "t", "0/1", "gdir")
        assert len(store.put("t", [run(10, n) for n in range(3)]).stored) == 3
        with pytest.raises(DamagedGroup, match=WAY_OUT):
            store.put("t", [run(1, 3)])


def test_a_table_grouped_by_step_refuses_a_resent_run_of_a_group_whose_head_is_lost(tmp_path: Path) -> None:
    """A step's group holds runs whose uids are not side by side (the run comes before the step): a
    resent run of the lost group is refused all the same, while a group of another step of the same
    task, whose runs lie beside the lost group's, is opened and takes runs."""

    def step_run(number: int, step: int) -> trxp.RawItem:
        return trxp.from_experience(make_experience(0, 1, number, step=step))

    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout="rows", estimator="none", group_by="step", group_size=8))
        store.put("t", [step_run(n, step) for n in range(3) for step in (0, 1)])
        lose(store, "t", "0/1/0", "gdir")
        before = store.stats("t")
        with pytest.raises(DamagedGroup, match=r"group 0/1/0: .*`expbuf repair` removes it too"):
            store.put("t", [step_run(1, 0)])
        assert store.stats("t") == before
        assert len(store.put("t", [step_run(n, 2) for n in range(3)] + [step_run(3, 1)]).stored) == 4


@pytest.mark.parametrize(
    "pushed",
    [
        [run(2, 3), run(1, 3)],  # a new run, beside another group's
        [run(1, n) for n in range(8)],  # the whole group again: its runs stored are copies, the rest new
    ],
)
def test_a_push_to_a_records_group_whose_record_is_lost_is_refused_and_stores_nothing(
    tmp_path: Path, pushed: list
) -> None:
    """A records table opened a new group under the lost one's key: the runs stored stayed out of it,
    pending for good, and the group completed without them. The push is refused (DATA_LOSS) naming the
    group and both ways out, nothing of it stored; a Delete naming the group removes it whole, and the
    same push is stored. A resent run alone is a copy, acknowledged as one (its own record is kept)."""
    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout="records", **EIGHTS))
        store.put("t", [run(task, n) for task in (1, 2) for n in range(3)])
        lose(store, "t", "0/1", "groups")
        before = store.stats("t")
        with pytest.raises(DamagedGroup, match=WAY_OUT):
            store.put("t", pushed)
        assert store.stats("t") == before
        assert held(store, "t", "0/2", ("items",)) == {"items": 3}
        assert store.put("t", [run(1, 2)]).duplicates == [uid(1, 2)]
        assert store.delete("t", group_ids=["0/1"]) == 3
        assert store.put("t", pushed).stored == [Entry.of(item).uid for item in pushed]
        assert store.verify("t") == []


@pytest.mark.parametrize(
    ("table_layout", "record"), [("rows", "gdir"), ("records", "groups")], indirect=["table_layout"]
)
@pytest.mark.usefixtures("table_layout")
def test_through_the_server_a_push_to_a_group_whose_head_is_lost_is_refused_and_the_server_serves(
    start_server: Servers, record: str
) -> None:
    """Through a server: the push is refused DATA_LOSS naming the group and the way out, the server
    takes the next push of another group, and once a Delete removed the group the refused push is
    stored."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_size=8, estimator="none")
        client.push([make_experience(0, task, n) for task in (1, 2) for n in range(3)], "t")
        lose(server.store, "t", "0/1", record)
        resent = [make_experience(0, 1, n) for n in range(2, 4)]
        with pytest.raises(DataLossError, match=WAY_OUT):
            client.push(resent, "t")
        assert client.stats("t")["t"].pending == 6
        assert len(client.push([make_experience(0, 2, 3)], "t").stored) == 1
        assert client.delete(table="t", groups=["0/1"]) == 3
        assert len(client.push(resent, "t").stored) == 2
        stats = client.stats("t")["t"]
        assert (stats.groups_pending, stats.pending) == (2, 6)
