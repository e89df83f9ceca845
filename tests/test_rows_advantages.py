"""Advantages on a rows table (issue 64): every estimator gives a rows table's experiences the values a
records table of the same settings gets, computed in the push that completes a group (its values
written once, into its segment) or by the advantage worker (the group waits computing as a head and
its fragments, in the compute queue, and becomes ready at the place it took when it completed); a
computing group answers pushes, failed runs and seals as a records table's does, survives a restart,
fails alone when its computation fails, and a damaged payload quarantines it. Every reply, batch
(its payload carries the advantages, the batch stage run), counter and event is compared with the
records table's, and `verify` is clean after each step."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_advantages import exploding  # noqa: F401 (a fixture)
from test_advantages_in_push import pushes
from test_rows_pending import Watched, put_both

from expbuf.client import decode
from expbuf.server.advantages.batch_stage import finish_batch
from expbuf.server.advantages.worker import AdvantageWorker, computed_in_push
from expbuf.server.store import Store
from expbuf.server.store.core.table_state.state import TableState
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.rows import PendingHead, decode_member_rows, directory_entry
from expbuf.server.store.schema.errors import StoreError
from expbuf.server.store.schema.estimator_registry import ESTIMATORS
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.states import COMPUTING, DROPPED, READY
from expbuf.server.store.schema.table_config import TableConfig

from helpers import StoppedClock as Clock
from helpers import both_layouts as both
from helpers import group_items, take_both
from helpers import layouts_stats as stats
from test_quarantine import damage

PARAMS: dict[str, dict[str, object]] = {
    "step_wise_grpo": {"enable_step_norm": True},
    "opmd": {"opmd_baseline": "logavgexp", "tau": 0.5},
    "rec": {"std_normalize": True},
    "multi_turn_discount": {"turn_level_discount": 0.9},
}
MULTI_STEP = {"step_wise_grpo", "multi_turn_discount"}


def clean(store: Store, *tables: str) -> None:
    for table in tables:
        assert store.verify(table) == [], table


def alike(store: Store, name: str = "t") -> None:
    """The rows table's stats are the records table's, the oldest experience's age too (the store's
    clock stopped), and both verify clean."""
    assert stats(store, f"{name}_rows") == stats(store, name)
    assert store.stats(f"{name}_rows")["oldest_age_seconds"] == store.stats(name)["oldest_age_seconds"]
    clean(store, name, f"{name}_rows")


def drain(store: Store, name: str = "t") -> int:
    """Every ready group taken from both tables in fifo order, a few at a time, each batch (its payload
    with the advantages the batch stage finished) the same; returns the experiences taken."""
    taken = 0
    while (got := take_both(store, name, num_groups=2, allow_partial=True)) is not None:
        taken += len(got[0])  # type: ignore[arg-type]
    return taken


@pytest.mark.parametrize("in_push", [True, False], ids=["in-push", "worker"])
@pytest.mark.parametrize("name", sorted(set(ESTIMATORS) - {"none"}))
def test_every_estimator_gives_a_rows_table_the_values_a_records_table_gets(
    tmp_path: Path, name: str, in_push: bool
) -> None:
    steps = 3 if name in MULTI_STEP else 1
    with Store(tmp_path, clock=Clock(), batch_stage=finish_batch) as store:
        worker = AdvantageWorker(store)
        if in_push:
            store.in_push = worker.in_push
        both(store, "t", estimator=name, estimator_params=PARAMS.get(name, {}), group_size=6, device="cpu")
        for items in pushes(7, steps=steps):
            put_both(store, "t", items)
        alike(store)
        computed_now = in_push and computed_in_push(TableConfig.of("t", estimator=name, device="cpu"), cuda=False)
        assert (store.stats("t_rows")["computing"] == 0) == computed_now
        assert worker.run_once() == (0 if computed_now else 18)  # 9 groups a table
        alike(store)
        assert store.stats("t_rows")["groups_ready"] == 9
        assert drain(store) == 54


def test_a_computing_rows_group_is_kept_as_its_head_and_answers_as_a_records_one(
    tmp_path: Path,
) -> None:
    """A group completed without the server's computation at hand (a worker's job) waits computing:
    its head (now naming its place in the compute queue, out of the pending index) with its members'
    rows, no segment and no record; pushes, failed runs and seals meet it complete, a retried push is a
    duplicate; it survives a restart and becomes ready, at the place it took when it completed, with
    the values a records table's gets."""
    with Store(tmp_path, clock=Clock(), batch_stage=finish_batch) as store:
        both(store, "t", estimator="grpo", group_size=4, device="cpu")
        put_both(store, "t", group_items(0, 0, 2, reward=1.0))  # pending: 0/0
        put_both(store, "t", group_items(0, 1, 4, reward=0.0)[:3] + group_items(0, 1, 4, reward=2.0)[3:])  # 0/1
        put_both(store, "t", group_items(0, 0, 4, reward=3.0)[2:])  # 0/0 completes after 0/1
        alike(store)
        table_id = store.catalog.lookup("t_rows")[0]
        with store.environment.read() as txn:
            tt = TableState(txn, store.db, table_id, store.catalog.lookup("t_rows")[1], 0.0, ())
            head = directory_entry(txn.get(tt.key("0/0"), db=store.db["gdir"]))
            assert isinstance(head, PendingHead) and head.queued is not None and head.fragments == 0
            assert len(decode_member_rows(head.inline)) == 4  # its members' rows, in its head
            assert tt.view("0/0").state == COMPUTING  # type: ignore[union-attr]
            assert txn.get(tt.prefix + head.queued.to_bytes(8, "big"), db=store.db["compute"]) == b"0/0"
        assert put_both(store, "t", group_items(0, 0, 4, reward=3.0)[3:]) == ([], ["0/0/3/0/r3s0"], [], [])
        assert put_both(store, "t", group_items(0, 1, 5)[4:])[0] == "GroupClosed"
        for call in (lambda table: store.fail_runs(table, ["0/0/9/0/r9s0"], ["oom"]), lambda t: store.seal(t, "0/1")):
            got = []
            for table in ("t", "t_rows"):
                with pytest.raises(StoreError) as raised:
                    call(table)
                got.append((type(raised.value), str(raised.value)))
            assert got[1] == got[0] and "computing" in got[0][1]
    with Store(tmp_path, clock=Clock(), batch_stage=finish_batch) as store:
        alike(store)
        worker = AdvantageWorker(store)
        store.in_push = worker.in_push
        put_both(store, "t", group_items(0, 2, 4, reward=1.0)[:2] + group_items(0, 2, 4, reward=0.0)[2:])
        assert store.stats("t_rows")["groups_ready"] == 1  # 0/2: computed in its push, ready first
        assert worker.run_once() == 4
        alike(store)
        with store.environment.read() as txn:
            tt = TableState(txn, store.db, table_id, store.catalog.lookup("t_rows")[1], 0.0, ())
            assert [tt.view(g).state for g in ("0/0", "0/1", "0/2")] == [READY] * 3  # type: ignore[union-attr]
        got = take_both(store, "t", num_groups=3)
        assert got is not None and got[1] == ["0/1"] * 4 + ["0/0"] * 4 + ["0/2"] * 4  # the order they completed in
        alike(store)


