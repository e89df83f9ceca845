"""Reads and deletes of a rows table (issue 64, step 2.9): Get, ReadFields (some fields, or whole),
ListExperiences (pages, filters) and `expbuf export` read a rows table's ready, leased and pending
experiences, and Delete takes them out (by uid and by group; ready, leased, pending or retired), exactly
as a records table of the same pushes, takes and deletes does: every reply over gRPC, the stats, what
an extension hears, later pushes and takes, and `verify` clean. A delete writes per group it touches
(a member's flag in its segment's state, a pending group's one fragment), never a record per
experience. Where a rows table cannot answer as a records table does (the failed payloads a records
table keeps, a rows table keeps none yet), its own answer is tested."""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import lmdb
import pytest
from test_rows_pending import RandomSteps, clean, put_both, run, uid

from expbuf.client import BufferClient, trxp
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server import cli
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.disk.rows import GroupRef
from expbuf.server.store.schema.sample_spec import TakeSpec

from helpers import StoppedClock as Clock
from helpers import both_layouts as both
from helpers import layouts_reply as reply
from helpers import layouts_stats as stats
from helpers import make_experience, take_both
from test_quarantine import damage

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_writes import counting

FOURS = {"estimator": "none", "group_by": "task", "group_size": 4}
FIELDS = ["reward", "model_version", "response_length", "length", "tokens", "logprobs", "advantages", "action_mask"]
UNKNOWN = "0/77/0/0/r0s0"


def pushed(task: int, runs: range = range(4)) -> list[trxp.RawItem]:
    """Runs of task `task` (batch 0) at model version `task`, their rewards varied."""
    made = (make_experience(0, task, r, reward=float((task + r) % 3), version=task) for r in runs)
    return [trxp.from_experience(exp) for exp in made]


def uids_of(task: int, runs: range = range(4)) -> list[str]:
    return [f"0/{task}/{r}/0/r{r}s0" for r in runs]


def filled(server) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Tables t and t_rows of FOURS on `server`, pushed over gRPC alike: tasks 0 to 5 whole (task k at
    model version k), task 9 pending (2 of its 4 runs); then task 0 consumed and task 1 leased. Returns
    the lease id of each table."""
    store = server.store
    both(store, "t", **FOURS)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=10) as client:
        for table in ("t", "t_rows"):
            client.push(trxp.build([item for task in range(6) for item in pushed(task)]), table=table)
            client.push(trxp.build(pushed(9, range(2))), table=table)
    take_both(store, "t", num_groups=1)  # task 0, consumed
    leases = {}
    for table in ("t", "t_rows"):
        batch = store.sample(TakeSpec(table=table, num_groups=1, delivery="lease", lease_seconds=600, wait_seconds=0))
        assert batch is not None and set(batch.group_ids) == {"0/1"}
        leases[table] = batch.lease_id
    assert stats(store, "t_rows") == stats(store, "t")
    return leases


def everyone() -> list[str]:
    """Every uid the tables were pushed, one never pushed, and one named twice."""
    return [*(u for task in range(6) for u in uids_of(task)), *uids_of(9), UNKNOWN]


def listed(
    stub: pb_grpc.ExperienceBufferStub, table: str, limit: int, **filters: object
) -> list[pb.ListExperiencesReply]:
    """Every page of a table's ListExperiences, `limit` a page."""
    pages, after = [], 0
    while True:
        page = stub.ListExperiences(pb.ListExperiencesRequest(table=table, after=after, limit=limit, **filters))
        pages.append(page)
        if page.done:
            return pages
        after = page.next


def alike(call: Callable[[str], object]) -> object:
    """`call` of tables t and t_rows: its result, or its gRPC status and details (the table named
    alike), asserted equal."""
    got = []
    for table in ("t", "t_rows"):
        try:
            got.append(call(table))
        except grpc.RpcError as exc:
            got.append((exc.code(), exc.details().replace("'t_rows'", "'t'")))
    assert got[1] == got[0]
    return got[0]


