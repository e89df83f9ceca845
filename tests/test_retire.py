"""Retiring groups as trained by their ids (Store.retire, the Retire RPC, every client): a
trainer that trained groups it did not take under a lease (a framework's own queue, verl's
mirror) consumes them as an ack would. Their payloads go and their tombstones stay, so a push
of them again is a duplicate; a prompt whose group it is counts as trained. Real LMDB in a
temporary directory, and a real server on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from expbuf.client import AsyncBufferClient, BufferClient, FailedPreconditionError, PermissionDeniedError, trxp
from expbuf.server.store import Store
from expbuf.server.store.core.table_state.rate_counts import INSERTED, SAMPLED
from expbuf.server.store.ledger.records import DatasetRecord, group_key
from expbuf.server.store.schema.errors import Forbidden, GroupIncomplete
from expbuf.server.store.schema.sample_spec import TakeSpec
from expbuf.server.store.schema.table_config import TableConfig

from conftest import Servers
from helpers import group_items, make_experience


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store(tmp_path / "data", seed=3) as s:
        s.create_table(
            TableConfig.of(
                name="t", group_size=2, estimator="none", samples_per_insert=1.0, samples_per_insert_error=100.0
            )
        )
        yield s
        assert s.verify("t") == []


def test_a_retired_groups_payloads_go_and_a_push_of_it_again_is_a_duplicate(store: Store) -> None:
    first, second = group_items("b", 0, 2), group_items("b", 1, 2)
    store.put("t", first)
    store.put("t", second)
    assert store.retire("t", ["b/0", "no/such", "b/0"]) == 1  # an unknown group is no error
    stats = store.stats("t")
    assert (stats["ready"], stats["consumed"], stats["groups_ready"]) == (2, 2, 1)
    assert store.get_payload("t", [i.uid for i in first])[1] == [i.uid for i in first]  # the payloads went
    again = store.put("t", first)
    assert again.duplicates == [i.uid for i in first] and again.stored == []  # the tombstones stayed
    assert store.retire("t", ["b/0"]) == 0  # retired already: a retry changes nothing
    batch = store.sample(TakeSpec("t", num_groups=2, allow_partial=True, wait_seconds=0))
    assert batch is not None and set(batch.group_ids) == {"b/1"}


def test_retiring_an_unsampled_group_leaves_the_rate_limiter_owed_nothing(store: Store) -> None:
    store.put("t", group_items("b", 0, 2))
    store.put("t", group_items("b", 1, 2))
    store.retire("t", ["b/0"])  # never sampled: out of the inserted count, as a delete is
    leased = store.sample(TakeSpec("t", num_groups=1, delivery="lease", lease_seconds=60, wait_seconds=0))
    assert leased is not None
    store.retire("t", ["b/1"])  # taken, so counted as sampled: it stays, as an ack leaves it
    stats = store.stats("t")
    assert (stats[INSERTED], stats[SAMPLED]) == (2, 2)
    assert store.ack(leased.lease_id) == 0  # the lease holds nothing any more
    assert store.stats("t")["groups_leased"] == 0


def test_an_incomplete_group_is_refused_by_name_and_nothing_is_retired(store: Store) -> None:
    store.put("t", group_items("b", 0, 2))
    store.put("t", group_items("b", 1, 2)[:1])
    with pytest.raises(GroupIncomplete, match=r"group b/1 is pending.*complete"):
        store.retire("t", ["b/0", "b/1"])
    assert store.stats("t")["groups_ready"] == 1 and store.stats("t")["consumed"] == 0


def test_a_group_leased_with_another_token_is_refused(store: Store) -> None:
    store.put("t", group_items("b", 0, 2))
    store.sample(TakeSpec("t", num_groups=1, delivery="lease", lease_seconds=60, wait_seconds=0), owner="a")
    with pytest.raises(Forbidden, match="b/0 is leased with another token"):
        store.retire("t", ["b/0"], owner="b")
    assert store.retire("t", ["b/0"], owner="a") == 1


def test_a_retired_prompt_group_trains_its_prompt(store: Store) -> None:
    store.claims.create("t", DatasetRecord("math", size=2))
    claimed, _ = store.claims.claim("t", "math", 2, seconds=60)
    for prompt in claimed:
        runs = [make_experience(f"math/{prompt.epoch}", f"{prompt.index}@0", run, reward=float(run)) for run in (0, 1)]
        store.put("t", [trxp.from_experience(e) for e in runs])
    assert store.retire("t", [group_key("math", 0, p.index, 0) for p in claimed]) == 2
    (ds,) = store.claims.datasets("t", "math")
    assert ds.total("trained") == 2 and ds.done
    assert store.claims.claim("t", "math", 1, seconds=60) == ([], True)


def test_the_retire_rpc_over_every_client(start_server: Servers) -> None:
    scopes = {
        "admin": frozenset({"push", "sample", "admin"}),
        "trainer": frozenset({"sample"}),
        "worker": frozenset({"push"}),
    }
    server = start_server(tokens=scopes)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="admin") as admin, BufferClient(target, token="trainer") as trainer:
        admin.create_table("t", group_size=2, estimator="none")
        pushed = [make_experience("b", task, run) for task in range(3) for run in range(2)]
        admin.push(pushed, table="t")
        assert trainer.retire(["b/0"], table="t") == 1  # sample scope: what a trainer does
        assert admin.push(pushed[:2], table="t").duplicates == [e.eid.uid for e in pushed[:2]]
        with BufferClient(target, token="worker") as worker, pytest.raises(PermissionDeniedError):
            worker.retire(["b/1"], table="t")
        admin.push([make_experience("b", 9, 0)], table="t")
        with pytest.raises(FailedPreconditionError, match="group b/9 is pending"):
            trainer.retire(["b/1", "b/9"], table="t")

        async def run() -> int:
            async with AsyncBufferClient(target, token="trainer") as aclient:
                return await aclient.retire(["b/1", "b/2"], table="t")

        assert asyncio.run(run()) == 2
        stats = admin.stats("t")["t"]
        assert (stats.consumed, stats.groups_ready, stats.pending) == (6, 0, 1)
