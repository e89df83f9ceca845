"""A rows table's pending or computing group whose head (its directory entry) no longer decodes, or is
lost: a Delete naming the group removes it whole (its head, fragments, index rows, payloads and
counts), counted damaged, so that the table checks clean and the group's key takes pushes again,
through the store and through a server that stays up."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_rows_pending import EIGHTS, LARGE, attempt_runs, cut_head, run, uid

from expbuf.client import BufferClient
from expbuf.client.errors import DataLossError
from expbuf.client.schema.routing import uid_group_key
from expbuf.server.app import ExpbufServer
from expbuf.server.store import Entry, Store
from expbuf.server.store.disk import layout
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.errors import DamagedGroup
from expbuf.server.store.schema.table_config import TableConfig

import cli_forks
from conftest import Servers
from helpers import StoppedClock as Clock
from helpers import make_experience, scrape
from test_quarantine import lose

COUNTED = ("pending", "computing", "bytes", "groups_pending", "groups_computing", "groups_ready", "ready")
HELD = ("gdir", "frags", "pending", "compute", "oldest", "blobs", "adv")  # what the group holds, by database


def assert_removed(before: dict, after: dict, state: str, runs: int) -> None:
    """Stats before and after group 0/1 of `runs` runs (run(1, n)), in `state`, was removed whole:
    its experiences and bytes uncounted, counted damaged, the group named in the last failure."""
    freed = sum(Entry.of(run(1, n)).size for n in range(runs))
    assert {name: after[name] for name in COUNTED} == {
        **{name: before[name] for name in COUNTED},
        state: before[state] - runs,
        "groups_" + state: before["groups_" + state] - 1,
        "bytes": before["bytes"] - freed,
    }
    assert after["damaged"] == before["damaged"] + runs
    assert "group 0/1" in after["last_failure"] and "removed whole" in after["last_failure"]


def damage(store: Store, table: str, gkey: str, how: str) -> None:
    """A pending group's head cut so that it no longer decodes, or lost (its directory entry deleted)."""
    if how == "cut":
        cut_head(store, table, gkey)
    else:
        lose(store, table, gkey, "gdir")


def held(store: Store, table: str, gkey: str, names: tuple[str, ...] = HELD) -> dict[str, int]:
    """How many keys (or, in the compute queue and the insertion order, values) of each database name
    group `gkey` or one of its members."""
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    found = dict.fromkeys(names, 0)
    with store.environment.read() as txn:
        for name in names:
            with txn.cursor(db=store.db[name]) as cur:
                at = cur.set_range(prefix)
                while at and cur.key().startswith(prefix):
                    key, value = bytes(cur.key()[len(prefix) :]), bytes(cur.value())
                    found[name] += gkey.encode() in (value if name in ("compute", "order") else key)
                    at = cur.next()
    return found