def shown(client: BufferClient, table: str) -> dict[str, object]:
    """A table's stats as the Stats call shows them, but its name, oldest group's age and next_rseq
    (helpers.layouts_stats says why)."""
    found = dataclasses.asdict(client.stats(table).tables[table])
    for name in ("name", "oldest_age_seconds", "next_rseq"):
        found.pop(name, None)
    return found


@pytest.fixture
def served(start_server) -> Iterator[tuple[object, pb_grpc.ExperienceBufferStub, BufferClient, dict[str, str]]]:  # type: ignore[no-untyped-def]
    server = start_server()
    leases = filled(server)
    target = f"127.0.0.1:{server.port}"
    with grpc.insecure_channel(target) as channel, BufferClient(target, timeout=10) as client:
        yield server, pb_grpc.ExperienceBufferStub(channel), client, leases


def test_get_read_fields_and_list_over_grpc_answer_as_a_records_table(served) -> None:  # type: ignore[no-untyped-def]
    server, stub, client, _ = served
    asked = everyone()
    got = alike(lambda table: stub.Get(pb.GetRequest(table=table, uids=asked)))
    assert isinstance(got, pb.GetReply)
    returned = [e.eid.uid for e in trxp.decode(got.payload)]
    assert returned == [*(u for task in range(1, 6) for u in uids_of(task)), *uids_of(9, range(2))]
    assert list(got.missing_uids) == [*uids_of(0), *uids_of(9, range(2, 4)), UNKNOWN]
    for fields in (FIELDS, [], ["reward", "version_segments", "prompt_length", "cost"]):
        request = pb.ReadFieldsRequest(table="", uids=asked, fields=fields, max_reply_bytes=1 << 20)
        replies = alike(
            lambda table, r=request: [m.SerializeToString() for m in stub.ReadFields(_named(r, table))]  # type: ignore[misc]
        )
        assert replies
    whole = alike(lambda table: trxp.encode(client.get(asked, table=table)))
    assert [e.eid.uid for e in trxp.decode(whole)] == returned  # type: ignore[arg-type]
    for limit, filters in (
        (3, {}),
        (1000, {}),
        (2, {"states": ["leased"]}),
        (2, {"states": ["pending", "ready"]}),
        (1, {"min_model_version": 3, "max_model_version": 4}),
        (1, {"states": ["computing"]}),
    ):
        pages = alike(lambda table, f=filters, n=limit: listed(stub, table, n, **f))  # type: ignore[misc]
        assert isinstance(pages, list) and pages[-1].done
    every = [e for page in listed(stub, "t_rows", 4) for e in page.experiences]
    assert [e.uid for e in every] == returned
    assert [e.state for e in every] == ["leased"] * 4 + ["ready"] * 16 + ["pending"] * 2
    assert shown(client, "t_rows") == shown(client, "t")
    clean(server.store, "t", "t_rows")


def _named(request: pb.ReadFieldsRequest, table: str) -> pb.ReadFieldsRequest:
    named = pb.ReadFieldsRequest()
    named.CopyFrom(request)
    named.table = table
    return named


def export(capsys: pytest.CaptureFixture[str], target: str, table: str, *args: str) -> tuple[int, str, str]:
    """`expbuf export` of a table (the command line's own code, in this process, over gRPC): its exit
    code, what it wrote to standard output and to standard error."""
    code = cli.main(["export", table, "--target", target, "--page", "3", *args])
    written = capsys.readouterr()
    return code, written.out, written.err


