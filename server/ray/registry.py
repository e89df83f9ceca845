"""The registry of a sharded buffer on Ray: an actor holding its shard map, kept in a file on its
node, and the options its shards were started with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from expbuf.client.schema.routing import ShardMap


def publish(namespace: str, name: str, shard: str, target: str) -> None:
    """A restarted shard's new address, in the registry's shard map; none to tell while start_shards
    starts the buffer (it publishes the addresses its shards answer)."""
    try:
        registry = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    ray.get(registry.set_target.remote(shard, target))


class Registry:
    """The shard map of one sharded buffer, kept in a file on its node so that it survives restarts,
    and the options its shards were started with, which add_shard reuses."""

    def __init__(self, path: str, options: dict[str, Any]) -> None:
        self.path = Path(path)
        self._options = options

    def get(self) -> str:
        return self.path.read_text()

    def options(self) -> dict[str, Any]:
        return self._options

    def add_shard(self, shard: str, target: str, since_batch: int) -> str:
        """Here, not in the caller, so that no shard's new address published meanwhile is lost."""
        grown = ShardMap.from_json(self.get()).add_shard(shard, target, since_batch).to_json()
        write(self.path, grown)
        return grown

    def set_target(self, shard: str, target: str) -> None:
        write(self.path, ShardMap.from_json(self.get()).with_targets({shard: target}).to_json())


def write(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    temporary.replace(path)
