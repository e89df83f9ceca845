"""The shard map a Ray deployment publishes, read from the client's side.

`expbuf.ray.start_shards` (the server's side, with the ray extra) runs a registry actor in a
Ray namespace that holds the buffer's shard map; a client only needs to read it. This reader
is the client's own, so the client imports nothing of the server.
"""

from __future__ import annotations

from .schema.routing import ShardMap


class NotARegistry(ValueError):
    """An actor of the buffer's name that is no buffer's registry (a shard, `{name}-{i}`, of another)."""


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
    if not hasattr(registry, "get"):  # a shard's handle: its methods are others
        raise NotARegistry(
            f"the actor {name!r} of Ray namespace {namespace!r} is not an expbuf buffer's registry (a shard of"
            f" buffer {name.rpartition('-')[0]!r}?): shards are named after their buffer, {{name}}-{{i}}; name the"
            " buffer as start_shards was given it, and give a new buffer a name no shard has"
        )
    return ShardMap.from_json(ray.get(registry.get.remote()))