def test_expbuf_export_of_a_rows_table_writes_what_a_records_tables_does(served, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, _, _, _ = served
    target = f"127.0.0.1:{server.port}"
    for args in ((), ("--state", "leased", "--state", "pending"), ("--min-version", "4")):
        records, rows = (export(capsys, target, table, *args) for table in ("t", "t_rows"))
        assert rows[0] == records[0] == 0 and rows[1] == records[1] and records[1]
        assert rows[2].replace("t_rows", "t") == records[2]
        assert args or rows[2].strip() == "exported 22 experiences of t_rows"
    out = {table: tmp_path / f"{table}.trxp" for table in ("t", "t_rows")}
    for table, path in out.items():
        assert export(capsys, target, table, "--format", "trxp", "--out", str(path))[0] == 0
    assert out["t_rows"].read_bytes() == out["t"].read_bytes()


def test_deletes_over_grpc_answer_as_a_records_table(served) -> None:  # type: ignore[no-untyped-def]
    """By uid and by group, of a ready group (in part, then whole), a leased one (in part: its lease
    acks the rest), a pending one (in part: it then completes later; then whole), consumed tombstones
    and names not stored: every reply, the stats, the listing and the reads after each as a records
    table's; then pushes of the deleted uids and takes of the rest."""
    server, stub, client, leases = served
    store = server.store
    for uids, groups in (
        ([uids_of(2)[1]], []),  # a ready group's member: the group stays ready, one short
        ([uids_of(2)[1], uids_of(2)[3]], ["0/3"]),  # one gone already; another of it; a group whole
        ([uids_of(1)[0], uids_of(9)[1]], []),  # a leased group's member, a pending group's
        ([uids_of(0)[0], UNKNOWN], ["0/77"]),  # a consumed tombstone; names never pushed
        ([], ["0/0"]),  # the consumed group's other tombstones
    ):
        request = pb.DeleteRequest(uids=uids, group_ids=groups)
        alike(lambda table, r=request: stub.Delete(_table(r, table)).deleted)  # type: ignore[misc]
        assert shown(client, "t_rows") == shown(client, "t")
        alike(lambda table: listed(stub, table, 5))
        alike(lambda table: stub.Get(pb.GetRequest(table=table, uids=everyone())))
        clean(store, "t", "t_rows")
    for rank in range(2):  # a rank's part of the leased step: the group's 3 others
        part = alike(
            lambda table, r=rank: [  # type: ignore[misc]
                m.SerializeToString()
                for m in stub.ReadFields(
                    pb.ReadFieldsRequest(table=table, lease_id=leases[table], rank=r, ranks=2, fields=["reward"])
                )
            ]
        )
        assert part
    assert alike(lambda table: store.ack(leases[table], table)) == 3
    # a deleted member's uid is free: its group complete, the push is refused as closed (a records
    # table's answer); a deleted group's uids open it again; a pending group's deleted run rejoins it
    assert put_both(store, "t", pushed(2, range(1, 2)))[0] == "GroupClosed"
    assert put_both(store, "t", pushed(0, range(1)))[0] == [uids_of(0)[0]]
    assert put_both(store, "t", pushed(3))[2] == ["0/3"]
    assert put_both(store, "t", pushed(9, range(1, 4)))[2] == ["0/9"]
    assert put_both(store, "t", pushed(9, range(1, 2)))[1] == [uids_of(9)[1]]  # a duplicate once more
    alike(lambda table: stub.Delete(pb.DeleteRequest(table=table, group_ids=["0/9"])).deleted)
    assert alike(lambda table: store.delete(table, group_ids=["0/0"])) == 1
    batches = []
    while (batch := take_both(store, "t", num_groups=1, allow_partial=True)) is not None:
        batches.append(batch)
    taken = [u for batch in batches for u in batch[0]]  # type: ignore[index]
    assert sorted(taken) == sorted(
        [*uids_of(2, range(0, 1)), *uids_of(2, range(2, 3)), *uids_of(3), *uids_of(4), *uids_of(5)]
    )
    assert shown(client, "t_rows") == shown(client, "t")
    clean(store, "t", "t_rows")


def _table(request: pb.DeleteRequest, table: str) -> pb.DeleteRequest:
    named = pb.DeleteRequest()
    named.CopyFrom(request)
    named.table = table
    return named


def test_a_failed_groups_kept_payloads_are_got_as_a_records_tables(tmp_path: Path) -> None:
    """A damaged payload found by a sample fails its group: both tables keep the other members'
    payloads (keep_failed) and Get returns them, the damaged one missing; ListExperiences lists none
    of them in either."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **FOURS)
        for table in ("t", "t_rows"):
            store.put(table, pushed(0) + pushed(1))
            damage(store, table, uids_of(0)[2])
        take_both(store, "t", num_groups=1)  # finds the damage: group 0/0 fails, 0/1 is taken
        got = {table: store.get_payload(table, uids_of(0)) for table in ("t", "t_rows")}
        assert [e.eid.uid for e in trxp.decode(got["t"][0])] == [uids_of(0)[n] for n in (0, 1, 3)]
        assert got["t_rows"] == got["t"]
        assert all(store.list_experiences(table).items == [] for table in ("t", "t_rows"))
        assert store.delete("t_rows", group_ids=["0/0"]) == 0  # failed: tombstones, forgotten
        assert store.get_payload("t_rows", uids_of(0))[1] == uids_of(0)  # its kept payloads with them
        assert store.stats("t_rows")["failed"] == 0 and store.stats("t")["failed"] == 3
        clean(store, "t", "t_rows")


def test_a_failed_groups_kept_payload_found_damaged_by_get_is_dropped_as_a_records_tables(tmp_path: Path) -> None:
    """A Get that finds a failed group's kept payload damaged leaves it out, drops it and counts it
    damaged, and quarantines it alone, as a records table's does; a rows table's Get raised TypeError
    (a view the table core did not make), an INTERNAL error to its caller."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **FOURS)
        for table in ("t", "t_rows"):
            store.put(table, pushed(0) + pushed(1))
            damage(store, table, uids_of(0)[2])
        take_both(store, "t", num_groups=1)  # finds the damage: group 0/0 fails, its others kept
        for table in ("t", "t_rows"):
            damage(store, table, uids_of(0)[0])
        got = {table: store.get_payload(table, uids_of(0)) for table in ("t", "t_rows")}
        assert got["t_rows"] == got["t"] and got["t"][1] == [uids_of(0)[n] for n in (0, 2)]
        assert store.get_payload("t_rows", uids_of(0)) == got["t"]  # its payload gone: missing, found no more
        counts = {table: store.stats(table) for table in ("t", "t_rows")}
        assert counts["t_rows"]["damaged"] == counts["t"]["damaged"] == 2
        assert (counts["t_rows"]["failed"], counts["t_rows"]["quarantined"]) == (2, 2)
        assert (counts["t"]["failed"], counts["t"]["quarantined"]) == (2, 2)
        clean(store, "t", "t_rows")


def test_a_delete_of_computing_groups_uncounts_them_as_a_records_tables(tmp_path: Path) -> None:
    """Groups waiting for the advantage worker, deleted whole or in part: uncounted as computing and
    out of the compute queue as a records table's, the check clean. A rows table's were uncounted as
    pending (pending -2 and computing 2 for good, and `verify` naming the counters)."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "g", estimator="grpo", group_size=2)
        groups = [
            [trxp.from_experience(make_experience(0, task, run, reward=float(run))) for run in range(2)]
            for task in range(2)
        ]
        for table in ("g", "g_rows"):
            for group in groups:
                store.put(table, group)
            assert store.stats(table)["groups_computing"] == 2
            assert store.delete(table, group_ids=["0/0"], uids=[groups[1][0].uid]) == 3
        assert stats(store, "g_rows") == stats(store, "g")
        assert store.stats("g_rows")["computing"] == 1 and store.stats("g_rows")["pending"] == 0
        assert [job.groups for job in store.compute_backlog() if job.table == "g_rows"] == [["0/1"]]
        clean(store, "g", "g_rows")


def test_a_list_shows_computing_groups_as_a_records_tables(tmp_path: Path) -> None:
    """Groups complete and waiting for the advantage worker (computing) are listed among the live
    experiences, in insertion order, as a records table's: a rows table's list read only its segments
    and its pending groups, and left them out."""
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "g", estimator="grpo", group_size=2)
        items = [
            trxp.from_experience(make_experience(0, task, run, reward=float(run)))
            for task in range(3)
            for run in (0, 1)
        ]
        for table in ("g", "g_rows"):
            store.put(table, items[:1] + items[2:5])  # 0/1 computing, 0/0 and 0/2 pending
            store.put(table, items[1:2])  # 0/0 completes: computing
        listed = {table: store.list_experiences(table).items for table in ("g", "g_rows")}
        assert listed["g_rows"] == listed["g"]
        assert [(e.uid, e.state) for e in listed["g_rows"]] == [
            (items[0].uid, "computing"), (items[2].uid, "computing"), (items[3].uid, "computing"),
            (items[4].uid, "pending"), (items[1].uid, "computing"),
        ]  # fmt: skip
        for states in (["computing"], ["pending"], ["computing", "ready"]):
            got = [store.list_experiences(table, states=states, limit=2).items for table in ("g", "g_rows")]
            assert got[1] == got[0] and got[0], states
        clean(store, "g", "g_rows")


def test_a_delete_writes_per_group_never_a_record_per_experience(tmp_path: Path) -> None:
    """A rows table's delete of groups of 8: their members' flags in their segment's state (one row
    however many), their payloads, their runs cut, their directory entries; of a pending group's
    members, its one fragment and head. Nothing of the records' databases."""
    eights = {**FOURS, "group_size": 8}
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **eights)
        items = [run(task, n) for task in range(4) for n in range(8)]
        store.put("t_rows", items)
        for n in range(3):
            store.put("t_rows", [run(9, n)])
        counted: collections.Counter[str] = collections.Counter()
        counting(store, counted)
        assert store.delete("t_rows", [uid(0, 1), uid(0, 2)], ["0/1", "0/2"]) == 18
        assert {name: count for name, count in counted.items() if count} == {
            "put sstate": 1, "del blobs": 18, "del gdir": 2, "del runs": 1, "put runs": 2, "put counters": 1,
        }  # fmt: skip
        counted.clear()
        assert store.delete("t_rows", [uid(9, 0), uid(9, 2)]) == 2  # a pending group's: its head holds them
        assert {name: count for name, count in counted.items() if count} == {
            "put gdir": 1, "del blobs": 2, "put counters": 1,
        }  # fmt: skip
        clean(store, "t_rows")


