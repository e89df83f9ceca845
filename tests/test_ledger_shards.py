"""The prompt ledger on the shards of a sharded table, in the storage engine: each shard holds
the dataset and hands out only the prompts it owns, those whose `name/epoch/index` the
sharded clients' router sends to it, so that over the shards every prompt goes out once per
epoch and its groups meet where it was handed out. Real LMDB in temporary directories."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from expbuf.client import trxp
from expbuf.client.schema.routing import ShardMap
from expbuf.server.store import Store
from expbuf.server.store.ledger import claim_life
from expbuf.server.store.ledger.claimed import Claimed
from expbuf.server.store.ledger.hand_out import STEP_HASHES
from expbuf.server.store.ledger.records import (
    DatasetRecord,
    counts_key,
    dataset_key,
    encode_counts,
    group_key,
    permuted,
)
from expbuf.server.store.ledger.shards import count_part
from expbuf.server.store.schema.errors import Cancelled, ConfigError
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from helpers import make_experience

SHARDS = ["s0", "s1", "s2"]


def sharded(name: str, shard: str, **settings: object) -> DatasetRecord:
    return DatasetRecord(name, shards=list(SHARDS), shard=shard, **settings)  # type: ignore[arg-type]


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[dict[str, Store]]:
    opened = {shard: Store(tmp_path / shard, seed=3) for shard in SHARDS}
    for store in opened.values():
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
    yield opened
    for store in opened.values():
        assert store.verify("t") == []
        store.close()


def test_each_shard_hands_out_its_own_prompts_and_over_the_shards_each_goes_out_once_per_epoch(
    stores: dict[str, Store],
) -> None:
    router = ShardMap.of({shard: f"h:{n}" for n, shard in enumerate(SHARDS)})
    handed: dict[str, list[tuple[int, int]]] = {}
    for shard, store in stores.items():
        ds, created = store.claims.create("t", sharded("math", shard, size=40, epochs=3, seed=11))
        assert created and ds.shard == shard and len(ds.owned) == 1  # the epochs started: the cursor's
        claimed, done = store.claims.claim("t", "math", 1000, seconds=60)
        assert {c.epoch for c in claimed} == {0, 1} and not done  # at most two epochs at once
        assert store.claims.claim("t", "math", 5, seconds=60) == ([], False)  # its part is out, not trained
        store.claims.report("t", "math", [(c.epoch, c.index, c.attempt, [1.0]) for c in claimed if not c.epoch])
        later, done = store.claims.claim("t", "math", 1000, seconds=60)  # epoch 0 trained: epoch 2 starts
        assert {c.epoch for c in later} == {2} and not done
        claimed += later
        handed[shard] = [(c.epoch, c.index) for c in claimed]
        (after,) = store.claims.datasets("t", "math")  # each epoch's part counted as the cursor reached it
        assert len(handed[shard]) == after.owned_total
        for c in claimed:  # the router sends every attempt's group to the shard that handed the prompt out
            assert {router.owner(group_key("math", c.epoch, c.index, a)) for a in range(3)} == {shard}
    everything = Counter(pair for pairs in handed.values() for pair in pairs)
    assert set(everything) == {(e, i) for e in range(3) for i in range(40)} and set(everything.values()) == {1}
    owned = {shard: store.claims.datasets("t", "math")[0].owned for shard, store in stores.items()}
    assert [sum(parts[e] for parts in owned.values()) for e in range(3)] == [40, 40, 40]
    assert len({tuple(parts) for parts in owned.values()}) == 3  # each shard's part of each epoch is its own
    # Each shard walks each epoch's seeded order and hands out its part of it, in that order.
    order = [(e, permuted(11, e, 40, position)) for e in range(3) for position in range(40)]
    assert handed["s1"] == [pair for pair in order if pair in set(handed["s1"])]


def test_a_shard_is_done_once_its_own_prompts_are_trained(stores: dict[str, Store]) -> None:
    store = stores["s2"]
    store.claims.create("t", sharded("math", "s2", size=12, epochs=2))
    claimed, _ = store.claims.claim("t", "math", 100, seconds=60)
    (ds,) = store.claims.datasets("t", "math")
    assert len(claimed) == ds.owned_total < 24 and not ds.done
    for c in claimed:
        runs = [make_experience(f"math/{c.epoch}", f"{c.index}@0", run, reward=float(run)) for run in (0, 1)]
        store.put("t", [trxp.from_experience(run) for run in runs])
    while store.sample(TakeSpec("t", num_groups=1, wait_seconds=0, delivery="consume")) is not None:
        pass
    (info,) = store.claims.datasets("t", "math")
    assert info.done and info.total("trained") == len(claimed)
    assert store.claims.claim("t", "math", 1, seconds=60) == ([], True)


def test_a_shards_part_of_each_epoch_is_kept_beside_its_counts_not_in_the_dataset_record(
    stores: dict[str, Store],
) -> None:
    """Every claim, completed group and consume rewrites the dataset record: it keeps its size
    whatever the epochs, each epoch's part being written where the epoch's counts are as the
    epoch starts, and kept there by every event."""
    store = stores["s1"]
    ds, _ = store.claims.create("t", sharded("long", "s1", size=3, epochs=4000))
    (c,), _ = store.claims.claim("t", "long", 1, seconds=60)
    runs = [make_experience(f"long/{c.epoch}", f"{c.index}@0", run, reward=float(run)) for run in (0, 1)]
    store.put("t", [trxp.from_experience(run) for run in runs])
    assert store.sample(TakeSpec("t", num_groups=1, wait_seconds=0, delivery="consume")) is not None
    table_id, _ = store.catalog.lookup("t")
    with store.environment.read() as txn:
        assert len(txn.get(dataset_key(table_id, "long"), db=store.catalog.db["ledger"])) < 1024
    (again,) = store.claims.datasets("t", "long")
    assert again.owned[:1] == ds.owned and again.owned_total == sum(again.owned) < 3 * 4000
    assert again.states(c.epoch) == {
        "pending": ds.owned[c.epoch] - 1, "claimed": 0, "generated": 0, "trained": 1, "dropped": 0
    }  # fmt: skip


def test_a_dataset_on_a_shard_is_created_once_whatever_order_its_shards_come_in(stores: dict[str, Store]) -> None:
    store = stores["s0"]
    ds, created = store.claims.create("t", sharded("math", "s0", size=9))
    again, created_again = store.claims.create(
        "t", DatasetRecord("math", size=9, shards=["s2", "s0", "s1"], shard="s0"), exist_ok=True
    )
    assert created and not created_again and again.owned == ds.owned and again.shards == SHARDS


def test_sharded_settings_out_of_range_are_refused_by_name(stores: dict[str, Store]) -> None:
    store = stores["s0"]
    for bad, message in [
        (DatasetRecord("m", size=4, shards=["s0", "s1"], shard="s9"), "shard is 's9', not one of its shards"),
        (DatasetRecord("m", size=4, shard="s0"), "shard is 's0', not one of its shards"),
        (DatasetRecord("m", size=4, shards=["s0", "s1"]), "shard is '', not one of its shards"),
        (DatasetRecord("m", size=4, shards=["s0", "s0"], shard="s0"), "names shard 's0' twice"),
        (DatasetRecord("m", size=4, shards=["s0", "a/b"], shard="s0"), "shard name 'a/b' must be"),
        (DatasetRecord("m", size=4, shards=[f"s{n}" for n in range(1025)], shard="s0"), "1025 shards; at most 1024"),
    ]:
        with pytest.raises(ConfigError, match=message):
            store.claims.create("t", bad)
    assert store.claims.datasets("t") == []


def test_a_create_whose_caller_gave_up_while_counting_stores_nothing(stores: dict[str, Store]) -> None:
    store = stores["s1"]
    with pytest.raises(Cancelled, match="dataset 'big'"):
        store.claims.create("t", sharded("big", "s1", size=10**9), stop=lambda: True)
    assert store.claims.datasets("t") == []


def test_a_claim_on_a_shard_of_many_shards_lets_the_writer_go_as_it_steps(tmp_path: Path) -> None:
    """On a shard's part of a dataset over many shards the cursor hashes the key of each prompt
    it steps over once per shard (1,024 shards: about 1 s of the writer for each prompt the
    shard owns): a claim spends at most STEP_HASHES of them in one transaction and goes on in
    the next, so that the writes of every other request come in between, and still hands out
    every prompt the shard owns, in its epoch's order."""
    shards = [f"s{n}" for n in range(256)]
    with Store(tmp_path / "s7", seed=3) as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        ds, _ = store.claims.create("t", DatasetRecord("wide", size=1000, seed=5, shards=shards, shard="s7"))
        assert ds.owned_total > 0
        before = store.environment.env.info()["last_txnid"]
        claimed, done = store.claims.claim("t", "wide", 1000, seconds=60)
        commits = store.environment.env.info()["last_txnid"] - before
        assert (len(claimed), done) == (ds.owned_total, False)
        assert commits >= 1000 * len(shards) // STEP_HASHES  # each transaction stepped over at most its share
        order = [permuted(5, 0, 1000, position) for position in range(1000)]
        assert [c.index for c in claimed] == [index for index in order if index in {c.index for c in claimed}]
        assert store.verify("t") == []


