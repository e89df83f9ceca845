"""TransferQueue's controller kept in expbuf (client/transferqueue/controller.py, journal.py):
TransferQueue's own API on a local Ray cluster, its controller actor killed with SIGKILL and
TransferQueue started again as a job restarts it; the state comes back exactly (keys, produced
fields, what each task consumed, custom metadata), through snapshots and the entries after them.
A real expbuf server on loopback, real LMDB."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from expbuf.client import BufferClient
from expbuf.client.errors import PermissionDeniedError

from conftest import Servers
from helpers import SlowReplies


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global tq, OmegaConf, TensorDict, SequentialSampler, ZMQMessage, ZMQRequestType, DurableController
    global JournalSettings, _Unmeasured, HEAD, Journal, entry_key, part_key, server_of, SnapshotFails
    global KeepsACursor
    tq = pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from transfer_queue.sampler import SequentialSampler
    from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

    from expbuf.client.transferqueue.controller import DurableController, JournalSettings, _Unmeasured
    from expbuf.client.transferqueue.journal import HEAD, Journal, entry_key, part_key
    from expbuf.client.transferqueue.storage import server_of

    class SnapshotFails(Journal):
        """A journal whose entries are stored and whose snapshots fail (the server refusing them)."""

        def snapshot(self, state: bytes) -> None:
            raise RuntimeError("no room for the snapshot")

    class KeepsACursor(SequentialSampler):
        def save_checkpoint(self) -> dict:
            return {**super().save_checkpoint(), "cursor": Cursor()}


def conf(target: str, **controller: Any) -> Any:
    settings: dict[str, Any] = {"backend": {"storage_backend": "Expbuf", "Expbuf": {"target": target, "table": "tq"}}}
    if controller:
        settings["controller"] = {"Expbuf": controller}
    return OmegaConf.create(settings)


def test_settings_come_from_the_backend_and_the_controller_s_own() -> None:
    plain = OmegaConf.create({"backend": {"storage_backend": "SimpleStorage"}})
    assert JournalSettings.from_conf(plain) is None  # another backend: TransferQueue's controller as it is
    settings = JournalSettings.from_conf(conf("h:1", snapshot_every=5))
    assert settings == JournalSettings(where=server_of({"target": "h:1"}, "here"), table="tq", snapshot_every=5)
    shards = OmegaConf.create({"backend": {"storage_backend": "Expbuf", "Expbuf": {"shards": ["a:1", "b:2"]}}})
    shards.controller = {"Expbuf": {"target": "h:1"}}  # the controller's own server replaces the backend's shards
    assert JournalSettings.from_conf(shards).where.target == "h:1"
    assert JournalSettings.from_conf(conf("h:1", journal=False)) is None
    with pytest.raises(ValueError, match="target"):
        JournalSettings.from_conf(OmegaConf.create({"controller": {"Expbuf": {"table": "t"}}}))


def test_the_journal_keeps_entries_and_snapshots_and_ends_a_cut_clean_up(start_server: Servers) -> None:
    server = start_server()
    # A journal's part is half the client's message (as test_tq_storage's values): 8 MiB makes
    # three parts of 4 MiB, the path of three of 128 MiB at the default without writing 256 MiB.
    with BufferClient(f"127.0.0.1:{server.port}", max_message_bytes=8 << 20) as client:
        client.create_table("j")
        journal = Journal(client, "j", snapshot_every=3)
        assert journal.load() == (None, [])
        for n in range(1, 4):
            assert journal.append(b"entry %d" % n)
        assert journal.due
        big = bytes(range(256)) * (2 * journal.limit // 256 + 3)  # three parts
        assert not journal.append(big) and journal.seq == 3  # more than a put: stored nothing
        journal.snapshot(big)
        assert journal.append(b"after")
        assert client.get_values([entry_key(n) for n in range(1, 4)], "j") == [None] * 3  # covered, cleared

        again = Journal(client, "j", snapshot_every=3)
        assert again.load() == (big, [b"after"]) and again.seq == 4

        # A crash after a new head and before its clean-up: the load ends the clean-up.
        again.snapshot(b"small")
        old = [part_key(1, part) for part in range(3)]
        client.put_values([*old, entry_key(4)], [b"x"] * 4, "j")
        third = Journal(client, "j")
        assert third.load() == (b"small", []) and third.seq == 4
        assert client.get_values([*old, entry_key(4)], "j") == [None] * 4
        (head,) = client.get_values([HEAD], "j")
        assert head is not None and b'"generation": 2' in head


def controller_pid(ray: ModuleType) -> int:
    actor = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def journalled(ray: ModuleType) -> int:
    actor = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    return ray.get(actor.journalled.remote())


def kill_controller(ray: ModuleType) -> None:
    """SIGKILL the controller's process, then start TransferQueue again as a restarted job does."""
    pid = controller_pid(ray)
    os.kill(pid, signal.SIGKILL)
    tq.close()


