"""Groups that finish short (issue 44): a worker reports a run failed (FailRuns), the run counts
as one of its group's runs, and a group whose runs are all known completes with the members
present when at least `min_group_size` succeeded (flagged partial), else it is dropped (reason
short). Advantages are computed over the members present: Trinity-RFT's own functions on those
members are the reference. The store with a settable clock (timeouts without sleeping), and a
real server on loopback for the wire, the metrics and a restart."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from expbuf.client import BufferClient, Experience, InvalidArgumentError
from expbuf.client.errors import AlreadyExistsError, FailedPreconditionError
from expbuf.server.store import Store
from expbuf.server.store.core.table_state.state import TableState
from expbuf.server.store.disk.layout import u64
from expbuf.server.store.disk.rows import GroupRef, SegmentView, directory_entry
from expbuf.server.store.schema.errors import ConfigError, GroupClosed
from expbuf.server.store.schema.table_config import TableConfig
from expbuf.server.store.schema.views import GroupView

from conftest import Servers
from helpers import group_items, make_experience, scrape
from test_estimators import Exp, assert_same, trinity_advantages
from test_store import Clock


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[Store]:
    with Store(tmp_path / "data", map_size=1 << 24, clock=clock, seed=7) as s:
        yield s
        for table in s.list_tables():
            assert s.verify(table.name) == []


def uid(task: int, run: int) -> str:
    return f"1/{task}/{run}/0/r{run}s0"  # helpers.group_items' uids: batch 1


def runs(task: int, numbers: Iterable[int]) -> list[Experience]:
    """Experiences of batch 1, as a rollout worker pushes them."""
    return [make_experience(1, task, run) for run in numbers]


def group_record(store: Store, table: str, gkey: str) -> GroupView | None:
    """The group as the store reads it, of either layout."""
    return store._in_table(table, lambda tt: tt.view(gkey))


def group(store: Store, table: str, gkey: str) -> GroupView:
    grp = group_record(store, table, gkey)
    assert grp is not None, gkey
    return grp


def partial(store: Store, table: str, gkey: str) -> bool:
    """Whether the group completed short: its record's flag, or a rows table's in its segment."""

    def read(tt: TableState) -> bool:
        if tt.config.storage.layout != "rows":
            return tt.existing_group(gkey).partial
        ref = directory_entry(tt.txn.get(tt.key(gkey), db=tt.db["gdir"]))
        assert isinstance(ref, GroupRef)
        return SegmentView(tt.txn.get(tt.prefix + u64(ref.seg), db=tt.db["segs"])).partial(ref.group)

    return store._in_table(table, read)


def test_min_group_size_is_checked_against_group_size() -> None:
    assert TableConfig.of("t", group_size=8, min_group_size=6).grouping.min_size == 6
    for bad in ({"group_size": 8, "min_group_size": 9}, {"group_size": 0, "min_group_size": 1}):
        with pytest.raises(ConfigError, match="min_group_size must be from 1 to group_size"):
            TableConfig.of("t", **bad)


@pytest.mark.usefixtures("records_layout")  # a group record's partial flag
def test_a_group_of_8_with_2_failed_runs_completes_with_the_6_and_records_why(store: Store) -> None:
    store.create_table(TableConfig.of("short", estimator="none", group_size=8, min_group_size=6))
    store.put("short", group_items(1, 0, 6))
    done = store.fail_runs("short", [uid(0, 6), uid(0, 7)], ["sandbox timed out", ""])
    assert (done.recorded, done.completed_groups, done.dropped_groups) == ([uid(0, 6), uid(0, 7)], ["1/0"], [])
    grp = group(store, "short", "1/0")
    assert grp.state == "ready" and partial(store, "short", "1/0") and len(grp.members) == 6
    assert grp.failed == {uid(0, 6): "sandbox timed out", uid(0, 7): "failed"}
    stats = store.stats("short")
    assert (stats["ready"], stats["runs_failed"], stats["groups_short"], stats["groups_dropped"]) == (6, 2, 1, 0)


@pytest.mark.usefixtures("records_layout")  # a group record's partial flag
def test_failures_first_then_the_pushes_complete_the_group_and_a_failed_run_pushed_after_all_rejoins(
    store: Store,
) -> None:
    store.create_table(TableConfig.of("late", estimator="none", group_size=4, min_group_size=2))
    assert store.fail_runs("late", [uid(0, 3), uid(0, 3)], []).recorded == [uid(0, 3)]  # twice: once
    assert store.fail_runs("late", [uid(0, 3)], ["again"]).recorded == []
    store.put("late", group_items(1, 0, 1))
    store.put("late", group_items(1, 0, 4)[3:])  # run 3 pushed after all: a member again
    assert group(store, "late", "1/0").failed == {}
    done = store.put("late", group_items(1, 0, 3)[1:])
    assert done.completed_groups == ["1/0"]
    grp = group(store, "late", "1/0")
    assert not partial(store, "late", "1/0") and len(grp.members) == 4
    assert store.stats("late")["groups_short"] == 0


def test_too_few_succeeded_drops_the_group_and_without_min_group_size_one_failure_does(store: Store) -> None:
    store.create_table(TableConfig.of("few", estimator="none", group_size=4, min_group_size=3))
    store.create_table(TableConfig.of("every", estimator="none", group_size=4))
    for table in ("few", "every"):
        store.put(table, group_items(1, 0, 2))
    assert store.fail_runs("few", [uid(0, 2)], []).dropped_groups == []  # 3 of 4 runs known
    assert store.fail_runs("few", [uid(0, 3)], []).dropped_groups == ["1/0"]  # 2 succeeded, 3 needed
    store.put("every", group_items(1, 0, 3)[2:])
    assert store.fail_runs("every", [uid(0, 3)], []).dropped_groups == ["1/0"]
    for table in ("few", "every"):
        stats = store.stats(table)
        assert (stats["groups_dropped"], stats["dropped_short"], stats["ready"]) == (1, 1, 0)


def test_a_timed_out_group_is_released_short_or_dropped_by_min_group_size(store: Store, clock: Clock) -> None:
    store.create_table(TableConfig.of("tmo", estimator="none", group_size=8, min_group_size=3, group_timeout_seconds=5))
    store.put("tmo", group_items(1, 0, 3))  # enough
    store.put("tmo", group_items(1, 1, 2))  # too few
    clock.now += 6
    assert store.tick()["groups_timed_out"] == 2
    stats = store.stats("tmo")
    assert (stats["ready"], stats["groups_short"], stats["dropped_short"]) == (3, 1, 1)
    # both counted where ExpbufGroupsTimingOut reads: it read groups dropped for a timeout alone, which
    # the default on_group_timeout (release) and min_group_size never count (a helper's audit)
    assert (stats["groups_timed_out"], stats["dropped_timeout"]) == (2, 0)


def test_bad_reports_are_refused_by_name_and_record_nothing(store: Store) -> None:
    from expbuf.server.store.schema.errors import Conflict, GroupClosed, GroupOverfilled, InvalidRequest

    store.create_table(TableConfig.of("bad", estimator="none", group_size=2))
    store.create_table(TableConfig.of("whole", estimator="none"))
    store.put("bad", group_items(1, 0, 2) + group_items(1, 1, 1))
    cases = [
        ("bad", ["not-a-uid"], InvalidRequest, "not an experience uid"),
        ("bad", [uid(1, 0)], Conflict, "was pushed"),
        ("bad", [uid(0, 5)], GroupClosed, "already complete"),
        ("whole", [uid(2, 0)], InvalidRequest, "group_size = 0"),
        ("bad", [uid(1, 1), uid(1, 2)], GroupOverfilled, "has all its 2 runs"),
    ]
    for table, uids, error, words in cases:
        with pytest.raises(error, match=words):
            store.fail_runs(table, uids, [])
    with pytest.raises(InvalidRequest, match="one reason a uid"):
        store.fail_runs("bad", [uid(1, 1)], ["a", "b"])
    assert store.stats("bad")["runs_failed"] == 0 and group(store, "bad", "1/1").failed == {}


@pytest.mark.parametrize(("estimator", "params"), [("grpo", {}), ("rloo", {}), ("opmd", {})])
def test_advantages_of_a_short_group_are_trinitys_on_the_members_present(
    start_server: Servers, estimator: str, params: dict
) -> None:
    """GRPO: mean and std over the 6 members (AReaL's and Trinity-RFT's rule for the members a
    group has); RLOO: each run's baseline is the mean of the other 5; OPMD: the mean over the 6."""
    runs = [Exp(task=3, run=r, step=0, reward=float(r % 3) - 0.5 * r, mask=[True] * (2 + r)) for r in range(8)]
    present, failed = runs[:6], runs[6:]
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("short", group_size=8, min_group_size=6, estimator=estimator, estimator_params=params)
        client.push([exp.build() for exp in present], table="short")
        done = client.fail_runs([exp.uid for exp in failed], "short", reasons=["tool error", "OOM"])
        assert done.completed_groups == ["0/3"] and done.dropped_groups == []
        batch = next(client.sample("short", num_groups=1, max_batches=1, timeout=30, delivery="consume"))
        got = {e.eid.uid: (e.advantages, e.returns) for e in batch.experiences}
    experience = pytest.importorskip("trinity.common.experience")
    want = trinity_advantages(estimator, params, [exp.build(experience.Experience, experience.EID) for exp in present])
    assert_same(got, want)


