"""The shard map a Ray deployment publishes, read from the client's side.

`expbuf.ray.start_shards` (the server's side, with the ray extra) runs a registry actor in a
Ray namespace that holds the buffer's shard map; a client only needs to read it. This reader
is the client's own, so the client imports nothing of the server.
"""

from __future__ import annotations

from .schema.routing import ShardMap


def shard_map(namespace: str, name: str = "expbuf") -> ShardMap:
    """The shard map of a running buffer; ValueError when there is none by that name.

    Needs `ray.init(address="auto")` first (and the ray extra): without it, Ray would start a
    cluster of its own here, empty, and say only that there is no such actor.
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            f"expbuf's shard map of {name!r} in Ray namespace {namespace!r} is read through Ray: call"
            ' ray.init(address="auto") first, to join the cluster that runs the shards'
        )
    registry = ray.get_actor(name, namespace=namespace)
    return ShardMap.from_json(ray.get(registry.get.remote()))
