"""Shards as Ray actors on a local Ray cluster: start, push, sample, a shard's process
killed with SIGKILL and restarted by Ray, nothing acknowledged lost."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import lmdb
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


# The tests below each run a buffer of their own (their own namespace and data root) on the module's
# cluster: groups of two with no advantages, ready as pushed, so that no shard waits for torch.
TABLE = {"name": "rl", "group_size": 2, "estimator": "none"}


def options(root: Path) -> dict[str, Any]:
    return {"data_root": str(root), "tables": [TABLE], "num_cpus": 0, "metrics_port": -1}


def pushed(client: ShardedBufferClient, batch: int) -> set[str]:
    experiences = [make_experience(batch, task, run) for task in range(10) for run in range(2)]
    client.push(experiences, table="rl")
    return {e.eid.uid for e in experiences}


def consumed(client: ShardedBufferClient) -> set[str]:
    uids: set[str] = set()
    for batch in client.sample("rl", num_groups=8, timeout=1.0, allow_partial=True, delivery="consume"):
        uids |= set(batch.uids)
    return uids


def actors_in(namespace: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace)


def killed(namespace: str, shard: str) -> int:
    """SIGKILL a shard's process, as a crash does; its pid."""
    pid: int = ray.get(ray.get_actor(shard, namespace=namespace).pid.remote())
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_restarted_shard_waits_for_its_data_directory_still_in_use(ray_cluster: ModuleType, tmp_path: Path) -> None:
    namespace = "expbuf-test-lock"
    expbuf_ray.start_shards(1, namespace=namespace, **options(tmp_path))
    client = ShardedBufferClient.from_ray(namespace, timeout=5.0)
    acked = pushed(client, 0)
    fd = os.open(tmp_path / "expbuf-0" / "data.mdb", os.O_RDONLY)
    try:
        pid = killed(namespace, "expbuf-0")
        # A reader's lock (`expbuf check`), taken as the killed process lets go, before Ray restarts it.
        deadline = time.monotonic() + 30
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        time.sleep(3)
    finally:
        os.close(fd)
    assert ray.get(ray.get_actor("expbuf-0", namespace=namespace).pid.remote(), timeout=60) != pid
    assert consumed(client) == acked
    client.close()
    assert expbuf_ray.stop_shards(namespace) == {}


def test_a_restarted_shard_whose_port_stays_taken_serves_on_another(ray_cluster: ModuleType, tmp_path: Path) -> None:
    namespace = "expbuf-test-port"
    started = expbuf_ray.start_shards(1, namespace=namespace, **options(tmp_path))
    client = ShardedBufferClient.from_ray(namespace, timeout=5.0)
    acked = pushed(client, 0)
    host, port = started.targets["expbuf-0"].rsplit(":", 1)
    pid = killed(namespace, "expbuf-0")
    with socket.socket() as holder:  # another process's socket on the port, for good
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 30
        while True:
            try:
                holder.bind((host, int(port)))
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        holder.listen()
        actor = ray.get_actor("expbuf-0", namespace=namespace)
        assert ray.get(actor.pid.remote(), timeout=60) != pid
        moved = expbuf_ray.shard_map(namespace)  # the registry publishes its new address
        assert moved.targets["expbuf-0"] == ray.get(actor.target.remote()) != started.targets["expbuf-0"]
        client.set_map(moved)
        assert consumed(client) == acked
    client.close()
    expbuf_ray.stop_shards(namespace)


def test_stop_shards_stops_every_shard_it_can_and_names_the_others(ray_cluster: ModuleType, tmp_path: Path) -> None:
    namespace = "expbuf-test-stop"
    expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path))
    ray.kill(ray.get_actor("expbuf-0", namespace=namespace), no_restart=True)  # gone for good
    assert list(expbuf_ray.stop_shards(namespace)) == ["expbuf-0"]
    assert actors_in(namespace) == []  # expbuf-1 and the registry stopped all the same


def test_a_buffer_whose_registry_is_gone_is_stopped_by_its_shards_names(
    ray_cluster: ModuleType, tmp_path: Path
) -> None:
    """The registry runs on the node of the driver that started the buffer: that node lost (or the
    driver dead as it started the buffer), stop_shards failed with Ray's "Failed to look up actor",
    and the shards ran on that no API of expbuf's could stop (an audit)."""
    namespace = "expbuf-test-orphans"
    expbuf_ray.start_shards(3, namespace=namespace, **options(tmp_path))
    for lost in ("expbuf", "expbuf-0"):  # the registry's node lost, a shard with it
        ray.kill(ray.get_actor(lost, namespace=namespace), no_restart=True)
    assert expbuf_ray.stop_shards(namespace) == {"expbuf": "its registry was not running"}
    assert actors_in(namespace) == []
    with pytest.raises(ValueError, match="no buffer 'expbuf' runs in Ray namespace 'expbuf-test-orphans'"):
        expbuf_ray.stop_shards(namespace)