@pytest.mark.parametrize("named", ["group", "member"])
@pytest.mark.parametrize("how", ["cut", "lost"])
@pytest.mark.parametrize(("state", "timed_out"), [("pending", False), ("pending", True), ("computing", False)])
def test_a_delete_naming_a_group_whose_head_does_not_decode_removes_it_whole(
    tmp_path: Path, state: str, timed_out: bool, how: str, named: str
) -> None:
    """Nothing could remove a pending or computing group whose head no longer decodes: a Delete of it
    was refused DATA_LOSS, and it stayed counted, its payloads and fragments kept, for good. One whose
    head was lost was not even refused: a Delete naming it found nothing, and its timeout failed the
    table's upkeep at every pass (no other group of the table timed out). A Delete naming it, or one of
    its members (refused DATA_LOSS where the head was cut, deleting nothing where it was lost), removes
    all of it and uncounts its members and bytes, also once its timeout passed over it (out of the
    pending index), and counts them damaged, as a records table's group whose record is lost; the table
    checks clean, its other groups take runs, and a fresh group of the same key is pushed and
    completes."""
    computing = state == "computing"
    settings = {**LARGE, "estimator": "grpo", "drop_zero_variance": False} if computing else LARGE
    runs = 40 if computing else 31  # over pushes of 4: rows spilled into fragments, and some in the head
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        store.create_table(TableConfig.of("t", layout="rows", group_timeout_seconds=60, **settings))
        for at in range(0, runs, 4):
            store.put("t", [run(1, n) for n in range(at, min(at + 4, runs))])
        store.put("t", [run(2, n) for n in range(3)] + [run(3, n) for n in range(40)])
        assert store.stats("t")["groups_" + state] == 2  # 0/1 and 0/2 pending, or 0/1 and 0/3 computing
        assert held(store, "t", "0/1")["frags"] >= 2
        damage(store, "t", "0/1", how)
        if timed_out:  # the timeout passes over it (out of the pending index) and releases 0/2
            clock.now += 61
            assert [store.tick()["groups_timed_out"] for _ in range(2)] == [1, 0]
        before = store.stats("t")
        if named == "group":
            assert store.delete("t", group_ids=["0/1"]) == runs
        else:
            assert store.delete("t", [uid(1, 0), uid(1, 1)]) == runs
        after = store.stats("t")
        assert_removed(before, after, state, runs)
        assert held(store, "t", "0/1") == dict.fromkeys(HELD, 0)
        assert store.verify("t") == []
        assert store.get("t", [uid(1, n) for n in range(runs)]) == {}
        assert store.delete("t", group_ids=["0/1"]) == 0
        assert store.stats("t")["damaged"] == after["damaged"]
        if not timed_out:
            assert store.put("t", [run(2, n) for n in range(3, 40)]).completed_groups == ["0/2"]
        assert store.put("t", [run(1, n) for n in range(40)]).completed_groups == ["0/1"]
        assert sum(store.stats("t")[f"groups_{now}"] for now in ("pending", "computing", "ready")) == 3
        assert store.verify("t") == []


def test_a_small_pending_group_whose_head_is_lost_is_removed_after_its_timeout_passed_over_it(
    tmp_path: Path,
) -> None:
    """A pending group of a few runs keeps them all in its head (no fragment): once its head is lost
    and its timeout passed over it (out of the pending index), only its payloads and its key in the
    index of the oldest are left of it. A Delete naming it removes it, counted damaged, and the table
    checks clean; the group's other runs pushed again make a fresh group."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        store.create_table(TableConfig.of("t", layout="rows", group_timeout_seconds=60, **EIGHTS))
        store.put("t", [run(task, n) for task in (1, 2) for n in range(3)])
        lose(store, "t", "0/1", "gdir")
        assert held(store, "t", "0/1") == {**dict.fromkeys(HELD, 0), "pending": 1, "oldest": 1, "blobs": 3}
        clock.now += 61
        assert store.tick()["groups_timed_out"] == 1  # 0/2, released
        assert any("'0/1': its head is lost" in p and "expbuf repair" in p for p in store.verify("t"))
        assert store.delete("t", group_ids=["0/1"]) == 3
        stats = store.stats("t")
        assert (stats["pending"], stats["groups_pending"], stats["damaged"], stats["ready"]) == (0, 0, 3, 3)
        assert held(store, "t", "0/1") == dict.fromkeys(HELD, 0)
        assert store.verify("t") == []
        assert store.put("t", [run(1, n) for n in range(8)]).completed_groups == ["0/1"]
        assert store.verify("t") == []


def test_a_delete_naming_a_group_gone_or_complete_whose_entry_is_lost_removes_nothing(tmp_path: Path) -> None:
    """A Delete naming a group the table does not hold, or a complete group whose directory entry
    (its place, which its segment still holds) is lost, removes nothing and counts no damage. One
    naming a member of that complete group, which deleted nothing and said so with a 0, is refused
    DATA_LOSS naming the group and `expbuf check` (which names it), as a records table's ready group
    whose record is lost is; a uid the table does not hold, and a name that is no uid, named beside
    0/2's, are none of it."""
    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout="rows", **EIGHTS))
        store.put("t", [run(1, n) for n in range(8)] + [run(2, n) for n in range(3)])
        lose(store, "t", "0/1", "gdir")
        before = store.stats("t")
        assert store.delete("t", group_ids=["0/1", "0/9"]) == 0
        assert store.stats("t") == before
        assert held(store, "t", "0/1")["blobs"] == 8
        with pytest.raises(DamagedGroup, match=re.escape("group 0/1: its record is not stored")) as refused:
            store.delete("t", [uid(2, 0), uid(1, 0)])
        assert "run `expbuf check`" in str(refused.value) and "Delete the group" not in str(refused.value)
        assert store.stats("t") == before
        assert store.verify("t") == ["group 0/1 of segment 0 has no directory entry naming it"]
        assert store.delete("t", [uid(2, 0), uid(9, 0), "not/an/experience"]) == 1


