"""A rows table's oldest live experience (stats' oldest_age_seconds, the metric
expbuf_oldest_age_seconds): the age a records table of the same data reports, and the one its
pushes' times say, through takes, confirms, give-backs, acks, nacks, lease expiries, deletes,
evictions, a trainer's retires and restarts; kept as segments and pending groups change
(core/table_state/oldest_index.py), checked by `verify`, and built at the open of a directory written
without it."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
from hypothesis import given
from hypothesis import strategies as st

from expbuf.client import trxp
from expbuf.client.schema.routing import uid_group_key
from expbuf.server.store import Entry, Store
from expbuf.server.store.core.table_state.oldest_index import stamp, unstamp
from expbuf.server.store.disk import layout
from expbuf.server.store.schema.errors import StoreError
from expbuf.server.store.schema.sample_spec import TakeSpec

from helpers import StoppedClock as Clock
from helpers import both_layouts as both
from helpers import layouts_reply as reply
from helpers import layouts_stats as stats
from helpers import make_experience

ONES = {"estimator": "none", "group_by": "none"}  # each experience its own group, keyed by its uid
FOURS = {"estimator": "none", "group_by": "task", "group_size": 4}
TABLES = ("t", "t_rows")


def group(task: int, size: int) -> list[trxp.RawItem]:
    """A whole group: `size` runs of task `task` (one run of a task of its own where `size` is 1)."""
    return [
        trxp.from_experience(make_experience(0, task, run, reward=float((task + run) % 3), priority=float(task % 4)))
        for run in range(size)
    ]


def ages(store: Store) -> tuple[float, float]:
    found = store.stats("t")["oldest_age_seconds"], store.stats("t_rows")["oldest_age_seconds"]
    assert found[1] == found[0], found
    return found[0], found[1]


def clean(store: Store) -> None:
    for table in TABLES:
        assert store.verify(table) == [], table


@given(st.lists(st.floats(allow_nan=False), min_size=2))
def test_a_times_stamp_sorts_as_the_times_do_and_reads_back(times: list[float]) -> None:
    times = [when + 0.0 for when in times]  # -0.0 as 0.0: equal times, one stamp
    assert [unstamp(stamp(when)) for when in times] == times
    assert sorted(map(stamp, times)) == [stamp(when) for when in sorted(times)]


class Steps:
    """A records and a rows table of the same settings, each group pushed whole, driven through the
    same random steps; after each, every reply and the stats (the oldest live experience's age too)
    agree, the age is the one the pushes' times say, and `verify` finds nothing wrong."""

    def __init__(self, root: Path, settings: dict[str, object], seed: int) -> None:
        self.root, self.rng, self.clock = root, random.Random(seed), Clock()
        self.size = int(settings.get("group_size", 1))  # type: ignore[call-overload]
        self.by = str(settings["group_by"])
        self.store = Store(root, clock=self.clock)
        both(self.store, "t", **settings)
        self.task = 0
        self.pushed: dict[str, float] = {}  # uid -> when pushed
        self.gone: set[str] = set()  # uids known to have left (taken, deleted, retired, evicted)
        self.held: list[tuple[str, dict[str, str], TakeSpec]] = []
        self.log: list[str] = []

    def both(self, what: str, call: Callable[[str], object], leases: dict[str, str] | None = None) -> object:
        """`call` on each table: its result, or the error it raised (the table's name and the lease id
        of each in `leases` made alike), asserted equal."""
        got: list[object] = []
        for table in TABLES:
            try:
                got.append(call(table))
            except StoreError as exc:
                message = str(exc).replace("'t_rows'", "'t'").replace((leases or {}).get(table, "\0"), "<lease>")
                got.append((type(exc).__name__, message))
        self.log.append(f"{what} -> {got[0]!r}"[:200])
        assert got[1] == got[0], "\n".join(self.log[-20:])
        return got[0]

    def push(self) -> None:
        self.clock.now += self.rng.choice([0.25, 1, 3])
        items = [item for _ in range(self.rng.randint(1, 5)) for item in group(self.next_task(), self.size)]
        self.both(f"push {len(items)}", lambda table: len(self.store.put(table, items).stored))
        for item in items:
            self.pushed.setdefault(Entry.of(item).uid, self.clock.now)

    def next_task(self) -> int:
        self.task += 1
        return self.task

    def take(self) -> None:
        rng = self.rng
        kind = rng.choice(["consume", "hold", "lease"])
        spec = TakeSpec(
            num_groups=rng.randint(1, 6),
            order=rng.choice(["fifo", "lifo", "priority"]),
            delivery="lease" if kind == "lease" else "consume",
            lease_seconds=rng.choice([2, 30]),
            allow_partial=True,
        )
        ids: dict[str, str] = {}

        def call(table: str) -> object:
            batch = self.store.sample(dataclasses.replace(spec, table=table), hold=kind == "hold")
            if batch is not None and kind != "consume":
                ids[table] = batch.lease_id
            return reply(batch)

        self.both(f"take {kind} {spec.num_groups} {spec.order}", call)
        if ids:
            self.held.append((kind, ids, spec))

    def end(self) -> None:
        kind, ids, spec = self.held.pop(self.rng.randrange(len(self.held)))
        good, store = self.rng.random() < 0.5, self.store

        def call(table: str) -> object:
            if kind == "hold":
                return (
                    store.confirm(ids[table], dataclasses.replace(spec, table=table))
                    if good
                    else store.give_back(ids[table], table)
                )
            return store.ack(ids[table], table) if good else store.nack(ids[table], table)

        self.both(f"end {kind} {'confirmed' if good else 'given back'}", call, ids)

    def delete(self) -> None:
        uids = self.rng.sample(sorted(self.pushed), min(len(self.pushed), self.rng.randint(1, 6)))
        groups = [] if self.rng.random() < 0.7 else [uid_group_key(uids[0], self.by) or ""]
        self.both(f"delete {len(uids)} and {groups}", lambda table: self.store.delete(table, uids, groups))

    def retire(self) -> None:
        uids = self.rng.sample(sorted(self.pushed), min(len(self.pushed), self.rng.randint(1, 4)))
        groups = sorted({uid_group_key(uid, self.by) or "" for uid in uids})
        self.both(f"retire {groups}", lambda table: self.store.retire(table, groups))

    def tick(self) -> None:
        self.clock.now += self.rng.choice([1, 3])
        self.log.append(f"tick {self.store.tick()}")

    def restart(self) -> None:
        self.store.close()
        self.store = Store(self.root, clock=self.clock)
        self.held = [h for h in self.held if h[0] == "lease"]  # a start gives held batches back
        self.log.append("restart")

    def check(self) -> None:
        store = self.store
        assert stats(store, "t_rows") == stats(store, "t"), "\n".join(self.log[-20:])
        age = ages(store)[0]
        live = self.live()
        assert age == (self.clock.now - min(self.pushed[uid] for uid in live) if live else 0.0), "\n".join(
            self.log[-20:]
        )
        clean(store)

    def live(self) -> list[str]:
        """The uids the records table holds live (its listing of them), pushed by these steps."""
        page = self.store.list_experiences("t", limit=10_000)
        found = [item.uid for item in page.items]
        assert page.done and set(found) <= set(self.pushed)
        return found

    def step(self) -> None:
        steps: list[tuple[Callable[[], None], float]] = [
            (self.push, 6), (self.take, 5), (self.end, 3 if self.held else 0), (self.delete, 2),
            (self.retire, 1.5), (self.tick, 1), (self.restart, 0.3),
        ]  # fmt: skip
        self.rng.choices([s for s, _ in steps], [w for _, w in steps])[0]()
        self.check()


@pytest.mark.parametrize(
    ("settings", "seed"),
    [
        (ONES, 1),
        (FOURS, 2),
        ({**ONES, "capacity_experiences": 150, "when_full": "evict"}, 3),
        ({**FOURS, "capacity_experiences": 120, "when_full": "evict"}, 4),
    ],
)
def test_the_oldest_age_follows_every_move_of_a_rows_table_as_a_records_tables(
    tmp_path: Path, settings: dict[str, object], seed: int
) -> None:
    steps = Steps(tmp_path, settings, seed)
    try:
        for _ in range(150):
            steps.step()
    finally:
        steps.store.close()


def test_the_oldest_age_is_the_oldest_live_experiences_through_scripted_moves(tmp_path: Path) -> None:
    """Groups of one pushed at known times: the age is that of the oldest one still live as the
    oldest are held (still live), given back, consumed, deleted, retired and evicted, and across a
    restart; 0 once none is live."""
    clock = Clock()
    start = clock.now
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **ONES, capacity_experiences=200, when_full="evict")
        uids = []
        for push in range(4):  # 4 pushes of 64 (one segment each) at 0, 10, 20, 30 s
            items = [item for task in range(64 * push, 64 * push + 64) for item in group(task, 1)]
            for table in TABLES:
                store.put(table, items)
            uids += [Entry.of(item).uid for item in items]
            clock.now += 10
        clock.now = start + 100
        assert ages(store) == (100.0, 100.0)
        assert store.stats("t_rows")["evicted"] == 56  # the oldest 56 made room: the first push's 8 left
        held = {t: store.sample(TakeSpec(t, num_groups=8), hold=True) for t in TABLES}
        assert ages(store) == (100.0, 100.0), "held experiences are live"
        for table, batch in held.items():
            assert batch is not None
            store.give_back(batch.lease_id, table)
        assert ages(store) == (100.0, 100.0)
        for table in TABLES:
            store.sample(TakeSpec(table, num_groups=8))  # the first push's last 8, consumed
        assert ages(store) == (90.0, 90.0)
        for table in TABLES:
            store.delete(table, uids[64:70])
            store.retire(table, uids[70:128])  # the rest of the second push: 0 ready of it left
        assert ages(store) == (80.0, 80.0)
        store.close()
    with Store(tmp_path, clock=clock) as store:
        assert ages(store) == (80.0, 80.0)
        for table in TABLES:
            store.delete(table, uids[128:])
        assert ages(store) == (0.0, 0.0)
        clean(store)