def test_a_run_of_several_steps_that_failed_after_pushing_some_is_left_out_as_trinity_leaves_it(
    start_server: Servers,
) -> None:
    """step_wise_grpo over runs of 2 steps (group_size counts experiences: 3 runs x 2), run 2
    failing after it pushed its first step. Its pushed step stays a member where only its missing
    step is reported, its reward taken as the run's last; Trinity-RFT's runner keeps none of a
    failed run's experiences. Deleting its pushed steps and reporting every step of it failed
    leaves it out: the advantages are Trinity's own over runs 0 and 1
    (docs/concepts/across-weight-updates.md)."""
    experience = pytest.importorskip("trinity.common.experience")
    rewards = {(0, 0): 0.0, (0, 1): 1.0, (1, 0): 0.0, (1, 1): 0.0, (2, 0): 0.0}
    pushed = [Exp(task=0, run=r, step=t, reward=reward, mask=[True, True]) for (r, t), reward in rewards.items()]
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("steps", group_size=6, min_group_size=4, estimator="step_wise_grpo")
        client.push([exp.build() for exp in pushed], table="steps")
        assert client.delete(["0/0/2/0/s"], "steps") == 1
        done = client.fail_runs(["0/0/2/0/s", "0/0/2/1/s"], "steps", reasons=["env crashed"] * 2)
        assert done.completed_groups == ["0/0"]
        batch = next(client.sample("steps", num_groups=1, max_batches=1, timeout=30, delivery="consume"))
        got = {e.eid.uid: (e.advantages, e.returns) for e in batch.experiences}
    kept = [exp.build(experience.Experience, experience.EID) for exp in pushed if exp.run != 2]
    assert_same(got, trinity_advantages("step_wise_grpo", {}, kept))