def fields(first: int, count: int) -> TensorDict:
    ids = torch.arange(first, first + count)
    return TensorDict({"input_ids": ids[:, None].repeat(1, 4), "reward": ids.float()}, batch_size=count)


@pytest.mark.parametrize("snapshot_every", [1000, 3], ids=["entries", "snapshots"])
def test_a_killed_controller_comes_back_with_every_key_field_and_consumption(
    ray_cluster: ModuleType, start_server: Servers, snapshot_every: int
) -> None:
    pytest.importorskip("expbuf.client.transferqueue")
    server = start_server()
    settings = conf(f"127.0.0.1:{server.port}", snapshot_every=snapshot_every)
    tq.init(settings)
    try:
        tq.kv_batch_put(keys=[f"k{i}" for i in range(8)], partition_id="train", fields=fields(0, 8))
        tq.kv_put(key="k8", partition_id="train", fields=fields(8, 1), tag={"score": 0.5})
        client = tq.get_client()
        first = client.get_meta(["input_ids", "reward"], 4, "train", mode="fetch", task_name="actor")
        assert first.global_indexes == [0, 1, 2, 3]
        if snapshot_every == 3:
            assert journalled(ray_cluster) < 3  # snapshots took over the entries

        kill_controller(ray_cluster)
        tq.init(settings)
        listed = tq.kv_list("train")["train"]
        assert sorted(listed) == [f"k{i}" for i in range(9)] and listed["k8"] == {"score": 0.5}
        got = tq.kv_batch_get(keys=["k2", "k8"], partition_id="train")
        assert got["reward"].tolist() == [2.0, 8.0]
        client = tq.get_client()
        _, consumed = client.get_consumption_status("actor", "train")
        assert consumed is not None and consumed.tolist()[:9] == [1, 1, 1, 1, 0, 0, 0, 0, 0]
        second = client.get_meta(["input_ids", "reward"], 4, "train", mode="fetch", task_name="actor")
        assert second.global_indexes == [4, 5, 6, 7]  # nothing consumed is handed out again
        tq.kv_clear(keys=["k0", "k1"], partition_id="train")

        kill_controller(ray_cluster)
        tq.init(settings)
        assert sorted(tq.kv_list("train")["train"]) == [f"k{i}" for i in range(2, 9)]
        client = tq.get_client()
        third = client.get_meta(["input_ids", "reward"], 1, "train", mode="fetch", task_name="actor")
        assert third.global_indexes == [8]
        _, critic = client.get_consumption_status("critic", "train")
        assert critic is not None and not critic.any()  # another task consumed nothing
    finally:
        tq.close()


def test_a_controller_waits_out_its_journal_server_and_keeps_the_change_it_was_making(
    ray_cluster: ModuleType, start_server: Servers, tmp_path: Any
) -> None:
    """The journal's server away longer than `wait_s`: the controller answers the put that
    changed its state once the server is back and has kept the change (never a failure that a
    restart would contradict); a restart after it comes back with it."""
    storage = start_server()
    journal = start_server(data=tmp_path / "journal")  # the controller's journal on a server of its own
    settings = OmegaConf.create(
        {
            "backend": {"storage_backend": "Expbuf", "Expbuf": {"target": f"127.0.0.1:{storage.port}", "table": "tq"}},
            "controller": {"Expbuf": {"target": f"127.0.0.1:{journal.port}", "wait_s": 1}},
        }
    )
    tq.init(settings)
    try:
        tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=fields(0, 2))
        start_server.stop(journal)
        with ThreadPoolExecutor(1) as pool:
            put = pool.submit(tq.kv_batch_put, keys=["c"], partition_id="train", fields=fields(2, 1))
            time.sleep(3)  # three times wait_s
            assert not put.done()  # no answer while the change is not kept
            journal = start_server(data=tmp_path / "journal", port=journal.port)
            put.result(timeout=60)
        assert sorted(tq.kv_list("train")["train"]) == ["a", "b", "c"]  # it goes on

        kill_controller(ray_cluster)
        tq.init(settings)
        assert sorted(tq.kv_list("train")["train"]) == ["a", "b", "c"]
        assert tq.kv_batch_get(keys=["a", "c"], partition_id="train")["reward"].tolist() == [0.0, 2.0]
    finally:
        tq.close()


