"""TransferQueue on expbuf through SIGKILLs (client/transferqueue/: the storage backend and the
durable controller). A producer puts fields, a consumer fetches them for its task, reads and
clears them a batch later, each in a Ray actor of its own, as a job's workers do; the test keeps
a durable log of every acknowledged put, batch handed out and clear, so that at every kill some
samples wait to be consumed and others are consumed and not yet cleared. In turn, the controller's process is
killed with a put in flight (and the job started again, as TransferQueue has no reconnect), the
producer's with a put in flight, the consumer's between batches, and the expbuf server's with
a put and a fetch in flight (started again on its data a second later). After each, every sample
put and not cleared before the kill is there with its fields, no sample is handed out twice, and at the end the
samples handed out are exactly the ones put, each once.

The consumer is killed between batches only: TransferQueue marks a fetch consumed when it answers
(at most once), so a consumer dying inside a fetch loses that batch with or without expbuf (the
samples stay stored and marked consumed). EXPBUF_SOAK_SCALE scales the rounds."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from faultkit import scaled
from helpers import ServerProcess, servers


def import_frameworks() -> None:
    """Run by tests/conftest.py before this module's tests: not at its import, which every pytest worker does."""
    global tq, OmegaConf
    tq = pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf


BATCH = 8
PARTITION, TASK = "train", "actor"


class Log:
    """The test's durable log: one JSON line a record, flushed to disk before the next step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, **record: Any) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()
            os.fsync(file.fileno())

    def records(self, kind: str) -> list[dict[str, Any]]:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return [record for record in map(json.loads, lines) if record["kind"] == kind]

    def put(self) -> list[int]:
        return sorted({key for record in self.records("put") for key in record["keys"]})

    def handed_out(self) -> list[int]:
        return [key for record in self.records("got") for key in record["keys"]]

    def cleared(self) -> set[int]:
        return {key for record in self.records("cleared") for key in record["keys"]}


def role(ray: ModuleType) -> Any:
    """A producer's or a consumer's actor (its class made here, so Ray ships it by value); one a
    call, so that a killed role's restart starts only its own process."""

    class Worker:
        def __init__(self) -> None:
            import expbuf.client.transferqueue  # noqa: F401  (registers the backend here)

            tq.init()

        def pid(self) -> int:
            return os.getpid()

        def put(self, keys: list[int]) -> list[int]:
            from tensordict import TensorDict

            ids = torch.tensor(keys)
            fields = TensorDict({"id": ids, "tokens": ids[:, None] * 1000 + torch.arange(64)}, batch_size=len(keys))
            tq.kv_batch_put(keys=[f"k{key}" for key in keys], partition_id=PARTITION, fields=fields)
            return keys

        def take(self) -> list[int]:
            client = tq.get_client()
            meta = client.get_meta(["id", "tokens"], BATCH, PARTITION, mode="fetch", task_name=TASK)
            if not meta.global_indexes:
                return []
            data = client.get_data(meta)
            ids = data["id"].tolist()
            tokens = data["tokens"]
            assert [row.tolist() for row in (tokens.unbind() if tokens.is_nested else tokens)] == [
                [key * 1000 + t for t in range(64)] for key in ids
            ]
            return ids

        def clear(self, keys: list[int]) -> None:
            tq.kv_clear(keys=[f"k{key}" for key in keys], partition_id=PARTITION)

    return ray.remote(num_cpus=0)(Worker).remote()


def check_stored(log: Log) -> None:
    """Every sample put and not yet cleared is listed, with its fields."""
    waiting = sorted(set(log.put()) - log.cleared())
    listed = tq.kv_list(PARTITION).get(PARTITION, {}) if waiting else {}
    assert {f"k{key}" for key in waiting} <= set(listed)
    if waiting:
        got = tq.kv_batch_get(keys=[f"k{key}" for key in waiting], partition_id=PARTITION)
        assert got["id"].tolist() == waiting


