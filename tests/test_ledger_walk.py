"""The prompt ledger under random steps, a records and a rows table side by side: claims made,
renewed, released, reported and ended by the clock; their groups pushed whole, in part, with a run
failed, or with rewards all equal; groups consumed, leased and acked or given back, retired as
trained, and deleted; restarts. After every step each table's ledger is the other's and `verify`
finds nothing wrong; the trainer never gets two groups of one prompt in one epoch; and at the end,
every prompt of every epoch trained or dropped, the dataset is done.

EXPBUF_SOAK_SCALE (a whole number, default 1) runs each walk at that many seeds."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from expbuf.client import trxp
from expbuf.client.rollout_pieces import split
from expbuf.server.store import Store
from expbuf.server.store.ledger.records import DatasetRecord, read_group_key
from expbuf.server.store.schema.errors import StoreError
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import make_experience

SCALE = max(1, int(float(os.environ.get("EXPBUF_SOAK_SCALE", "1"))))
TABLES = ("t", "t_rows")
SIZE, EPOCHS = 5, 3


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def run_of(ref: tuple[int, int, int], run: int, reward: float) -> trxp.RawItem:
    epoch, index, attempt = ref
    return trxp.from_experience(make_experience(f"math/{epoch}", f"{index}@{attempt}", run, reward=reward))


def piece_of(ref: tuple[int, int, int], run: int, at: int) -> trxp.RawItem:
    """Piece `at` of three of a run of an attempt (the rollout's response cut at 2 and 4)."""
    epoch, index, attempt = ref
    exp = make_experience(f"math/{epoch}", f"{index}@{attempt}", run, reward=float(run), response=6)
    return trxp.from_experience(split(exp, [2, 4])[at])


class Walk:
    """Both tables under the same steps; what the trainer got of each, by prompt and epoch."""

    def __init__(self, root: Path, seed: int, table: dict[str, object], dataset: dict[str, object]) -> None:
        self.root, self.rng, self.clock = root, random.Random(seed), Clock()
        self.store = Store(root, clock=self.clock)
        for name in TABLES:
            layout = "rows" if name.endswith("rows") else "records"
            self.store.create_table(
                TableConfig.of(name=name, group_by="task", estimator="none", layout=layout, **table)
            )
            self.store.claims.create(name, DatasetRecord("math", size=SIZE, epochs=EPOCHS, seed=seed, **dataset))
        self.claimed: list[tuple[int, int, int]] = []
        self.pushed: list[tuple[int, int, int]] = []
        self.leases: list[dict[str, str]] = []
        self.lease_groups: dict[str, list[str]] = {}
        self.trained: dict[str, dict[tuple[int, int], list[str]]] = {name: {} for name in TABLES}
        self.log: list[str] = []

    def both(self, what: str, call: Callable[[str], object]) -> object:
        got: list[object] = []
        for name in TABLES:
            try:
                got.append(call(name))
            except StoreError as exc:
                message = str(exc).replace("'t_rows'", "'t'")
                for lease_id in self.lease_groups:
                    message = message.replace(lease_id, "<lease>")
                got.append((type(exc).__name__, message))
        self.log.append(f"{what} -> {got[0]!r}"[:300])
        assert got[1] == got[0], "\n".join(self.log[-30:])
        return got[0]

    def got(self, name: str, gkeys: list[str]) -> None:
        """The trainer got these groups of a table (an attempt's twice is one training: a report of
        it made again counts what the first took)."""
        for gkey in dict.fromkeys(gkeys):
            named = read_group_key(gkey)
            assert named is not None
            trained = self.trained[name].setdefault(named[1:3], [])
            if gkey not in trained:
                trained.append(gkey)

    def check(self) -> None:
        for name in TABLES:
            assert self.store.verify(name) == [], "\n".join(self.log[-30:])
            twice = {prompt: gkeys for prompt, gkeys in self.trained[name].items() if len(gkeys) > 1}
            assert not twice, f"{name} trained a prompt twice in an epoch: {twice}\n" + "\n".join(self.log[-30:])

        def ledger(name: str) -> object:
            (ds,) = self.store.claims.datasets(name, "math")
            page = self.store.claims.prompts(name, "math")
            return (
                ds.totals,
                ds.counts,
                ds.reissued,
                ds.skipped,
                [(e, i, r.state, r.attempt) for e, i, r in page.prompts],
            )

        self.both("ledger", ledger)
        self.both("partials", lambda t: self.store.stats(t)["partials"])

    # ---- steps ----------------------------------------------------------------------------------

    def claim(self) -> None:
        count, seconds = self.rng.randint(1, 3), float(self.rng.choice([5, 10, 30]))
        got = self.both(
            f"claim {count}", lambda t: self.store.claims.claim(t, "math", count, seconds=seconds, owner="w")
        )
        if isinstance(got, tuple) and not isinstance(got[0], str):
            self.claimed += [(p.epoch, p.index, p.attempt) for p in got[0]]

    def push(self) -> None:
        ref = self.rng.choice(self.claimed)
        runs = self.rng.choice([[0, 1], [0, 1], [0], [1]])
        equal = self.rng.random() < 0.3
        items = [run_of(ref, run, 1.0 if equal else float(run)) for run in runs]
        self.both(f"push {ref} {runs} equal={equal}", lambda t: self.store.put(t, items).stored)
        self.pushed.append(ref)

    def piece(self) -> None:
        ref = self.rng.choice(self.claimed)
        run, at = self.rng.randint(0, 1), self.rng.choice([0, 0, 1, 2])
        item = piece_of(ref, run, at)
        self.both(f"piece {ref} run {run} at {at}", lambda t: self.store.put(t, [item]).stored)

    def fail(self) -> None:
        ref = self.rng.choice(self.claimed)
        uid = run_of(ref, self.rng.randint(0, 1), 0.0).uid
        self.both(f"fail {uid}", lambda t: self.store.fail_runs(t, [uid], ["died"]) and None)

    def end(self) -> None:
        ref = self.claimed.pop(self.rng.randrange(len(self.claimed)))
        how, claims = self.rng.choice(["release", "report", "renew"]), self.store.claims
        if how == "release":
            self.both(f"release {ref}", lambda t: claims.release(t, "math", [ref]))
        elif how == "renew":
            self.both(f"renew {ref}", lambda t: claims.renew(t, "math", [ref], 10.0)[1])
            self.claimed.append(ref)
        else:
            rewards = [1.0, 1.0] if self.rng.random() < 0.3 else [1.0, 0.0]

            def report(t: str) -> int:
                reported = claims.report(t, "math", [(*ref, rewards)])
                if reported:
                    self.got(t, [f"math/{ref[0]}/{ref[1]}@{ref[2]}"])
                return reported

            self.both(f"report {ref} {rewards}", report)

    def tick(self) -> None:
        seconds = self.rng.choice([1, 4, 11])
        self.clock.now += seconds
        self.both(f"tick {seconds}", lambda t: self.store.tick() and None)

    def take(self) -> None:
        delivery = self.rng.choice(["consume", "lease"])
        lease: dict[str, str] = {}

        def take(t: str) -> object:
            batch = self.store.sample(TakeSpec(t, num_groups=1, delivery=delivery, lease_seconds=20.0), timeout=0)
            if batch is None:
                return None
            if delivery == "consume":
                self.got(t, list(batch.group_ids))
            else:
                lease[t] = batch.lease_id
                self.lease_groups[batch.lease_id] = list(batch.group_ids)
            return sorted(set(batch.group_ids))

        if self.both(f"take {delivery}", take) is not None and lease:
            self.leases.append(lease)

    def settle(self) -> None:
        lease = self.leases.pop(self.rng.randrange(len(self.leases)))
        ack = self.rng.random() < 0.7

        def settle(t: str) -> object:
            if not ack:
                return self.store.nack(lease[t], t)
            acked = self.store.ack(lease[t], t)
            if acked:
                self.got(t, self.lease_groups[lease[t]])
            return acked

        self.both(f"{'ack' if ack else 'nack'}", settle)

    def retire(self) -> None:
        gkey = "math/{}/{}@{}".format(*self.rng.choice(self.pushed))

        def retire(t: str) -> int:
            retired = self.store.retire(t, [gkey])
            if retired:
                self.got(t, [gkey])
            return retired

        self.both(f"retire {gkey}", retire)

    def delete(self) -> None:
        gkey = "math/{}/{}@{}".format(*self.rng.choice(self.pushed))
        self.both(f"delete {gkey}", lambda t: self.store.delete(t, group_ids=[gkey]))

    def restart(self) -> None:
        self.store.close()
        self.store = Store(self.root, clock=self.clock)
        self.leases.clear()  # unacked leases come back when their time comes
        self.log.append("restart")

    def steps(self) -> list[tuple[Callable[[], None], float]]:
        claimed, pushed = bool(self.claimed), bool(self.pushed)
        return [
            (self.claim, 2.0),
            (self.push, 5.0 if claimed else 0),
            (self.fail, 0.5 if claimed else 0),
            (self.piece, 2.0 if claimed else 0),
            (self.end, 1.0 if claimed else 0),
            (self.tick, 1.0),
            (self.take, 2.0),
            (self.settle, 1.0 if self.leases else 0),
            (self.retire, 0.3 if pushed else 0),
            (self.delete, 0.3 if pushed else 0),
            (self.restart, 0.1),
        ]

    def drain(self) -> None:
        """Workers that push every claim's group whole and a trainer that consumes them, until done."""
        for _ in range(200):
            self.clock.now += 31
            self.both("tick", lambda t: self.store.tick() and None)
            self.claimed.clear()
            self.claim()
            for ref in list(self.claimed):
                items = [run_of(ref, run, float(run)) for run in (0, 1)]
                self.both(f"push {ref}", lambda t, items=items: self.store.put(t, items).stored)
            while self.both("take", lambda t: self._consume(t)) is not None:
                pass
            if all(self.store.claims.datasets(t, "math")[0].done for t in TABLES):
                return
        raise AssertionError("the dataset never finished\n" + "\n".join(self.log[-30:]))

    def _consume(self, t: str) -> object:
        batch = self.store.sample(TakeSpec(t, num_groups=1), timeout=0)
        if batch is None:
            return None
        self.got(t, list(batch.group_ids))
        return sorted(set(batch.group_ids))


WALKS = [
    ({"group_size": 2}, {}),
    ({"group_size": 2, "drop_zero_variance": True}, {"on_drop": "retry", "max_attempts": 3}),
    ({"group_size": 2, "drop_zero_variance": True}, {"zero_variance": "retry", "max_in_flight": 3}),
    ({"group_size": 2, "drop_zero_variance": True}, {"zero_variance": "skip", "order": "pools"}),
    ({"group_size": 2, "min_group_size": 1, "group_timeout_seconds": 8}, {"order": "pass_rate", "on_drop": "retry"}),
]


@pytest.mark.parametrize("table,dataset", WALKS)
@pytest.mark.parametrize("seed", range(SCALE))
def test_the_ledger_under_random_steps_agrees_across_layouts_and_loses_no_prompt(
    tmp_path: Path, table: dict[str, object], dataset: dict[str, object], seed: int
) -> None:
    walk = Walk(tmp_path / "data", seed, table, dataset)
    try:
        for _ in range(80):
            steps = walk.steps()
            step = walk.rng.choices([s for s, _ in steps], [w for _, w in steps])[0]
            step()
            walk.check()
        walk.drain()
        walk.check()
        for name in TABLES:
            page = walk.store.claims.prompts(name, "math", limit=1000)
            states = {(e, i): r.state for e, i, r in page.prompts}
            assert {(e, i) for e in range(EPOCHS) for i in range(SIZE)} == set(states)
            assert set(states.values()) <= {"trained", "dropped"}
            (ds,) = walk.store.claims.datasets(name, "math")
            assert ds.total("trained") == sum(len(g) for g in walk.trained[name].values())
            assert walk.store.stats(name)["partials"] == 0  # every prompt done: no rollout left in pieces
    finally:
        walk.store.close()