def test_deleted_members_stay_uncounted_when_their_segment_is_forgotten(tmp_path: Path) -> None:
    """Tombstones forgotten tombstone_seconds after their groups retired, as a records table's: of a
    group one of whose members was deleted while ready, of a group deleted whole (its segment retires
    with the others), and of one a tombstone of which was deleted; every uid may then be pushed again."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **FOURS, tombstone_seconds=60)
        put_both(store, "t", [item for task in range(3) for item in pushed(task)])  # one segment of 3 groups
        for uids, groups in (([uids_of(0)[1]], ["0/1"]), ([], [])):
            assert alike(lambda table, u=uids, g=groups: store.delete(table, u, g)) == len(uids) + 4 * len(groups)
        take_both(store, "t", num_groups=2)
        assert alike(lambda table: store.delete(table, [uids_of(2)[0]])) == 0  # a consumed tombstone
        assert stats(store, "t_rows") == stats(store, "t") and store.stats("t")["consumed"] == 6
        clock.now += 61
        assert store.tick()["tombstones_pruned"] == 12
        assert stats(store, "t_rows") == stats(store, "t") and store.stats("t_rows")["consumed"] == 0
        assert put_both(store, "t", [item for task in range(3) for item in pushed(task)])[2] == ["0/0", "0/1", "0/2"]
        clean(store, "t", "t_rows")


def test_verify_names_a_deleted_groups_directory_entry_left_behind(tmp_path: Path) -> None:
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **FOURS)
        store.put("t_rows", pushed(0) + pushed(1))
        assert store.delete("t_rows", group_ids=["0/0"]) == 4
        prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])
        env: lmdb.Environment = store.environment.env
        with env.begin(write=True) as txn:
            txn.put(prefix + b"0/0", GroupRef(0, 0).encode(), db=store.db["gdir"])
        assert store.verify("t_rows") == ["group 0/0 of segment 0 was deleted but its directory entry names it"]


class Reading(RandomSteps):
    """RandomSteps with reads among its steps (Get, ReadFields whole or in fields, pages of
    ListExperiences with random filters, of random uids pushed or not): every reply, the stats,
    what an extension hears and `verify` as a records table's."""

    def pushed_uids(self, count: int) -> list[str]:
        known = sorted({item.uid for items in self.pushes for item in items})
        picked = self.rng.sample(known, min(len(known), count))
        return picked + ([UNKNOWN] if self.rng.random() < 0.2 else [])

    def get(self) -> None:
        uids = self.pushed_uids(self.rng.randint(1, 12))
        self.both(f"get {uids}", lambda table: self.store.get_payload(table, uids))

    def fields(self) -> None:
        uids, whole = self.pushed_uids(self.rng.randint(1, 12)), self.rng.random() < 0.5

        def call(table: str) -> object:
            batch, missing = self.store.read_fields(table, uids, whole=whole)
            try:
                return (reply(batch), batch.segments, missing)
            finally:
                assert batch.snapshot is not None
                batch.snapshot.release()

        self.both(f"read fields {uids}", call)

    def page(self) -> None:
        rng = self.rng
        filters = {
            "states": rng.sample(["pending", "ready", "leased"], rng.randint(0, 2)),
            "min_version": rng.choice([None, None, 0, 1]),
            "max_version": rng.choice([None, None, 0]),
            "after": rng.choice([0, 0, rng.randrange(400)]),
            "limit": rng.choice([1, 3, 10, 1000]),
        }
        self.both(f"list {filters}", lambda table: self.store.list_experiences(table, **filters))  # type: ignore[arg-type]

    def extra(self) -> list[Callable[[], None]]:
        """The steps this adds to RandomSteps's."""
        return [self.get, self.fields, self.page]

    def step(self) -> None:
        if self.rng.random() < 0.3:
            self.rng.choice(self.extra())()
            self.check()
        else:
            super().step()