@pytest.mark.parametrize("table_layout", ["rows"], indirect=True)
@pytest.mark.usefixtures("table_layout")
def test_through_the_server_a_delete_removes_a_pending_group_whose_head_does_not_decode(
    start_server: Servers, tmp_path: Path
) -> None:
    """Through a server that stays up: a push to the damaged group is refused DATA_LOSS naming the way
    out, a Delete naming the group removes it, counted damaged in Stats and expbuf_damaged_total (it
    was counted nowhere), the health check says SERVING, the group's key takes a fresh group, and
    `expbuf check` finds the directory clean after the server stops."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=20) as client:
        client.create_table("t", group_size=8, estimator="none")
        client.push([make_experience(0, task, n) for task in (1, 2) for n in range(3)], "t")
        cut_head(server.store, "t", "0/1")
        with pytest.raises(DataLossError, match=re.escape("Delete the group by its id")):
            client.push([make_experience(0, 1, 3)], "t")
        assert client.delete(table="t", groups=["0/1"]) == 3
        serves_after_removal(server, client)
    server.stop()
    code, lines = cli("check", tmp_path / "data")
    assert code == 0 and "t: ok" in lines and all(line.endswith(": ok") for line in lines), lines


def serves_after_removal(server: ExpbufServer, client: BufferClient) -> None:
    """Once group 0/1 of table t (3 runs; 0/2 holds 3 too) was removed whole through `server`: its runs
    counted damaged in Stats and expbuf_damaged_total, the health check SERVING, and a fresh group of
    its key pushed and complete."""
    assert client.stats("t")["t"].damaged == 3
    assert scrape(server.metrics_port)[("expbuf_damaged_total", (("table", "t"),))] == 3
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert client.push([make_experience(0, 1, n) for n in range(8)], "t").completed_groups == ["0/1"]
    stats = client.stats("t")["t"]
    assert (stats.groups_pending, stats.pending, stats.groups_ready, stats.ready) == (1, 3, 1, 8)


def test_a_complete_groups_directory_entry_that_does_not_decode_is_not_removed(tmp_path: Path) -> None:
    """A complete group's directory entry (its place in a segment, which still holds the group) that
    no longer decodes is no pending group to remove: a Delete naming it is refused DATA_LOSS as
    before, its refusal naming `expbuf check` and no Delete, and nothing changes."""
    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout="rows", **LARGE))
        store.put("t", [run(1, n) for n in range(40)])
        cut_head(store, "t", "0/1")
        before = store.stats("t")
        with pytest.raises(DamagedGroup, match=re.escape("run `expbuf check`")) as refused:
            store.delete("t", group_ids=["0/1"])
        assert "Delete the group" not in str(refused.value)
        assert store.stats("t") == before
        assert held(store, "t", "0/1")["gdir"] == 1


def cli(command: str, data: Path) -> tuple[int, list[str]]:
    done = cli_forks.run(command, "--data", str(data), timeout=120)
    return done.returncode, done.stdout.splitlines()


@pytest.mark.parametrize(
    ("how", "named", "why"), [("cut", "'0/1' does not decode", "did not decode"), ("lost", "0/1", "was lost")]
)
def test_expbuf_repair_removes_a_pending_group_whose_head_does_not_decode(
    tmp_path: Path, how: str, named: str, why: str
) -> None:
    """With the server stopped: `expbuf check` names the group's entry and the way out, `expbuf repair`
    (which refused nothing of it but left it) removes the group whole, its experiences and bytes
    uncounted and counted damaged, and the directory checks clean; the next open serves the table, and
    the group's key takes a fresh group. A group whose head is lost was not named, nor removed."""
    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout="rows", **LARGE))
        for at in range(0, 31, 4):
            store.put("t", [run(1, n) for n in range(at, min(at + 4, 31))])
        store.put("t", [run(2, n) for n in range(3)])
        damage(store, "t", "0/1", how)
        before = store.stats("t")
    code, lines = cli("check", tmp_path)
    assert code == 1 and any(named in line and "expbuf repair" in line for line in lines), lines
    assert cli("repair", tmp_path) == (0, [f"t: removed group 0/1, whose record {why}, with 31 experience(s)"])
    assert cli("check", tmp_path) == (0, ["default: ok", "t: ok"])
    assert cli("repair", tmp_path) == (0, ["no stray chunk sets"])
    with Store(tmp_path, clock=Clock()) as store:
        after = store.stats("t")
        freed = sum(Entry.of(run(1, n)).size for n in range(31))
        assert (after["pending"], after["groups_pending"], after["bytes"]) == (3, 1, before["bytes"] - freed)
        assert after["damaged"] == before["damaged"] + 31
        assert held(store, "t", "0/1") == dict.fromkeys(HELD, 0)
        assert store.put("t", [run(1, n) for n in range(40)]).completed_groups == ["0/1"]
        assert store.verify("t") == []


