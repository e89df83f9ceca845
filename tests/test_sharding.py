"""Sharding: routing by rendezvous hashing over epochs, and ShardedBufferClient over three
`expbuf serve` processes (groups whole on their shard, exactly-once delivery, a shard
killed with SIGKILL mid-run, a shard added while groups are pending)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from expbuf.client import (
    AsyncBufferClient,
    BufferClient,
    BufferError,
    Claim,
    Experience,
    Prompt,
    PromptPage,
    PushResult,
    trxp,
)
from expbuf.client.schema.experience import EID
from expbuf.client.schema.prompts import MAX_PROMPTS_PER_CALL
from expbuf.client.schema.routing import (
    Epoch,
    ShardMap,
    ShardMapError,
    batch_number,
    group_key,
    owners,
    rendezvous,
    routing_key,
    uid_group_key,
)
from expbuf.client.shards.blocking import (
    AsyncShardedBufferClient,
    LiveResult,
    ShardedBufferClient,
    ShardError,
    allocate,
    dns_targets,
)
from expbuf.client.shards.ledger import bounds, merge_pages, spread
from expbuf.client.shards.plans import Owed
from expbuf.client.shards.poll import POLL_SECONDS, Wait
from expbuf.proto.v1 import buffer_pb2 as pb
from expbuf.proto.v1 import buffer_pb2_grpc as pb_grpc
from expbuf.server.app import ExpbufServer

from conftest import Servers
from helpers import ServerProcess, SlowReplies, make_experience, scrape

NAMES = ("s0", "s1", "s2")


class Shards:
    """Three `expbuf serve` processes, each with its own data directory and shard name."""

    def __init__(self, root: Path, names: tuple[str, ...] = NAMES) -> None:
        self.root = root
        with ThreadPoolExecutor(len(names)) as pool:  # side by side: each start imports torch
            self.procs = dict(zip(names, pool.map(self._start, names), strict=True))

    def _start(self, name: str) -> ServerProcess:
        # Every shard is pushed to tables with an estimator at once, and the tests' deadlines (2 s
        # pushes, 5 s samples) leave no room for torch's load beside them: it loads at the start.
        return ServerProcess(
            str(self.root / name), "--metrics-port", "0", "--shard", name, "--advantage-worker", "at_start"
        )

    def targets(self) -> dict[str, str]:
        return {name: proc.target for name, proc in self.procs.items()}

    def kill(self, name: str) -> None:
        assert self.procs[name].stop(signal.SIGKILL) == -signal.SIGKILL

    def restart(self, name: str) -> str:
        self.procs[name] = self._start(name)
        return self.procs[name].target

    def stop(self) -> None:
        running = [proc.proc for proc in self.procs.values() if proc.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            proc.wait(30)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shards]:
    running = Shards(tmp_path_factory.mktemp("shards"))
    yield running
    running.stop()


def groups(batch: int, tasks: range, runs: range) -> list:
    return [make_experience(batch, task, run) for task in tasks for run in runs]


def settled(client: ShardedBufferClient, table: str) -> LiveResult:
    """Each shard's stats once no group's advantages are still being computed."""
    for _ in range(600):
        per_shard = client.shard_stats(table)
        if not any(stats[table].groups_computing for stats in per_shard.values()):
            return per_shard
        time.sleep(0.05)
    raise AssertionError(f"advantages still computing: {per_shard}")


def wait_for(condition: Callable[[], object], what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds}s for {what}"
        time.sleep(0.05)


def scrape_refusals(shards: Shards, name: str) -> dict[str, float]:
    """A shard's refusals of table 'huge' by reason, from a real /metrics scrape."""
    return {
        dict(labels)["reason"]: value
        for (metric, labels), value in scrape(shards.procs[name].metrics_port).items()
        if metric == "expbuf_refused_total" and dict(labels).get("table") == "huge"
    }


def attempt(prompt: Prompt, runs: range = range(2)) -> list[Experience]:
    """The experiences of one attempt at a prompt (rewards 0, 1, ...)."""
    out = []
    for run in runs:
        exp = make_experience(0, 0, run, reward=float(run))
        exp.eid = prompt.eid(run)
        out.append(exp)
    return out


def drain(client: ShardedBufferClient, table: str, num_groups: int = 3) -> list:
    """Consume every batch there is (a short wait ends the stream)."""
    batches = []
    for batch in client.sample(table, num_groups=num_groups, timeout=1.0, allow_partial=True, delivery="consume"):
        batches.append(batch)
    return batches


# ---- routing ---------------------------------------------------------------------------


def test_rendezvous_moves_only_the_keys_the_new_shard_wins() -> None:
    keys = [f"0/{task}" for task in range(2000)]
    before = {key: rendezvous(key, ["a", "b", "c"]) for key in keys}
    after = {key: rendezvous(key, ["a", "b", "c", "d"]) for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert all(after[key] == "d" for key in moved)
    assert 350 < len(moved) < 650  # about a quarter of the keys move to the fourth shard
    assert set(Counter(before.values())) == {"a", "b", "c"}
    assert list(owners(keys, ["a", "b", "c"])) == [before[key] for key in keys]
    for key in [*keys, "12/eval/3", "x" * 300]:  # the hash is blake2b-64 keyed by the shard's name, ties by name
        scores = {s: hashlib.blake2b(key.encode(), digest_size=8, key=s.encode()).digest() for s in ("a", "b", "c")}
        assert rendezvous(key, "abc") == max(scores, key=lambda s: (int.from_bytes(scores[s], "big"), s))


def test_epochs_route_groups_by_the_batch_they_began_in() -> None:
    grown = ShardMap.of({"a": "h:1", "b": "h:2"}).add_shard("c", "h:3", since_batch=10)
    assert grown.epoch == 1 and grown.shards == ("a", "b", "c")
    old_keys = [f"9/{task}" for task in range(300)]
    assert {grown.owner(key) for key in old_keys} == {"a", "b"}  # pending groups stay where they began
    new_keys = [f"10/{task}" for task in range(300)]
    assert {grown.owner(key) for key in new_keys} == {"a", "b", "c"}
    for key in new_keys:  # a new group moves only when the added shard wins it
        assert grown.owner(key) in ("c", rendezvous(key, ["a", "b"]))
    assert grown.owner("eval/3") == rendezvous("eval/3", ["a", "b"])  # a batch that is not a number: epoch 0
    assert ShardMap.from_json(grown.to_json()) == grown


def test_group_keys_and_batches() -> None:
    eid = make_experience("12/eval", 3, 1, step=2).eid
    assert [group_key(eid, g) for g in ("task", "run", "step")] == ["12/eval/3", "12/eval/3/1", "12/eval/3/2"]
    assert group_key(eid, "none") == eid.uid
    assert [batch_number(k) for k in ("12/eval/3", "7", "x/1", "-3/1", "12abc/1")] == [12, 7, None, None, None]
    with pytest.raises(ShardMapError, match="group_by is 'tasks'"):
        group_key(eid, "tasks")


def test_every_attempt_at_a_prompt_routes_as_the_prompt() -> None:
    """A group key ending in `<digits>@<digits>` (the prompt ledger's task, index@attempt) is
    hashed without its `@attempt`, so every attempt lands on the shard that holds the prompt."""
    grown = ShardMap.of({"a": "h:1", "b": "h:2", "c": "h:3"}).add_shard("d", "h:4", since_batch=10)
    keys = [f"math/{epoch}/{index}" for epoch in range(3) for index in range(200)]
    for key in keys:
        assert routing_key(f"{key}@0") == routing_key(f"{key}@17") == key
        owner = grown.owner(key)
        assert {grown.owner(f"{key}@{attempt}") for attempt in range(8)} == {owner}
        assert owner == rendezvous(key, ["a", "b", "c"])  # a dataset's name is no number: epoch 0
    assert {grown.owner(key) for key in keys} == {"a", "b", "c"}
    assert routing_key("12@3") == "12" and routing_key("12/7@1") == "12/7"
    assert grown.owner("12/7@1") == rendezvous("12/7", ["a", "b", "c", "d"])  # batch 12 is epoch 1's
    # Any other key, '@' or not, is hashed whole, as before.
    for key in (
        "0/17",
        "math/0/12",
        "math/0/12@",
        "math/0/@3",
        "math/0/x@3",
        "math/0/12@x",
        "math/0/1@2@3",
        "math/0/12@3/4",
        "math/0/12@-3",
        "math/0/+1@3",
        "math/0/\u0661@3",
        "math/0/1@\u0662",
        "math/0/ 1@3",
        "math/0/1@2\n",
    ):
        assert routing_key(key) == key, key
        assert grown.owner(key) == rendezvous(key, grown.epoch_of(key).shards)


def test_a_uid_alone_gives_its_group_key() -> None:
    """get routes uids to their owner: the key read from the right of a uid is the eid's own."""
    for eid in (make_experience("12/eval", 3, 1, step=2).eid, make_experience(5, "t", 0).eid):
        for grouping in ("task", "run", "step", "none"):
            assert uid_group_key(eid.uid, grouping) == group_key(eid, grouping)
    assert [uid_group_key(uid, "task") for uid in ("a/b/c", "0/1/x/0/s", "0/1/2/y/s")] == [None, None, None]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ShardMap(()), "at least one epoch"),
        (lambda: ShardMap((Epoch(0, 0, ("a", "a")),), {"a": "h:1"}), "names a shard twice"),
        (lambda: ShardMap((Epoch(0, 0, ("a/b",)),), {"a/b": "h:1"}), "shard name 'a/b'"),
        (lambda: ShardMap((Epoch(0, 0, ("a",)),), {}), "no address for shard"),
        (lambda: ShardMap.of({"a": "h:1"}).add_shard("b", "h:2", 0), "not after epoch 0"),
        (lambda: ShardMap.of({"a": "h:1"}).add_shard("a", "h:2", 5), "already in epoch 0"),
        (lambda: ShardMap.from_json("{}"), "not a shard map"),
    ],
)
def test_bad_shard_maps_are_refused_by_name(make, message: str) -> None:
    with pytest.raises(ShardMapError, match=message):
        make()


