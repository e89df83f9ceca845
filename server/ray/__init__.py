"""expbuf shards as Ray actors (installed as `expbuf.ray`; needs the `ray` extra).

Ray places, restarts and names the shards; expbuf adds only which shard owns a group
(expbuf.client.schema.routing). Each shard is an actor running a plain expbuf server:

- one shard per alive node by default, pinned to its node (hard node affinity) so that a
  restarted actor finds its own LMDB directory under `data_root` on that node's disk, and a
  resumed buffer's shards each placed on the node that holds its directory (node ids change
  when a cluster starts again);
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

import hashlib
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from expbuf.client.ray_registry import NotARegistry, shard_map
from expbuf.client.schema.routing import ShardMap

from .registry import Registry, write
from .shard import OWNER_FILE, ShardActor, owner_record, owner_refusal, refusal_by

log = logging.getLogger("expbuf")

DEFAULT_DATA_ROOT = "/tmp/expbuf-ray"
# How long stop_shards waits for a shard to commit and close its store, and for Ray to release a
# killed actor's name (so that the buffer can be started again at once).
_STOP_SECONDS = 60.0


def data_root_of(namespace: str, data_root: str | None = None) -> Path:
    """A buffer's data root: `data_root`, or one of its namespace's own under /tmp/expbuf-ray, so that
    jobs in different namespaces never share data by default. A relative one is refused: the driver
    and each shard (Ray's worker, in a directory of Ray's) would read it from directories of their
    own, the map in one place and the data in another."""
    if data_root and not Path(data_root).is_absolute():
        raise ValueError(
            f"data_root {data_root!r} is relative: the driver and the shards (Ray's workers) have working"
            " directories of their own; give an absolute path on each node's persistent disk"
        )
    return Path(data_root) if data_root else Path(DEFAULT_DATA_ROOT) / namespace


def _alive_nodes() -> list[str]:
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])


# What of a shard's data.mdb tells one store from another, the same on every node of a disk they
# share: the whole file where it is small, else LMDB's two meta pages (its last commit's number and
# root pages) and SAMPLED pieces spread over it.
_PIECE = 8192
_SAMPLED = 64


@ray.remote(num_cpus=0)
def _held_here(root: str, shards: list[str]) -> dict[str, str]:
    """The shards whose data directory is under `root` on the node this runs on, each with what its
    store is (`stored_as`): "" for a directory that holds none."""
    return {shard: stored_as(Path(root) / shard) for shard in shards if (Path(root) / shard).is_dir()}


def stored_as(directory: Path) -> str:
    """What a shard's data directory holds: its data.mdb's size and pieces of it (_SAMPLED), or ""
    where it holds no store (a directory made empty, as a lost node's shard is started again without its data)."""
    data, digest = directory / "data.mdb", hashlib.sha256()
    try:
        size = data.stat().st_size
        with data.open("rb") as file:
            step = max(_PIECE, size // _SAMPLED)
            for at in range(0, size, step):
                file.seek(at)
                digest.update(file.read(_PIECE))
    except OSError:
        return ""
    return f"{size}:{digest.hexdigest()}" if size else ""


def holders_of(found: Mapping[str, Mapping[str, str]]) -> dict[str, list[str]]:
    """Each shard's nodes to resume it on, from what each node's directory of it holds ({shard:
    {node: stored_as}}): those that hold its store (all of them, on a disk they share, where every
    node reads the same), else those that hold its directory empty (the way on without its data). A
    directory made empty beside the store was taken as holding it: the shard, started there, served
    an empty store. Nodes holding different stores of one shard are refused (ValueError naming them):
    which one is the shard's is the operator's to say."""
    holders = {}
    for shard, nodes in found.items():
        stores = {node: held for node, held in nodes.items() if held}
        if len(set(stores.values())) > 1:
            raise ValueError(
                f"the data directory of shard {shard} holds different stores on nodes {', '.join(sorted(stores))}:"
                " move the one that is not the shard's away from under data_root, then start again"
            )
        holders[shard] = list(stores or nodes)
    return holders


def _asked(nodes: Sequence[str], task: Any, args: tuple[Any, ...], what: str) -> list[Any]:
    """`task(*args)`'s answer on each of `nodes`, in their order; a ValueError naming `what` the nodes
    were asked where they do not all answer within _STOP_SECONDS."""
    asks = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
        for node in nodes
    ]
    try:
        return ray.get(asks, timeout=_STOP_SECONDS)
    except ray.exceptions.GetTimeoutError:
        raise ValueError(
            f"the alive nodes did not say within {_STOP_SECONDS:.0f} s which of them {what}: start_shards again"
            " once every node answers"
        ) from None


def _holders(root: Path, shards: Sequence[str], nodes: Sequence[str]) -> dict[str, list[str]]:
    """Each shard's alive nodes to resume it on (holders_of), by what each holds under `root`."""
    held = _asked(nodes, _held_here, (str(root), list(shards)), f"hold the shards' data directories under {root}")
    found = {
        shard: {node: here[shard] for node, here in zip(nodes, held, strict=True) if shard in here} for shard in shards
    }
    return holders_of(found)


@ray.remote(num_cpus=0)
def _map_here(root: str, name: str) -> tuple[str, str] | None:
    """The map of buffer `name` under `root` on the node this runs on, and the owner record beside it
    ("" for none); None where the node keeps no map of it."""
    kept, owner = Path(root) / f"{name}.shard-map.json", Path(root) / f"{name}.{OWNER_FILE}"
    try:
        return kept.read_text(), owner.read_text() if owner.exists() else ""
    except OSError:
        return None


def _kept_map(path: Path, root: Path, name: str, nodes: Sequence[str], owner: str) -> ShardMap | None:
    """The map of buffer `name` to resume: the newest that the driver (`path`) or an alive node keeps
    under `root`. A buffer started from one node and resumed from another, its data roots on disks of
    their own, left its map on the first: a driver that looked only on its own disk started it
    afresh, its shards on empty stores, the experiences left unserved where they were; and each
    driver since keeps a copy, which a later add_shard leaves behind on all but the registry's node.
    A copy behind holds the newest's first shards; maps of other shards are refused (ValueError
    naming the nodes), as is a map of another buffer's (its namespace)."""
    kept = _asked(nodes, _map_here, (str(root), name), f"keep buffer {name!r}'s map under {root}")
    maps: dict[str, ShardMap] = {"this driver": ShardMap.from_json(path.read_text())} if path.exists() else {}
    for node, found in zip(nodes, kept, strict=True):
        if found is None:
            continue
        refusal = refusal_by(found[1], owner, f"{root} on node {node}")
        if refusal:
            raise ValueError(f"data_root {refusal}")
        maps[f"node {node}"] = ShardMap.from_json(found[0])
    newest = max(maps.values(), key=lambda kept_map: len(kept_map.shards), default=None)
    if newest is not None and any(
        kept_map.shards != newest.shards[: len(kept_map.shards)] for kept_map in maps.values()
    ):
        held = "; ".join(f"{where}: {', '.join(kept_map.shards)}" for where, kept_map in sorted(maps.items()))
        raise ValueError(
            f"buffer {name!r}'s map under {root} names other shards in different places ({held}): keep the one of"
            " the buffer's data and move the others away, then start again"
        )
    return newest


def placed(shards: Sequence[str], nodes: Sequence[str], holders: Mapping[str, Sequence[str]] | None) -> list[str]:
    """Each shard's node: for a new buffer (`holders` None), round-robin over the alive `nodes`; for a
    resumed one, a node that holds the shard's data directory (of several, a disk they share,
    round-robin over them). A resumed shard that no alive node holds is refused (ValueError naming
    it): started on another node it would serve an empty store, its experiences left on the node that holds them."""
    if holders is None:
        return [nodes[i % len(nodes)] for i in range(len(shards))]
    lost = [shard for shard in shards if not holders[shard]]
    if lost:
        raise ValueError(
            f"no alive node ({len(nodes)}) holds the data directory of shard(s) {', '.join(lost)}: its node is"
            " down or its disk is gone, and started on another node it would serve an empty store. Start again"
            " once that node is back; to go on without its experiences, make the directory, empty, on the"
            " node it is to run on"
        )
    return [holders[shard][i % len(holders[shard])] for i, shard in enumerate(shards)]


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

    Calling it again for a running buffer returns its map (refused where given another count of
    shards, data root or tables than it runs with). A buffer stopped earlier with this data
    root and name is resumed: its map (`{data_root}/{name}.shard-map.json`) and data, with the
    shards that map names, each on a node that holds its data directory (refused, naming it, where
    no alive node does); a `num_shards` other than theirs is refused. On a failure no shard is left.
    """
    try:
        running = shard_map(namespace, name)
    except NotARegistry:
        raise
    except ValueError:
        pass
    else:
        return _as_asked(running, namespace, name, num_shards, data_root, tables)
    root = data_root_of(namespace, data_root)
    path = root / f"{name}.shard-map.json"
    owner, owner_file = owner_record(namespace, name), root / f"{name}.{OWNER_FILE}"
    refusal = owner_refusal(owner_file, owner)
    if refusal:
        raise ValueError(f"data_root {refusal}")
    nodes = _alive_nodes()
    earlier = _kept_map(path, root, name, nodes, owner)
    if earlier is None:
        shards = [f"{name}-{index}" for index in range(num_shards or len(nodes))]
    elif num_shards in (None, len(earlier.shards)):
        shards = list(earlier.shards)
    else:
        raise ValueError(
            f"{path} (here or on another node) holds the map of buffer {name!r} started earlier with this"
            f" data_root, of {len(earlier.shards)} shards ({', '.join(earlier.shards)}) that keep its data:"
            f" start_shards({len(earlier.shards)}) or no num_shards resumes it, add_shard grows it; to start afresh,"
            f" remove that file from every node that keeps one and the shards' directories under {root}, or give"
            " another data_root"
        )
    try:
        at = placed(shards, nodes, None if earlier is None else _holders(root, shards, nodes))
    except ValueError as exc:
        kept = path if path.exists() else f"{path} of another node"
        raise ValueError(f"buffer {name!r} resumes from {kept}, under {root}: {exc}") from None
    options = {
        "data_root": str(root),
        "tables": list(tables),
        "max_restarts": max_restarts,
        "num_cpus": num_cpus,
        "metrics_port": metrics_port,
    }
    actors: dict[str, ActorHandle] = {}
    try:
        for i, shard in enumerate(shards):  # each killed with the others should a later one fail
            actors[shard] = _start(shard, at[i], namespace, name, options)
        targets = {shard: ray.get(actor.target.remote()) for shard, actor in actors.items()}
        started = ShardMap.of(targets) if earlier is None else earlier.with_targets(targets)
        root.mkdir(parents=True, exist_ok=True)
        write(path, started.to_json())
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
    except ray.exceptions.ActorAlreadyExistsError:
        _kill(actors, namespace)
        if actors:
            raise
        return _started_by_another(namespace, name)  # its first shard's name taken: another driver's start
    except BaseException:
        _kill(actors, namespace)
        raise


def _as_asked(
    running: ShardMap,
    namespace: str,
    name: str,
    num_shards: int | None,
    data_root: str | None,
    tables: Sequence[dict[str, Any]],
) -> ShardMap:
    """The map of the running buffer `name`, where it is the buffer asked for: a start given another
    count of shards, data root or tables (another job's, in the same namespace) got the running one's
    map, its data root never made and its tables never created (its first push failed NOT_FOUND)."""
    kept = ray.get(ray.get_actor(name, namespace=namespace).options.remote())
    asked = {  # fewer shards than it runs: a start made before add_shard grew it
        "num_shards": (num_shards if num_shards and num_shards > len(running.shards) else None, len(running.shards)),
        "data_root": (data_root and str(data_root_of(namespace, data_root)), kept["data_root"]),
        "tables": (_each(tables) or None, _each(kept["tables"])),  # in any order, 2 and 2.0 alike
    }
    differ = [
        f"{what} {given!r} (it runs with {has!r})" for what, (given, has) in asked.items() if given and given != has
    ]
    if differ:
        raise ValueError(
            f"buffer {name!r} of Ray namespace {namespace!r} runs already, started otherwise: {'; '.join(differ)}."
            " Give another job's buffer a name or namespace of its own, or stop_shards this one first"
        )
    return running


def _each(tables: Sequence[dict[str, Any]]) -> list[Any]:
    """The tables in one order, as JSON makes them (a tuple of one driver's code, a list of another's
    YAML), compared as values (a setting given 2 by one and 2.0 by the other is one)."""
    made = [json.loads(json.dumps(table, sort_keys=True, default=str)) for table in tables]
    return sorted(made, key=lambda table: (str(table.get("name", "")), json.dumps(table, sort_keys=True)))


def _started_by_another(namespace: str, name: str) -> ShardMap:
    """The map of a buffer another driver is starting (its first shard's name was taken as this
    one's start began), once its registry is up: both drivers get the buffer, as a start of a
    running buffer does, where the later one failed ActorAlreadyExistsError."""
    deadline = time.monotonic() + _STOP_SECONDS
    while True:
        try:
            return shard_map(namespace, name)
        except ValueError:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"shard {name}-0 of namespace {namespace!r} is taken, and no buffer {name!r} came up there"
                    f" within {_STOP_SECONDS:.0f} s: another driver's start failed, or an actor of that name is"
                    " not expbuf's; stop_shards, or kill that actor, then start again"
                ) from None
        time.sleep(0.2)


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
        return ShardMap.from_json(ray.get(registry.add_shard.remote(shard, target, since_batch)))
    except BaseException:  # a map that refuses the epoch too: no shard left that no map names
        _kill({shard: actor}, namespace)
        raise


def _running_shards(namespace: str, name: str) -> list[str]:
    """The shards of buffer `name` running in `namespace`, by their names ({name}-{i}), each that
    runs, whichever others are gone (a lost node takes its shard with the registry): those of a
    buffer whose registry is gone."""
    shard = re.compile(re.escape(name) + r"-(\d+)")
    found = [
        (int(match.group(1)), actor["name"])
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == namespace and (match := shard.fullmatch(actor["name"]))
    ]
    return [actor for _, actor in sorted(found)]


def stop_shards(namespace: str, name: str = "expbuf") -> dict[str, str]:
    """Stop every shard (each commits and closes its store) and the registry; the data stays. A
    buffer whose registry is gone (its node lost, a driver that died as it started the buffer) has
    its shards found by their names, `{name}-{i}`, and stopped all the same.

    A shard that cannot be stopped cleanly (gone already, or not answering) does not keep the others
    and the registry running: it is killed, and named in the answer, {shard: why}, and in a warning.
    """
    try:
        shards: Sequence[str] = shard_map(namespace, name).shards
    except NotARegistry:
        raise
    except ValueError:  # its registry gone (its node lost, a driver that died as it started the buffer)
        shards = _running_shards(namespace, name)
        if not shards:
            raise ValueError(f"no buffer {name!r} runs in Ray namespace {namespace!r}: no registry, no shard") from None
    unstopped: dict[str, str] = {}
    actors: dict[str, ActorHandle] = {}
    for shard in shards:
        try:
            actors[shard] = ray.get_actor(shard, namespace=namespace)
        except ValueError:
            unstopped[shard] = "not running"
            continue
        try:
            ray.get(actors[shard].stop.remote(), timeout=_STOP_SECONDS)
        except ray.exceptions.RayError as exc:  # GetTimeoutError among them
            unstopped[shard] = f"killed without a clean stop: {type(exc).__name__}"
    try:
        actors[name] = ray.get_actor(name, namespace=namespace)
    except ValueError:
        unstopped[name] = "its registry was not running"
    _kill(actors, namespace)
    if unstopped:
        log.warning("expbuf.ray.stop_shards(%r): shards not stopped cleanly: %s", namespace, unstopped)
    return unstopped
