"""The prompt ledger in the storage engine: datasets, claims, and the life of each prompt
(pending, claimed, generated, trained, dropped) moved by the table's own events, durable and
in the same transaction. Real LMDB in a temporary directory; the store's clock is the test's."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from expbuf.client import trxp
from expbuf.client.schema.prompts import MAX_PROMPTS_PER_CALL
from expbuf.server.store import Store
from expbuf.server.store.disk import layout
from expbuf.server.store.ledger.claimed import Claimed
from expbuf.server.store.ledger.records import (
    DatasetRecord,
    PromptRecord,
    counts_key,
    dataset_key,
    encode_counts,
    expiry_key,
    group_key,
    permuted,
    prompt_key,
    queue_key,
)
from expbuf.server.store.schema.errors import ConfigError, Conflict, Forbidden, InvalidRequest, NotFound, StaleAttempt
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import make_experience


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def items(name: str, prompt: Claimed, runs: range, reward: float | None = None) -> list[trxp.RawItem]:
    """The experiences of one attempt at a prompt: EID batch name/epoch, task index@attempt."""
    return [
        trxp.from_experience(
            make_experience(
                f"{name}/{prompt.epoch}",
                f"{prompt.index}@{prompt.attempt}",
                run,
                reward=float(run if reward is None else reward),
            )
        )
        for run in runs
    ]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Store:
    with Store(tmp_path / "data", clock=clock, seed=3) as s:
        s.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        yield s
        assert s.verify("t") == []


def ledger(store: Store, name: str = "math") -> DatasetRecord:
    (ds,) = store.claims.datasets("t", name)
    return ds


def counts(ds: DatasetRecord) -> dict[str, int]:
    return {state: ds.total(state) for state in ("claimed", "generated", "trained", "dropped")}


def test_a_dataset_is_created_once_and_refused_by_name(store: Store) -> None:
    ds, created = store.claims.create("t", DatasetRecord("math", size=4, epochs=2, seed=7))
    assert created and (ds.owned, ds.counts, ds.owned_total) == ([4], [{}], 8)  # epoch 1 has not started
    again, created = store.claims.create("t", DatasetRecord("math", size=4, epochs=2, seed=7), exist_ok=True)
    assert not created and again.created == ds.created
    with pytest.raises(Conflict, match="epochs: the dataset has 2, the request 3"):
        store.claims.create("t", DatasetRecord("math", size=4, epochs=3, seed=7), exist_ok=True)
    with pytest.raises(Conflict, match="already has dataset 'math'"):
        store.claims.create("t", DatasetRecord("math", size=4, epochs=2, seed=7))
    for bad, message in [
        (DatasetRecord("9lives", size=1), "must start with a letter"),
        (DatasetRecord("m", size=0), "size is 0"),
        (DatasetRecord("m", size=1, epochs=0), "epochs is 0"),
        (DatasetRecord("m", size=1, on_drop="never"), "on_drop is 'never'"),
        (DatasetRecord("m", size=1, max_attempts=0), "max_attempts is 0"),
        (DatasetRecord("m", size=1, seed=2**64), "seed is"),
    ]:
        with pytest.raises(ConfigError, match=message):
            store.claims.create("t", bad)
    store.create_table(TableConfig.of(name="runs", group_by="run", estimator="none"))
    with pytest.raises(ConfigError, match="group_by = task"):
        store.claims.create("runs", DatasetRecord("m", size=1))
    with pytest.raises(NotFound, match="no dataset 'nope'"):
        store.claims.claim("t", "nope", 1, seconds=10)


def test_epochs_visit_every_index_once_in_order_or_in_a_seeded_permutation(store: Store) -> None:
    store.claims.create("t", DatasetRecord("plain", size=5, epochs=2))
    store.claims.create("t", DatasetRecord("shuffled", size=1000, epochs=2, seed=11))
    plain, _ = store.claims.claim("t", "plain", 10, seconds=60)
    assert [(p.epoch, p.index, p.attempt) for p in plain] == [(e, i, 0) for e in range(2) for i in range(5)]
    shuffled, _ = store.claims.claim("t", "shuffled", 2000, seconds=60)
    first, second = ([p.index for p in shuffled if p.epoch == e] for e in range(2))
    assert sorted(first) == sorted(second) == list(range(1000))
    assert first != list(range(1000)) and first != second
    assert first == [permuted(11, 0, 1000, position) for position in range(1000)]  # fixed by the seed alone


def test_an_epochs_order_never_changes_under_a_running_dataset() -> None:
    """A dataset's cursor is a position in its epoch's order, stored: a faster walk of the order
    must give each position the index it always had."""
    assert [permuted(11, 0, 1000, position) for position in range(8)] == [1, 753, 4, 518, 99, 952, 579, 876]
    assert [permuted(-(2**63), 7, 2**40, p) for p in (0, 1, 2**40 - 1)] == [637875235719, 235243148563, 29585336100]
    assert [permuted(2**63 - 1, 2**20 - 1, 5, position) for position in range(5)] == [2, 4, 0, 1, 3]
    assert [permuted(None, 3, 5, position) for position in range(5)] == [0, 1, 2, 3, 4]


def test_a_prompt_is_generated_when_its_group_completes_and_trained_when_consumed(store: Store) -> None:
    store.claims.create("t", DatasetRecord("math", size=3))
    (prompt,), done = store.claims.claim("t", "math", 1, seconds=60, owner="worker-1")
    assert (prompt.epoch, prompt.index, prompt.attempt, done) == (0, 0, 0, False)
    store.put("t", items("math", prompt, range(1)))
    assert counts(ledger(store)) == {"claimed": 1, "generated": 0, "trained": 0, "dropped": 0}
    store.put("t", items("math", prompt, range(1, 2)))
    assert counts(ledger(store)) == {"claimed": 0, "generated": 1, "trained": 0, "dropped": 0}
    batch = store.sample(TakeSpec("t", num_groups=1))
    assert batch.group_ids == [group_key("math", 0, 0, 0)] * 2
    assert counts(ledger(store)) == {"claimed": 0, "generated": 0, "trained": 1, "dropped": 0}
    page = store.claims.prompts("t", "math")
    assert [(e, i, r.state, r.attempt) for e, i, r in page.prompts] == [(0, 0, "trained", 0)]


def test_a_lease_acked_trains_its_prompt_and_one_given_back_does_not(store: Store) -> None:
    store.claims.create("t", DatasetRecord("math", size=2))
    prompts, _ = store.claims.claim("t", "math", 2, seconds=60)
    for prompt in prompts:
        store.put("t", items("math", prompt, range(2)))
    first = store.sample(TakeSpec("t", num_groups=1, delivery="lease"))
    second = store.sample(TakeSpec("t", num_groups=1, delivery="lease"))
    store.nack(second.lease_id)
    assert counts(ledger(store))["generated"] == 2
    store.ack(first.lease_id)
    assert counts(ledger(store)) == {"claimed": 0, "generated": 1, "trained": 1, "dropped": 0}


def test_a_claim_that_ends_sends_its_prompt_back_first_and_its_old_attempt_is_refused(
    store: Store, clock: Clock
) -> None:
    store.claims.create("t", DatasetRecord("math", size=3))
    (lost,), _ = store.claims.claim("t", "math", 1, seconds=10, owner="crashed")
    store.put("t", items("math", lost, range(1)))  # one of two runs, then the worker dies
    clock.now += 11
    store.tick()
    ds = ledger(store)
    assert counts(ds) == {"claimed": 0, "generated": 0, "trained": 0, "dropped": 0}
    assert (ds.reissued, ds.attempts_dropped) == (1, 1)
    assert store.stats("t")["pending"] == 0  # the incomplete group of the ended attempt was dropped
    with pytest.raises(StaleAttempt, match=r"attempt 0 of prompt math/0/0, whose claim ended"):
        store.put("t", items("math", lost, range(1, 2)))
    (again, fresh), _ = store.claims.claim("t", "math", 2, seconds=10)
    assert (again.epoch, again.index, again.attempt) == (0, 0, 1)  # sent back: out before the new ones
    assert (fresh.index, fresh.attempt) == (1, 0)
    store.put("t", items("math", again, range(2)))
    assert counts(ledger(store))["generated"] == 1
    assert store.sample(TakeSpec("t", num_groups=1)).group_ids == [group_key("math", 0, 0, 1)] * 2


def test_a_group_dropped_as_its_claim_ends_is_counted_under_a_reason(store: Store, clock: Clock) -> None:
    """expbuf_groups_dropped_total's reasons sum to Stats.groups_dropped: a group dropped as its
    prompt's claim ended was counted in groups_dropped under no reason (a helper's audit)."""
    from expbuf.server.rpc.interceptors.store_metrics import StoreCollector

    store.claims.create("t", DatasetRecord("math", size=3))
    (lost,), _ = store.claims.claim("t", "math", 1, seconds=10)
    store.put("t", items("math", lost, range(1)))
    clock.now += 11
    store.tick()
    reasons = {
        sample.labels["reason"]: sample.value
        for family in StoreCollector(store).collect()
        for sample in family.samples
        if sample.name == "expbuf_groups_dropped_total" and sample.labels["table"] == "t"
    }
    assert store.stats("t")["groups_dropped"] == 1 and reasons["claim_ended"] == 1 and sum(reasons.values()) == 1


def test_a_renewal_naming_no_dataset_is_refused_and_ends_no_claim(store: Store, clock: Clock) -> None:
    """RenewClaims naming a dataset the table does not have (a typo, or the default table by an empty
    name) answered that every claim named had ended, and its worker gave up claims still held; a
    release names it NotFound (a helper's audit). A renewal does too, and renews nothing."""
    store.claims.create("t", DatasetRecord("math", size=3))
    (held,), _ = store.claims.claim("t", "math", 1, seconds=10)
    with pytest.raises(NotFound, match="no dataset 'maths'"):
        store.claims.renew("t", "maths", [(held.epoch, held.index, held.attempt)], 60)
    assert store.claims.renew("t", "math", [(held.epoch, held.index, held.attempt)], 60)[1] == []


def test_release_renew_and_another_tokens_claims(store: Store, clock: Clock) -> None:
    store.claims.create("t", DatasetRecord("math", size=3))
    (a, b), _ = store.claims.claim("t", "math", 2, seconds=10, holder="token-a")
    with pytest.raises(Forbidden, match="claimed with another token"):
        store.claims.renew("t", "math", [(a.epoch, a.index, a.attempt)], 60, holder="token-b")
    clock.now += 8
    expires, ended = store.claims.renew("t", "math", [(a.epoch, a.index, a.attempt)], 60, holder="token-a")
    assert expires == clock.now + 60 and ended == []
    clock.now += 5  # b's claim has ended, a's not
    store.tick()
    expires, ended = store.claims.renew(
        "t", "math", [(a.epoch, a.index, a.attempt), (b.epoch, b.index, b.attempt)], 60, holder="token-a"
    )
    assert ended == [(b.epoch, b.index, b.attempt)]
    assert store.claims.release("t", "math", [(a.epoch, a.index, a.attempt)], holder="token-a") == 1
    assert store.claims.release("t", "math", [(a.epoch, a.index, a.attempt)], holder="token-a") == 0
    back, _ = store.claims.claim("t", "math", 3, seconds=10)
    assert [(p.index, p.attempt) for p in back] == [(1, 1), (0, 1), (2, 0)]


def test_a_claim_made_again_under_its_id_answers_what_the_first_handed_out(store: Store, clock: Clock) -> None:
    """A claim whose reply was lost, made again with its id, hands out no more: its prompts would
    be held by no one until their lease ended, filling max_in_flight, each spending an attempt."""
    store.claims.create("t", DatasetRecord("math", size=6, max_in_flight=4))
    first, _ = store.claims.claim("t", "math", 3, seconds=100, claim_id="a", holder="token-a")
    again, _ = store.claims.claim("t", "math", 3, seconds=100, claim_id="a", holder="token-a")
    assert again == first and [p.index for p in first] == [0, 1, 2]
    assert counts(ledger(store))["claimed"] == 3
    other, _ = store.claims.claim("t", "math", 3, seconds=100, claim_id="b", holder="token-a")
    assert [(p.index, p.attempt) for p in other] == [(3, 0)]  # max_in_flight: one more
    with pytest.raises(Forbidden, match="claimed with another token"):
        store.claims.claim("t", "math", 3, seconds=100, claim_id="a", holder="token-b")
    store.claims.release("t", "math", [(p.epoch, p.index, p.attempt) for p in first[:2]], holder="token-a")
    assert store.claims.claim("t", "math", 3, seconds=100, claim_id="a", holder="token-a")[0] == first[2:]
    store.claims.release("t", "math", [(first[2].epoch, first[2].index, first[2].attempt)], holder="token-a")
    anew, _ = store.claims.claim("t", "math", 3, seconds=100, claim_id="a")  # none held: a claim as any
    assert [(p.index, p.attempt) for p in anew] == [(0, 1), (1, 1), (2, 1)]
    assert store.claims.claim("t", "math", 3, seconds=100, claim_id="a")[0] == anew
    assert store.claims.claim("t", "math", 1, seconds=100)[0] == []  # no id: a claim as any, none left
    with pytest.raises(InvalidRequest, match="claim_id is 65 bytes"):
        store.claims.claim("t", "math", 1, seconds=100, claim_id="x" * 65)


def test_a_claims_id_is_kept_across_a_restart_and_forgotten_when_its_lease_ends(tmp_path: Path, clock: Clock) -> None:
    with Store(tmp_path / "data", clock=clock) as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        store.claims.create("t", DatasetRecord("math", size=4))
        store.claims.create("t", DatasetRecord("code", size=4))
        first, _ = store.claims.claim("t", "math", 2, seconds=30, claim_id="kept")
    with Store(tmp_path / "data", clock=clock) as store:  # a server killed before its reply went
        assert store.claims.claim("t", "math", 2, seconds=30, claim_id="kept")[0] == first
        assert [p.index for p in store.claims.claim("t", "code", 1, seconds=30, claim_id="kept")[0]] == [0]
        assert store.verify("t") == []
        table_id, _ = store.catalog.lookup("t")
        kept = layout.table_prefix(table_id) + b"k"
        clock.now += 31
        store.tick()  # the claims and their ids end
        with store.environment.read() as txn, txn.cursor(db=store.catalog.db["ledger"]) as cur:
            assert not (cur.set_range(kept) and bytes(cur.key()).startswith(kept))
        again, _ = store.claims.claim("t", "math", 2, seconds=30, claim_id="kept")
        assert [(p.index, p.attempt) for p in again] == [(0, 1), (1, 1)]
        assert store.verify("t") == []


def test_max_in_flight_bounds_claimed_and_generated_prompts(store: Store) -> None:
    store.claims.create("t", DatasetRecord("math", size=10, max_in_flight=3))
    prompts, _ = store.claims.claim("t", "math", 5, seconds=60)
    assert len(prompts) == 3
    assert store.claims.claim("t", "math", 1, seconds=60) == ([], False)
    store.put("t", items("math", prompts[0], range(2)))  # generated: still in flight
    assert store.claims.claim("t", "math", 1, seconds=60) == ([], False)
    store.sample(TakeSpec("t", num_groups=1))  # trained: room for one
    assert len(store.claims.claim("t", "math", 5, seconds=60)[0]) == 1


def test_a_dataset_is_done_once_every_prompt_of_every_epoch_is_trained_or_dropped(store: Store) -> None:
    store.claims.create("t", DatasetRecord("math", size=2, epochs=2))
    prompts, done = store.claims.claim("t", "math", 10, seconds=60)
    assert len(prompts) == 4 and not done
    for prompt in prompts:
        store.put("t", items("math", prompt, range(2)))
    assert store.claims.claim("t", "math", 1, seconds=60) == ([], False)  # generated, not trained
    store.sample(TakeSpec("t", num_groups=4))
    assert store.claims.claim("t", "math", 1, seconds=60) == ([], True)
    assert ledger(store).done


@pytest.mark.parametrize(("on_drop", "max_attempts"), [("done", 5), ("retry", 5), ("retry", 1)])
def test_a_group_the_table_drops_counts_its_prompt_done_or_sends_it_back(
    tmp_path: Path, on_drop: str, max_attempts: int
) -> None:
    with Store(tmp_path / "data") as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none", drop_zero_variance=True))
        store.claims.create("t", DatasetRecord("math", size=2, on_drop=on_drop, max_attempts=max_attempts))
        (prompt,), _ = store.claims.claim("t", "math", 1, seconds=60)
        store.put("t", items("math", prompt, range(2), reward=1.0))  # all rewards equal: dropped
        ds = ledger(store)
        if on_drop == "retry" and max_attempts > 1:
            assert (counts(ds)["dropped"], ds.reissued) == (0, 1)
            (again,), _ = store.claims.claim("t", "math", 1, seconds=60)
            assert (again.index, again.attempt) == (0, 1)
        else:
            assert (counts(ds)["dropped"], ds.reissued) == (1, 0)
            (nxt,), _ = store.claims.claim("t", "math", 1, seconds=60)
            assert (nxt.index, nxt.attempt) == (1, 0)
        assert store.verify("t") == []


def test_the_ledger_survives_a_restart(tmp_path: Path, clock: Clock) -> None:
    with Store(tmp_path / "data", clock=clock) as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        store.claims.create("t", DatasetRecord("math", size=4, seed=5))
        (first, second), _ = store.claims.claim("t", "math", 2, seconds=10)
        store.put("t", items("math", first, range(2)))
    clock.now += 20
    with Store(tmp_path / "data", clock=clock) as store:
        store.tick()  # the second claim ended while the server was down
        ds = ledger(store)
        assert counts(ds) == {"claimed": 0, "generated": 1, "trained": 0, "dropped": 0}
        (again, *_), _ = store.claims.claim("t", "math", 3, seconds=10)
        assert (again.index, again.attempt) == (second.index, 1)
        assert (ledger(store).cursor_epoch, ledger(store).cursor_position) == (1, 0)  # past the last epoch


def test_a_table_without_datasets_reads_the_ledger_once(store: Store) -> None:
    """Pushes into a table that holds no dataset never look up their groups in the ledger."""
    store.put("t", items("x", Claimed(0, 0, 0, 0.0), range(2)))
    assert store.ledger.holds(store.catalog.state(store.environment.env.begin(), *store.catalog.lookup("t"))) is False


def test_check_finds_a_ledger_that_disagrees_with_its_prompts(tmp_path: Path, clock: Clock) -> None:
    """`expbuf check` (Store.verify) holds a dataset's totals and counts by epoch, its claims'
    expiry index and its queue of prompts sent back against the prompt records, and those
    against the groups."""
    with Store(tmp_path / "data", clock=clock) as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        store.claims.create("t", DatasetRecord("math", size=4))
        (done, held, back), _ = store.claims.claim("t", "math", 3, seconds=10)
        store.put("t", items("math", done, range(2)))  # generated
        store.claims.release("t", "math", [(back.epoch, back.index, back.attempt)])  # pending, in the queue
        assert store.verify("t") == []
        table_id, _ = store.catalog.lookup("t")
        db = store.catalog.db["ledger"]
        with store.environment.env.begin(write=True) as txn:
            txn.delete(expiry_key(table_id, held.expires, "math", 0, held.index), db=db)
            txn.delete(queue_key(table_id, "math", 0), db=db)
            txn.put(
                counts_key(table_id, "math", 0), encode_counts(4, {"claimed": 1, "generated": 1, "trained": 1}), db=db
            )
            txn.put(prompt_key(table_id, "math", 0, 3), PromptRecord("generated", 0).encode(), db=db)
        found = store.verify("t")
    assert found == [
        f"dataset math: prompt 0/{held.index} is claimed, but its claim has no expiry key",
        f"dataset math: prompt 0/{back.index} is pending at attempt 1, but no queue entry names it",
        "dataset math: prompt 0/3 is generated, but the group of attempt 0 is not there",
        "dataset math: its totals count 1 generated prompt(s), but 2 prompt record(s) are generated",
        "dataset math: epoch 0 counts 1 generated prompt(s), but 2 prompt record(s) are generated",
        "dataset math: epoch 0 counts 1 trained prompt(s), but 0 prompt record(s) are trained",
        "dataset math: epoch 0 holds 4 prompt record(s), but its cursor has handed out 3",
    ]


def test_an_event_writes_only_its_epochs_counts_whatever_the_epochs(store: Store) -> None:
    """A claim, a group completing and a consume each rewrite the dataset's record: it holds
    totals, and each epoch's counts are a record of their own, so the most epochs a dataset may
    have (2**20) cost an event no more than one."""
    store.claims.create("t", DatasetRecord("long", size=2, epochs=2**20))
    (prompt,), _ = store.claims.claim("t", "long", 1, seconds=60)
    store.put("t", items("long", prompt, range(2)))
    assert store.sample(TakeSpec("t", num_groups=1)) is not None
    table_id, _ = store.catalog.lookup("t")
    with store.environment.read() as txn:
        assert len(txn.get(dataset_key(table_id, "long"), db=store.catalog.db["ledger"])) < 1024
    ds = ledger(store, "long")
    assert (ds.total("trained"), ds.counts) == (1, [{"trained": 1}])


def ledger_keys(store: Store, kind: bytes) -> int:
    """The table's keys of one kind in the ledger database (ledger_records.py: d, c, p, q, g, x)."""
    table_id, _ = store.catalog.lookup("t")
    prefix = layout.table_prefix(table_id) + kind
    with store.environment.read() as txn, txn.cursor(db=store.catalog.db["ledger"]) as cur:
        found, keys = cur.set_range(prefix), 0
        while found and bytes(cur.key()).startswith(prefix):
            keys, found = keys + 1, cur.next()
    return keys


def test_a_dataset_of_many_epochs_costs_nothing_until_an_epoch_starts(store: Store) -> None:
    """A dataset of 2**20 epochs (the most allowed) is one record at create, and a read of it
    reads the epochs started (through the cursor's), not every epoch: its totals and whether it
    is done come from its record."""
    store.claims.create("t", DatasetRecord("long", size=10, epochs=2**20))
    assert [ledger_keys(store, kind) for kind in (b"d", b"c", b"p")] == [1, 0, 0]
    ds = ledger(store, "long")
    assert (ds.owned, ds.counts, ds.owned_total, ds.overall()["pending"], ds.done) == (
        [10],
        [{}],
        10 * 2**20,
        10 * 2**20,
        False,
    )
    store.claims.claim("t", "long", 11, seconds=60)
    assert [ledger_keys(store, kind) for kind in (b"d", b"c", b"p")] == [1, 2, 11]
    ds = ledger(store, "long")
    assert (ds.owned, ds.counts, ds.total("claimed")) == ([10, 10], [{"claimed": 10}, {"claimed": 1}], 11)
    assert [ds.states(epoch)["pending"] for epoch in (0, 1)] == [0, 9]


def test_claims_that_end_together_end_so_many_a_transaction(store: Store, clock: Clock) -> None:
    """A claim's end costs the writer what its release does: claims that end together (a fleet
    of rollout workers gone at once) end at most MAX_PROMPTS_PER_CALL a transaction, the rest at
    the next upkeep pass, which comes back while the table holds claims."""
    store.claims.create("t", DatasetRecord("math", size=MAX_PROMPTS_PER_CALL + 1))
    for count in (MAX_PROMPTS_PER_CALL, 1):
        store.claims.claim("t", "math", count, seconds=60)
    clock.now += 61
    store.tick()
    ds = ledger(store)
    assert (ds.total("claimed"), ds.reissued) == (1, MAX_PROMPTS_PER_CALL)
    store.tick()
    ds = ledger(store)
    assert (ds.total("claimed"), ds.reissued) == (0, MAX_PROMPTS_PER_CALL + 1)


def test_a_prompt_whose_every_attempt_has_a_group_already_is_dropped(store: Store) -> None:
    """A prompt whose attempts' groups the table held before its dataset existed is handed out
    at the first attempt without one; one without any (max_attempts of them taken) is dropped,
    and the claim hands out the next prompt."""
    for index, attempt in ((0, 0), (1, 0), (1, 1)):
        store.put("t", items("math", Claimed(0, index, attempt, 0.0), range(2)))
    store.claims.create("t", DatasetRecord("math", size=3, max_attempts=2))
    claimed, _ = store.claims.claim("t", "math", 3, seconds=60)
    assert [(c.index, c.attempt) for c in claimed] == [(0, 1), (2, 0)]
    assert counts(ledger(store)) == {"claimed": 2, "generated": 0, "trained": 0, "dropped": 1}


def test_a_failed_run_of_an_attempt_whose_claim_ended_is_refused_as_its_push_would_be(
    store: Store, clock: Clock
) -> None:
    store.claims.create("t", DatasetRecord("math", size=3))
    (lost,), _ = store.claims.claim("t", "math", 1, seconds=10, owner="crashed")
    clock.now += 11
    store.tick()
    (run,) = [item.uid for item in items("math", lost, range(1))]
    with pytest.raises(StaleAttempt, match=r"attempt 0 of prompt math/0/0, whose claim ended"):
        store.fail_runs("t", [run], ["the worker died"])
    assert store.stats("t")["runs_failed"] == 0


def test_a_claim_starts_an_epoch_only_once_every_prompt_two_epochs_before_is_done(store: Store) -> None:
    """Issue 63: a claimant could start epochs it never trains (64 claims of 4,096 prompts of a
    1-prompt dataset of 2**20 epochs started 262,144, and a read of the ledger read them all). The
    cursor starts epoch e only once every prompt of epoch e - 2 is trained or dropped: claims run
    at most two epochs at once, and a claim that meets the bound hands out what it has and waits."""
    store.claims.create("t", DatasetRecord("one", size=1, epochs=2**20, max_attempts=1))
    prompts, done = store.claims.claim("t", "one", 4096, seconds=60)
    assert [p.epoch for p in prompts] == [0, 1] and not done
    for _ in range(63):
        assert store.claims.claim("t", "one", 4096, seconds=60) == ([], False)
    assert len(ledger(store, "one").owned) <= 3  # the epochs a read of the ledger reads
    store.claims.report("t", "one", [(0, 0, 0, [1.0, 0.0])])  # epoch 0 trained: epoch 2 may start
    (third,), _ = store.claims.claim("t", "one", 4096, seconds=60)
    assert third.epoch == 2
    assert store.claims.claim("t", "one", 1, seconds=60) == ([], False)  # epoch 1 is claimed still
    assert store.claims.release("t", "one", [(1, 0, 0)]) == 1  # its attempts spent: dropped, done too
    (fourth,), _ = store.claims.claim("t", "one", 4096, seconds=60)
    assert fourth.epoch == 3


def test_a_claim_that_waits_at_the_epoch_bound_gets_the_next_epoch_once_one_trains(store: Store) -> None:
    """A claim waiting at the bound wakes when the epoch two before it is done, as one waiting for
    a prompt sent back does."""
    store.claims.create("t", DatasetRecord("two", size=2, epochs=4))
    first, _ = store.claims.claim("t", "two", 4, seconds=60)
    assert sorted(p.epoch for p in first) == [0, 0, 1, 1]
    waited: list[list[Claimed]] = []
    waiter = threading.Thread(target=lambda: waited.append(store.claims.claim("t", "two", 4, seconds=60, wait=30)[0]))
    waiter.start()
    for prompt in first:
        if prompt.epoch == 0:
            store.put("t", items("two", prompt, range(2)))
    store.sample(TakeSpec("t", num_groups=2))  # epoch 0 trained
    waiter.join(60)
    assert not waiter.is_alive() and waited and waited[0] and {p.epoch for p in waited[0]} == {2}