def drop_oldest_index(path: Path) -> None:
    """The directory as a release before the index of a rows table's oldest wrote it: without it."""
    env = lmdb.open(str(path), max_dbs=layout.MAX_DBS)
    try:
        with env.begin(write=True) as txn:
            assert txn.get(b"oldest") is not None, "the index was kept"
            txn.drop(env.open_db(b"oldest", txn=txn), delete=True)
    finally:
        env.close()


def test_a_directory_written_without_the_oldest_index_builds_it_at_its_open(tmp_path: Path) -> None:
    """Segments with live, retired and deleted members, pending and computing groups: the index is
    built in the open's transaction, the ages as before, `verify` clean, and kept from then on."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **FOURS)
        both(store, "c", estimator="grpo", group_by="task", group_size=4)  # no worker: groups stay computing
        for task in range(40):
            clock.now += 1
            items = group(task, 4)
            for table in ("t", "t_rows"):
                store.put(table, items[: 4 if task % 5 else 2])  # every fifth group left pending
            if task % 7 == 3:
                for table in ("c", "c_rows"):
                    store.put(table, items)
        for table in ("t", "t_rows"):
            store.sample(TakeSpec(table, num_groups=5))
            store.delete(table, [Entry.of(item).uid for item in group(12, 4)[:2]])
        clock.now += 5
        before = {table: store.stats(table)["oldest_age_seconds"] for table in ("t_rows", "c_rows")}
        assert before["t_rows"] == store.stats("t")["oldest_age_seconds"] == 44.0, "0/0 is pending still"
        assert before["c_rows"] == store.stats("c")["oldest_age_seconds"] == 41.0, "0/3 is computing"
    drop_oldest_index(tmp_path)
    with Store(tmp_path, clock=clock) as store:
        assert {table: store.stats(table)["oldest_age_seconds"] for table in before} == before
        for table in ("t", "t_rows", "c", "c_rows"):
            assert store.verify(table) == [], table
        for table in ("t", "t_rows"):
            store.put(table, group(0, 4)[2:])  # 0/0 completes
            store.retire(table, ["0/0"])  # and is trained
        assert ages(store) == (39.0, 39.0), "0/5 is pending still"
        clean(store)


def test_verify_names_an_oldest_index_that_does_not_say_what_the_rows_do(tmp_path: Path) -> None:
    """A rows table's index of its oldest live members that lacks a segment's or a pending group's
    key, holds one at another time, or names what holds none live, is named by `verify`."""
    clock = Clock()
    with Store(tmp_path, clock=clock) as store:
        both(store, "t", **FOURS)
        for table in TABLES:
            store.put(table, group(1, 4) + group(2, 2))  # a segment, and a pending group
        prefix = layout.table_prefix(store.catalog.lookup("t_rows")[0])

        def keys() -> list[bytes]:
            with store.environment.read() as txn, txn.cursor(db=store.db["oldest"]) as cur:
                return [bytes(key) for key in cur.iternext(values=False) if key.startswith(prefix)]

        kept = keys()
        assert len(kept) == 2 and store.verify("t_rows") == []
        for key in kept:
            store.environment.submit(lambda txn, key=key: txn.delete(key, db=store.db["oldest"]))
            assert len(store.verify("t_rows")) == 1, key
            moved = key[:4] + (int.from_bytes(key[4:12], "big") + 1).to_bytes(8, "big") + key[12:]
            store.environment.submit(lambda txn, moved=moved: txn.put(moved, b"", db=store.db["oldest"]))
            assert len(store.verify("t_rows")) == 2, key  # one missing, one of no such time
            store.environment.submit(lambda txn, moved=moved: txn.delete(moved, db=store.db["oldest"]))
            store.environment.submit(lambda txn, key=key: txn.put(key, b"", db=store.db["oldest"]))
        assert store.verify("t_rows") == []
        stray = prefix + kept[0][4:12] + b"\x00" + (10**9).to_bytes(8, "big")
        store.environment.submit(lambda txn: txn.put(stray, b"", db=store.db["oldest"]))
        assert len(store.verify("t_rows")) == 1