def test_a_rows_group_whose_computation_fails_fails_alone(tmp_path: Path, exploding: str) -> None:  # noqa: F811
    with Store(tmp_path, clock=Clock(), batch_stage=finish_batch) as store:
        both(store, "t", estimator=exploding)
        items = group_items(1, 0, 3, reward=1.0) + group_items(1, 1, 3, reward=13.0) + group_items(1, 2, 3)
        put_both(store, "t", items)
        assert AdvantageWorker(store).run_once() == 6
        alike(store)
        rows = store.stats("t_rows")
        assert (rows["groups_ready"], rows["groups_failed"], rows["ready"]) == (2, 1, 6)
        assert "group 1/1" in rows["last_failure"] and "reward of 13" in rows["last_failure"]
        assert drain(store) == 6


def test_a_damaged_payload_of_a_computing_rows_group_fails_it_as_a_records_one(tmp_path: Path) -> None:
    """A token-level estimator reads the payloads of the groups it computes: one found damaged fails
    its group, on a rows table as on a records table, the damaged member quarantined and the others'
    payloads kept."""
    with Store(tmp_path, clock=Clock(), batch_stage=finish_batch) as store:
        both(store, "t", estimator="rloo", group_size=3)
        put_both(store, "t", group_items(2, 0, 3) + group_items(2, 1, 3))
        for table in ("t", "t_rows"):
            damage(store, table, "2/1/1/0/r1s0")
        AdvantageWorker(store).run_once()
        AdvantageWorker(store).run_once()
        records, rows = store.stats("t"), store.stats("t_rows")
        assert (records["quarantined"], records["failed"], rows["quarantined"], rows["failed"]) == (1, 2, 1, 2)
        assert stats(store, "t_rows") == stats(store, "t")
        clean(store, "t", "t_rows")
        assert (rows["groups_ready"], rows["groups_failed"], rows["damaged"]) == (1, 1, 1)
        assert drain(store) == 3