@pytest.mark.parametrize(
    ("layout", "directory", "named"),
    [
        ("rows", "gdir", "'0/1': its head is lost"),
        ("records", "groups", "'0/1': its record is lost, the pending index"),
    ],
)
def test_expbuf_repair_removes_a_group_that_holds_no_member_whose_head_is_lost(
    tmp_path: Path, layout: str, directory: str, named: str
) -> None:
    """A pending group holding only a run reported failed, its head (a records table's group record)
    lost: its row in the pending index is all that is left of it. `expbuf check` names it and the way
    out, `expbuf repair` removes it, and the table checks clean, its other group still pending."""
    with Store(tmp_path, clock=Clock()) as store:
        store.create_table(TableConfig.of("t", layout=layout, **EIGHTS))
        store.fail_runs("t", [uid(1, 0)], ["died"])
        store.put("t", [run(2, n) for n in range(3)])
        lose(store, "t", "0/1", directory)
    code, lines = cli("check", tmp_path)
    assert code == 1 and any(named in line and "expbuf repair" in line for line in lines), lines
    assert cli("repair", tmp_path) == (0, ["t: removed group 0/1, whose record was lost, with 0 experience(s)"])
    assert cli("check", tmp_path) == (0, ["default: ok", "t: ok"])
    with Store(tmp_path, clock=Clock()) as store:
        assert (store.stats("t")["groups_pending"], store.stats("t")["pending"]) == (1, 3)


@pytest.mark.parametrize("removed_by", ["delete", "repair"])
def test_a_claimed_prompts_group_removed_leaves_the_prompt_ledger_consistent(tmp_path: Path, removed_by: str) -> None:
    """The damaged group of a claimed prompt removed by a Delete (the prompt ledger hears it leave,
    as of a group deleted whole) or by `expbuf repair` (the claim left to end): the table, its
    ledger included, checks clean, and the other prompt's group completes."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        store.create_table(TableConfig.of("t", layout="rows", group_by="task", group_size=4, estimator="none"))
        store.claims.create("t", DatasetRecord("math", size=8))
        prompts, _ = store.claims.claim("t", "math", 2, seconds=300, owner="w")
        runs = [attempt_runs(p.epoch, p.index, p.attempt, range(4)) for p in prompts]
        for items in runs:
            store.put("t", items[:2])
        gkey = uid_group_key(Entry.of(runs[0][0]).uid, "task")
        cut_head(store, "t", gkey)
        if removed_by == "delete":
            assert store.delete("t", group_ids=[gkey]) == 2
    if removed_by == "repair":
        assert cli("repair", tmp_path)[0] == 0
    with Store(tmp_path, clock=clock) as store:
        assert store.verify("t") == []
        assert store.put("t", runs[1][2:]).completed_groups == [uid_group_key(Entry.of(runs[1][0]).uid, "task")]
        assert store.verify("t") == []
