"""SIGKILL an `expbuf serve` child while a pusher has a window of pushes in flight.

Every push is either acknowledged, and then durable (Get finds it after a restart on the
killed data), or fails with an error that names its uids. A server that is back within the
pushes' deadline takes the pushes that were in flight again, when the client waits for it
(wait_for_ready), and then every push is acknowledged.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import pytest

from expbuf.client import BufferClient, PushResult, UnavailableError

from faultkit import payload, servers
from helpers import ServerProcess

pytestmark = pytest.mark.faults

PUSHES = 40
WINDOW = 8


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerProcess]]:
    with servers() as start:
        yield start


def push_through_a_kill(
    target: str, acked_before_kill: int, kill: Callable[[], None], **client: float | bool
) -> tuple[list[futures.Future[PushResult]], list[list[str]]]:
    """Push PUSHES groups with a window of WINDOW, killing the server once `acked_before_kill` are acked."""
    acked = threading.Event()
    count = [0]
    lock = threading.Lock()

    def one_more(future: futures.Future[PushResult]) -> None:
        with lock:
            count[0] += future.exception() is None
            if count[0] == acked_before_kill:
                acked.set()

    killer = threading.Thread(target=lambda: (acked.wait(120), kill()))
    killer.start()
    pushed, sent = [], []
    with BufferClient(target, **client) as buffer, buffer.pusher("default", window=WINDOW) as pusher:
        for task in range(PUSHES):
            body, uids = payload("pipe", task)
            future = pusher.push(body)
            future.add_done_callback(one_more)
            pushed.append(future)
            sent.append(uids)
    killer.join()
    return pushed, sent


def test_a_killed_server_loses_no_acked_push_and_names_the_uids_of_each_failed_one(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    data = str(tmp_path / "data")
    server = serve(data)
    pushed, sent = push_through_a_kill(server.target, 5, lambda: server.stop(signal.SIGKILL), retries=2, timeout=10)
    acked = [uids for future, uids in zip(pushed, sent, strict=True) if future.exception() is None]
    failed = [(future.exception(), uids) for future, uids in zip(pushed, sent, strict=True) if future.exception()]
    assert len(acked) >= 5 and failed, "the kill came while pushes were in flight"
    for error, uids in failed:
        assert isinstance(error, UnavailableError), error
        for uid in uids:
            assert uid in error.details
    for future, uids in zip(pushed, sent, strict=True):
        if future.exception() is None:
            assert future.result().stored + future.result().duplicates == uids
    again = serve(data)
    with BufferClient(again.target) as client:
        assert client.get([uid for uids in acked for uid in uids]).missing_uids == []


def test_a_server_back_within_the_deadline_takes_every_push_that_was_in_flight(
    tmp_path: Path, serve: Callable[..., ServerProcess]
) -> None:
    data = str(tmp_path / "data")
    server = serve(data)
    port = server.port

    def restart() -> None:
        server.stop(signal.SIGKILL)
        serve(data, "--port", str(port))

    pushed, sent = push_through_a_kill(server.target, 5, restart, wait_for_ready=True, timeout=120)
    for future, uids in zip(pushed, sent, strict=True):
        result = future.result()
        assert sorted(result.stored + result.duplicates) == sorted(uids)
    with BufferClient(server.target) as client:
        assert client.get([uid for uids in sent for uid in uids]).missing_uids == []