def payloads_of(store: Store, table: str) -> set[str]:
    """The uids whose payloads a table holds."""
    prefix = layout.table_prefix(store.catalog.lookup(table)[0])
    with store.environment.read() as txn, txn.cursor(db=store.db["blobs"]) as cur:
        found, uids = cur.set_range(prefix), set()
        while found and cur.key().startswith(prefix):
            uids.add(bytes(cur.key()[len(prefix) :]).decode())
            found = cur.next()
    return uids


@pytest.mark.parametrize("keep_failed", [True, False])
def test_a_failed_rows_group_keeps_its_payloads_as_a_records_one(
    tmp_path: Path,
    exploding: str,  # noqa: F811
    keep_failed: bool,
) -> None:
    """A group whose computation fails keeps its payloads where the table keeps failed ones (for Get,
    as a records table's), until its tombstones are forgotten; a group failed for a damaged payload
    keeps its other members' whatever keep_failed says, the damaged one's gone."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", estimator=exploding, keep_failed=keep_failed, tombstone_seconds=60)
        put_both(store, "t", group_items(1, 0, 3, reward=1.0) + group_items(1, 1, 3, reward=13.0))
        AdvantageWorker(store, retry_delays=()).run_once()
        put_both(store, "t", group_items(1, 2, 3, reward=1.0))
        AdvantageWorker(store).run_once()
        damage(store, "t_rows", "1/2/1/0/r1s0")
        damage(store, "t", "1/2/1/0/r1s0")
        for table in ("t", "t_rows"):
            store.quarantine(table, ["1/2/1/0/r1s0"])
        guilty = {f"1/1/{run}/0/r{run}s0" for run in range(3)}
        kept = payloads_of(store, "t")
        assert payloads_of(store, "t_rows") == kept
        assert guilty & kept == (guilty if keep_failed else set())
        assert {"1/2/0/0/r0s0", "1/2/2/0/r2s0"} <= kept and "1/2/1/0/r1s0" not in kept
        clean(store, "t", "t_rows")
        take_both(store, "t", num_groups=1)
        clock.now += 61
        store.tick()
        assert payloads_of(store, "t_rows") == payloads_of(store, "t") == set()
        clean(store, "t", "t_rows")


def advantage_rows(store: Store, table: str) -> int:
    """How many token-level advantage records a table keeps (the `adv` database, by uid)."""
    prefix, count = layout.table_prefix(store.catalog.lookup(table)[0]), 0
    with store.environment.read() as txn, txn.cursor(db=store.db["adv"]) as cur:
        found = cur.set_range(prefix)
        while found and cur.key().startswith(prefix):
            count, found = count + 1, cur.next()
    return count


def test_a_rows_groups_token_level_advantages_leave_with_it_as_a_records_groups(tmp_path: Path) -> None:
    """The token-level values of a group (the adv database) go when it leaves, consumed, acked,
    evicted, retired as trained or failed for damage, on a rows table as on a records table: none are
    left behind for experiences the table no longer holds."""
    with Store(tmp_path, clock=Clock(), batch_stage=finish_batch) as store:
        worker = AdvantageWorker(store)  # a token-level estimator's values are the worker's
        both(store, "t", estimator="reinforceplusplus", group_size=2, capacity_experiences=6, when_full="evict")

        def counted() -> None:
            assert [advantage_rows(store, t) for t in ("t_rows", "t")] == [store.stats("t")["ready"]] * 2
            alike(store)

        def push(task: int) -> None:
            put_both(store, "t", group_items(3, task, 2, reward=1.0)[:1] + group_items(3, task, 2, reward=0.0)[1:])
            assert worker.run_once() == 2  # a group a table
            counted()

        for task in range(3):
            push(task)
        take_both(store, "t", num_groups=1)  # consumed: 3/0
        counted()
        lease = [
            store.sample(TakeSpec(table=t, num_groups=1, delivery="lease", wait_seconds=0)) for t in ("t", "t_rows")
        ]
        for table, batch in zip(("t", "t_rows"), lease, strict=True):
            assert batch is not None
            store.ack(batch.lease_id, table)  # 3/1
        counted()
        push(3)
        push(4)
        push(5)  # full: 3/2 evicted
        assert store.stats("t_rows")["evicted"] == 2
        assert [store.retire(t, ["3/3"]) for t in ("t", "t_rows")] == [1, 1]
        counted()
        for table in ("t", "t_rows"):
            damage(store, table, "3/4/1/0/r1s0")
        assert store.quarantine("t", ["3/4/1/0/r1s0"]) == store.quarantine("t_rows", ["3/4/1/0/r1s0"]) == 1
        assert [advantage_rows(store, t) for t in ("t_rows", "t")] == [2, 2]  # 3/5's
        assert drain(store) == 2
        assert [advantage_rows(store, t) for t in ("t_rows", "t")] == [0, 0]
        clean(store, "t", "t_rows")


def test_verify_names_a_computing_rows_groups_row_left_in_the_pending_index(tmp_path: Path) -> None:
    """A computing group is out of the pending index (a timeout would complete it again): `verify`
    names a row of it left there, as it names any row of a group that is not pending."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", estimator="grpo", group_size=2, device="cpu")
        put_both(store, "t", group_items(0, 0, 2, reward=1.0)[:1] + group_items(0, 0, 2, reward=0.0)[1:])
        assert store.stats("t_rows")["computing"] == 2
        table_id, config = store.catalog.lookup("t_rows")

        def left(txn) -> None:  # type: ignore[no-untyped-def]
            tt = TableState(txn, store.db, table_id, config, 0.0, ())
            head = directory_entry(txn.get(tt.key("0/0"), db=store.db["gdir"]))
            assert isinstance(head, PendingHead) and head.queued is not None
            txn.put(tt.pending_key("0/0", head), b"", db=store.db["pending"])

        store.environment.submit(left)
        assert store.verify("t_rows") == ["the pending index names b'0/0', which is not pending"]