def test_a_fetch_whose_journal_put_was_kept_and_its_answer_lost_hands_its_samples_out(
    start_server: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """A fetch's journal entry the server kept while its answer came after the client's timeout:
    the controller puts the same entry again until the server answers, then hands the samples
    out, never an error for samples that its journal (and so a restart) holds as consumed."""
    server = start_server()
    proxy = SlowReplies(f"127.0.0.1:{server.port}")
    with (
        BufferClient(f"127.0.0.1:{server.port}") as direct,
        BufferClient(proxy.target, timeout=1.0, wait_for_ready=True) as client,
    ):
        direct.create_table("tq")
        live = DurableController()
        live._journal = Journal(client, "tq")
        assert insert(live, "p", 3) == [0, 1, 2]
        produced(live, "p", [0, 1, 2])
        proxy.delay = 2.5  # the server's answers come after the client's timeout
        threading.Timer(1.5, setattr, (proxy, "delay", 0.0)).start()  # then in time again
        with caplog.at_level(logging.WARNING, logger="expbuf.transferqueue"):
            assert fetch(live, "p", 2) == [0, 1]
        assert "controller/journal/00000000000000000003 is unsettled (DEADLINE_EXCEEDED" in caplog.text
        assert live._stopped is None

        restarted = DurableController()
        restarted._restore(*Journal(direct, "tq").load())
        _, consumed = restarted.get_consumption_status("p", "actor")
        assert consumed is not None and consumed.tolist() == [1, 1, 0]  # what was handed out, no more
        assert fetch(live, "p", 1) == [2]


def ask(controller: Any, kind: ZMQRequestType, **body: Any) -> Any:
    """What a controller running in this process answers a request: its reply's body."""
    return controller._handle_request(ZMQMessage.create(kind, sender_id="t", body=body), _Unmeasured()).body


def insert(controller: Any, partition: str, count: int) -> list[int]:
    """The indexes an insert of `count` samples into `partition` is given."""
    meta = ask(controller, ZMQRequestType.GET_META, data_fields=["x"], batch_size=count, partition_id=partition,
               mode="insert")["metadata"]  # fmt: skip
    return list(meta.global_indexes)


def produced(controller: Any, partition: str, indexes: list[int]) -> None:
    """Tell `controller` that field x of `indexes` is stored, as a producer's put does."""
    schema = {"x": {"dtype": torch.float32, "shape": (1,), "is_nested": False}}
    assert ask(controller, ZMQRequestType.NOTIFY_DATA_UPDATE, partition_id=partition, global_indexes=indexes,
               field_schema=schema)["success"]  # fmt: skip


def fetch(controller: Any, partition: str, count: int) -> list[int]:
    """The indexes a fetch of up to `count` samples of field x by task "actor" is handed."""
    meta = ask(controller, ZMQRequestType.GET_META, data_fields=["x"], batch_size=count, partition_id=partition,
               mode="fetch", task_name="actor")["metadata"]  # fmt: skip
    return list(meta.global_indexes)


def test_indexes_reused_after_a_snapshot_are_the_ones_a_restart_hands_out(start_server: Servers) -> None:
    """TransferQueue reuses released indexes in the order of its sets; a set rebuilt by loading a
    snapshot may iterate otherwise than the live one it was saved from, unless the live controller
    takes the loaded state too. The controller runs in this process, its journal in a real server."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("ctl")
        live = DurableController()
        live._journal = Journal(client, "ctl", snapshot_every=10**6)
        first = insert(live, "a", 100)
        dropped = [i for i in first if i not in (3, 40, 70)]
        ask(live, ZMQRequestType.CLEAR_META, global_indexes=dropped, partition_ids=["a"] * len(dropped))
        insert(live, "b", 97)
        live._snapshot()
        ask(live, ZMQRequestType.CLEAR_PARTITION, partition_id="a")
        given = insert(live, "c", 1)

        restarted = DurableController()
        restarted._restore(*Journal(client, "ctl").load())
        assert restarted.index_manager.get_indexes_for_partition("c") == given
        assert insert(restarted, "d", 2) == insert(live, "d", 2)  # the same indexes next, live or restarted


def test_a_durable_change_is_answered_and_a_failed_snapshot_stops_the_controller_after_it(
    start_server: Servers, tmp_path: Any
) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("ctl")
        live = DurableController()
        live._journal = SnapshotFails(client, "ctl", snapshot_every=1)  # a snapshot is due at once
        assert insert(live, "p", 2) == [0, 1]  # its entry is durable: answered
        with pytest.raises(RuntimeError, match="answers nothing more"):
            ask(live, ZMQRequestType.GET_LIST_PARTITIONS)
        restarted = DurableController()
        restarted._restore(*Journal(client, "ctl").load())
        assert restarted.index_manager.get_indexes_for_partition("p") == [0, 1]

        loads = DurableController()
        loads._journal = SnapshotFails(client, "ctl2")
        client.create_table("ctl2")
        loads.save_checkpoint(str(tmp_path / "state.pkl"))
        with pytest.raises(RuntimeError, match="answers nothing more"):  # the loaded state is in no journal
            ask(loads, ZMQRequestType.LOAD_CONTROLLER_CHECKPOINT, path=str(tmp_path / "state.pkl"))
        assert loads._stopped is not None


class Hostile:
    """A pickle that writes `marker` when loaded: what a token of the push scope could put."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@pytest.mark.parametrize("where", ["entry", "snapshot"])
def test_a_hostile_pickle_in_the_journal_is_refused_at_the_restart_and_never_runs(
    start_server: Servers, tmp_path: Path, where: str
) -> None:
    """A pickle that runs code, put under the controller's first journal entry (or as its
    snapshot, under a head naming it): the controller's restart refuses it by name, and its
    code never runs. The controller runs in this process, as its Ray actor runs it."""
    server = start_server()
    marker = tmp_path / "ran"
    hostile = pickle.dumps(Hostile(marker))
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("tq")
        if where == "entry":
            client.put_values([entry_key(1)], [hostile], "tq")
        else:
            head = json.dumps({"generation": 1, "parts": 1, "seq": 0}).encode()
            client.put_values([part_key(1, 0), HEAD], [hostile, head], "tq")
    with pytest.raises(
        pickle.UnpicklingError, match=r"builtins\.exec, which expbuf's TransferQueue backend never loads"
    ):
        DurableController().store_config(conf(f"127.0.0.1:{server.port}"))
    assert not marker.exists()


TOKENS = {"job": frozenset({"push", "sample"}), "ops": frozenset({"admin"}), "intruder": frozenset({"push"})}


def test_the_controller_journals_on_a_push_and_sample_token_and_trusts_no_other_token_s_entry(
    start_server: Servers,
) -> None:
    """The controller's journal runs on the job's push and sample token over a table an admin
    made; another token can neither clear nor replace its entries, and an entry another token put
    first (the next one the controller would write) fails the restart, naming it, where it would
    have been replayed as the controller's own."""
    server = start_server(tokens=TOKENS)
    target = f"127.0.0.1:{server.port}"
    with BufferClient(target, token="ops") as ops:
        ops.create_table("tq")
    settings = conf(target, token="job")
    live = DurableController()
    live.store_config(settings)
    assert insert(live, "p", 2) == [0, 1]  # journalled as entry 1
    with BufferClient(target, token="intruder") as intruder:
        with pytest.raises(PermissionDeniedError, match="another token wrote"):
            intruder.clear_values([entry_key(1)], "tq")
        with pytest.raises(PermissionDeniedError, match="another token wrote"):
            intruder.put_values([entry_key(1)], [pickle.dumps([])], "tq")
        restarted = DurableController()
        restarted.store_config(settings)
        assert restarted.index_manager.get_indexes_for_partition("p") == [0, 1]
        clear = [("request", ZMQRequestType.CLEAR_PARTITION.value, {"partition_id": "p"})]
        intruder.put_values([entry_key(2)], [pickle.dumps(clear)], "tq")  # the entry the controller writes next
    with pytest.raises(PermissionDeniedError, match=r"controller/journal/0+2' holds a value another token wrote"):
        DurableController().store_config(settings)


class Cursor:
    """Sampler state of a type of the user's own, which a restart could not load."""


def test_a_snapshot_a_restart_could_not_load_stops_the_controller_when_it_is_taken(start_server: Servers) -> None:
    """A sampler whose state holds a type the controller does not load back: its first snapshot
    stops the controller, naming the type, while the state it could not keep is still live, rather
    than a restart finding a journal it cannot load."""
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}") as client:
        client.create_table("ctl")
        live = DurableController(sampler=KeepsACursor)
        live._journal = Journal(client, "ctl", snapshot_every=1)  # a snapshot is due at the first entry
        assert insert(live, "p", 2) == [0, 1]  # its entry is durable: answered
        with pytest.raises(RuntimeError, match=r"test_tq_controller\.Cursor"):
            ask(live, ZMQRequestType.GET_LIST_PARTITIONS)
        restarted = DurableController()
        restarted._restore(*Journal(client, "ctl").load())  # the entry before it, as it was
        assert restarted.index_manager.get_indexes_for_partition("p") == [0, 1]
