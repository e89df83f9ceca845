"""More random steps for a rows table against a records table (test_rows_pending's RandomSteps): the
calls and data a user has that RandomSteps leaves out. Damaged payloads found by quarantine, a Get,
ReadFields or a take; ListExperiences' pages; Retire; reset_offpolicy; lease renewals, a rank's part
of a lease, a Sample stream's confirms, a held group's runs damaged, deleted or failed meanwhile, and
the clock past the leases' ends; reads of rollouts held in pieces; runs sharing a long prompt, and
runs stored in chunks; tables of group_size 0; the prompt ledger's claims and their groups;
token-level estimators with their batch stage; and `scan_directory` after every step. A walk with
short tombstones or eviction checks each table on its own (there the layouts differ by design:
docs/internals/storage.md), and that it holds no more than its capacity.

EXPBUF_SOAK_SCALE (a whole number, default 1) runs each walk at that many seeds."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_rows_pending import RandomSteps, Watched, reply, uid, walk

from expbuf.client import trxp
from expbuf.client.schema.experience import EID, Experience
from expbuf.server.advantages.batch_stage import finish_batch
from expbuf.server.store import Store, scan_directory
from expbuf.server.store.disk import layout
from expbuf.server.store.ledger.records import DatasetRecord
from expbuf.server.store.schema.errors import StoreError

from helpers import make_experience
from test_quarantine import damage

SCALE = max(1, int(float(os.environ.get("EXPBUF_SOAK_SCALE", "1"))))
SHARED_TASKS = 3  # every third task's runs share a prompt long enough to be stored once
CHUNKED_TASKS = (5, 17)  # these tasks' even runs are stored in chunks (a section over 4 MiB)


def long_prompt_run(task: int, number: int, reward: float, version: int | None, priority: float) -> trxp.RawItem:
    """A run whose prompt (the task's 512 tokens, the same for every run) is long enough to be shared."""
    prompt = torch.randint(0, 50_000, (512,), generator=torch.Generator().manual_seed(task))
    response = 4 + number
    info: dict[str, object] = {"priority": priority}
    if version is not None:
        info["model_version"] = version
    exp = Experience(
        eid=EID(batch=0, task=task, run=number, step=0, suffix=f"r{number}s0"),
        tokens=torch.cat([prompt, torch.arange(response) + 100 * number]),
        prompt_length=512,
        logprobs=torch.full((response,), -0.5),
        action_mask=torch.ones(response, dtype=torch.bool),
        reward=reward,
        info=info,
    )
    return trxp.from_experience(exp)


class MoreSteps(RandomSteps):
    """RandomSteps with the steps above. Settings beyond a table's: `shared` (long prompts), `chunked`
    (runs in chunks), `ledger` (a dataset whose claimed prompts' groups are pushed), `stage` (the
    store runs the batch stage, for estimators that need one)."""

    def __init__(self, root: Path, settings: dict[str, object], seed: int) -> None:
        settings = dict(settings)
        self.shared = bool(settings.pop("shared", False))
        self.chunked = bool(settings.pop("chunked", False))
        self.ledger = bool(settings.pop("ledger", False))
        self.stage = bool(settings.pop("stage", False))
        super().__init__(root, settings, seed)
        self.size = self.size or 4  # group_size 0: a group is what one push brings; runs 0..5 of a task
        self.claimed: list[tuple[int, int, int]] = []
        if self.ledger:
            for table in ("t", "t_rows"):
                self.store.claims.create(table, DatasetRecord("math", size=12))

    def open(self) -> Store:
        return Store(
            self.root,
            clock=self.clock,
            extensions={"watched": Watched},
            batch_stage=finish_batch if self.stage else None,
        )

    def run(self, task: int, number: int, reward: float) -> trxp.RawItem:
        if self.chunked and task in CHUNKED_TASKS and number % 2 == 0:
            exp = make_experience(0, task, number, reward=reward, version=task % 4, response=600_000)
            return trxp.from_experience(exp)
        if self.shared and task % SHARED_TASKS == 1:
            version = None if task % 7 == 3 and number % 4 == 0 else task % 4 + number % 2
            return long_prompt_run(task, number, reward, version, float((task * 5 + number) % 3))
        return super().run(task, number, reward)

    def uids(self, count: int) -> list[str]:
        """`count` uids of runs of the tasks in play (some never pushed)."""
        tasks = range(self.low, self.low + 8)
        return [uid(self.rng.choice(tasks), self.rng.randrange(self.size + 2)) for _ in range(count)]

    def stored(self, table: str, name: str) -> bool:
        """Whether the table holds a payload under `name`."""
        key = layout.table_prefix(self.store.catalog.lookup(table)[0]) + name.encode()
        with self.store.environment.read() as txn:
            return txn.get(key, db=self.store.db["blobs"]) is not None

    def damage(self) -> None:
        """A stored payload damaged alike in both tables, then found: a kept one (of a failed group) by a
        Get and quarantine, a live one by quarantine, a Get, ReadFields or a take. Its group fails whole
        (the damaged member's payload gone) in both, whatever state it was in."""
        store, rng = self.store, self.rng
        live = [e.uid for e in store.reads.page("t", limit=1000).items]
        kept = [u for u in self.uids(8) if u not in live and all(self.stored(t, u) for t in ("t", "t_rows"))]
        if kept and rng.random() < 0.4:
            target, how = kept[0], "get"
        elif live and all(self.stored(t, (target := rng.choice(live))) for t in ("t", "t_rows")):
            how = rng.choice(["quarantine", "get", "fields", "take"])
        else:
            return
        for table in ("t", "t_rows"):
            damage(store, table, target)
        more = self.uids(2)
        if how == "quarantine":
            self.both(f"quarantine damaged {target}", lambda t: store.quarantine(t, [target, *more]))
        elif how == "get":
            self.both(f"get damaged {target}", lambda t: sorted(store.reads.get(t, [target, *more]).items()))
        elif how == "fields":
            self.both(f"fields damaged {target}", lambda t: self.fields_of(t, [target, *more]))
        else:
            self.log.append(f"damaged {target}")
            self.take()
        self.both(f"quarantine again {target}", lambda t: store.quarantine(t, [target]))

    def fields_of(self, table: str, uids: list[str]) -> object:
        """What ReadFields answers of `uids`: the batch's columns and payload, and the missing uids."""
        batch, missing = self.store.reads.fields(table, uids, whole=True)
        try:
            return (
                list(batch.uids),
                list(batch.group_ids),
                list(batch.versions),
                list(batch.rewards),
                batch.payload,
                missing,
            )
        finally:
            if batch.snapshot is not None:
                batch.snapshot.release()

    def fields(self) -> None:
        """ReadFields and GetPayload of a few runs of the tasks in play, and their rollouts held in pieces."""
        uids, tids = self.uids(5), [f"0/{task}" for task in range(self.low, self.low + 8)]
        self.both("fields", lambda t: self.fields_of(t, uids))
        self.both("payload", lambda t: self.store.reads.payload(t, uids))
        self.both("partials", lambda t: self.store.reads.partials(t, tids))

    def pages(self) -> None:
        """ListExperiences page by page, of some states and versions, a few experiences a page: a rows
        table lists from its segments' columns and pending heads, and must page as a records table."""
        rng = self.rng
        states = rng.choice([(), ("ready",), ("pending",), ("leased", "ready"), ("computing", "pending")])
        low, high, limit = rng.choice([None, None, 1, 2]), rng.choice([None, None, 2, 3]), rng.randint(1, 7)

        def call(table: str) -> object:
            pages, after, done = [], 0, False
            while not done:
                page = self.store.reads.page(
                    table, states=states, min_version=low, max_version=high, after=after, limit=limit
                )
                listed = [(e.uid, e.group, e.state, e.version, e.reward, e.times_sampled) for e in page.items]
                pages.append((listed, page.next))
                after, done = page.next, page.done
            return pages

        self.both(f"pages of {states} from {low} to {high}, {limit} a page", call)

    def retire(self) -> None:
        """Retire (a trainer's groups trained outside a lease) of a group or two, in whatever state."""
        groups = [f"0/{self.rng.randrange(self.low, self.low + 8)}" for _ in range(self.rng.randint(1, 2))]
        self.both(f"retire {groups}", lambda t: self.store.retire(t, groups))

    def reset(self) -> None:
        version = self.rng.choice([None, 0, 2])
        self.both(f"reset_offpolicy {version}", lambda t: self.store.reset_offpolicy(t, version))

    def renew(self) -> None:
        """A lease (or a held batch, whose clock then starts) renewed, perhaps past its end."""
        kind, ids, _ = self.rng.choice(self.held)
        seconds = self.rng.choice([1.0, 5.0, 30.0])
        self.leases = ids
        self.both(f"renew {kind} {seconds}", lambda t: self.store.renew(ids[t], seconds, t)[1])
        self.leases = {}

    def part(self) -> None:
        """A rank's part of a lease or held batch (its groups still held: some may have left it)."""
        kind, ids, _ = self.rng.choice(self.held)
        ranks = self.rng.randint(1, 3)
        rank = self.rng.randrange(ranks)
        self.leases = ids
        self.both(f"part {kind} {rank}/{ranks}", lambda t: self.store.reads.part(t, ids[t], rank, ranks, "tokens")[0])
        self.leases = {}

    def stream(self) -> None:
        """A Sample stream's next take, which confirms its last held batch in the same commit."""
        last = self.rng.choice([h for h in self.held if h[0] == "hold"])
        self.held.remove(last)
        _, ids, spec = last
        drawn, taken = self.store.sampling.rng.getstate(), {}

        def call(table: str) -> object:
            self.store.sampling.rng.setstate(drawn)
            batch = self.store.sample(dataclasses.replace(spec, table=table), hold=True, confirm=ids[table])
            if batch is not None:
                taken[table] = batch.lease_id
            return reply(batch)

        self.leases = ids
        self.both(f"stream: confirm and take {spec.delivery} {spec.num_groups} {spec.order}", call)
        self.leases = {}
        if taken:
            self.held.append(("hold", taken, spec))

    def held_change(self) -> None:
        """A run of a group under a lease or hold damaged and found, deleted or reported failed meanwhile:
        the lease goes on without its group (or its run)."""
        _, ids, _ = self.rng.choice(self.held)
        try:
            held = self.store.reads.part("t", ids["t"], 0, 1, "tokens")[0]
        except StoreError:  # ended (expired) meanwhile
            return
        if not held:
            return
        target, how, store = self.rng.choice(held), self.rng.choice(["damage", "delete", "fail"]), self.store
        if how == "damage" and all(self.stored(t, target) for t in ("t", "t_rows")):
            for table in ("t", "t_rows"):
                damage(store, table, target)
            self.both(f"quarantine held {target}", lambda t: store.quarantine(t, [target]))
        elif how == "delete":
            self.both(f"delete held {target}", lambda t: store.delete(t, [target]))
        else:
            self.both(f"fail held {target}", lambda t: store.fail_runs(t, [target], ["oom"]).recorded)

    def long_tick(self) -> None:
        """The clock past every lease's end (30 s at most) and past short tombstones."""
        self.clock.now += self.rng.choice([31, 65])
        self.log.append(f"tick to {self.clock.now}: {self.store.tick()}")

    def claim(self) -> None:
        count, seconds = self.rng.randint(1, 3), self.rng.choice([3, 8, 30])

        def call(table: str) -> object:
            got, done = self.store.claims.claim(table, "math", count, seconds=seconds, owner="w")
            return [(c.epoch, c.index, c.attempt) for c in got], done

        got = self.both(f"claim {count} for {seconds}", call)
        if isinstance(got, tuple) and isinstance(got[0], list):
            self.claimed.extend(got[0])

    def claimed_push(self) -> None:
        """Some runs of a claimed prompt's attempt (its claim perhaps ended meanwhile)."""
        epoch, index, attempt = self.rng.choice(self.claimed)
        runs = sorted(self.rng.sample(range(self.size + 1), self.rng.randint(1, self.size)))
        made = (
            make_experience(f"math/{epoch}", f"{index}@{attempt}", number, reward=float(number % 2 + index % 2))
            for number in runs
        )
        items = [trxp.from_experience(exp) for exp in made]

        def put(table: str) -> object:
            r = self.store.put(table, items)
            return (r.stored, r.duplicates, r.completed_groups, r.dropped_groups, r.partial)

        self.both(f"claimed push {epoch}/{index}@{attempt} {runs}", put)

    def claim_end(self) -> None:
        """A claim released, reported trained, or renewed."""
        ref = self.claimed.pop(self.rng.randrange(len(self.claimed)))
        how, claims = self.rng.choice(["release", "report", "renew"]), self.store.claims
        if how == "release":
            self.both(f"release {ref}", lambda t: claims.release(t, "math", [ref]))
        elif how == "renew":
            self.both(f"renew claim {ref}", lambda t: claims.renew(t, "math", [ref], 5.0)[1])
            self.claimed.append(ref)
        else:
            self.both(f"report {ref}", lambda t: claims.report(t, "math", [(*ref, [1.0, 0.0])]))

    def check(self) -> None:
        super().check()
        if self.ledger:

            def call(table: str) -> object:
                page = self.store.claims.prompts(table, "math")
                return self.store.claims.datasets(table, "math"), [
                    (e, i, r.state, r.attempt) for e, i, r in page.prompts
                ]

            self.both("ledger", call)
        with self.store.environment.read() as txn:
            report = scan_directory(txn, self.store.environment.db, self.clock.now)
        assert not any(report.values()), (report, "\n".join(self.log[-25:]))

    def steps(self) -> list[tuple[Callable[[], None], float]]:
        held, holds, claimed = bool(self.held), any(h[0] == "hold" for h in self.held), bool(self.claimed)
        return [
            *super().steps(),
            (self.damage, 0.7), (self.retire, 0.7), (self.reset, 0.2), (self.fields, 0.5), (self.pages, 0.5),
            (self.long_tick, 0.3), (self.restart, 0.4), (self.renew, 1 if held else 0),
            (self.part, 0.5 if held else 0), (self.stream, 1.5 if holds else 0), (self.held_change, 1 if held else 0),
            (self.claim, 1.5 if self.ledger else 0), (self.claimed_push, 4 if claimed else 0),
            (self.claim_end, 1 if claimed else 0),
        ]  # fmt: skip


class AloneSteps(MoreSteps):
    """MoreSteps where the layouts differ by design (tombstones forgotten soon after a take of a group
    its segment keeps, eviction in another order: docs/internals/storage.md): each table is checked on
    its own, an unexpected error (a bare StoreError) raised, `verify` and the scan clean."""

    def both(self, what: str, call: Callable[[str], object]) -> object:
        got: list[object] = []
        for table in ("t", "t_rows"):
            try:
                got.append(call(table))
            except StoreError as exc:
                if type(exc) is StoreError:
                    raise
                got.append((type(exc).__name__, str(exc)))
        self.log.append(f"{what} -> {got!r}"[:300])
        return got[0]

    def steps(self) -> list[tuple[Callable[[], None], float]]:
        self.held = [h for h in self.held if len(h[1]) == 2]  # a take that only one table served is let go
        return super().steps()

    def __init__(self, root: Path, settings: dict[str, object], seed: int) -> None:
        self.capacity = int(settings.get("capacity_experiences", 0))  # type: ignore[call-overload]
        super().__init__(root, settings, seed)

    def check(self) -> None:
        verify = self.committed()
        for table in ("t", "t_rows"):
            assert not verify or self.store.verify(table) == [], (table, "\n".join(self.log[-25:]))
            counts = self.store.stats(table)
            live = sum(counts[state] for state in ("pending", "computing", "ready", "leased"))
            assert live <= (self.capacity or live), (table, live, "\n".join(self.log[-25:]))
        for table in ("t", "t_rows"):
            for extension in self.store.extensions_of(table):
                if isinstance(extension, Watched):
                    extension.events.clear()
        with self.store.environment.read() as txn:
            report = scan_directory(txn, self.store.environment.db, self.clock.now)
        assert not any(report.values()), (report, "\n".join(self.log[-25:]))


WALKS = [
    ({"group_size": 4, "shared": True, "chunked": True}, 2),
    ({"group_size": 8, "capacity_experiences": 30, "min_group_size": 4, "shared": True}, 5),
    ({"group_size": 4, "priority_decay": 1.0, "reuse_cooldown_seconds": 5, "max_times_sampled": 4}, 8),
    (
        {
            "group_size": 0,
            "group_timeout_seconds": 6,
            "shared": True,
            "estimator": "grpo",
            "estimator_params": {"std_threshold": 0.3},
            "in_push": True,
        },
        12,
    ),
    ({"group_size": 4, "ledger": True, "group_timeout_seconds": 6, "min_group_size": 2}, 22),
    ({"group_size": 4, "estimator": "reinforceplusplus", "stage": True, "evict_stale": True, "max_staleness": 1}, 31),
]
ALONE = [
    ({"group_size": 8, "tombstone_seconds": 3, "capacity_experiences": 40, "when_full": "evict", "shared": True}, 11),
]


@pytest.mark.parametrize("round", range(SCALE))
@pytest.mark.parametrize(("settings", "seed"), WALKS)
def test_more_random_steps_leave_a_rows_table_as_a_records_tables(
    tmp_path: Path, settings: dict[str, object], seed: int, round: int
) -> None:
    walk(tmp_path, settings, seed + 1000 * round, 150, kind=MoreSteps)


@pytest.mark.parametrize("round", range(SCALE))
@pytest.mark.parametrize(("settings", "seed"), ALONE)
def test_random_steps_where_the_layouts_differ_leave_each_table_sound(
    tmp_path: Path, settings: dict[str, object], seed: int, round: int
) -> None:
    walk(tmp_path, settings, seed + 1000 * round, 150, kind=AloneSteps)
