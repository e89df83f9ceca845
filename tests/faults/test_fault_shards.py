"""One of three shards SIGKILLed: every sharded call degrades instead of stopping the trainer.

While the shard is down, a sample with a trainer version is served by the others and sets
the version on them, stats name the missing shard, a get answers from each uid's owner
that is up, and a table created with exist_ok is made on the others; the version and the
table are owed to the missing shard and reach it first thing when it is back. Both the
blocking and the asyncio client run the same plans, so both are driven here.

The prompt ledger too: claims go on with the other shards while one is down, whose prompts
wait for it and come out once it is back, none lost and none handed out twice; a dataset
created with exist_ok meanwhile is owed to it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from expbuf.client import BufferClient, Claim, Prompt, trxp
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient, ShardError

from faultkit import group, servers
from helpers import ServerProcess, make_experience

pytestmark = pytest.mark.faults

NAMES = ("s0", "s1", "s2")
GROUPS = 36


def settle(client: ShardedBufferClient, table: str) -> None:
    """Wait until no shard is still computing a group's advantages."""
    for _ in range(600):
        if not any(stats[table].groups_computing for stats in client.shard_stats(table).values()):
            return
        time.sleep(0.05)
    raise AssertionError("advantages still computing")


def test_a_killed_shard_degrades_every_call_and_is_paid_what_it_missed(tmp_path: Path) -> None:
    with servers() as start:

        def shard(name: str) -> ServerProcess:
            # torch loaded at the start: the first push would load it in three children at once, beside
            # calls of 5 s deadlines
            return start(str(tmp_path / name), "--shard", name, "--advantage-worker", "at_start")

        with ThreadPoolExecutor(len(NAMES)) as pool:  # side by side: each start imports torch
            procs = dict(zip(NAMES, pool.map(shard, NAMES), strict=True))
        client = ShardedBufferClient({n: p.target for n, p in procs.items()}, timeout=5.0, retries=2)
        client.create_table("t", group_size=2)
        items = [item for task in range(GROUPS) for item in group("0", task, 2)]
        client.push(trxp.build(items), table="t")
        client.create_table("t4", group_size=2, estimator="none")
        client.push(trxp.build(items), table="t4")
        settle(client, "t")
        owner = {item.uid: client.shard_map.owner(f"0/{item.meta['eid']['task']}") for item in items}
        assert set(owner.values()) == set(NAMES)

        assert procs["s1"].stop(signal.SIGKILL) == -signal.SIGKILL

        # A trainer that passes its version is fed by the live shards, which take the version.
        served = list(
            client.sample("t", num_groups=2, max_batches=3, trainer_version=7, timeout=10, delivery="consume")
        )
        assert len(served) == 3 and set().union(*(batch.shards for batch in served)) <= {"s0", "s2"}
        per_shard = client.shard_stats("t")
        assert set(per_shard) == {"s0", "s2"} and set(per_shard.missing) == {"s1"}
        assert {stats["t"].trainer_version for stats in per_shard.values()} == {7}
        assert client.pending == {"s1": [("trainer_version", "t", 7)]}

        # Stats: the live shards summed, the missing one named.
        merged = client.stats("t")
        assert set(merged.missing) == {"s1"} and "UNAVAILABLE" in merged.missing["s1"]
        assert merged["t"].ready == sum(stats["t"].ready for stats in per_shard.values())

        # Get: uids on live shards answer from their owner; a uid of the missing shard says so.
        delivered = {uid for batch in served for uid in batch.uids}
        live = [uid for uid, shard in owner.items() if shard != "s1" and uid not in delivered][:6]
        assert [exp.eid.uid for exp in client.get(live, table="t")] == live
        down = next(uid for uid, shard in owner.items() if shard == "s1")
        with pytest.raises(ShardError) as lost:
            client.get([live[0], down], table="t")
        assert lost.value.code == grpc.StatusCode.UNAVAILABLE and lost.value.shards == ["s1"]
        assert [exp.eid.uid for exp in lost.value.result] == [live[0]]

        # A table created with exist_ok: made on the live shards, owed to the missing one.
        config = client.create_table("t2", group_size=2, exist_ok=True)
        assert config.group_size == 2 and set(config.missing) == {"s1"}
        with pytest.raises(ShardError, match="shard s1"):
            client.create_table("t3", group_size=2)  # without exist_ok a missing shard fails it, and is not owed it
        assert client.pending == {"s1": [("create_table", "t2"), ("trainer_version", "t", 7)]}

        # The asyncio client runs the same plans.
        async def degraded() -> None:
            async with AsyncShardedBufferClient(client.shard_map, timeout=5.0, retries=2) as aclient:
                batches = [
                    b
                    async for b in aclient.sample(
                        "t", num_groups=1, max_batches=2, trainer_version=8, delivery="consume"
                    )
                ]
                assert len(batches) == 2 and set().union(*(b.shards for b in batches)) <= {"s0", "s2"}
                assert set((await aclient.stats("t")).missing) == {"s1"}
                assert [e.eid.uid for e in await aclient.get(live[-2:], table="t")] == live[-2:]
                assert set((await aclient.create_table("t2", group_size=2, exist_ok=True)).missing) == {"s1"}
                assert aclient.pending == {"s1": [("create_table", "t2"), ("trainer_version", "t", 8)]}
                delivered.update(uid for batch in batches for uid in batch.uids)

        asyncio.run(degraded())
        served_uids = [uid for batch in served for uid in batch.uids]

        # A table dropped while the shard is down, and made again with exist_ok: the drop is owed to
        # it, before the create. The create met the table the drop missed, with its groups, and was
        # paid so: a run under the name again was handed that shard's old groups and ledger.
        with pytest.raises(ShardError, match="shard s1") as dropped:
            client.drop_table("t4")
        assert dropped.value.shards == ["s1"]
        assert set(client.create_table("t4", group_size=4, estimator="none", exist_ok=True).missing) == {"s1"}
        assert client.pending == {
            "s1": [("drop_table", "t4"), ("create_table", "t2"), ("create_table", "t4"), ("trainer_version", "t", 7)]
        }

        # Back on its directory and its address: the client's next call that reaches it (within the
        # client's reconnect backoff, 2 s at most) pays what it is owed, in order.
        procs["s1"] = start(str(tmp_path / "s1"), "--shard", "s1", "--port", str(procs["s1"].port))
        deadline = time.monotonic() + 30
        while client.stats("t").missing:
            assert time.monotonic() < deadline, "the client did not reach the restarted shard"
            time.sleep(0.2)
        assert client.pending == {}
        client.set_trainer_version(9, "t2")
        with BufferClient(procs["s1"].target) as direct:
            assert {table.name for table in direct.list_tables()} == {"default", "t", "t2", "t4"}
            made_again = direct.create_table("t4", group_size=4, estimator="none", exist_ok=True)  # the same: no change
            assert direct.stats("t4")["t4"].ready == 0 and made_again.group_size == 4
            assert direct.stats("t")["t"].trainer_version == 7
            assert direct.stats("t2")["t2"].trainer_version == 9
        assert not client.stats("t").missing

        # Nothing was lost or delivered twice: the rest, the killed shard's groups too, comes once.
        drained = client.sample("t", num_groups=3, timeout=1.0, allow_partial=True, delivery="consume")
        rest = [uid for batch in drained for uid in batch.uids]
        counts = Counter([*served_uids, *(delivered - set(served_uids)), *rest])
        assert set(counts) == set(owner) and set(counts.values()) == {1}
        client.close()