def test_groups_a_quarantine_fails_are_heard_of_in_one_event_as_a_records_tables(tmp_path: Path) -> None:
    """Damaged payloads found in a ready, a leased, a computing and a pending group at once fail them
    together: an extension hears one Retired event of the four groups, on a rows table as on a records
    table (never an empty one, nor one for the complete groups and one for the others)."""
    with Store(tmp_path, clock=Clock(), extensions={"watched": Watched}) as store:
        both(store, "t", estimator="grpo", group_size=2, device="cpu", extensions=["watched"])
        worker = AdvantageWorker(store)
        for task in range(3):
            put_both(store, "t", group_items(4, task, 2, reward=1.0)[:1] + group_items(4, task, 2, reward=0.0)[1:])
        assert worker.run_once() == 6  # 4/0, 4/1 and 4/2 ready
        take_both(store, "t", num_groups=1, delivery="lease")  # 4/0 leased
        put_both(store, "t", group_items(4, 3, 2, reward=1.0)[:1] + group_items(4, 3, 2, reward=0.0)[1:])  # computing
        put_both(store, "t", group_items(4, 4, 2)[:1])  # pending
        heard = [next(e for e in store.extensions_of(t) if isinstance(e, Watched)).events for t in ("t", "t_rows")]
        for events in heard:
            events.clear()
        damaged = [f"4/{task}/0/0/r0s0" for task in (0, 2, 3, 4)]
        for table in ("t", "t_rows"):
            for uid in damaged:
                damage(store, table, uid)
            assert store.quarantine(table, damaged) == 4
        assert len(heard[0]) == 1 and heard[1] == heard[0]
        rows = store.stats("t_rows")
        assert (rows["groups_failed"], rows["groups_ready"], rows["leased"]) == (4, 1, 0)
        clean(store, "t", "t_rows")


