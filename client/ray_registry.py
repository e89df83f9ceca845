"""The shard map a Ray deployment publishes, read from the client's side.

`expbuf.ray.start_shards` (the server's side, with the ray extra) runs a registry actor in a
Ray namespace that holds the buffer's shard map; a client only needs to read it. This reader
is the client's own, so the client imports nothing of the server.
"""

from __future__ import annotations

from .schema.routing import ShardMap


def shard_map(namespace: str, name: str = "expbuf") -> ShardMap:
    """The shard map of a running buffer; ValueError when there is none by that name (needs
    `ray.init()` first, and the ray extra)."""
    import ray

    registry = ray.get_actor(name, namespace=namespace)
    return ShardMap.from_json(ray.get(registry.get.remote()))