def test_allocate_splits_a_batch_by_ready_groups() -> None:
    assert allocate({"a": 30, "b": 10, "c": 0}, 8) == {"a": 6, "b": 2}
    assert allocate({"a": 2, "b": 1}, 8) == {"a": 2, "b": 1}  # less than asked: all there is
    picks = Counter(shard for _ in range(4000) for shard in allocate({"a": 3, "b": 1}, 1))
    assert 2.5 < picks["a"] / picks["b"] < 3.5  # one group: each shard in proportion to what it holds
    for _ in range(200):
        parts = allocate({"a": 5, "b": 7, "c": 11}, 9)
        assert sum(parts.values()) == 9 and parts["a"] <= 5


@pytest.mark.parametrize(
    ("ready", "need"), [({"a": 9, "b": 6, "c": 5}, 2), ({"a": 200, "b": 1}, 1), ({"a": 4, "b": 4, "c": 3, "d": 2}, 7)]
)
def test_allocate_gives_every_ready_group_the_same_chance_whatever_its_shard(ready: dict[str, int], need: int) -> None:
    """Each shard's part is, on average, its share of the batch (need x its ready / all ready), so
    that each ready group is in a batch with the same chance, need / all ready. Leftover seats were
    drawn one at a time without replacement, weighted by the shares' fractions, which gives those
    fractions only where one seat is left over: with 9, 6 and 5 ready and 2 wanted, a group on the
    first shard had a chance of 0.088 and one on the third 0.113, not 0.1 (an audit)."""
    random.seed(64)
    draws = 40_000
    total = Counter[str]()
    for _ in range(draws):
        parts = allocate(ready, need)
        assert sum(parts.values()) == need and all(parts[shard] <= ready[shard] for shard in parts)
        total.update(parts)
    everything = sum(ready.values())
    for shard, count in ready.items():
        assert abs(total[shard] / draws - need * count / everything) < 0.015, (shard, total[shard] / draws)


def test_the_client_never_imports_ray() -> None:
    code = "import sys, expbuf.client, expbuf.client.shards.blocking; sys.exit(int('ray' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- three shards ----------------------------------------------------------------------