def test_over_the_wire_the_reports_survive_a_restart_and_the_metrics_count_them(start_server: Servers) -> None:
    server = start_server()
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target) as client:
        client.create_table("wire", group_size=4, min_group_size=3, estimator="none")
        client.push(runs(0, range(2)), table="wire")
        assert client.fail_runs([uid(0, 3)], "wire", reasons=["crashed"]).recorded == [uid(0, 3)]
        with pytest.raises(InvalidArgumentError, match="not an experience uid"):
            client.fail_runs(["x"], "wire")
        client.push(runs(1, range(1)), table="wire")
        with pytest.raises(AlreadyExistsError, match="was pushed"):
            client.fail_runs([uid(1, 0)], "wire")
    start_server.stop(server)
    server = start_server(port=server.port)
    with BufferClient(target) as client:
        done = client.push(runs(0, [2]), table="wire")  # the third member: 3 of 4 with the failure
        assert done.completed_groups == ["1/0"]
        assert client.fail_runs([uid(1, 1), uid(1, 2), uid(1, 3)], "wire").dropped_groups == ["1/1"]
        with pytest.raises(FailedPreconditionError, match="already complete"):
            client.fail_runs([uid(0, 3)], "wire")
    metrics = scrape(server.metrics_port)
    assert metrics[("expbuf_runs_failed_total", (("table", "wire"),))] == 4
    assert metrics[("expbuf_groups_short_total", (("table", "wire"),))] == 1
    assert metrics[("expbuf_groups_dropped_total", (("reason", "short"), ("table", "wire")))] == 1