class Deleting(Reading):
    """Reading's steps with deletes among them (random uids and groups, pushed or not, live or retired)."""

    def delete(self) -> None:
        rng = self.rng
        uids = self.pushed_uids(rng.choice([0, 1, 1, 2, 4]))
        groups = [f"0/{rng.randrange(self.low, self.low + 8)}" for _ in range(rng.choice([0, 0, 1, 2]))]
        self.both(f"delete {uids} {groups}", lambda table: self.store.delete(table, uids, groups))

    def extra(self) -> list[Callable[[], None]]:
        return [self.delete, self.delete, *super().extra()]


@pytest.mark.parametrize(
    ("settings", "seed"),
    [
        ({"group_size": 4}, 11),
        ({"group_size": 8, "min_group_size": 5}, 12),
        ({"group_size": 4, "drop_zero_variance": True, "group_timeout_seconds": 6, "on_group_timeout": "drop"}, 13),
        ({"group_size": 8, "group_timeout_seconds": 10, "min_group_size": 3, "drop_zero_variance": True}, 14),
    ],
)
def test_random_steps_with_deletes_and_reads_leave_a_rows_table_as_a_records_tables(
    tmp_path: Path, settings: dict[str, object], seed: int
) -> None:
    steps = Deleting(tmp_path, settings, seed)
    try:
        for _ in range(250):
            steps.step()
    finally:
        steps.store.close()


@pytest.mark.parametrize("order", ["priority", "fifo-from-a-version"])
def test_a_take_from_an_index_counts_a_group_without_its_deleted_members(tmp_path: Path, order: str) -> None:
    """A take that reads an order's index (priority, or a lowest version) counts a group one member
    short after a Delete as that many experiences, as a take from the runs and a records table do:
    a batch of 4 experiences takes a second group where the first has 3 left."""
    spec = {"order": "priority"} if order == "priority" else {"order": "fifo", "min_model_version": 0}
    with Store(tmp_path, clock=Clock()) as store:
        both(store, "t", **FOURS)
        for task, priority in ((0, 3.0), (1, 2.0), (2, 1.0)):
            items = [trxp.from_experience(make_experience(0, task, n, priority=priority, version=1)) for n in range(4)]
            put_both(store, "t", items)
        for table in ("t", "t_rows"):
            assert store.delete(table, [uid(0, 1)]) == 1
        got = take_both(store, "t", batch_size=4, **spec)
        assert got is not None and got[1] == ["0/0"] * 3 + ["0/1"] * 4
        clean(store, "t", "t_rows")
