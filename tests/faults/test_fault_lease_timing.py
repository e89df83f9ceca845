"""Leases under the default credit window with a slow trainer, against an `expbuf serve` child.

With `window = 2` the server prepares the next batches while the trainer's caller is still
on one. A leased batch's clock starts when the client hands it to its caller, so a trainer
whose step is longer than half its lease still acks every batch in time, and a second
trainer alongside is never handed a batch the first one holds (issue: leases expired in the
window, acks failed NOT_FOUND and uids went to both trainers).
"""

from __future__ import annotations

import threading
import time

import pytest

from expbuf.client import BufferClient, trxp

from faultkit import group, scaled

pytestmark = pytest.mark.faults

LEASE = 3.0  # seconds
STEP = 2.0  # a training step: two of them are longer than the lease


def test_a_slow_trainer_acks_every_batch_and_no_uid_goes_to_two_trainers(serve, tmp_path) -> None:
    server = serve(str(tmp_path / "data"))
    steps = scaled(4)
    with BufferClient(f"127.0.0.1:{server.port}", timeout=30) as client:
        client.create_table("t", group_size=2, estimator="none")
        client.push(trxp.build([item for task in range(200) for item in group("s", task, 2)]), table="t")
        seen: dict[str, list[str]] = {"slow": [], "fast": []}
        failed: list[BaseException] = []
        stop = threading.Event()

        def fast() -> None:  # a second trainer: quick steps, acks at once
            try:
                while not stop.is_set():
                    for batch in client.sample("t", num_groups=1, lease_seconds=LEASE, max_batches=1, timeout=5):
                        seen["fast"] += batch.uids
                        batch.ack()
                    time.sleep(0.05)
            except BaseException as exc:
                failed.append(exc)

        other = threading.Thread(target=fast)
        other.start()
        try:
            acked = 0
            for batch in client.sample("t", num_groups=2, lease_seconds=LEASE, max_batches=steps):
                seen["slow"] += batch.uids
                time.sleep(STEP)
                acked += batch.ack()
        finally:
            stop.set()
            other.join(60)
        assert not failed, failed
        assert acked == 4 * steps
        assert not set(seen["slow"]) & set(seen["fast"])
        stats = client.stats("t")["t"]
        assert stats.leases_expired == 0
        assert stats.consumed == len(seen["slow"]) + len(seen["fast"])