def test_a_running_buffer_is_not_taken_for_another(ray_cluster: ModuleType, tmp_path: Path) -> None:
    """Shards are named after their buffer ({name}-{i}) in its namespace: a buffer named as another's
    shard, its map read or its stop asked for, met that shard and raised AttributeError ('ActorHandle'
    object has no attribute 'get'), and its start left a shard or two behind. A start of another
    job's buffer under a running one's name got the running one's map, its own data root and tables
    never made (its first push failed NOT_FOUND). From an audit."""
    namespace = "expbuf-test-names"
    expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path / "a"), name="a")
    not_a_buffer = r"the actor 'a-0' of Ray namespace 'expbuf-test-names' is not an expbuf buffer's registry"
    for call in (expbuf_ray.start_shards, expbuf_ray.stop_shards):
        with pytest.raises(ValueError, match=not_a_buffer):
            call(namespace=namespace, name="a-0")  # type: ignore[operator]
    assert actors_in(namespace) == ["a", "a-0", "a-1"]
    again = expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path / "a"), name="a")
    assert again.shards == ("a-0", "a-1")  # the running buffer, asked as it was started
    alike = {**options(tmp_path / "a"), "tables": [{**TABLE, "group_size": 2.0}]}  # another driver's YAML
    assert expbuf_ray.start_shards(2, namespace=namespace, **alike, name="a").shards == ("a-0", "a-1")
    expbuf_ray.add_shard(10, namespace=namespace, name="a")
    grown = expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path / "a"), name="a")
    assert grown.shards == ("a-0", "a-1", "a-2")  # asked as it was started, before add_shard grew it
    other = {"name": "other", "estimator": "none"}
    asked = {"num_shards": 4, "data_root": str(tmp_path / "b"), "tables": [other]}
    for what, given in asked.items():  # another job's buffer, the same name and namespace: refused
        settings = {**options(tmp_path / "a"), "num_shards": 3, what: given}
        with pytest.raises(ValueError, match=f"buffer 'a' of Ray namespace 'expbuf-test-names' runs already, .*{what}"):
            expbuf_ray.start_shards(namespace=namespace, name="a", **settings)
    assert actors_in(namespace) == ["a", "a-0", "a-1", "a-2"] and not (tmp_path / "b").exists()
    expbuf_ray.stop_shards(namespace, "a")


def test_start_shards_refuses_an_earlier_run_s_map_of_other_shards(ray_cluster: ModuleType, tmp_path: Path) -> None:
    namespace = "expbuf-test-map"
    expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path))
    expbuf_ray.stop_shards(namespace)
    with pytest.raises(ValueError, match=r"expbuf\.shard-map\.json .* 2 shards"):
        expbuf_ray.start_shards(1, namespace=namespace, **options(tmp_path))
    assert actors_in(namespace) == []
    assert expbuf_ray.start_shards(namespace=namespace, **options(tmp_path)).shards == ("expbuf-0", "expbuf-1")
    expbuf_ray.stop_shards(namespace)


def test_a_resumed_shard_whose_data_directory_no_alive_node_holds_is_refused(
    ray_cluster: ModuleType, tmp_path: Path
) -> None:
    """Started on another node, it served an empty store while its experiences waited on the node
    that holds them: a resume after the nodes changed (node ids are new at each cluster start)."""
    namespace = "expbuf-test-resume-lost"
    expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path))
    client = ShardedBufferClient.from_ray(namespace, timeout=STARTING_SECONDS)
    uids = pushed(client, 1)
    client.close()
    expbuf_ray.stop_shards(namespace)
    (tmp_path / "expbuf-1").rename(tmp_path / "elsewhere")  # its node's disk, not this node's
    with pytest.raises(ValueError, match=r"no alive node \(1\) holds the data directory of shard\(s\) expbuf-1:"):
        expbuf_ray.start_shards(namespace=namespace, **options(tmp_path))
    assert actors_in(namespace) == [] and not (tmp_path / "expbuf-1").exists()
    (tmp_path / "elsewhere").rename(tmp_path / "expbuf-1")  # its node back
    expbuf_ray.start_shards(namespace=namespace, **options(tmp_path))
    client = ShardedBufferClient.from_ray(namespace, timeout=STARTING_SECONDS)
    assert consumed(client) == uids  # both shards' experiences, none lost
    client.close()
    expbuf_ray.stop_shards(namespace)


