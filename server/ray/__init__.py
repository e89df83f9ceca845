"""expbuf shards as Ray actors (installed as `expbuf.ray`; needs the `ray` extra).

Ray places, restarts and names the shards; expbuf adds only which shard owns a group
(expbuf.client.schema.routing). Each shard is an actor running a plain expbuf server:

- one shard per alive node by default, pinned to its node (hard node affinity) so that a
  restarted actor finds its own LMDB directory under `data_root` on that node's disk;
- restarted by Ray after a crash (`max_restarts`), on the same port, which it keeps in
  its data directory, so that clients reach it at the address they already have;
- found by name: a registry actor called `name` in `namespace` holds the shard map (the
  epochs and each shard's address), and `ShardedBufferClient.from_ray(namespace)` reads it.

Actors are detached: they outlive the driver that started them, until `stop_shards`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from expbuf.client.ray_registry import shard_map
from expbuf.client.schema.routing import ShardMap

_PORT_FILE = "ray-port"
# How long a restarted shard waits for its crashed predecessor to let go of the data directory.
_LOCK_WAIT_SECONDS = 30.0


class ShardActor:
    """One expbuf server inside a Ray actor, its data under `data_root/name` on this node."""

    def __init__(self, name: str, data_root: str, tables: Sequence[dict[str, Any]], metrics_port: int) -> None:
        from expbuf.server.app import ExpbufServer
        from expbuf.server.config import ServerConfig
        from expbuf.server.store.schema.errors import StoreError
        from expbuf.server.store.schema.table_config import TableConfig

        data = Path(data_root) / name
        data.mkdir(parents=True, exist_ok=True)
        port_file = data / _PORT_FILE
        port = int(port_file.read_text()) if port_file.exists() else 0
        config = ServerConfig(
            data=str(data),
            host=ray.util.get_node_ip_address(),
            port=port,
            metrics_port=metrics_port,
            shard=name,
            tables=tuple(TableConfig.from_settings(t) for t in tables),
        )
        deadline = time.monotonic() + _LOCK_WAIT_SECONDS
        while True:
            try:
                self.server = ExpbufServer(config).start()
                break
            except StoreError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        port_file.write_text(str(self.server.port))
        self.address = f"{config.host}:{self.server.port}"

    def target(self) -> str:
        return self.address

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.server.stop()


class Registry:
    """The shard map of one sharded buffer, kept in a file on its node so that it survives restarts."""

    def __init__(self, path: str, initial: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            self.path.write_text(initial)

    def get(self) -> str:
        return self.path.read_text()

    def put(self, shard_map: str) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(shard_map)
        temporary.replace(self.path)


def _alive_nodes() -> list[str]:
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])


def _start(
    name: str,
    node: str,
    namespace: str,
    data_root: str,
    tables: Sequence[dict[str, Any]],
    max_restarts: int,
    num_cpus: float,
    metrics_port: int,
) -> str:
    actor = (
        ray.remote(ShardActor)
        .options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            max_restarts=max_restarts,
            max_task_retries=-1,
            num_cpus=num_cpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        )
        .remote(name, data_root, list(tables), metrics_port)
    )
    return ray.get(actor.target.remote())


def start_shards(
    num_shards: int | None = None,
    *,
    namespace: str,
    name: str = "expbuf",
    data_root: str = "/tmp/expbuf-ray",
    tables: Sequence[dict[str, Any]] = (),
    max_restarts: int = -1,
    num_cpus: float = 1,
    metrics_port: int = 0,
) -> ShardMap:
    """Start `num_shards` shards (default: one per alive node), round-robin over the nodes.

    Shard i is the actor `{name}-{i}`; `tables` (TOML-style dicts) are created on every shard.
    `data_root` must be on each node's persistent disk. `metrics_port` 0 picks a free port
    per shard (-1: none). Calling it again for a running buffer returns its map.
    """
    try:
        return shard_map(namespace, name)
    except ValueError:
        pass
    nodes = _alive_nodes()
    count = num_shards or len(nodes)
    names = [f"{name}-{index}" for index in range(count)]
    targets = {
        shard: _start(
            shard, nodes[index % len(nodes)], namespace, data_root, tables, max_restarts, num_cpus, metrics_port
        )
        for index, shard in enumerate(names)
    }
    initial = ShardMap.of(targets)
    here = ray.get_runtime_context().get_node_id()
    ray.remote(Registry).options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(str(Path(data_root) / f"{name}.shard-map.json"), initial.to_json())
    return shard_map(namespace, name)


def add_shard(
    since_batch: int,
    *,
    namespace: str,
    name: str = "expbuf",
    node: str | None = None,
    data_root: str = "/tmp/expbuf-ray",
    tables: Sequence[dict[str, Any]] = (),
    max_restarts: int = -1,
    num_cpus: float = 1,
    metrics_port: int = 0,
) -> ShardMap:
    """Start one more shard and publish a new epoch routing groups of batches from `since_batch` on.

    Writers adopt it with `client.set_map(expbuf.ray.shard_map(namespace))` before that batch.
    """
    current = shard_map(namespace, name)
    shard = f"{name}-{len(current.shards)}"
    node = node or _alive_nodes()[len(current.shards) % len(_alive_nodes())]
    target = _start(shard, node, namespace, data_root, tables, max_restarts, num_cpus, metrics_port)
    grown = current.add_shard(shard, target, since_batch)
    ray.get(ray.get_actor(name, namespace=namespace).put.remote(grown.to_json()))
    return grown


def stop_shards(namespace: str, name: str = "expbuf") -> None:
    """Stop every shard (each commits and closes its store) and the registry; the data stays."""
    current = shard_map(namespace, name)
    for shard in current.shards:
        actor = ray.get_actor(shard, namespace=namespace)
        ray.get(actor.stop.remote())
        ray.kill(actor, no_restart=True)
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
