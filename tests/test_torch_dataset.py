"""ExperienceDataset in a trainer's loop (from an audit of the trainer's side): its leases cover a
step, not the wait for the next batch; a DataLoader's workers are refused by name; a loop left
with `break` gives its batch back unless it is acknowledged first."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch.utils.data

from expbuf.client import BufferClient, trxp
from expbuf.client.errors import NotFoundError
from expbuf.client.torch import ExperienceDataset

from helpers import group_items


def push(client: BufferClient, task: int) -> None:
    client.push(trxp.build(group_items(7, task, 2)))


def test_a_batch_is_acknowledged_before_the_next_is_waited_for(client: BufferClient) -> None:
    """It was acknowledged once the next batch had come: a trainer waiting for rollouts past its
    lease (a short step, slow rollouts) found the trained batch's lease expired, the batch served
    again and the loop ended by NotFoundError (the audit: lease_seconds 2, rollouts every 3 s)."""
    push(client, 0)
    later = threading.Timer(3.0, push, (client, 1))  # the next group comes after the first's lease
    seen = []
    for batch in ExperienceDataset(client, num_groups=1, max_batches=2, lease_seconds=2.0, timeout=20):
        seen.append(batch.groups[0])
        if len(seen) == 1:
            later.start()
    later.join()
    assert seen == ["7/0", "7/1"]
    stats = client.stats()["default"]
    assert (stats.consumed, stats.ready, stats.leased) == (4, 0, 0)


def test_a_step_longer_than_its_lease_says_which_setting(client: BufferClient) -> None:
    push(client, 0)
    dataset = ExperienceDataset(client, num_groups=1, lease_seconds=1.0, timeout=5)
    with pytest.raises(NotFoundError, match="pass lease_seconds longer than a step among its sample arguments"):
        for _ in dataset:
            time.sleep(2.5)  # past the lease and the server's next look at it
    stats = client.stats()["default"]
    assert (stats.ready, stats.leased) == (2, 0)  # back, to be trained again, and nothing else held


def test_a_loop_left_with_break_gives_its_batch_back_unless_acknowledged(client: BufferClient) -> None:
    """`for batch in loader: train(batch); break` cannot tell a finished step from one that raised:
    the batch goes back, to be trained again, unless `ack_held()` says its step is done."""
    for task in range(3):
        push(client, task)
    dataset = ExperienceDataset(client, num_groups=1, timeout=5)
    for _ in dataset:
        break
    assert client.stats()["default"].ready == 6
    for _ in dataset:
        assert dataset.ack_held() == 2
        break
    stats = client.stats()["default"]
    assert (stats.consumed, stats.ready, stats.leased) == (2, 4, 0)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_dataloaders_workers_are_refused_naming_num_workers(client: BufferClient, start: str) -> None:
    """With num_workers > 0 a forked worker iterated a copy of the client, its batches unpicklable on
    their way back (gRPC's channel): the loader waited for good, and the batches the workers acked
    were lost (the audit: 2 groups consumed, 0 seen); spawn failed on pickling the channel."""
    push(client, 0)
    loader = torch.utils.data.DataLoader(
        ExperienceDataset(client, num_groups=1, timeout=5),
        batch_size=None,
        num_workers=1,
        multiprocessing_context=start,
        timeout=60,
    )
    with pytest.raises(RuntimeError, match=r"use DataLoader\(\.\.\., num_workers=0\)"):
        next(iter(loader))
    stats = client.stats()["default"]
    assert (stats.ready, stats.consumed) == (2, 0)


def test_a_script_that_exits_with_a_sample_stream_open_ends_it_quietly(client: BufferClient) -> None:
    """A script's `batches = client.sample(...)`, `next(batches)`, and no close(): the stream, left to
    the collector, ran its end with the modules torn down and printed "Exception ignored in ...
    TypeError: catching classes that do not inherit from BaseException is not allowed" (the audit,
    a lease stream), and a consume stream's script never ended (here: killed at 120 s). It is ended
    as the interpreter exits, as leaving its loop ends it: the batch had is delivered."""
    for task in range(2):
        push(client, task)
    script = (
        "from expbuf.client import BufferClient\n"
        f"client = BufferClient({client.target!r}, timeout=10)\n"
        "batches = client.sample(num_groups=1, delivery='consume', timeout=5)\n"
        "print(next(batches).groups[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "7/0\n", "")
    stats = client.stats()["default"]
    assert (stats.consumed, stats.ready, stats.leased) == (2, 2, 0)  # the batch on its way came back
