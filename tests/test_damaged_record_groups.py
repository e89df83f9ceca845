"""A records table's pending or computing group whose own record is lost, or no longer decodes, as a
rows table's whose head is (test_damaged_group_delete.py): its timeout passes over it, a Delete naming
the group or one of its members removes it whole (its index rows, members and payloads), counted
damaged, `expbuf check` names it with the way out and `expbuf repair` removes it; through the store and
through a server that stays up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_damaged_group_delete import assert_removed, cli, held, serves_after_removal
from test_rows_pending import EIGHTS, run, uid

from expbuf.client import BufferClient
from expbuf.server.store import Entry, Store
from expbuf.server.store.schema.errors import DamagedGroup
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import StoppedClock as Clock
from helpers import make_experience
from test_quarantine import garble, lose

HELD = ("groups", "items", "blobs", "pending", "compute", "order")  # what a records group holds, by database
COMPUTES = {**EIGHTS, "estimator": "grpo", "drop_zero_variance": False}


def damage(store: Store, table: str, gkey: str, how: str) -> None:
    """A group's record lost (deleted), or cut so that it no longer decodes, as a damaged page would leave it."""
    if how == "cut":
        garble(store, table, gkey, "groups")
    else:
        lose(store, table, gkey, "groups")


def records_table(store: Store, settings: dict[str, object]) -> None:
    """Table t, a records table whose groups time out after a minute, holding group 0/1 (3 runs of 8
    pending, or 8 computing) and 0/2 (3 runs pending)."""
    store.create_table(TableConfig.of("t", layout="records", group_timeout_seconds=60, **settings))
    runs = 8 if settings is COMPUTES else 3
    store.put("t", [run(1, n) for n in range(runs)] + [run(2, n) for n in range(3)])


@pytest.mark.parametrize("named", ["group", "member"])
@pytest.mark.parametrize("how", ["cut", "lost"])
@pytest.mark.parametrize(("state", "timed_out"), [("pending", False), ("pending", True), ("computing", False)])
def test_a_delete_naming_a_group_whose_record_is_lost_or_one_of_its_members_removes_it_whole(
    tmp_path: Path, state: str, timed_out: bool, how: str, named: str
) -> None:
    """A Delete naming a pending or computing group whose own record damage lost found nothing, and one
    naming a member was refused INTERNAL ("group ... is named but not stored"); its timeout failed the
    table's upkeep at every pass. Its timeout passes over it now (the other group times out, nothing
    fails), and a Delete naming it or a member removes all of it: its members, payloads and index rows
    go, uncounted, counted damaged, and the table checks clean; a fresh group of the key completes."""
    computing = state == "computing"
    runs = 8 if computing else 3
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        records_table(store, COMPUTES if computing else EIGHTS)
        assert store.stats("t")["groups_" + state] == (1 if computing else 2)
        damage(store, "t", "0/1", how)
        if timed_out:  # the timeout passes over it (out of the pending index) and releases 0/2
            clock.now += 61
            ticks = [store.tick() for _ in range(2)]
            assert [(tick["groups_timed_out"], tick["failed"]) for tick in ticks] == [(1, 0), (0, 0)]
            assert store.maintenance_failures == 0
        assert any("'0/1': its record is lost" in p and "expbuf repair" in p for p in store.verify("t"))
        before = store.stats("t")
        if named == "group":
            assert store.delete("t", group_ids=["0/1"]) == runs
        else:
            assert store.delete("t", [uid(1, 1)]) == runs
        after = store.stats("t")
        assert_removed(before, after, state, runs)
        assert held(store, "t", "0/1", HELD) == dict.fromkeys(HELD, 0)
        assert store.verify("t") == []
        assert store.delete("t", group_ids=["0/1"]) == 0
        assert store.stats("t")["damaged"] == after["damaged"]
        assert store.put("t", [run(1, n) for n in range(8)]).completed_groups == ["0/1"]
        assert store.verify("t") == []


