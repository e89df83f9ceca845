"""Shards as Ray actors on a local Ray cluster: start, push, sample, a shard's process
killed with SIGKILL and restarted by Ray, nothing acknowledged lost."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from expbuf.client.shards.blocking import ShardedBufferClient, ShardError

from helpers import make_experience, wait_ready


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global ray, expbuf_ray
    ray = pytest.importorskip("ray")
    expbuf_ray = pytest.importorskip("expbuf.ray")


NAMESPACE = "expbuf-test"
# A push to a shard that has just started computes its groups' advantages once the shard's torch
# has loaded (server/advantages/start.py): about 2 s on a quiet machine, past the client's 5 s on
# a busy one. Such a push waits this long for its acknowledgement.
STARTING_SECONDS = 120.0


@pytest.fixture(scope="module")
def cluster(ray_cluster: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shards' data root, on the session's Ray cluster."""
    return tmp_path_factory.mktemp("ray-shards")


def push_until_acknowledged(client: ShardedBufferClient, experiences: list, table: str) -> None:
    """A rollout worker's loop: a push that failed on a restarting shard is pushed again."""
    for _ in range(60):
        try:
            client.push(experiences, table=table)
            return
        except ShardError:
            time.sleep(0.5)
    raise AssertionError("the push was never acknowledged")


def test_shards_on_ray_survive_a_killed_actor(cluster: Path) -> None:
    shard_map = expbuf_ray.start_shards(
        2,
        namespace=NAMESPACE,
        data_root=str(cluster),
        tables=[{"name": "rl", "group_size": 2}],
        num_cpus=0,
        metrics_port=-1,
    )
    assert shard_map.shards == ("expbuf-0", "expbuf-1")
    assert expbuf_ray.start_shards(2, namespace=NAMESPACE, data_root=str(cluster)) == shard_map  # idempotent
    client = ShardedBufferClient.from_ray(NAMESPACE, timeout=5.0)
    acked: set[str] = set()
    first = [make_experience(0, task, run) for task in range(20) for run in range(2)]
    client.push(first, table="rl", timeout=STARTING_SECONDS)  # both shards have just started
    acked |= {e.eid.uid for e in first}
    delivered = []
    for batch in client.sample("rl", num_groups=4, delivery="lease", max_batches=2):
        delivered += batch.uids
        batch.ack()
    assert set(batch.shards) <= set(shard_map.shards)

    actor = ray.get_actor("expbuf-1", namespace=NAMESPACE)
    pid = ray.get(actor.pid.remote())
    os.kill(pid, signal.SIGKILL)
    second = [make_experience(1, task, run) for task in range(20) for run in range(2)]
    push_until_acknowledged(client, second, "rl")  # the shard's groups wait for Ray to restart it
    acked |= {e.eid.uid for e in second}
    assert ray.get(actor.pid.remote()) != pid  # restarted, on its node, at the same address
    assert expbuf_ray.shard_map(NAMESPACE) == shard_map

    # The restarted shard's worker computes the advantages of what it was pushed once torch has
    # loaded, after the push's answer: every acknowledged group ready, then consumed.
    wait_ready(client, "rl", len(acked) - len(delivered))
    for batch in client.sample("rl", num_groups=4, timeout=1.0, allow_partial=True, delivery="consume"):
        delivered += batch.uids
    assert Counter(delivered).most_common(1)[0][1] == 1
    assert set(delivered) == acked  # every acknowledged experience, once
    assert {uid for uid in acked if shard_map.owner(uid.rsplit("/", 3)[0]) == "expbuf-1"}  # the shard held some

    # A third shard in a new epoch: groups of batch 2 on spread over all three.
    options = {"data_root": str(cluster), "tables": [{"name": "rl", "group_size": 2}], "num_cpus": 0}
    grown = expbuf_ray.add_shard(2, namespace=NAMESPACE, metrics_port=-1, **options)
    assert grown.epoch == 1 and grown.shards[-1] == "expbuf-2" == grown.epochs[1].shards[-1]
    assert expbuf_ray.shard_map(NAMESPACE) == grown
    client.set_map(grown)
    third = [make_experience(2, task, run) for task in range(30) for run in range(2)]
    client.push(third, table="rl", timeout=STARTING_SECONDS)  # expbuf-2 has just started
    held = client.shard_stats("rl")["expbuf-2"]["rl"]
    assert held.pushed == 2 * sum(grown.owner(f"2/{task}") == "expbuf-2" for task in range(30)) > 0
    client.close()
    expbuf_ray.stop_shards(NAMESPACE)
    with pytest.raises(ValueError):
        expbuf_ray.shard_map(NAMESPACE)
