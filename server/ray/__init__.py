"""expbuf shards as Ray actors (installed as `expbuf.ray`; needs the `ray` extra).

Ray places, restarts and names the shards; expbuf adds only which shard owns a group
(expbuf.client.schema.routing). Each shard is an actor running a plain expbuf server:

- one shard per alive node by default, pinned to its node (hard node affinity) so that a
  restarted actor finds its own LMDB directory under `data_root` on that node's disk;
- restarted by Ray after a crash (`max_restarts`), on the same port, which it keeps in
  its data directory, so that clients reach it at the address they already have; a restart
  waits for a process still holding its data directory, and serves on a fresh port, which it
  publishes in the shard map, when its own stays taken;
- found by name: a registry actor called `name` in `namespace` holds the shard map (the
  epochs and each shard's address), and `ShardedBufferClient.from_ray(namespace)` reads it;
- owned by one buffer: a shard's data directory records the namespace and name of the buffer
  that made it, and a buffer of another namespace is refused it rather than handed its data.

Actors are detached: they outlive the driver that started them, until `stop_shards`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from expbuf.client.ray_registry import shard_map
from expbuf.client.schema.routing import ShardMap

if TYPE_CHECKING:
    from expbuf.server.app import ExpbufServer
    from expbuf.server.config import ServerConfig

log = logging.getLogger("expbuf")

DEFAULT_DATA_ROOT = "/tmp/expbuf-ray"
_PORT_FILE = "ray-port"
# The buffer a shard's data directory belongs to: {"namespace": ..., "name": ...}.
_OWNER_FILE = "ray-buffer"
# The file of a data directory that its server (and a reader such as `expbuf check`) holds a flock on
# (server/store/disk/environment/directory.py).
_LOCKED_FILE = "data.mdb"
# How long a restarted shard waits for a process still holding its data directory: its crashed
# predecessor going away, an `expbuf check` reading it. A shard's first start does not wait.
_LOCK_WAIT_SECONDS = 120.0
# How long a shard waits for its saved port, taken by another socket, before it serves on a fresh one.
_PORT_WAIT_SECONDS = 5.0
# How long stop_shards waits for a shard to commit and close its store, and for Ray to release a
# killed actor's name (so that the buffer can be started again at once).
_STOP_SECONDS = 60.0


def _owner(namespace: str, name: str) -> str:
    """The record of a buffer in the data it owns: a buffer is its name in its Ray namespace."""
    return json.dumps({"namespace": namespace, "name": name})


def data_root_of(namespace: str, data_root: str | None = None) -> Path:
    """A buffer's data root: `data_root`, or one of its namespace's own under /tmp/expbuf-ray, so that
    jobs in different namespaces never share data by default."""
    return Path(data_root) if data_root else Path(DEFAULT_DATA_ROOT) / namespace


class ShardActor:
    """One expbuf server inside a Ray actor, its data under `data_root/shard` on this node."""

    def __init__(
        self, shard: str, namespace: str, name: str, data_root: str, tables: Sequence[dict[str, Any]], metrics_port: int
    ) -> None:
        from expbuf.server.app import StartupError
        from expbuf.server.config import ServerConfig
        from expbuf.server.store.schema.table_config import TableConfig

        data = Path(data_root) / shard
        data.mkdir(parents=True, exist_ok=True)
        owner = _owner(namespace, name)
        refusal = _owner_refusal(data / _OWNER_FILE, owner)
        if refusal:
            raise StartupError(f"shard {shard}: data directory {refusal}")
        port_file = data / _PORT_FILE
        saved = int(port_file.read_text()) if port_file.exists() else 0
        config = ServerConfig(
            data=str(data),
            host=ray.util.get_node_ip_address(),
            port=saved,
            metrics_port=metrics_port,
            shard=shard,
            tables=tuple(TableConfig.from_settings(t) for t in tables),
        )
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.server = _serve(config, restarted)
        (data / _OWNER_FILE).write_text(owner)  # once it holds the directory, not before
        port_file.write_text(str(self.server.port))
        self.address = f"{config.host}:{self.server.port}"
        if restarted and self.server.port != saved:
            _publish(namespace, name, shard, self.address)

    def target(self) -> str:
        return self.address

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.server.stop()


def _owner_refusal(owner_file: Path, owner: str) -> str | None:
    """Why a data directory (or data root) that another buffer made is refused to `owner` (its namespace
    and name), which would otherwise serve, and sample, experiences another job pushed; None when it is ours."""
    if not owner_file.exists() or owner_file.read_text() == owner:
        return None
    theirs, ours = json.loads(owner_file.read_text()), json.loads(owner)
    return (
        f"{owner_file.parent} belongs to the buffer {theirs['name']!r} of Ray namespace {theirs['namespace']!r},"
        f" not to {ours['name']!r} of {ours['namespace']!r}: give this buffer a data_root of its own"
    )


def _serve(config: ServerConfig, restarted: bool) -> ExpbufServer:
    """The shard's server, started once what keeps it from starting has gone: a restart waits for the
    data directory (Ray gives up for good on an actor whose constructor raised), and a port taken for
    longer than _PORT_WAIT_SECONDS is given up for a fresh one. Other failures raise at once."""
    from expbuf.server.app import ExpbufServer, StartupError

    data = Path(config.data)
    started = time.monotonic()
    while True:
        try:
            return ExpbufServer(config).start()
        except StartupError:
            waited = time.monotonic() - started
            if _in_use(data):
                if not restarted:
                    raise StartupError(
                        f"shard {config.shard}: data directory {data} is in use by another process (another"
                        " buffer's shard, an `expbuf serve` or an `expbuf check`): give each buffer a data_root"
                        " of its own"
                    ) from None
                if waited >= _LOCK_WAIT_SECONDS:
                    raise StartupError(
                        f"shard {config.shard}: data directory {data} still in use by another process after"
                        f" {_LOCK_WAIT_SECONDS:.0f} s (the shard's previous process, or an `expbuf check`), and Ray"
                        " does not restart it again: end that process, then expbuf.ray.stop_shards and start_shards"
                    ) from None
            elif config.port and _port_taken(config.host, config.port):
                if waited >= _PORT_WAIT_SECONDS:
                    log.warning(
                        "shard %s: port %d still taken after %.0f s: serving on a fresh port, published in the shard"
                        " map (clients take it with client.set_map(expbuf.ray.shard_map(namespace)))",
                        config.shard,
                        config.port,
                        _PORT_WAIT_SECONDS,
                    )
                    config = replace(config, port=0)
                    continue
            else:
                raise
        time.sleep(0.2)


def _in_use(data: Path) -> bool:
    """Whether another process holds the data directory's lock, a server's or a reader's."""
    try:
        fd = os.open(data / _LOCKED_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _port_taken(host: str, port: int) -> bool:
    """Whether another socket holds the port (bound as the server binds it: TIME_WAIT is no conflict)."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError:
            return True
    return False


def _publish(namespace: str, name: str, shard: str, target: str) -> None:
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
        _write(self.path, grown)
        return grown

    def set_target(self, shard: str, target: str) -> None:
        _write(self.path, ShardMap.from_json(self.get()).with_targets({shard: target}).to_json())


def _write(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def _alive_nodes() -> list[str]:
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])


def _start(shard: str, node: str, namespace: str, name: str, options: Mapping[str, Any]) -> ActorHandle:
    return (
        ray.remote(ShardActor)
        .options(
            name=shard,
            namespace=namespace,
            lifetime="detached",
            max_restarts=options["max_restarts"],
            max_task_retries=-1,
            num_cpus=options["num_cpus"],
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        )
        .remote(shard, namespace, name, options["data_root"], options["tables"], options["metrics_port"])
    )


def _kill(actors: Mapping[str, ActorHandle], namespace: str) -> None:
    """Kill the actors and wait until Ray has released their names, so that they can be started again."""
    for actor in actors.values():
        ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + _STOP_SECONDS
    for actor_name in actors:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(actor_name, namespace=namespace)
            except ValueError:
                break
            time.sleep(0.1)


def start_shards(
    num_shards: int | None = None,
    *,
    namespace: str,
    name: str = "expbuf",
    data_root: str | None = None,
    tables: Sequence[dict[str, Any]] = (),
    max_restarts: int = -1,
    num_cpus: float = 0,
    metrics_port: int = 0,
) -> ShardMap:
    """Start `num_shards` shards (default: one per alive node), round-robin over the nodes.

    Shard i is the actor `{name}-{i}`; `tables` (TOML-style dicts) are created on every shard.
    `data_root` (default /tmp/expbuf-ray/{namespace}) must be on each node's persistent disk.
    `num_cpus`: what Ray reserves for each shard, none by default (a shard waits on disk and
    network, and a reserved CPU freed by a crash can go to a queued task, which then keeps the
    restart waiting). `metrics_port` 0 picks a free port per shard (-1: none).

    Calling it again for a running buffer returns its map. A buffer stopped earlier with this data
    root and name is resumed: its map (`{data_root}/{name}.shard-map.json`) and data, with the
    shards that map names; a `num_shards` other than theirs is refused. On a failure no shard is left.
    """
    try:
        return shard_map(namespace, name)
    except ValueError:
        pass
    root = data_root_of(namespace, data_root)
    path = root / f"{name}.shard-map.json"
    owner, owner_file = _owner(namespace, name), root / f"{name}.{_OWNER_FILE}"
    refusal = _owner_refusal(owner_file, owner)
    if refusal:
        raise ValueError(f"data_root {refusal}")
    earlier = ShardMap.from_json(path.read_text()) if path.exists() else None
    nodes = _alive_nodes()
    if earlier is None:
        shards = [f"{name}-{index}" for index in range(num_shards or len(nodes))]
    elif num_shards in (None, len(earlier.shards)):
        shards = list(earlier.shards)
    else:
        raise ValueError(
            f"{path} holds the map of buffer {name!r} started earlier with this data_root, of"
            f" {len(earlier.shards)} shards ({', '.join(earlier.shards)}) that keep its data: start_shards"
            f"({len(earlier.shards)}) or no num_shards resumes it, add_shard grows it; to start afresh, remove"
            f" that file and the shards' directories under {root}, or give another data_root"
        )
    options = {
        "data_root": str(root),
        "tables": list(tables),
        "max_restarts": max_restarts,
        "num_cpus": num_cpus,
        "metrics_port": metrics_port,
    }
    actors = {shard: _start(shard, nodes[i % len(nodes)], namespace, name, options) for i, shard in enumerate(shards)}
    try:
        targets = {shard: ray.get(actor.target.remote()) for shard, actor in actors.items()}
        started = ShardMap.of(targets) if earlier is None else earlier.with_targets(targets)
        _write(path, started.to_json())
        owner_file.write_text(owner)
        here = ray.get_runtime_context().get_node_id()
        actors[name] = (
            ray.remote(Registry)
            .options(
                name=name,
                namespace=namespace,
                lifetime="detached",
                max_restarts=-1,
                max_task_retries=-1,
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            )
            .remote(str(path), options)
        )
        return shard_map(namespace, name)
    except BaseException:
        _kill(actors, namespace)
        raise


def add_shard(
    since_batch: int,
    *,
    namespace: str,
    name: str = "expbuf",
    node: str | None = None,
    data_root: str | None = None,
    tables: Sequence[dict[str, Any]] | None = None,
    max_restarts: int | None = None,
    num_cpus: float | None = None,
    metrics_port: int | None = None,
) -> ShardMap:
    """Start one more shard and publish a new epoch routing groups of batches from `since_batch` on.

    The options left None are the buffer's, as start_shards was given them. Writers adopt the new
    shard with `client.set_map(expbuf.ray.shard_map(namespace))` before that batch.
    """
    current = shard_map(namespace, name)
    registry = ray.get_actor(name, namespace=namespace)
    given = {
        "data_root": data_root,
        "tables": None if tables is None else list(tables),
        "max_restarts": max_restarts,
        "num_cpus": num_cpus,
        "metrics_port": metrics_port,
    }
    options = {**ray.get(registry.options.remote()), **{k: v for k, v in given.items() if v is not None}}
    shard = f"{name}-{len(current.shards)}"
    nodes = _alive_nodes()
    actor = _start(shard, node or nodes[len(current.shards) % len(nodes)], namespace, name, options)
    try:
        target = ray.get(actor.target.remote())
    except BaseException:
        _kill({shard: actor}, namespace)
        raise
    return ShardMap.from_json(ray.get(registry.add_shard.remote(shard, target, since_batch)))


def stop_shards(namespace: str, name: str = "expbuf") -> dict[str, str]:
    """Stop every shard (each commits and closes its store) and the registry; the data stays.

    A shard that cannot be stopped cleanly (gone already, or not answering) does not keep the others
    and the registry running: it is killed, and named in the answer, {shard: why}, and in a warning.
    """
    current = shard_map(namespace, name)
    unstopped: dict[str, str] = {}
    actors: dict[str, ActorHandle] = {}
    for shard in current.shards:
        try:
            actors[shard] = ray.get_actor(shard, namespace=namespace)
        except ValueError:
            unstopped[shard] = "not running"
            continue
        try:
            ray.get(actors[shard].stop.remote(), timeout=_STOP_SECONDS)
        except ray.exceptions.RayError as exc:  # GetTimeoutError among them
            unstopped[shard] = f"killed without a clean stop: {type(exc).__name__}"
    actors[name] = ray.get_actor(name, namespace=namespace)
    _kill(actors, namespace)
    if unstopped:
        log.warning("expbuf.ray.stop_shards(%r): shards not stopped cleanly: %s", namespace, unstopped)
    return unstopped
