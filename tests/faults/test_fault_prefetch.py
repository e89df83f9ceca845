"""A process SIGKILLed while batches wait decoded ahead of their caller (`prefetch`): nothing is
lost and nothing is handed over twice.

A trainer killed with batches decoded ahead gives them all back: only the batch its caller
took stays taken. A server killed under such a trainer: the trainer gets the error, never the
batches decoded ahead (they go back to the buffer, and are there when the server is up again).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from expbuf.client import BufferClient, UnavailableError
from expbuf.client.prefetch import THREAD_NAME

from helpers import Decodes, ServerProcess, fill, settle

pytestmark = pytest.mark.faults

TESTS = Path(__file__).resolve().parents[1]

# A trainer that takes one batch of a table and stops there, once two more are decoded ahead
# (prefetch 2, window 3): it prints the batch's uids and waits to be killed.
TRAINER = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, sys.argv[3])
    from helpers import Decodes
    from expbuf.client import BufferClient
    decodes = Decodes(setattr)
    client = BufferClient(sys.argv[1])
    batches = client.sample(sys.argv[4], num_groups=1, delivery=sys.argv[2], lease_seconds=600, window=3, prefetch=2)
    first = next(batches)
    assert decodes.wait(3, 30), decodes.threads
    print(" ".join(first.uids), flush=True)
    threading.Event().wait()
    """
)


@pytest.mark.parametrize("delivery", ["consume", "lease"])
def test_a_trainer_killed_with_batches_decoded_ahead_gives_them_back(
    child_server: ServerProcess, delivery: str
) -> None:
    """The trainer's server lives on (conftest's `child_server`, shared by both deliveries, each
    on a table of its own)."""
    table = f"prefetch_{delivery}"
    with BufferClient(child_server.target, timeout=10) as client:
        client.create_table(table, group_size=2, estimator="none")
        fill(client, 10, table)
        trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER, child_server.target, delivery, str(TESTS), table],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = trainer.stdout.readline()
            assert line, f"the trainer exited with {trainer.wait(10)}: {trainer.stderr.read()}"
            taken = line.split()
            # The server has batch 1's confirmation once it sent batch 4 (a window of 3 after it).
            stats = settle(client, lambda s: s.leased + s.consumed == 8, table)
            assert stats.leased + stats.consumed == 8
        finally:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(30)
        stats = settle(client, lambda s: s.leased + s.consumed == 2, table)
        if delivery == "consume":
            assert (stats.consumed, stats.leased, stats.ready) == (2, 0, 18)
            assert client.get(taken, table=table) == []
        else:
            assert (stats.consumed, stats.leased, stats.ready) == (0, 2, 18)
            leased = client.list_experiences(table, states=["leased"]).experiences
            assert sorted(e.uid for e in leased) == sorted(taken)


def test_a_server_killed_under_batches_decoded_ahead_hands_none_of_them_over(
    tmp_path: Path, serve: Callable[..., ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = str(tmp_path / "data")
    server = serve(data)
    decodes = Decodes(monkeypatch.setattr)
    with BufferClient(server.target, timeout=10, retries=0) as client:
        client.create_table("t", group_size=2, estimator="none")
        fill(client, 10)
        batches = client.sample("t", num_groups=1, lease_seconds=600, window=3, prefetch=2)
        first = next(batches)
        assert first.ack() == 2
        assert decodes.wait(3)
        (thread,) = (t for t in threading.enumerate() if t.name == THREAD_NAME)
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
        thread.join(20)  # it sees the stream break, and ends
        assert not thread.is_alive()
        with pytest.raises(UnavailableError):
            next(batches)
        server = serve(data)
    with BufferClient(server.target, timeout=10) as client:  # the batches held when it was killed are back
        stats = client.stats("t")["t"]
        assert (stats.consumed, stats.leased, stats.ready) == (2, 0, 18)