def test_resumed_shards_go_to_the_nodes_that_hold_their_data() -> None:
    """Node ids are new each time a cluster starts, so a resume by their order put shards on
    nodes without their data; each goes where its directory is (any, on a disk nodes share)."""
    shards, nodes = ["b-0", "b-1", "b-2"], ["n1", "n2"]
    assert expbuf_ray.placed(shards, nodes, None) == ["n1", "n2", "n1"]  # a new buffer: round-robin
    holders = {"b-0": ["n2"], "b-1": ["n1"], "b-2": ["n2"]}
    assert expbuf_ray.placed(shards, nodes, holders) == ["n2", "n1", "n2"]
    shared = dict.fromkeys(shards, nodes)
    assert expbuf_ray.placed(shards, nodes, shared) == ["n1", "n2", "n1"]
    with pytest.raises(ValueError, match=r"shard\(s\) b-0, b-2: its node is down"):
        expbuf_ray.placed(shards, nodes, {"b-0": [], "b-1": ["n1"], "b-2": []})


def test_a_resumed_shard_goes_where_its_store_is_not_to_a_directory_made_empty(tmp_path: Path) -> None:
    """Any directory of a shard's name was taken as holding its data: a node where it was made
    empty (the way on for a lost node's shard) got the shard beside the node with its store, and
    it served an empty store (an audit: 0 of 60 served). Nodes with different stores of one shard
    are refused; on a disk nodes share, every node reads the same store."""
    store, other, empty = tmp_path / "store", tmp_path / "other", tmp_path / "empty"
    for directory, marks in ((store, b"a"), (other, b"b")):
        with lmdb.open(str(directory)) as env, env.begin(write=True) as txn:
            txn.put(b"k", marks)
    empty.mkdir()
    held, elsewhere = expbuf_ray.stored_as(store), expbuf_ray.stored_as(other)
    assert held and elsewhere and held != elsewhere and expbuf_ray.stored_as(empty) == ""
    found = {"b-0": {"n1": "", "n2": held}, "b-1": {"n1": "", "n3": ""}, "b-2": {"n1": held, "n2": held}}
    assert expbuf_ray.holders_of(found) == {"b-0": ["n2"], "b-1": ["n1", "n3"], "b-2": ["n1", "n2"]}
    with pytest.raises(ValueError, match="shard b-0 holds different stores on nodes n1, n2: move the one"):
        expbuf_ray.holders_of({"b-0": {"n1": elsewhere, "n2": held, "n3": ""}})


def test_a_buffer_of_another_namespace_is_refused_the_data_of_another(ray_cluster: ModuleType, tmp_path: Path) -> None:
    expbuf_ray.start_shards(1, namespace="expbuf-test-job1", **options(tmp_path))
    refusal = r"belongs to the buffer 'expbuf' of Ray namespace 'expbuf-test-job1'"
    with pytest.raises(ValueError, match=refusal):  # while it runs: not its port named
        expbuf_ray.start_shards(1, namespace="expbuf-test-job2", **options(tmp_path))
    expbuf_ray.stop_shards("expbuf-test-job1")
    with pytest.raises(ValueError, match=refusal):  # once it has stopped
        expbuf_ray.start_shards(1, namespace="expbuf-test-job2", **options(tmp_path))
    # On a node other than the driver's, the data root holds the shards' directories alone: each refuses.
    (tmp_path / "expbuf.ray-buffer").unlink()
    (tmp_path / "expbuf.shard-map.json").unlink()
    with pytest.raises(ray.exceptions.RayActorError, match=refusal):
        expbuf_ray.start_shards(1, namespace="expbuf-test-job2", **options(tmp_path))
    assert actors_in("expbuf-test-job2") == []