@pytest.mark.parametrize("name", ["reinforceplusplus", "reinforce++_baseline"])
def test_read_fields_of_experiences_none_computed_yet_of_a_token_level_table_returns_them(
    tmp_path: Path, name: str
) -> None:
    """ReadFields (a client's get(): ReadFields without fields) of only pending and computing
    experiences of a table whose batch stage finishes its advantages returns them without advantages,
    as it does with a computed one among them (test_advantages' Get), on either layout. A token-valued
    estimator's stage was run on an empty batch and failed (torch.cat of no tensors): a client's get()
    of a pending group's runs was an internal error."""
    with Store(tmp_path, clock=Clock(), batch_stage=finish_batch) as store:
        both(store, "t", estimator=name, group_size=3, device="cpu")
        put_both(store, "t", group_items(7, 0, 3)[:2] + group_items(7, 1, 3))  # 7/0 pending, 7/1 computing
        uids = [f"7/{task}/{run}/0/r{run}s0" for task, run in ((0, 0), (0, 1), (1, 2))]
        got = []
        for table in ("t", "t_rows"):
            batch, missing = store.read_fields(table, uids, whole=True)
            try:
                got.append((list(batch.uids), missing, [e.advantages for e in decode(batch.payload)]))
            finally:
                batch.release()
        assert got[1] == got[0] == (uids, [], [None, None, None])
        clean(store, "t", "t_rows")


@pytest.mark.parametrize("group_size", [0, 2])
def test_a_push_whose_groups_all_fall_under_the_std_threshold_is_heard_as_a_records_tables(
    tmp_path: Path, group_size: int
) -> None:
    """A push computed in the push whose completed groups the estimator's std_threshold all drops: an
    extension hears them dropped, one Retired event, as from a records table. A rows table told it
    of a Moved event from pending to ready of no groups first."""
    with Store(tmp_path, clock=Clock(), extensions={"watched": Watched}) as store:
        worker = AdvantageWorker(store)
        store.in_push = worker.in_push
        params = {"std_threshold": 0.3}
        both(store, "t", estimator="grpo", estimator_params=params, group_size=group_size, extensions=["watched"])
        put_both(store, "t", group_items(3, 0, 2, reward=1.0) + group_items(3, 1, 2, reward=0.0))
        heard = [next(e for e in store.extensions_of(t) if isinstance(e, Watched)).events for t in ("t", "t_rows")]
        assert heard[1] == heard[0]
        assert [event[:2] for event in heard[0]] == [("retired", DROPPED)] and len(heard[0][0][-1]) == 2
        assert store.stats("t_rows")["dropped_std_threshold"] == 2
        alike(store)