def test_a_claim_whose_later_step_is_refused_hands_out_what_its_earlier_steps_claimed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim goes on in a transaction of its own where its cursor reaches an epoch whose part is not
    counted yet: one refused there (a full map that cannot grow) answers with the prompts its earlier
    transactions claimed, which are durable and held for the caller; it raised, and they stayed
    claimed by a caller that never learned which they were, until their claims ended."""
    steps: list[object] = []
    original = claim_life.ClaimRules.claim

    def claim(self: claim_life.ClaimRules, *args: object, **kwargs: object) -> object:
        steps.append(original(self, *args, **kwargs))
        if len(steps) == 2:  # the claim's second transaction meets a full map
            raise lmdb.MapFullError("the map is full")
        return steps[-1]

    monkeypatch.setattr(claim_life.ClaimRules, "claim", claim)
    size = 8 << 20  # max_map_size: the map cannot grow, the batch is refused (StorageFull)
    with Store(tmp_path / "s0", map_size=size, max_map_size=size, seed=1) as store:
        store.create_table(TableConfig.of(name="t", group_size=2, estimator="none"))
        store.claims.create("t", sharded("math", "s0", size=12, epochs=3, seed=7))
        got, done = store.claims.claim("t", "math", 12, seconds=600, owner="worker-1")
        held = [(epoch, index) for epoch, index, _ in store.claims.prompts("t", "math", states=["claimed"]).prompts]
        assert len(steps) == 2 and got and not done
        assert sorted((c.epoch, c.index) for c in got) == sorted(held)


def ledger_entries(store: Store) -> int:
    """The records of the ledger's database, every table's."""
    with store.environment.read() as txn:
        return int(txn.stat(store.catalog.db["ledger"])["entries"])


def test_a_shards_part_of_a_dataset_of_many_epochs_costs_nothing_until_an_epoch_starts(
    stores: dict[str, Store],
) -> None:
    """A shard's part of a dataset of 2**20 epochs (the most allowed) is one dataset record and
    the counts of epoch 0 at create, where it was a count and a record for every epoch, in the
    writer; each later epoch's part is counted, and written, when a claim's cursor reaches it."""
    store = stores["s1"]
    before = ledger_entries(store)
    ds, _ = store.claims.create("t", sharded("long", "s1", size=10, epochs=2**20))
    assert ledger_entries(store) - before == 2
    assert (len(ds.owned), ds.owned_total == ds.owned[0], ds.done) == (1, True, False)
    claimed, _ = store.claims.claim("t", "long", 100, seconds=60)
    (info,) = store.claims.datasets("t", "long")
    started = info.cursor_epoch + 1
    # claims run at most two epochs at once: the parts of epochs 0 and 1, and the next one's counted
    assert len(claimed) == info.owned[0] + info.owned[1] and len(info.owned) == len(info.counts) == started == 3
    assert sum(info.states(epoch)["claimed"] for epoch in range(started)) == info.total("claimed") == len(claimed)
    assert info.owned_total == sum(info.owned)  # the prompts of the epochs counted
    # one counts record an epoch started, one record per prompt claimed and its group's entry and expiry key, and
    # the statistics of each index claimed (its part of the 10, in every epoch)
    indexes = len({c.index for c in claimed})
    assert ledger_entries(store) - before == 1 + started + 3 * len(claimed) + indexes


def test_a_shards_part_of_an_epoch_larger_than_a_transactions_share_is_counted_before_it_starts(
    stores: dict[str, Store],
) -> None:
    """An epoch whose part takes more hashes to count than a transaction may spend (STEP_HASHES)
    is counted outside the writer before the claim's cursor enters it: every shard hands out its
    part of each epoch, once, and the parts of each epoch add up to it."""
    size = STEP_HASHES // len(SHARDS) + 10
    handed: Counter[tuple[int, int]] = Counter()
    for shard, store in stores.items():
        store.claims.create("t", sharded("big", shard, size=size, epochs=2, seed=3))
        for _ in range(2 * size):
            claimed, _ = store.claims.claim("t", "big", 4096, seconds=600)
            if not claimed:
                break
            handed.update((c.epoch, c.index) for c in claimed)
    assert set(handed) == {(e, i) for e in range(2) for i in range(size)} and set(handed.values()) == {1}
    parts = [store.claims.datasets("t", "big")[0] for store in stores.values()]
    assert [sum(p.owned[e] for p in parts) for e in range(2)] == [size, size]
    assert all(p.cursor_epoch == 2 for p in parts)


def test_a_shards_part_counted_at_create_by_an_earlier_release_reads_checks_and_hands_out(
    stores: dict[str, Store],
) -> None:
    """A data directory from the release that counted a shard's part of every epoch at create (a
    counts record for each epoch, a dataset record without `counted`) reads as counted through
    its last epoch: it checks clean, hands out its part of every epoch once, and is done once
    those are trained."""
    store = stores["s0"]
    ds, _ = store.claims.create("t", sharded("old", "s0", size=6, epochs=3))
    table_id, _ = store.catalog.lookup("t")
    db = store.catalog.db["ledger"]
    parts = [count_part(ds, epoch) for epoch in range(3)]

    def as_written_before(txn: lmdb.Transaction[bytes]) -> None:
        for epoch, owned in enumerate(parts):
            txn.put(counts_key(table_id, "old", epoch), encode_counts(owned, {}), db=db)
        stored = json.loads(ds.encode())
        del stored["counted"]
        stored["owned_total"] = sum(parts)
        txn.put(dataset_key(table_id, "old"), json.dumps(stored).encode(), db=db)

    store.environment.submit(as_written_before)
    (old,) = store.claims.datasets("t", "old")
    assert (old.counted, old.owned_total, store.verify("t")) == (3, sum(parts), [])
    claimed: list[Claimed] = []
    while more := store.claims.claim("t", "old", 100, seconds=60)[0]:  # trained as claimed: epoch after epoch
        claimed += more
        for c in more:
            runs = [make_experience(f"old/{c.epoch}", f"{c.index}@0", run, reward=float(run)) for run in (0, 1)]
            store.put("t", [trxp.from_experience(run) for run in runs])
        while store.sample(TakeSpec("t", num_groups=1, wait_seconds=0, delivery="consume")) is not None:
            pass
    assert len(claimed) == sum(parts) and len({(c.epoch, c.index) for c in claimed}) == sum(parts)
    (old,) = store.claims.datasets("t", "old")
    assert old.done and old.owned == parts