def _namespaces() -> bool:
    """Whether this host lets a process have mounts of its own (an unprivileged user namespace)."""
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.skipif(not _namespaces(), reason="no user namespaces here: the driver needs a disk view of its own")
def test_a_buffer_resumed_from_a_driver_on_another_node_finds_its_map_and_data(
    ray_cluster: ModuleType, tmp_path: Path
) -> None:
    """A buffer started from one node and resumed by a driver on another, each node's data root on a
    disk of its own: the driver found no map on its own disk and started the buffer afresh, its
    shards on empty stores, the experiences pushed before left unserved (an audit on a simulated
    3-node cluster: 42 of 60 gone). The driver asks the nodes for the map. Here the second driver
    runs in a mount namespace of its own, the data root another directory to it, which holds the
    copy of the map a driver left there before the buffer grew (add_shard writes the registry's
    node's alone): the newest map is resumed, not the copy behind it (the review)."""
    namespace, root, elsewhere = "expbuf-test-elsewhere", tmp_path / "root", tmp_path / "driver-disk"
    expbuf_ray.start_shards(2, namespace=namespace, **options(root))
    elsewhere.mkdir()
    for kept in ("expbuf.shard-map.json", "expbuf.ray-buffer"):  # the copy of a driver there before
        (elsewhere / kept).write_bytes((root / kept).read_bytes())
    expbuf_ray.add_shard(10, namespace=namespace)
    with ShardedBufferClient.from_ray(namespace, timeout=STARTING_SECONDS) as client:
        uids = pushed(client, 1) | pushed(client, 11)  # batch 11 on the epoch of three shards
    expbuf_ray.stop_shards(namespace)
    script = (
        "import sys, ray\n"
        "import expbuf.ray\n"
        f"ray.init(address={ray.get_runtime_context().gcs_address!r}, logging_level='ERROR', log_to_driver=False)\n"
        f"started = expbuf.ray.start_shards(namespace={namespace!r}, **{options(root)!r})\n"
        "print(','.join(started.shards))\n"
    )
    driver = f'mount --bind {elsewhere} {root} && exec {sys.executable} -c "$0"'
    command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", driver, script]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["expbuf-0,expbuf-1,expbuf-2"]
    try:
        with ShardedBufferClient.from_ray(namespace, timeout=STARTING_SECONDS) as client:
            assert consumed(client) == uids
    finally:
        expbuf_ray.stop_shards(namespace)


def test_a_running_buffers_tables_are_compared_as_their_values() -> None:
    """start_shards of a running buffer compares the tables it is given with those it runs with as
    values, whatever form one driver's code and another's YAML give them (2 or 2.0, a tuple or a
    list): text of one (JSON) took 2.0 for another setting, values a tuple (the review)."""
    code = [{"name": "rl", "group_size": 2, "extensions": ("prompt_ledger",)}]
    yaml = [{"extensions": ["prompt_ledger"], "group_size": 2.0, "name": "rl"}]
    assert expbuf_ray._each(code) == expbuf_ray._each(yaml) != expbuf_ray._each([{**yaml[0], "group_size": 3}])


def test_the_default_data_root_is_the_namespace_s_own() -> None:
    assert expbuf_ray.data_root_of("rl") == Path("/tmp/expbuf-ray/rl")
    assert expbuf_ray.data_root_of("rl", "/mnt/nvme/expbuf") == Path("/mnt/nvme/expbuf")


def test_add_shard_takes_the_buffer_s_data_root_and_tables(ray_cluster: ModuleType, tmp_path: Path) -> None:
    namespace = "expbuf-test-grow"
    expbuf_ray.start_shards(1, namespace=namespace, **options(tmp_path))
    grown = expbuf_ray.add_shard(1, namespace=namespace)  # as docs/operations/ray.md shows it
    assert (tmp_path / "expbuf-1").is_dir()
    client = ShardedBufferClient.from_ray(namespace, timeout=5.0)
    assert client.shard_map == grown
    pushed(client, 1)
    assert client.shard_stats("rl")["expbuf-1"]["rl"].pushed > 0
    client.close()
    expbuf_ray.stop_shards(namespace)


def test_a_start_that_fails_partway_leaves_no_shard_behind(ray_cluster: ModuleType, tmp_path: Path) -> None:
    namespace = "expbuf-test-partial"
    (tmp_path / "expbuf-1").write_text("")  # shard 1's data directory cannot be made
    with pytest.raises(ray.exceptions.RayActorError, match="expbuf-1"):
        expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path))
    assert actors_in(namespace) == []
    (tmp_path / "expbuf-1").unlink()
    assert expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path)).shards == ("expbuf-0", "expbuf-1")
    expbuf_ray.stop_shards(namespace)


def test_a_shard_takes_no_cpu_that_queued_tasks_could_take_at_its_restart(
    ray_cluster: ModuleType, tmp_path: Path
) -> None:
    namespace = "expbuf-test-cpus"
    root = {"data_root": str(tmp_path), "tables": [TABLE], "metrics_port": -1}  # num_cpus left to its default
    expbuf_ray.start_shards(1, namespace=namespace, **root)

    @ray.remote(num_cpus=1)
    def work() -> None:
        time.sleep(60)

    busy = [work.remote() for _ in range(3)]  # every CPU of the cluster taken, one more waiting
    try:
        time.sleep(2)
        pid = killed(namespace, "expbuf-0")
        assert ray.get(ray.get_actor("expbuf-0", namespace=namespace).pid.remote(), timeout=20) != pid
    finally:
        for task in busy:
            ray.cancel(task, force=True)
    expbuf_ray.stop_shards(namespace)