def test_groups_land_whole_on_their_shard_and_are_delivered_once(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("mixed", group_size=4)
        experiences = groups(0, range(60), range(4))
        # Mixed pushes: each carries pieces of many groups, and every group is split over two pushes.
        halves = [[e for e in experiences if e.eid.run < 2], [e for e in experiences if e.eid.run >= 2]]
        first = client.push(halves[0][::-1], table="mixed")
        assert len(first.stored) == 120 and not first.completed_groups
        second = client.push(halves[1], table="mixed")
        assert sorted(second.completed_groups) == sorted({e.eid.tid for e in experiences})
        assert client.push(halves[1], table="mixed").duplicates  # a retried push is a duplicate

        owner = {e.eid.uid: client.shard_map.owner(e.eid.tid) for e in experiences}
        per_shard = settled(client, "mixed")
        for name in NAMES:
            held = [uid for uid, shard in owner.items() if shard == name]
            assert per_shard[name]["mixed"].ready == len(held) > 0
            assert per_shard[name]["mixed"].groups_ready * 4 == len(held)  # every group whole
            with BufferClient(shards.procs[name].target) as direct:
                assert {e.eid.uid for e in direct.get(held, table="mixed")} == set(held)
        assert client.stats("mixed")["mixed"].ready == 240

        batches = drain(client, "mixed")
        delivered = [uid for batch in batches for uid in batch.uids]
        assert sorted(delivered) == sorted(owner)  # exactly once
        assert set().union(*(batch.shards for batch in batches)) == set(NAMES)
        for batch in batches:
            assert set(Counter(batch.group_ids).values()) == {4}  # whole groups
            assert {owner[uid] for uid in batch.uids} == set(batch.shards)
            assert sorted(e.eid.uid for e in batch.experiences) == sorted(batch.uids)
        assert client.stats("mixed")["mixed"].consumed == 240


def test_a_columnar_batch_from_several_shards_is_their_columns_in_batch_order(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("columns", group_size=2)
        client.push(groups(0, range(12), range(2)), table="columns")
        settled(client, "columns")
        options = {"num_groups": 12, "delivery": "replay", "max_batches": 1, "timeout": 10}
        (whole,) = client.sample("columns", **options)
        (columnar,) = client.sample("columns", **options, fields=["tokens", "advantages"])
        assert len(columnar.shards) > 1 and sorted(columnar.uids) == sorted(whole.uids)
        by_uid = {exp.eid.uid: exp for exp in whole.experiences}
        for name in ("tokens", "advantages"):
            column = columnar.columns[name]
            assert column.items == list(range(24))
            for uid, got in zip(columnar.uids, column.tensors, strict=True):
                assert torch.equal(got, getattr(by_uid[uid], name)), (name, uid)


def test_the_columns_joined_from_several_shards_come_in_the_order_asked(start_server: Servers, tmp_path: Path) -> None:
    """A field that the first shard's part lacks (its experiences were pushed without it) comes
    where it was asked among the columns of a sampled batch or a read, not after the others."""
    targets, _ = in_process_shards(start_server, tmp_path)
    fields = ["tokens", "teacher_logprobs", "logprobs"]
    with ShardedBufferClient(targets) as client:
        client.create_table("t", group_size=2, estimator="none")
        made = groups(0, range(8), range(2))
        first = next(iter(client.clients))
        for exp in made:
            if client.shard_map.owner(group_key(exp.eid, "task")) != first:
                exp.teacher_logprobs = torch.full((4,), -0.25)
        client.push(made, table="t")
        (batch,) = client.sample("t", num_groups=8, max_batches=1, timeout=10, fields=fields)
        uids = sorted(
            (exp.eid.uid for exp in made),
            key=lambda uid: client.shard_map.owner(str(uid_group_key(uid, "task"))) != first,
        )
        read = client.read_fields(uids, fields, table="t")
    assert batch.shards[0] == first and len(batch.shards) == 2
    assert list(batch.columns) == fields and list(read.columns) == fields
    assert len(batch.columns["teacher_logprobs"].items) == len(read.columns["teacher_logprobs"].items) < 16


def test_fields_read_from_several_shards_come_in_request_order(shards: Shards) -> None:
    """read_fields asks each uid of the shard that owns its group and puts the columns together in
    the order asked, the uids no shard holds in missing_uids; the asyncio client alike."""
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("fields", group_size=2)
        made = groups(0, range(12), range(2))
        client.push(made, table="fields")
        settled(client, "fields")
        uids = [exp.eid.uid for exp in reversed(made)] + ["0/99/0/0/absent"]
        read = client.read_fields(uids, ["tokens", "logprobs"], table="fields", share=1, of=2)
        (batch,) = client.sample("fields", num_groups=12, delivery="replay", max_batches=1, timeout=10)
        assert len(batch.shards) > 1  # the groups lie on several shards
    assert read.uids == uids[:-1] and read.missing_uids == ["0/99/0/0/absent"]
    by_uid = {exp.eid.uid: exp for exp in made}
    for k, uid in enumerate(read.uids):
        exp = by_uid[uid]
        length, prompt = exp.tokens.shape[0], exp.prompt_length
        half = slice(length // 2, length)
        assert torch.equal(read.columns["tokens"].tensors[k], exp.tokens[half]), uid
        assert torch.equal(read.columns["logprobs"].tensors[k], exp.logprobs[max(half.start - prompt, 0) :]), uid
    assert read.group_ids == [f"{uid.split('/')[0]}/{uid.split('/')[1]}" for uid in read.uids]

    async def run() -> list[str]:
        async with AsyncShardedBufferClient(shards.targets()) as aio:
            return (await aio.read_fields(uids, ["tokens"], table="fields")).uids

    assert asyncio.run(run()) == uids[:-1]


def test_a_step_leased_from_several_shards_is_split_over_the_ranks_together(shards: Shards) -> None:
    """read_part of a batch leased from several shards: every run once, whole groups, the loads
    balanced over the groups of every shard (not shard by shard), the same part each time a rank
    asks, and with `equal` as many groups a rank; the asyncio client reads the same parts."""
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("ranks", group_size=2, estimator="none")
        made = [make_experience(0, task, run, response=4 + 9 * task) for task in range(12) for run in range(2)]
        client.push(made, table="ranks")
        settled(client, "ranks")
        (batch,) = client.sample("ranks", num_groups=12, delivery="lease", max_batches=1, timeout=10, fields=["reward"])
        assert len(batch.shards) > 1
        reads = [client.read_part(batch.lease_id, rank, 3, ["tokens"], table="ranks") for rank in range(3)]
        equal = [client.read_part(batch.lease_id, rank, 3, ["tokens"], table="ranks", equal=True) for rank in range(3)]
        again = client.read_part(batch.lease_id, 2, 3, ["tokens"], table="ranks")
        whole = client.get_part(batch.lease_id, 0, 3, table="ranks")

        async def run() -> list[list[str]]:
            async with AsyncShardedBufferClient(shards.targets()) as aio:
                parts = [
                    (await aio.read_part(batch.lease_id, rank, 3, ["tokens"], table="ranks")).uids for rank in range(3)
                ]
                assert [exp.eid.uid for exp in await aio.get_part(batch.lease_id, 1, 3, table="ranks")] == parts[1]
                whole = 0  # each shard's part of the lease, read whole from that shard alone
                for part in batch.lease_id.split(","):
                    shard, _, lease = part.partition("/")
                    async with AsyncBufferClient(shards.targets()[shard]) as one:
                        whole += len(await one.get_part(lease, 0, 1, table="ranks"))
                assert whole == 24
                return parts

        assert asyncio.run(run()) == [read.uids for read in reads]
        with pytest.raises(ValueError, match="balance 'nothing' is not one of"):
            client.read_part(batch.lease_id, 0, 3, ["tokens"], table="ranks", balance="nothing")
        assert batch.ack() == 24
    by_uid = {exp.eid.uid: exp for exp in made}
    assert sorted(uid for read in reads for uid in read.uids) == sorted(by_uid)
    assert again.uids == reads[2].uids
    assert [exp.eid.uid for exp in whole] == reads[0].uids
    assert all(torch.equal(exp.tokens, by_uid[exp.eid.uid].tokens) for exp in whole)
    loads = []
    for read in reads:
        assert all(read.group_ids.count(group) == 2 for group in read.group_ids)  # whole groups
        for k, uid in enumerate(read.uids):
            assert torch.equal(read.columns["tokens"].tensors[k], by_uid[uid].tokens)
        loads.append(sum(by_uid[uid].tokens.numel() for uid in read.uids))
    assert max(loads) <= 1.05 * sum(loads) / 3  # balanced over both shards' groups together
    assert [len(set(read.group_ids)) for read in equal] == [4, 4, 4]


def test_prefix_and_branches_read_from_several_shards_rebuild_each_runs_tokens(shards: Shards) -> None:
    """prefix_of names batch positions: joined from several shards' replies, each names where its
    run's prefix now is, so every run's tokens come back as its prefix then its branch."""
    made = [
        Experience(
            eid=EID(batch=0, task=task, run=run),
            tokens=torch.cat([torch.arange(5) + 100 * task, torch.arange(3 + run)]),
            prompt_length=5,
            reward=float(run),
        )
        for task in range(9)
        for run in range(2)
    ]
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("tree", group_size=2, estimator="none")
        client.push(made, table="tree")
        settled(client, "tree")
        uids = [exp.eid.uid for exp in made]
        read = client.read_fields(uids, ["prefix_tokens", "branch_tokens", "prefix_of"], table="tree")
        (batch,) = client.sample("tree", num_groups=9, delivery="replay", max_batches=1, timeout=10)
        assert len(batch.shards) > 1
    tree = read.prefix_branches()
    by_uid = {exp.eid.uid: exp for exp in made}
    for k, position in enumerate(tree.items):
        assert torch.equal(tree.tokens(k), by_uid[read.uids[position]].tokens)


def test_leases_are_acked_on_the_shard_that_granted_them(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("leased", group_size=2)
        client.push(groups(0, range(12), range(2)), table="leased")
        batches = list(client.sample("leased", num_groups=2, delivery="lease", max_batches=6))
        for batch in batches:
            assert {lease.split("/")[0] for lease in batch.lease_id.split(",")} == set(batch.shards)
        before = time.time()
        assert batches[0].renew(600) >= before + 590 and batches[0].lease_expires >= before + 590
        assert sum(batch.ack() for batch in batches[:5]) == 20  # experiences
        assert client.nack(batches[5].lease_id, table="leased") == 4
        stats = client.stats("leased")["leased"]
        assert (stats.consumed, stats.ready, stats.leased) == (20, 4, 0)
        with pytest.raises(BufferError, match="does not name shards"):
            client.ack("nowhere/abc", table="leased")


def test_a_shard_killed_mid_run_loses_nothing_acknowledged(shards: Shards) -> None:
    client = ShardedBufferClient(shards.targets(), timeout=2.0, retries=2)
    client.create_table("killed", group_size=2)
    acked: set[str] = set()
    failures: list[ShardError] = []
    done = threading.Event()

    def rollout() -> None:
        """Push groups until told to stop; a failed push is retried until it is acknowledged."""
        batch = 0
        while not done.is_set():
            payload = groups(batch, range(6), range(2))
            while True:
                try:
                    client.push(payload, table="killed")
                    acked.update(e.eid.uid for e in payload)
                    break
                except ShardError as exc:
                    failures.append(exc)
                    time.sleep(0.2)
            batch += 1

    pusher = threading.Thread(target=rollout, daemon=True)  # a failing test must not leave it running
    pusher.start()
    wait_for(lambda: len(acked) >= 60, "the first pushes")
    shards.kill("s1")
    wait_for(lambda: failures, "a push to the killed shard to fail")
    # The other shards keep taking pushes and serving a trainer while s1 is down.
    elsewhere = [t for t in range(40) if client.shard_map.owner(f"99999/{t}") != "s1"][:6]
    assert len(client.push(groups(99999, elsewhere, range(2)), table="killed").stored) == 12
    served = list(client.sample("killed", num_groups=1, max_batches=4, timeout=5, delivery="consume"))
    assert set().union(*(batch.shards for batch in served)) <= {"s0", "s2"}
    assert failures[0].code == grpc.StatusCode.UNAVAILABLE and failures[0].shards == ["s1"]
    assert "shard s1 (" in str(failures[0])
    assert isinstance(failures[0].result, PushResult)  # what the other shards stored

    client.set_map(client.shard_map.with_targets({"s1": shards.restart("s1")}))
    before = len(acked)
    wait_for(lambda: len(acked) >= before + 36, "the rollout to go on")  # the failed push went through
    done.set()
    pusher.join(30)
    assert not pusher.is_alive()
    delivered = [uid for batch in (*served, *drain(client, "killed", 4)) for uid in batch.uids]
    assert Counter(delivered).most_common(1)[0][1] == 1
    assert acked <= set(delivered)  # nothing acknowledged is lost, and every group is delivered once
    client.close()


def test_adding_a_shard_pending_groups_finish_where_they_began(shards: Shards) -> None:
    two = {name: shards.procs[name].target for name in ("s0", "s1")}
    added = ServerProcess(str(shards.root / "s3"), "--metrics-port", "0", "--shard", "s3")
    try:
        with ShardedBufferClient(two) as client:
            client.create_table("grow", group_size=4)
            client.push(groups(5, range(40), range(2)), table="grow")  # 40 pending groups of batch 5
            grown = client.shard_map.add_shard("s3", added.target, since_batch=6)
            client.set_map(grown)
            client.create_table("grow", group_size=4, exist_ok=True)  # on the new shard too
            done = client.push(groups(5, range(40), range(2, 4)), table="grow")
            assert len(done.completed_groups) == 40  # the pending groups completed on their old shards
            fresh = client.push(groups(6, range(60), range(4)), table="grow")
            assert len(fresh.completed_groups) == 60
            per_shard = settled(client, "grow")
            moved = sum(grown.owner(f"6/{task}") == "s3" for task in range(60))
            assert per_shard["s3"]["grow"].groups_ready == moved > 0
            assert sum(stats["grow"].groups_ready for stats in per_shard.values()) == 100
            assert sum(stats["grow"].groups_pending for stats in per_shard.values()) == 0
    finally:
        added.stop(signal.SIGTERM)


def test_keyed_values_live_each_on_one_shard_and_stay_there_as_shards_are_added(shards: Shards) -> None:
    two = {name: shards.procs[name].target for name in ("s0", "s1")}
    keys = [f"{i}@field" for i in range(40)]
    values = [b"v%d" % i for i in range(40)]
    with ShardedBufferClient(two) as client:
        client.create_table("kv_sharded")
        assert client.put_values(keys, values, "kv_sharded") == 40
        held = []
        for target in two.values():
            with BufferClient(target) as direct:
                held.append(sum(value is not None for value in direct.get_values(keys, "kv_sharded")))
        assert 0 not in held and sum(held) == 40  # each key on one shard, both used
        client.set_map(client.shard_map.add_shard("s2", shards.procs["s2"].target, since_batch=10**6))
        assert client.get_values([*reversed(keys), "absent"], "kv_sharded") == [*reversed(values), None]

        async def on_aio() -> tuple[list[bytes | None], int]:
            async with AsyncShardedBufferClient(two) as aio:
                return await aio.get_values(keys[:3], "kv_sharded"), await aio.clear_values(keys[:20], "kv_sharded")

        assert asyncio.run(on_aio()) == (values[:3], 20)
        assert client.get_values(keys, "kv_sharded") == [None] * 20 + values[20:]
        assert client.clear_values(keys, "kv_sharded") == 20


def test_failed_runs_go_to_the_shard_of_their_group_and_complete_it_short(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("short_sharded", group_size=4, min_group_size=3, estimator="none")
        client.push(groups(7, range(12), range(3)), table="short_sharded")  # 12 groups, 3 of 4 runs each
        failed = [make_experience(7, task, 3).eid.uid for task in range(12)]
        done = client.fail_runs(failed, "short_sharded", reasons=["tool error"] * 12)
        assert sorted(done.recorded) == sorted(failed)
        assert sorted(done.completed_groups) == sorted(f"7/{task}" for task in range(12))
        per_shard = settled(client, "short_sharded")
        assert sum(1 for stats in per_shard.values() if stats["short_sharded"].groups_ready) >= 2  # spread out
        assert sum(stats["short_sharded"].groups_ready for stats in per_shard.values()) == 12
        with pytest.raises(ValueError, match="not an experience uid"):
            client.fail_runs(["nope"], "short_sharded")

        async def on_aio() -> list[str]:
            async with AsyncShardedBufferClient(shards.targets()) as aio:
                return (await aio.fail_runs([make_experience(8, 0, 3).eid.uid], "short_sharded")).recorded

        assert asyncio.run(on_aio()) == [make_experience(8, 0, 3).eid.uid]


def test_push_to_a_missing_table_or_bad_payload_names_the_problem(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets()) as client:
        with pytest.raises(BufferError, match="table 'nope' does not exist") as missing:
            client.push(groups(0, range(2), range(2)), table="nope")
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(BufferError, match=r"TRXP|magic|header") as bad:
            client.push(b"not a payload")
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(TypeError, match="not one string"):
            ShardedBufferClient("127.0.0.1:1")


def test_a_sample_of_a_table_the_shards_refuse_fails_naming_them(shards: Shards) -> None:
    """A table no shard holds is NOT_FOUND at once, from every shard, as from one server: not
    a wait for the whole timeout ending UNAVAILABLE as if no shard had answered."""
    with (
        ShardedBufferClient(shards.targets()) as client,
        pytest.raises(ShardError, match="table 'absent' does not exist") as blocking,
    ):
        list(client.sample("absent", num_groups=1, timeout=2))

    async def run() -> ShardError:
        async with AsyncShardedBufferClient(shards.targets()) as aio:
            with pytest.raises(ShardError) as awaited:
                async for _ in aio.sample("absent", num_groups=1, timeout=2, allow_partial=True):
                    pass
            return awaited.value

    for error in (blocking.value, asyncio.run(run())):
        assert error.code == grpc.StatusCode.NOT_FOUND
        assert sorted(error.shards) == sorted(NAMES)
        assert all(f"shard {name} (" in str(error) for name in NAMES)


def test_a_sample_leaves_out_a_shard_without_the_table_where_another_holds_it(shards: Shards) -> None:
    """A shard that lacks a table others hold (created there by another client while it was down)
    refuses its probe NOT_FOUND: the sample is served by the shards that hold it, as by shards
    that do not answer, and fails only where none holds the table."""
    first = next(iter(NAMES))
    with BufferClient(shards.targets()[first]) as one:
        one.create_table("on_one", estimator="none", group_by="none")
        one.push(trxp.encode([make_experience(0, 0, 0)]), table="on_one")
    with ShardedBufferClient(shards.targets()) as client:
        (batch,) = client.sample("on_one", num_groups=1, max_batches=1, timeout=10)
        assert batch.uids == [make_experience(0, 0, 0).eid.uid]


def in_process_shards(start_server: Servers, root: Path, **full: object) -> tuple[dict[str, str], ExpbufServer]:
    """Two in-process shards, "free" and "full" (started with the settings `full`), and the second."""
    free, second = start_server(root / "free"), start_server(root / "full", **full)
    return {"free": f"127.0.0.1:{free.port}", "full": f"127.0.0.1:{second.port}"}, second


def test_a_shards_refusal_of_its_part_fails_the_sample_at_once_and_gives_the_other_parts_back(
    start_server: Servers, tmp_path: Path
) -> None:
    """A shard that refuses its part (its table's one stream taken: STREAMS_FULL) fails the sample
    with that refusal, naming it, as one server's would, and does not wait out the sample's
    timeout to send the other shards' parts as a partial batch; those parts go back to their
    buffer, leased, consumed or replayed, ready to be sampled again and not counted as sampled,
    as the caller never had them: a replayed part is not retired by max_times_sampled = 1 (the
    asyncio client alike)."""
    targets, full = in_process_shards(start_server, tmp_path, workers=8, max_table_streams=1)
    with ShardedBufferClient(targets) as client, grpc.insecure_channel(targets["full"]) as channel:
        client.create_table("t", group_size=2, estimator="none", max_times_sampled=1)
        client.push(groups(0, range(8), range(2)), table="t")
        ready = {shard: stats["t"].ready for shard, stats in client.shard_stats("t").items()}
        assert ready["free"] and ready["full"]
        waiting = pb_grpc.ExperienceBufferStub(channel).Sample(
            iter([pb.SampleRequest(table="t", num_groups=100, wait_seconds=60)]), timeout=60
        )
        wait_for(lambda: full.service.table_streams._open.get("t", 0) == 1, "the full shard's one stream")

        async def sample_async(delivery: str) -> None:
            async with AsyncShardedBufferClient(targets) as aio:
                async for _ in aio.sample("t", num_groups=8, timeout=10, delivery=delivery):
                    pass

        for delivery in ("lease", "consume", "replay", "async consume", "async replay"):
            with pytest.raises(ShardError) as refused:
                if delivery.startswith("async "):
                    asyncio.run(sample_async(delivery.removeprefix("async ")))
                else:
                    list(client.sample("t", num_groups=8, timeout=10, delivery=delivery))
            error = refused.value
            assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.reason == "streams_full", error
            assert error.shards == ["full"] and "max_table_streams = 1" in str(error)
            stats = client.shard_stats("t")["free"]["t"]
            assert (stats.ready, stats.leased, stats.consumed, stats.sampled) == (ready["free"], 0, 0, 0), delivery
        waiting.cancel()
        with BufferClient(targets["free"]) as free:
            (again,) = free.sample("t", num_groups=ready["free"] // 2, max_batches=1, timeout=10, delivery="consume")
        assert len(again.uids) == ready["free"] and again.times_sampled == [1] * ready["free"]


def test_an_ack_made_again_after_a_shard_failed_it_ends_only_the_rest(start_server: Servers, tmp_path: Path) -> None:
    """An ack of a batch from two shards that one shard fails (down) is made again once it is back:
    the retry acks that shard's part alone, the other's counted as acked, not refused as a lease
    that shard no longer knows; a nack of a part acked already is refused naming it."""
    targets, second = in_process_shards(start_server, tmp_path)
    with ShardedBufferClient(targets, timeout=5.0, retries=0, wait_for_ready=False) as client:
        client.create_table("t", group_size=2, estimator="none")
        client.push(groups(0, range(8), range(2)), table="t")
        (first,) = client.sample("t", num_groups=8, delivery="lease", max_batches=1, timeout=10)
        assert sorted(first.shards) == sorted(targets)
        on_free = sum(1 for group in first.group_ids if client.shard_map.owner(group) == "free")
        start_server.stop(second)
        with pytest.raises(ShardError) as failed:
            first.ack()
        assert failed.value.shards == ["full"] and failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert failed.value.result == on_free

        def again() -> int | None:
            try:
                return first.ack()
            except ShardError as exc:
                assert exc.shards == ["full"] and exc.code == grpc.StatusCode.UNAVAILABLE, exc
                assert exc.result == on_free
                return None

        assert again() is None  # the shard still down: its part alone fails
        with pytest.raises(ShardError) as nacked:
            client.nack(first.lease_id, table="t")
        assert nacked.value.shards == ["free", "full"] and "was acked already by this client" in str(nacked.value)
        start_server(tmp_path / "full", port=second.port)
        acked: list[int | None] = []
        wait_for(lambda: acked.append(again()) or acked[-1] is not None, "the ack made again")
        assert acked[-1] == len(first.uids)
        stats = client.stats("t")["t"]
        assert (stats.consumed, stats.leased, stats.ready) == (16, 0, 0)


def test_a_renewal_of_a_lease_partly_acked_renews_the_parts_still_leased(start_server: Servers, tmp_path: Path) -> None:
    """A batch from two shards whose ack one shard failed (down) keeps that shard's part leased: a
    renewal once the shard is back renews that part, not refused NOT_FOUND for the part acked
    already, and the ack made again ends it; a renewal of a lease whose parts this client has all
    ended (one acked, one nacked) is refused NOT_FOUND naming them."""
    targets, second = in_process_shards(start_server, tmp_path)
    with ShardedBufferClient(targets, timeout=5.0, retries=0, wait_for_ready=False) as client:
        client.create_table("t", group_size=2, estimator="none")
        client.push(groups(0, range(16), range(2)), table="t")
        batches = [
            batch
            for _ in range(2)
            for batch in client.sample("t", num_groups=8, delivery="lease", lease_seconds=30, max_batches=1, timeout=10)
        ]
        assert all(sorted(batch.shards) == sorted(targets) for batch in batches)
        start_server.stop(second)
        for batch in batches:
            with pytest.raises(ShardError) as failed:
                batch.ack()
            assert failed.value.shards == ["full"] and failed.value.code == grpc.StatusCode.UNAVAILABLE
        start_server(tmp_path / "full", port=second.port)
        first, ended = batches
        before = time.time()
        renewed: list[float] = []

        def renew() -> bool:
            try:
                renewed.append(first.renew(3600))
            except ShardError as exc:
                assert exc.shards == ["full"] and exc.code == grpc.StatusCode.UNAVAILABLE, exc
                return False
            return True

        wait_for(renew, "the renewal once the shard is back")
        assert renewed[-1] >= before + 3600
        assert first.ack() == len(first.uids)
        with pytest.raises(ShardError) as nacked:
            ended.nack()
        assert nacked.value.shards == ["free"] and "was acked already by this client" in str(nacked.value)
        with pytest.raises(ShardError) as refused:
            ended.renew(60)
        assert refused.value.code == grpc.StatusCode.NOT_FOUND and refused.value.shards == ["free", "full"]
        assert "was acked already by this client" in str(refused.value) and "was nacked already" in str(refused.value)


def test_async_client_pushes_samples_and_acks_across_shards(shards: Shards) -> None:
    async def run() -> None:
        async with AsyncShardedBufferClient(shards.targets()) as client:
            await client.create_table("async", group_size=3)
            result = await client.push(groups(0, range(9), range(3)), table="async")
            assert len(result.completed_groups) == 9
            uids = []
            async for batch in client.sample("async", num_groups=3, delivery="lease", max_batches=3):
                assert await batch.renew(600) > time.time() + 590
                assert await batch.ack() == 9
                uids += batch.uids
            assert len(set(uids)) == 27
            assert (await client.stats("async"))["async"].consumed == 27

    asyncio.run(run())


def pushed_through(shards: Shards, kind: str, table: str, pushes: list) -> tuple[list, list[int]]:
    """Each push's outcome through a sharded pusher of window 4, and the order its futures completed in."""
    done: list[int] = []

    def note(index: int) -> Callable[[object], None]:
        return lambda _: done.append(index)

    if kind == "blocking":
        with ShardedBufferClient(shards.targets()) as client, client.pusher(table, window=4) as pusher:
            futures = []
            for index, items in enumerate(pushes):
                futures.append(pusher.push(items))
                futures[-1].add_done_callback(note(index))
                assert pusher.in_flight <= 4
        return [f.exception() or f.result() for f in futures], done

    async def run() -> list:
        async with AsyncShardedBufferClient(shards.targets()) as client:
            async with client.pusher(table, window=4) as pusher:
                futures = []
                for index, items in enumerate(pushes):
                    futures.append(await pusher.push(items))
                    futures[-1].add_done_callback(note(index))
                    assert pusher.in_flight <= 4
            return list(await asyncio.gather(*futures, return_exceptions=True))

    return asyncio.run(run()), done


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_a_sharded_pusher_sends_each_group_to_its_shard_and_answers_in_push_order(shards: Shards, kind: str) -> None:
    table = f"piped-{kind}"
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table(table, group_size=2)
        pushes = [groups(batch, range(3), range(2)) for batch in range(10)]  # three groups a push
        pushes.append(pushes[2])  # the same push again in the window: duplicates
        outcomes, order = pushed_through(shards, kind, table, pushes)
        assert order == list(range(len(pushes)))
        for items, outcome in zip(pushes[:10], outcomes, strict=False):
            assert isinstance(outcome, PushResult), outcome
            assert sorted(outcome.stored) == sorted(e.eid.uid for e in items) and outcome.duplicates == []
            assert sorted(outcome.completed_groups) == sorted({e.eid.tid for e in items})
        assert sorted(outcomes[10].duplicates) == sorted(e.eid.uid for e in pushes[2]) and not outcomes[10].stored
        owners_of = {e.eid.uid: client.shard_map.owner(e.eid.tid) for items in pushes for e in items}
        assert len(set(owners_of.values())) == len(NAMES)
        for name in NAMES:
            held = [uid for uid, shard in owners_of.items() if shard == name]
            with BufferClient(shards.procs[name].target) as direct:
                assert direct.get(held, table=table).missing_uids == []


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_a_refused_push_of_a_sharded_pusher_fails_alone_naming_its_shard_and_uids(shards: Shards, kind: str) -> None:
    table = f"piped-refused-{kind}"
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table(table, group_size=2)
        first = groups(0, range(1), range(2))
        conflict = [make_experience(0, 0, 0, reward=0.0), *groups(0, range(5, 6), range(2))]  # first[0]'s uid
        pushes = [first, groups(0, range(1, 2), range(2)), conflict, groups(0, range(2, 3), range(2)), b"no TRXP"]
        pushes.append(groups(0, range(3, 4), range(2)))
        outcomes, order = pushed_through(shards, kind, table, pushes)
        assert order == list(range(len(pushes)))
        refused = outcomes[2]
        shard = client.shard_map.owner("0/0")
        assert isinstance(refused, ShardError) and refused.code == grpc.StatusCode.ALREADY_EXISTS, refused
        assert refused.shards == [shard] and f"shard {shard} " in refused.details
        assert "push 3 of this pusher" in refused.details
        if client.shard_map.owner("0/5") == shard:  # the part on that shard is refused whole
            assert set(refused.uids) == {e.eid.uid for e in conflict} and refused.result.stored == []
        else:  # the other shard stored its part
            assert refused.uids == (conflict[0].eid.uid,)
            assert sorted(refused.result.stored) == sorted(e.eid.uid for e in conflict[1:])
        unreadable = outcomes[4]
        assert isinstance(unreadable, BufferError) and unreadable.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "push 5 of this pusher" in unreadable.details
        for index in (0, 1, 3, 5):
            stored = outcomes[index]
            assert isinstance(stored, PushResult) and sorted(stored.stored) == sorted(e.eid.uid for e in pushes[index])


@pytest.mark.parametrize("kind", ["blocking", "asyncio"])
def test_an_empty_push_of_a_sharded_pusher_completes_and_holds_up_none_after_it(shards: Shards, kind: str) -> None:
    """A push of nothing (a step whose rollouts all failed) has no part for any shard: it completes
    at once, stored nothing, as one server's pusher's does, and the pushes after it complete too.
    (The waits are bounds for a push that would never complete, not timings.)"""
    table = f"piped-empty-{kind}"
    later = groups(0, range(2), range(2))
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table(table, group_size=2)
        if kind == "blocking":
            pusher = client.pusher(table)
            futures = [pusher.push([]), pusher.push(later)]
            outcomes = [future.result(timeout=30) for future in futures]
            pusher.close()
        else:

            async def run() -> list[PushResult]:
                async with AsyncShardedBufferClient(shards.targets()) as aio:
                    pusher = aio.pusher(table)
                    futures = [await pusher.push([]), await pusher.push(later)]
                    done = [await asyncio.wait_for(future, 30) for future in futures]
                    await pusher.close()
                    return done

            outcomes = asyncio.run(run())
    assert outcomes[0] == PushResult([], [], [])
    assert sorted(outcomes[1].stored) == sorted(e.eid.uid for e in later)


def test_metrics_carry_the_shard_label(shards: Shards) -> None:
    with BufferClient(shards.procs["s2"].target) as direct:
        direct.stats()
    port = shards.procs["s2"].metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert re.search(r'expbuf_groups\{shard="s2",state="ready",table="default"\}', text)
    assert re.search(r'expbuf_rpc_duration_seconds_count\{[^}]*shard="s2"', text)
    # The dashboard's shard variable lists the label's values, and every query selects by it.
    dashboard = json.loads((Path(__file__).parent.parent / "docker" / "grafana" / "expbuf.json").read_text())
    variable = dashboard["templating"]["list"][0]
    assert variable["name"] == "shard" and variable["definition"] == "label_values(expbuf_groups, shard)"
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for expr in exprs:
        for metric in re.findall(r"\bexpbuf_[a-z_]+(\{[^}]*\})?", expr):
            assert 'shard=~"$shard"' in metric, expr
    assert len(exprs) >= 10


def test_dns_discovery_names_shards_by_their_reverse_entries(shards: Shards) -> None:
    port = shards.procs["s0"].port
    targets = dns_targets("localhost", port)
    assert list(targets.values()) == [f"localhost:{port}"]
    with ShardedBufferClient.from_dns("localhost", port) as client:
        assert client.list_tables()
    with pytest.raises(BufferError, match="cannot resolve"):
        dns_targets("no-such-host.invalid", port)
    # A grown set: its epochs come as JSON, each shard at its stable per-pod name.
    grown = ShardMap.of({"expbuf-0": "x:1"}).add_shard("expbuf-1", "x:2", since_batch=3).to_json()
    with ShardedBufferClient.from_dns("expbuf.ns.svc", 50051, shard_map=grown) as client:
        assert client.shard_map.targets == {
            "expbuf-0": "expbuf-0.expbuf.ns.svc:50051",
            "expbuf-1": "expbuf-1.expbuf.ns.svc:50051",
        }
        assert client.shard_map.epoch == 1


def test_trxp_parts_keep_every_item(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets()) as client:
        experiences = groups(0, range(10), range(2))
        parts = client.split(trxp.encode(experiences), "task")
        items = [item.uid for part in parts.values() for item in trxp.parse(part)]
        assert sorted(items) == sorted(e.eid.uid for e in experiences)


def test_groups_retire_as_trained_on_the_shards_that_hold_them(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("retire", group_size=2, estimator="none")
        pushed = groups(0, range(12), range(2))
        client.push(pushed, table="retire")
        held = {client.shard_map.owner(f"0/{task}") for task in range(12)}
        assert len(held) > 1  # the groups are spread over several shards
        assert client.retire([f"0/{task}" for task in range(8)] + ["0/99"], table="retire") == 8
        again = client.push(pushed[:16], table="retire")
        assert sorted(again.duplicates) == sorted(e.eid.uid for e in pushed[:16])  # their tombstones stayed

        async def rest() -> int:
            async with AsyncShardedBufferClient(shards.targets()) as aclient:
                return await aclient.retire([f"0/{task}" for task in range(12)], table="retire")

        assert asyncio.run(rest()) == 4
        per_shard = client.shard_stats("retire")
        assert sum(s["retire"].consumed for s in per_shard.values()) == 24
        assert sum(s["retire"].groups_ready for s in per_shard.values()) == 0


def test_admission_holds_the_staleness_bound_over_all_shards(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("admit", estimator="none", group_by="none", max_staleness=1, batch_size=4)
        home = client.admission_shard("admit")
        assert home == client.admission_shard("admit") and home in NAMES
        first = client.admit("admit", 5)
        assert first.count == 5 and first.table == "admit"
        assert client.admit("admit", 5).count == 3  # (1 + 0 + 1) * 4 over every shard, not per shard
        assert client.admit("admit", 1).count == 0
        assert client.finish_grant(first, accepted=2) == 3
        assert client.admit("admit", 9).count == 3
        assert client.set_trainer_version(1, "admit") == 1
        assert {s["admit"].trainer_version for s in client.shard_stats("admit").values()} == {1}
        assert client.admit("admit", 9).count == 4
        per_shard = client.shard_stats("admit")
        assert per_shard[home]["admit"].admitted == 15
        assert all(per_shard[name]["admit"].admitted == 0 for name in NAMES if name != home)


def test_trainer_version_reaches_every_shard_and_stale_pushes_are_merged(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("stale", estimator="none", group_by="none", max_staleness=1)
        fresh = [make_experience(0, task, 0, version=3) for task in range(6)]
        client.push(fresh, table="stale")
        batches = list(client.sample("stale", num_groups=1, max_batches=1, trainer_version=4, delivery="consume"))
        assert len(batches) == 1
        assert {s["stale"].trainer_version for s in client.shard_stats("stale").values()} == {4}
        old = [make_experience(1, task, 0, version=2) for task in range(6)]
        result = client.push([*old, make_experience(1, 99, 0, version=4)], table="stale")
        assert sorted(result.stale) == sorted(exp.eid.uid for exp in old)
        assert len(result.stored) == 1


def test_async_client_admits_on_one_shard_and_sets_versions_on_all(shards: Shards) -> None:
    async def run() -> None:
        async with AsyncShardedBufferClient(shards.targets()) as client:
            await client.create_table("admit_async", estimator="none", max_staleness=0, batch_size=3)
            grant = await client.admit("admit_async", 5)
            assert grant.count == 3
            assert (await client.admit("admit_async", 1)).count == 0
            assert await client.set_trainer_version(2, "admit_async") == 2
            assert (await client.admit("admit_async", 9)).count == 6
            assert await client.finish_grant(grant, accepted=0) == 3
            stats = await client.shard_stats("admit_async")
            assert {s["admit_async"].trainer_version for s in stats.values()} == {2}
            assert stats[client.admission_shard("admit_async")]["admit_async"].admitted == 9

    asyncio.run(run())


def test_what_a_missing_shard_is_owed_keeps_the_newest_and_tables_first() -> None:
    owed = Owed()
    owed.version("s1", "t", 3)
    owed.create("s1", "t", {"group_size": 2})
    calls = owed.calls("s1")
    assert [call.method for call in calls] == ["create_table", "set_trainer_version"]  # the table before its version
    owed.version("s1", "t", 4)  # a newer version while the older one was on its way
    owed.settle(calls[1], 3)
    assert owed.pending() == {"s1": [("create_table", "t"), ("trainer_version", "t", 4)]}
    owed.settle(calls[0], BufferError(grpc.StatusCode.UNAVAILABLE, "down"))  # still down: still owed
    assert owed.pending()["s1"][0] == ("create_table", "t")
    owed.settle(calls[0], {"name": "t", "group_size": 2})
    assert owed.pending() == {"s1": [("trainer_version", "t", 4)]}
    owed.forget("t")  # dropped: nothing more is owed for it
    assert owed.pending() == {}
    owed.create("s2", "u", {})
    owed.version("s2", "u", 9)
    owed.forget_versions("u")  # an admin's reset: an owed newer version must not undo it
    assert owed.pending() == {"s2": [("create_table", "u")]}


def test_a_dataset_owed_to_a_missing_shard_comes_after_its_table_and_before_versions() -> None:
    owed = Owed()
    owed.version("s1", "t", 3)
    owed.dataset("s1", "t", "math", 8, {"epochs": 2, "shards": ["s0", "s1"], "shard": "s1"})
    owed.create("s1", "t", {"group_size": 2})
    calls = owed.calls("s1")
    assert [call.method for call in calls] == ["create_table", "create_dataset", "set_trainer_version"]
    assert calls[1].args == ("t", "math", 8) and calls[1].kwargs["exist_ok"] and calls[1].kwargs["shard"] == "s1"
    assert owed.pending() == {
        "s1": [("create_table", "t"), ("create_dataset", "t", "math"), ("trainer_version", "t", 3)]
    }
    owed.settle(calls[1], BufferError(grpc.StatusCode.UNAVAILABLE, "down"))
    assert ("create_dataset", "t", "math") in owed.pending()["s1"]
    owed.settle(calls[1], object())  # created
    assert ("create_dataset", "t", "math") not in owed.pending()["s1"]
    owed.dataset("s2", "t", "math", 8, {})
    owed.forget("t")  # its table dropped: nothing more is owed for it
    assert owed.pending() == {}


# ---- the prompt ledger on shards -----------------------------------------------------------


def test_claims_split_over_the_shards_and_max_in_flight_among_them() -> None:
    assert spread(7, ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 2}
    assert spread(1, ["b", "c", "a"]) == {"b": 1}  # one prompt: the shard whose turn it is
    assert bounds(10, ["a", "b", "c"]) == {"a": 4, "b": 3, "c": 3}
    assert bounds(2, ["a", "b", "c"]) == {"a": 1, "b": 1, "c": 1}  # each shard may hand out one
    assert bounds(0, ["a", "b"]) == {"a": 0, "b": 0} and bounds("x", ["a"]) == {"a": "x"}  # refused by the shard


def test_a_waiting_claim_pauses_between_asks_of_shards_that_are_down() -> None:
    """The claim plan alone, each shard call answered here: s0 and s2 are done, s1 is down. The
    done shards are not asked again; the down one is, after pauses that double up to a cap."""
    down = BufferError(grpc.StatusCode.UNAVAILABLE, "down")
    with ShardedBufferClient({"s0": "127.0.0.1:1", "s1": "127.0.0.1:2", "s2": "127.0.0.1:3"}) as client:
        plan = client._claim("t", "math", 2, 60.0, "", 30.0, "")
        steps, outcome = [], None
        for _ in range(14):
            step = plan.send(outcome)
            steps.append(step if isinstance(step, Wait) else [call.shard for call in step])
            outcome = None if isinstance(step, Wait) else [down if c.shard == "s1" else Claim([], True) for c in step]
        assert steps[:2] == [["s0", "s1"], ["s2"]]  # parts of 2 from the shards in turn, then the rest
        assert steps[2::2] == [["s1"]] * 6
        assert [step.seconds for step in steps[3::2]] == [POLL_SECONDS[0] * 2**i for i in range(5)] + [POLL_SECONDS[1]]
        with pytest.raises(ShardError, match="shard s1") as nobody:
            client._run(client._claim("t", "math", 1, 60.0, "", 0.0, ""))  # no shard answers at all: UNAVAILABLE
        assert nobody.value.code == grpc.StatusCode.UNAVAILABLE and set(nobody.value.shards) == set(client.clients)


def test_a_shard_that_did_not_answer_a_claim_is_asked_again_under_its_id() -> None:
    """The claim plan alone: s1's first two claims fail UNAVAILABLE (their replies lost, say), and
    it is asked again under the id of the claim it did not answer, which the shard answers with
    what that claim handed out, rather than claim more; each shard under an id of its own. A
    caller's own claim made again with its `claim_id` asks under the same ids."""
    down = BufferError(grpc.StatusCode.UNAVAILABLE, "down")
    failed = Counter[str]()

    def answer(call: Any) -> Any:
        if call.method != "claim":
            return object()  # the probe of a shard believed down answers
        if call.shard == "s1" and failed["s1"] < 2:
            failed["s1"] += 1
            return down
        return Claim([], True)

    with ShardedBufferClient({"s0": "127.0.0.1:1", "s1": "127.0.0.1:2"}) as client:
        plan, asked, outcome = client._claim("t", "math", 2, 60.0, "", 30.0, ""), defaultdict(list), None
        with pytest.raises(StopIteration):
            for _ in range(30):
                step = plan.send(outcome)
                calls = [] if isinstance(step, Wait) else list(step)
                for call in calls:
                    asked[call.shard] += [call.kwargs["claim_id"]] if call.method == "claim" else []
                outcome = None if isinstance(step, Wait) else [answer(call) for call in calls]
        assert len(asked["s1"]) == 3 and len(set(asked["s1"])) == 1
        assert len(asked["s0"]) == 1 and asked["s0"] != asked["s1"][:1]
        first, again = ({c.shard: c.kwargs["claim_id"] for c in client._claim(
            "t", "math", 2, 60.0, "", 30.0, "mine").send(None)} for _ in range(2))  # fmt: skip
        assert first == again and len(set(first.values())) == 2


def test_merged_pages_of_prompts_miss_and_repeat_none() -> None:
    """Pages of three shards, each of its own prompts, some read but filtered out by state."""
    owned = {
        shard: [(e, i) for e in range(2) for i in range(30) if (3 * e + i) % 3 == n] for n, shard in enumerate(NAMES)
    }
    kept = {pair for pair in (p for part in owned.values() for p in part) if pair[1] % 4 != 1}

    def page(shard: str, after: tuple[int, int] | None, limit: int) -> PromptPage:
        read = [pair for pair in owned[shard] if after is None or pair > after][:limit]
        rows = [Prompt("math", e, i, 0, f"math/{e}", f"{i}@0", 0.0) for e, i in read if (e, i) in kept]
        return PromptPage(rows, read[-1] if read else after, len(read) < limit)

    for limit in (1, 4, 7, 100):
        seen, after, done = [], None, False
        while not done:
            merged = merge_pages([page(shard, after, limit) for shard in NAMES], limit)
            assert len(merged.prompts) <= limit
            seen += [(p.epoch, p.index) for p in merged.prompts]
            after, done = merged.after, merged.done
        assert seen == sorted(kept), limit


def test_a_dataset_a_shard_lacks_is_not_done_and_names_that_shard_missing(shards: Shards) -> None:
    """A dataset made while a shard was down is owed to it by the client that made it, in its
    memory: that client gone, the shard never gets it. datasets() merged the shards that held it
    and said done, with the missing shard's prompts never handed out."""
    targets = shards.targets()
    with ShardedBufferClient(targets, timeout=20) as client:
        client.create_table("lacking", group_size=2, estimator="none")
        for shard in NAMES[:2]:  # what a create with NAMES[2] down left, its owed part forgotten
            with BufferClient(targets[shard], timeout=20) as one:
                one.create_dataset("lacking", "math", 4, shards=list(NAMES), shard=shard)
        for _ in range(2):  # every prompt of the shards that hold it, trained
            with pytest.raises(ShardError, match=f"shard {NAMES[2]} .*has no dataset 'math'") as refused:
                client.claim("lacking", "math", 4)  # the others' prompts in its result
            client.report_prompts({prompt: [1.0, 0.0] for prompt in refused.value.result.prompts})
        assert [part.done for part in client.datasets("lacking")] == [False]
        (info,) = client.datasets("lacking")
        assert not info.done and set(info.missing) == {NAMES[2]} and info.total("trained") > 0, info
        assert "has no dataset 'math'" in info.missing[NAMES[2]]
        client.create_dataset("lacking", "math", 4, exist_ok=True)  # the repair the message names
        (info,) = client.datasets("lacking")
        assert not info.missing and not info.done


def test_a_sharded_claim_out_of_bounds_is_refused_before_any_shard_claims_and_a_page_of_0_is_the_default(
    shards: Shards,
) -> None:
    """A count past MAX_PROMPTS_PER_CALL was spread over the shards, each part within it: 5,000
    claimed, 12,289 claimed 8,192 before a shard refused its part (naming a count never asked
    for); a negative wait claimed; a page of limit 0 (the wire's default) raised IndexError."""
    with ShardedBufferClient(shards.targets(), timeout=20) as client:
        client.create_table("bounds", group_size=2, estimator="none")
        client.create_dataset("bounds", "math", 3 * MAX_PROMPTS_PER_CALL + 3)
        for count in (0, MAX_PROMPTS_PER_CALL + 1, 3 * MAX_PROMPTS_PER_CALL + 1, 2.0):
            with pytest.raises(ValueError, match=f"count is {count!r}; a claim asks for 1 to {MAX_PROMPTS_PER_CALL}"):
                client.claim("bounds", "math", count)  # type: ignore[arg-type]
        for wait in (-1, float("nan"), float("inf"), "1"):
            with pytest.raises(ValueError, match=r"wait is .*; it is a finite number of seconds"):
                client.claim("bounds", "math", 1, wait=wait)  # type: ignore[arg-type]
        assert client.ledger("bounds", "math").total("claimed") == 0
        claimed = client.claim("bounds", "math", 5)
        page = client.list_prompts("bounds", "math", limit=0)
        assert sorted(p.index for p in page.prompts) == sorted(p.index for p in claimed.prompts) and page.done


def test_a_dataset_across_shards_hands_out_each_prompt_once_per_epoch_where_its_groups_land(shards: Shards) -> None:
    with ShardedBufferClient(shards.targets(), timeout=20) as client:
        client.create_table("prompts", group_size=2, estimator="none")
        info = client.create_dataset("prompts", "math", 30, epochs=2, seed=4, max_in_flight=10)
        assert (info.owned, info.max_in_flight, info.shards, info.missing, info.done) == (
            60,
            10,
            list(NAMES),
            {},
            False,
        )
        assert ([c.pending for c in info.counts], info.total("pending")) == ([30], 60)  # epoch 1 has not started
        parts = {}
        for name in NAMES:
            with BufferClient(shards.procs[name].target) as direct:
                parts[name] = direct.ledger("prompts", "math")
        assert {part.shard for part in parts.values()} == set(NAMES)
        assert [len(p.counts) for p in parts.values()] == [1, 1, 1]
        assert sum(p.counts[0].pending for p in parts.values()) == 30
        assert sum(p.total("pending") for p in parts.values()) == 30  # each shard's: its part of the epochs started
        assert sorted(part.max_in_flight for part in parts.values()) == [3, 3, 4]
        assert client.create_dataset("prompts", "math", 30, epochs=2, seed=4, max_in_flight=10, exist_ok=True) == info
        with pytest.raises(ValueError, match="shard and shards are the sharded client's to set"):
            client.create_dataset("prompts", "other", 3, shards=["s0"], shard="s0")

        handed: list[Prompt] = []
        released: Prompt | None = None
        while not (claim := client.claim("prompts", "math", 4, lease_seconds=120, owner="w")).done:
            assert claim.prompts, "a claim that is not done gives prompts: none is in flight between claims"
            handed += claim.prompts
            if released is None:  # one attempt given back half pushed: the prompt comes back with attempt 1
                released = claim.prompts[0]
                client.push(attempt(released, range(1)), table="prompts")
                assert client.release_claims([released]) == 1
            work = [p for p in claim.prompts if p != released]
            assert client.renew_claims(work, 120) == []
            for prompt in work:
                client.push(attempt(prompt), table="prompts")
                owner = client.shard_map.owner(prompt.group)
                with BufferClient(shards.procs[owner].target) as direct:  # the group is on the prompt's shard
                    assert len(direct.get([e.eid.uid for e in attempt(prompt)], table="prompts")) == 2
            if work:
                (batch,) = client.sample("prompts", num_groups=len(work), max_batches=1, timeout=10, delivery="consume")
                assert sorted(batch.groups) == sorted(p.group for p in work)
        assert released is not None
        again = [p for p in handed if (p.epoch, p.index) == (released.epoch, released.index)]
        assert [p.attempt for p in again] == [0, 1]
        assert client.shard_map.owner(again[0].group) == client.shard_map.owner(again[1].group)
        firsts = Counter((p.epoch, p.index) for p in handed if p.attempt == 0)
        assert set(firsts) == {(e, i) for e in (0, 1) for i in range(30)} and set(firsts.values()) == {1}

        ledger = client.ledger("prompts", "math")
        assert ledger.done and [c.trained for c in ledger.counts] == [30, 30]
        assert (ledger.reissued, ledger.attempts_dropped, ledger.total("pending")) == (1, 1, 0)
        assert client.datasets("prompts") == [ledger]
        listed, after = [], None
        while True:
            page = client.list_prompts("prompts", "math", after=after, limit=7)
            listed += page.prompts
            after = page.after
            if page.done:
                break
        assert [(p.epoch, p.index) for p in listed] == sorted(firsts)
        assert {(p.state, p.owner) for p in listed} == {("trained", "w")}
        for name in NAMES:  # each shard holds the prompts it owns, and only those
            with BufferClient(shards.procs[name].target) as direct:
                mine = direct.list_prompts("prompts", "math").prompts
            assert mine and {client.shard_map.owner(p.group) for p in mine} == {name}


def test_a_create_that_outlasts_its_timeout_is_not_owed_and_stores_nothing(shards: Shards) -> None:
    """Each shard counts its part before the write; one whose caller gave up stops and stores nothing."""
    with ShardedBufferClient(shards.targets()) as client:
        client.create_table("huge", group_size=2)
    cancelled = {name: scrape_refusals(shards, name).get("cancelled", 0) for name in NAMES}
    with ShardedBufferClient(shards.targets(), timeout=1.0, retries=0) as client:
        with pytest.raises(ShardError) as slow:  # millions of prompts: seconds to count on each shard
            client.create_dataset("huge", "math", 5_000_000, exist_ok=True)
        assert slow.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and set(slow.value.shards) == set(NAMES)
        assert client.pending == {}  # not owed: it would take as long again
    for name in NAMES:
        wait_for(lambda name=name: scrape_refusals(shards, name).get("cancelled", 0) > cancelled[name], "the stop")
    with ShardedBufferClient(shards.targets()) as client:
        assert client.datasets("huge") == []


def test_async_client_runs_the_ledger_across_shards(shards: Shards) -> None:
    async def run() -> None:
        async with AsyncShardedBufferClient(shards.targets()) as client:
            await client.create_table("aprompts", group_size=2, estimator="none")
            info = await client.create_dataset("aprompts", "math", 9)
            assert (info.owned, info.shards) == (9, list(NAMES))
            claim = await client.claim("aprompts", "math", 5, lease_seconds=60)
            assert len(claim.prompts) == 5 and not claim.done
            assert len({client.shard_map.owner(p.group) for p in claim.prompts}) > 1  # from several shards
            assert await client.renew_claims(claim.prompts, 60) == []
            assert await client.release_claims(claim.prompts[3:]) == 2
            ledger = await client.ledger("aprompts", "math")
            assert (ledger.total("claimed"), ledger.total("pending"), ledger.reissued) == (3, 6, 2)
            assert await client.datasets("aprompts") == [ledger]
            page = await client.list_prompts("aprompts", "math", states=["claimed"])
            assert sorted(p.index for p in page.prompts) == sorted(p.index for p in claim.prompts[:3])
            rest = await client.claim("aprompts", "math", 9, lease_seconds=60)
            assert len(rest.prompts) == 6 and {p.attempt for p in rest.prompts} == {0, 1}
            assert (await client.claim("aprompts", "math", 1, wait=0.5)).prompts == []  # all out: waited, none
            # runs trained outside expbuf: each prompt reported on the shard that holds it
            assert await client.report_prompts({p: [1.0, 0.0] for p in rest.prompts}) == 6
            reported = await client.ledger("aprompts", "math")
            assert (reported.total("trained"), reported.total("claimed")) == (6, 3)

    asyncio.run(run())


def test_an_asyncio_push_cancelled_as_a_shard_holds_its_part_is_made_and_the_pushes_after_it_complete(
    start_server: Servers, tmp_path: Path
) -> None:
    """A caller's asyncio.wait_for cancels a push whose part waits for a shard that reads nothing
    (flow control: its connection held): the part already handed to that shard's pusher was never
    reported back, the push never had an outcome, and as futures complete in order, no push after
    it ever completed, nor flush(). The push is made all the same now, and those after it complete."""
    first = start_server(tmp_path / "first")
    held = SlowReplies(f"127.0.0.1:{start_server(tmp_path / 'second').port}")
    targets = {"first": f"127.0.0.1:{first.port}", "second": held.target}
    with ShardedBufferClient(targets) as setup:
        setup.create_table("t", group_size=1, estimator="none", group_by="none")
        owner = setup.shard_map.owner

    def on(shard: str, count: int, batch: int, response: int = 4) -> list:
        made = (make_experience(batch, task, 0, response=response) for task in range(1000))
        return list(itertools.islice((e for e in made if owner(e.eid.uid) == shard), count))

    async def push_all() -> tuple[int, int]:
        async with (
            AsyncShardedBufferClient(targets, timeout=5.0) as client,
            client.pusher("t", window=4) as pusher,
        ):
            await (await pusher.push(on("first", 1, 0) + on("second", 1, 1)))
            held.hold()  # the second shard reads nothing more
            big = on("second", 3, 2, response=2_000_000) + on("first", 1, 2)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(pusher.push(big), 2.0)
            held.release()
            later = await pusher.push(on("first", 1, 3) + on("second", 1, 4))
            result = await asyncio.wait_for(later, 60)
            await asyncio.wait_for(pusher.flush(), 60)
            return len(result.stored), pusher.in_flight

    out: list[tuple[int, int]] = []
    pushing = threading.Thread(target=lambda: out.append(asyncio.run(push_all())), daemon=True)
    pushing.start()
    pushing.join(180)
    held.release()
    assert out == [(2, 0)], "the pushes after the cancelled one never completed"
    held.close()