def test_a_killed_shard_delays_its_prompts_and_loses_none(tmp_path: Path) -> None:
    with servers() as start:
        with ThreadPoolExecutor(len(NAMES)) as pool:
            procs = dict(zip(NAMES, pool.map(lambda n: start(str(tmp_path / n), "--shard", n), NAMES), strict=True))
        client = ShardedBufferClient({n: p.target for n, p in procs.items()}, timeout=5.0, retries=2)
        client.create_table("p", group_size=2, estimator="none")
        client.create_dataset("p", "math", 24, epochs=2, seed=3)
        handed: list[Prompt] = []

        def claim(count: int, wait: float = 0.0) -> Claim:
            claimed = client.claim("p", "math", count, lease_seconds=300, wait=wait)
            handed.extend(claimed.prompts)
            return claimed

        def work(prompts: list[Prompt]) -> None:
            """Generate each prompt's group and train it."""
            for prompt in prompts:
                runs = [make_experience(0, 0, run, reward=float(run)) for run in (0, 1)]
                for run, exp in enumerate(runs):
                    exp.eid = prompt.eid(run)
                client.push(runs, table="p")
            (batch,) = client.sample("p", num_groups=len(prompts), max_batches=1, timeout=10, delivery="consume")
            assert sorted(batch.groups) == sorted(p.group for p in prompts)

        def shard(prompt: Prompt) -> str:
            return client.shard_map.owner(prompt.group)

        work(claim(6).prompts)
        held = claim(3).prompts  # claimed, one from each shard, before the kill: their claims are durable
        assert {shard(p) for p in held} == set(NAMES)
        assert procs["s1"].stop(signal.SIGKILL) == -signal.SIGKILL

        # The others keep handing out their prompts; the killed shard's wait for it.
        while more := claim(5).prompts:
            assert "s1" not in {shard(p) for p in more}
            work(more)
        work([p for p in held if shard(p) != "s1"])
        late = client.claim("p", "math", 2, wait=1.5)
        assert (late.prompts, late.done) == ([], False)
        ledger = client.ledger("p", "math")
        assert set(ledger.missing) == {"s1"} and not ledger.done
        made = client.create_dataset("p", "late", 6, exist_ok=True)  # made on the others, owed to s1
        assert set(made.missing) == {"s1"} and client.pending == {"s1": [("create_dataset", "p", "late")]}

        async def degraded() -> None:
            async with AsyncShardedBufferClient(client.shard_map, timeout=5.0, retries=2) as aclient:
                claimed = await aclient.claim("p", "math", 4)
                assert (claimed.prompts, claimed.done) == ([], False)
                assert set((await aclient.ledger("p", "math")).missing) == {"s1"}

        asyncio.run(degraded())

        # Back on its directory and address: its held claim is still held, and its prompts come out.
        procs["s1"] = start(str(tmp_path / "s1"), "--shard", "s1", "--port", str(procs["s1"].port))
        deadline = time.monotonic() + 30
        while client.ledger("p", "math").missing:  # within the client's reconnect backoff, 2 s at most
            assert time.monotonic() < deadline, "the client did not reach the restarted shard"
            time.sleep(0.2)
        assert client.pending == {}
        with BufferClient(procs["s1"].target) as direct:
            assert direct.ledger("p", "late").shard == "s1"
        assert client.ledger("p", "late").owned == 6
        work([p for p in held if shard(p) == "s1"])
        while not (more := claim(4, wait=2.0)).done:
            assert {shard(p) for p in more.prompts} <= {"s1"}
            if more.prompts:
                work(more.prompts)
        firsts = Counter((p.epoch, p.index) for p in handed)
        assert set(firsts) == {(e, i) for e in range(2) for i in range(24)} and set(firsts.values()) == {1}
        ledger = client.ledger("p", "math")
        assert ledger.done and not ledger.missing and [c.trained for c in ledger.counts] == [24, 24]
        assert (ledger.reissued, ledger.attempts_dropped) == (0, 0)
        client.close()