def test_reading_the_shard_map_before_ray_init_says_so() -> None:
    script = (
        "import ray\n"
        "from expbuf.client.ray_registry import shard_map\n"
        "try:\n"
        "    shard_map('rl')\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
        "print('initialized', ray.is_initialized())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert 'ray.init(address="auto")' in result.stdout
    assert "initialized False" in result.stdout


def test_a_failed_add_shard_and_a_start_with_a_name_taken_leave_no_shard_behind(
    ray_cluster: ModuleType, tmp_path: Path
) -> None:
    """An add_shard the map refused (its epoch not after the last) left its shard running, detached,
    named in no map: every later add_shard failed on its name and stop_shards left it. A start whose
    second shard's name was taken left its first. Both kill what they started now (a helper's audit)."""
    namespace = "expbuf-test-leaks"
    expbuf_ray.start_shards(1, namespace=namespace, **options(tmp_path / "a"))
    with pytest.raises(Exception, match="epoch"):
        expbuf_ray.add_shard(0, namespace=namespace)
    assert actors_in(namespace) == ["expbuf", "expbuf-0"]
    assert expbuf_ray.add_shard(1, namespace=namespace).shards == ("expbuf-0", "expbuf-1")
    expbuf_ray.stop_shards(namespace)

    @ray.remote(num_cpus=0)
    class Other:
        pass

    other = Other.options(name="expbuf-1", namespace=namespace, lifetime="detached").remote()  # not expbuf's
    try:
        with pytest.raises(ray.exceptions.ActorAlreadyExistsError):
            expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path / "b"))
        assert actors_in(namespace) == ["expbuf-1"]
    finally:
        ray.kill(other, no_restart=True)


def test_two_drivers_starting_one_buffer_both_get_it(ray_cluster: ModuleType, tmp_path: Path) -> None:
    """Each trainer worker 'ensures' the buffer: of two starts at once one failed, its first shard's
    name taken by the other's (3 of 3 tries in a helper's audit). The later waits for the other's."""
    namespace = "expbuf-test-race"
    got: list[Any] = []
    other = threading.Thread(
        target=lambda: got.append(expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path)))
    )
    other.start()
    mine = expbuf_ray.start_shards(2, namespace=namespace, **options(tmp_path))
    other.join(120)
    assert got == [mine] and mine.shards == ("expbuf-0", "expbuf-1")
    expbuf_ray.stop_shards(namespace)


def test_a_relative_data_root_is_refused() -> None:
    """The driver and the shards (Ray's workers) read it from working directories of their own: the
    map went to one place and the data to another, and the start crashed FileNotFoundError."""
    with pytest.raises(ValueError, match="data_root 'expbuf-data' is relative"):
        expbuf_ray.data_root_of("rl", "expbuf-data")


def test_a_shard_whose_store_breaks_stops_for_ray_to_start_it_again(ray_cluster: ModuleType, tmp_path: Path) -> None:
    """A shard whose store can take no more writes refused every push UNAVAILABLE for good, in the
    same process (a helper's audit): it stops now and exits 3, as `expbuf serve` does, and Ray starts
    it again on its data. Its store is broken here as a failed write of the disk breaks it."""
    from expbuf.server.ray.shard import ShardActor

    class Breakable(ShardActor):
        def brake(self) -> None:
            self.server.store.environment.writer._broke("a disk that failed a write")

    namespace = "expbuf-test-broken"
    actor = (
        ray.remote(Breakable)
        .options(name="expbuf-0", namespace=namespace, lifetime="detached", max_restarts=1, num_cpus=0)
        .remote("expbuf-0", namespace, "expbuf", str(tmp_path), [TABLE], 0)
    )
    try:
        pid = ray.get(actor.pid.remote())
        metrics = ray.get(actor.metrics_target.remote())
        assert metrics.rsplit(":", 1)[1].isdigit() and metrics != ray.get(actor.target.remote())
        ray.get(actor.brake.remote())
        deadline = time.monotonic() + 60
        restarted = None
        while restarted in (None, pid) and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                restarted = ray.get(actor.pid.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
        assert restarted not in (None, pid)
        with ShardedBufferClient({"expbuf-0": ray.get(actor.target.remote())}, timeout=STARTING_SECONDS) as client:
            assert pushed(client, 1)  # the restarted shard takes writes
    finally:
        ray.kill(actor, no_restart=True)