def test_a_group_of_failed_runs_alone_is_dropped_however_it_ends_and_remembered_until_its_tombstone_goes(
    store: Store, clock: Clock
) -> None:
    """A group dropped short keeps its record as a tombstone, members or none (issue 63: one of
    runs all reported failed was forgotten, so a later report of a fifth run, or a push of one of
    its failed runs, opened a pending group that nothing completed): such calls are refused by
    name until `tombstone_seconds`, after which the group is forgotten, as its members would be."""
    store.create_table(
        TableConfig.of("none_ok", estimator="none", group_size=4, group_timeout_seconds=5, tombstone_seconds=100)
    )
    store.fail_runs("none_ok", [uid(0, 0)], [])  # a timeout: no member to release
    store.fail_runs("none_ok", [uid(1, 0)], [])  # a seal
    assert store.seal("none_ok", "1/1") == 0
    assert store.fail_runs("none_ok", [uid(2, n) for n in range(4)], []).dropped_groups == ["1/2"]  # all failed
    clock.now += 6
    assert store.tick()["groups_timed_out"] == 1
    stats = store.stats("none_ok")
    assert (stats["groups_dropped"], stats["dropped_short"], stats["groups_ready"], stats["groups_pending"]) == (
        3,
        3,
        0,
        0,
    )
    for task in range(3):
        assert group(store, "none_ok", f"1/{task}").state == "dropped"
        with pytest.raises(GroupClosed, match=rf"group 1/{task} is already complete \(dropped\)"):
            store.fail_runs("none_ok", [uid(task, 3 if task < 2 else 4)], [])  # a run it never had: a fifth
        with pytest.raises(GroupClosed, match=rf"group 1/{task} is already complete \(dropped\)"):
            store.put("none_ok", group_items(1, task, 1))  # one of its failed runs, pushed after all
    assert store.stats("none_ok")["groups_pending"] == 0 and store.verify("none_ok") == []
    clock.now += 101
    store.tick()
    assert group_record(store, "none_ok", "1/2") is None  # its tombstone gone: forgotten
    assert store.put("none_ok", group_items(1, 2, 1)).stored  # the group may start again


def test_a_group_dropped_short_over_the_wire_refuses_a_later_report_and_a_push(client: BufferClient) -> None:
    client.create_table("t", group_size=4, estimator="none")
    assert client.fail_runs([uid(0, run) for run in range(4)], table="t").dropped_groups == ["1/0"]
    with pytest.raises(FailedPreconditionError, match=r"group 1/0 is already complete \(dropped\)"):
        client.fail_runs([uid(0, 4)], table="t")  # a fifth run
    with pytest.raises(FailedPreconditionError, match=r"group 1/0 is already complete \(dropped\)"):
        client.push(runs(0, [0]), table="t")  # one of its failed runs
    assert client.stats("t")["t"].groups_pending == 0


def test_a_short_group_the_zero_variance_filter_drops_is_reported_dropped(store: Store) -> None:
    store.create_table(
        TableConfig.of("dapo_short", estimator="none", group_size=4, min_group_size=2, drop_zero_variance=True)
    )
    store.put("dapo_short", group_items(1, 0, 2, reward=1.0))
    done = store.fail_runs("dapo_short", [uid(0, 2), uid(0, 3)], [])
    assert (done.completed_groups, done.dropped_groups) == ([], ["1/0"])
    stats = store.stats("dapo_short")
    assert (stats["groups_short"], stats["dropped_zero_variance"]) == (0, 1)