def test_transfer_queue_on_expbuf_loses_nothing_and_hands_out_nothing_twice_through_kills(
    ray_cluster: ModuleType, tmp_path: Path
) -> None:
    ray = ray_cluster
    log = Log(tmp_path / "log.jsonl")
    next_key = 0

    def batch() -> list[int]:
        nonlocal next_key
        next_key += BATCH
        return list(range(next_key - BATCH, next_key))

    def take(consumer: Any) -> None:
        """Hand a batch out, and clear the one handed out before it: at each kill, samples wait
        unconsumed, and others are consumed and not yet cleared."""
        keys = ray.get(consumer.take.remote(), timeout=120)
        log.write(kind="got", keys=keys)
        done = sorted(set(log.handed_out()) - set(keys) - log.cleared())
        if done:
            ray.get(consumer.clear.remote(done), timeout=120)
            log.write(kind="cleared", keys=done)

    def put(producer: Any, keys: list[int]) -> None:
        ray.get(producer.put.remote(keys), timeout=120)
        log.write(kind="put", keys=keys)

    with servers() as start:
        server: ServerProcess = start(str(tmp_path / "data"))
        settings = OmegaConf.create(
            {
                "backend": {"storage_backend": "Expbuf", "Expbuf": {"target": server.target, "table": "tq"}},
                # snapshots and entries both in play; a fetch of too few answers at once, empty
                "controller": {"polling_mode": True, "Expbuf": {"snapshot_every": 7}},
            }
        )
        import expbuf.client.transferqueue  # noqa: F401

        tq.init(settings)
        producer, consumer = role(ray), role(ray)
        try:
            for _ in range(scaled(1)):
                for target in ("controller", "producer", "consumer", "expbuf"):
                    put(producer, batch())
                    take(consumer)
                    keys = batch()
                    if target == "controller":
                        in_flight = producer.put.remote(keys)
                        time.sleep(0.05)
                        controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
                        os.kill(ray.get(controller.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
                        for worker in (producer, consumer):  # the job goes down with it
                            ray.kill(worker)
                        tq.close()
                        tq.init(settings)
                        producer, consumer = role(ray), role(ray)
                        put(producer, keys)  # the put in flight, again: a key's second put is the first's
                    elif target == "producer":
                        in_flight = producer.put.remote(keys)
                        time.sleep(0.05)
                        os.kill(_pid(ray, producer), signal.SIGKILL)
                        try:
                            ray.get(in_flight, timeout=60)
                            log.write(kind="put", keys=keys)  # it was acknowledged before the kill
                        except ray.exceptions.RayActorError:
                            pass
                        producer = role(ray)
                        put(producer, keys)
                    elif target == "consumer":
                        os.kill(_pid(ray, consumer), signal.SIGKILL)
                        consumer = role(ray)
                        put(producer, keys)
                    else:
                        in_flight = producer.put.remote(keys)
                        fetch = consumer.take.remote()
                        time.sleep(0.05)
                        server.stop(signal.SIGKILL)
                        time.sleep(1)
                        server = start(str(tmp_path / "data"), "--port", str(server.port))
                        ray.get(in_flight, timeout=120)
                        log.write(kind="put", keys=keys)
                        log.write(kind="got", keys=ray.get(fetch, timeout=120))
                    check_stored(log)
                    handed_out = log.handed_out()
                    assert len(handed_out) == len(set(handed_out)), "a sample was handed out twice"

            while len(log.handed_out()) < len(log.put()):
                before = len(log.handed_out())
                take(consumer)
                assert len(log.handed_out()) > before, "samples put were not handed out"
            assert sorted(log.handed_out()) == log.put()  # each sample put handed out, once
            assert len(log.put()) == next_key
        finally:
            tq.close()


def _pid(ray: ModuleType, actor: Any) -> int:
    return ray.get(actor.pid.remote(), timeout=60)