def test_a_delete_naming_a_member_of_a_ready_group_whose_record_is_lost_is_refused_and_removes_nothing(
    tmp_path: Path,
) -> None:
    """A ready group whose record is lost is no pending group to remove (a sample fails it): a Delete
    naming one of its members was refused INTERNAL; it is refused DATA_LOSS naming the group and `expbuf
    check`, no Delete, and nothing changes. A Delete naming the group removes nothing."""
    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout="records", **EIGHTS))
        store.put("t", [run(1, n) for n in range(8)])
        lose(store, "t", "0/1", "groups")
        before = store.stats("t")
        with pytest.raises(DamagedGroup, match=re.escape("group 0/1: its record is not stored")) as refused:
            store.delete("t", [uid(1, 0)])
        assert "run `expbuf check`" in str(refused.value) and "Delete the group" not in str(refused.value)
        assert store.delete("t", group_ids=["0/1"]) == 0
        assert store.stats("t") == before
        assert held(store, "t", "0/1", HELD)["items"] == 8


@pytest.mark.parametrize(("how", "why"), [("cut", "did not decode"), ("lost", "was lost")])
@pytest.mark.parametrize("state", ["pending", "computing"])
def test_expbuf_repair_removes_a_records_group_whose_record_is_lost(
    tmp_path: Path, state: str, how: str, why: str
) -> None:
    """With the server stopped: `expbuf check` names the group and the way out (it named each member
    as not one of its group's, and no way out), `expbuf repair` (which left it) removes it whole, its
    experiences and bytes uncounted and counted damaged, and the directory checks clean; the next open
    serves the table, and the group's key takes a fresh group."""
    computing = state == "computing"
    runs = 8 if computing else 3
    with Store(tmp_path, clock=Clock()) as store:
        records_table(store, COMPUTES if computing else EIGHTS)
        damage(store, "t", "0/1", how)
        before = store.stats("t")
    code, lines = cli("check", tmp_path)
    assert code == 1 and any("'0/1': its record is lost" in line and "expbuf repair" in line for line in lines), lines
    assert cli("repair", tmp_path) == (0, [f"t: removed group 0/1, whose record {why}, with {runs} experience(s)"])
    assert cli("check", tmp_path) == (0, ["default: ok", "t: ok"])
    assert cli("repair", tmp_path) == (0, ["no stray chunk sets"])
    with Store(tmp_path, clock=Clock()) as store:
        after = store.stats("t")
        freed = sum(Entry.of(run(1, n)).size for n in range(runs))
        assert (after[state], after["groups_" + state], after["bytes"]) == (
            before[state] - runs, before["groups_" + state] - 1, before["bytes"] - freed,
        )  # fmt: skip
        assert after["damaged"] == before["damaged"] + runs
        assert held(store, "t", "0/1", HELD) == dict.fromkeys(HELD, 0)
        assert store.put("t", [run(1, n) for n in range(8)]).completed_groups == ["0/1"]
        assert store.verify("t") == []


@pytest.mark.parametrize("table_layout", ["records"], indirect=True)
@pytest.mark.usefixtures("table_layout")
def test_through_the_server_a_delete_of_a_member_removes_a_pending_group_whose_record_is_lost(
    start_server: Servers, tmp_path: Path
) -> None:
    """Through a server that stays up: a Delete naming a member of a pending group whose record is lost
    (refused INTERNAL before) removes the group whole, counted damaged in Stats and
    expbuf_damaged_total, the health check says SERVING, the group's key takes a fresh group, and
    `expbuf check` finds the directory clean after the server stops."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_size=8, estimator="none")
        client.push([make_experience(0, task, n) for task in (1, 2) for n in range(3)], "t")
        lose(server.store, "t", "0/1", "groups")
        member = make_experience(0, 1, 2).eid.uid
        assert client.delete(table="t", uids=[member]) == 3
        serves_after_removal(server, client)
    server.stop()
    code, lines = cli("check", tmp_path / "data")
    assert code == 0 and "t: ok" in lines and all(line.endswith(": ok") for line in lines), lines
