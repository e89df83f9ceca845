"""SIGKILL an `expbuf serve` child while a pusher has a window of pushes in flight, from the
blocking and the asyncio client.

Every push is either acknowledged, and then durable (Get finds it after a restart on the
killed data), or fails with an error that names its uids. A server that is back within the
pushes' deadline takes the pushes that were in flight again, when the client waits for it
(wait_for_ready), and then every push is acknowledged. The asyncio pusher's pushes are large,
so that it is still writing when the server dies.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

from expbuf.client import AsyncBufferClient, BufferClient, PushResult, UnavailableError, trxp

from faultkit import payload, servers
from helpers import ServerProcess, group_items

pytestmark = pytest.mark.faults

PUSHES = 40
WINDOW = 8
KINDS = ("blocking", "asyncio")


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerProcess]]:
    with servers() as start:
        yield start


def push_through_a_kill(
    kind: str, target: str, acked_before_kill: int, kill: Callable[[], None], **client: Any
) -> tuple[list[PushResult | BaseException], list[list[str]]]:
    """Push PUSHES groups with a window of WINDOW from a client of `kind`, killing the server once
    `acked_before_kill` are acked; each push's outcome, and its uids."""
    acked = threading.Event()
    count = [0]
    lock = threading.Lock()

    def one_more(future: futures.Future[PushResult] | asyncio.Future[PushResult]) -> None:
        with lock:
            count[0] += future.exception() is None
            if count[0] == acked_before_kill:
                acked.set()

    killer = threading.Thread(target=lambda: (acked.wait(120), kill()))
    killer.start()
    if kind == "blocking":
        bodies = [payload("pipe", task) for task in range(PUSHES)]
        with BufferClient(target, **client) as buffer, buffer.pusher("default", window=WINDOW) as pusher:
            pushed = []
            for body, _ in bodies:
                pushed.append(pusher.push(body))
                pushed[-1].add_done_callback(one_more)
        outcomes = [future.exception() or future.result() for future in pushed]
    else:
        bodies = [large("pipe", task) for task in range(PUSHES)]

        async def push_all() -> list[PushResult | BaseException]:
            async with AsyncBufferClient(target, **client) as buffer, buffer.pusher("default", window=WINDOW) as pusher:
                pushed = []
                for body, _ in bodies:
                    pushed.append(await pusher.push(body))
                    pushed[-1].add_done_callback(one_more)
            return await asyncio.gather(*pushed, return_exceptions=True)

        outcomes = asyncio.run(push_all())
    killer.join()
    return outcomes, [uids for _, uids in bodies]


def large(batch: str, task: int) -> tuple[bytes, list[str]]:
    """TRXP bytes of a group of four runs, about 290 KB: the client is still writing one when the server dies."""
    items = group_items(batch, task, 4, response=8000)
    return trxp.build(items), [item.uid for item in items]


@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_server_loses_no_acked_push_and_names_the_uids_of_each_failed_one(
    tmp_path: Path, serve: Callable[..., ServerProcess], kind: str
) -> None:
    data = str(tmp_path / "data")
    server = serve(data)
    outcomes, sent = push_through_a_kill(
        kind, server.target, 5, lambda: server.stop(signal.SIGKILL), retries=2, timeout=10
    )
    acked = [uids for outcome, uids in zip(outcomes, sent, strict=True) if isinstance(outcome, PushResult)]
    failed = [
        (outcome, uids) for outcome, uids in zip(outcomes, sent, strict=True) if not isinstance(outcome, PushResult)
    ]
    assert len(acked) >= 5 and failed, "the kill came while pushes were in flight"
    for error, uids in failed:
        assert isinstance(error, UnavailableError), error
        for uid in uids:
            assert uid in error.details
    for outcome, uids in zip(outcomes, sent, strict=True):
        if isinstance(outcome, PushResult):
            assert outcome.stored + outcome.duplicates == uids
    again = serve(data)
    with BufferClient(again.target) as client:
        assert client.get([uid for uids in acked for uid in uids]).missing_uids == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_back_within_the_deadline_takes_every_push_that_was_in_flight(
    tmp_path: Path, serve: Callable[..., ServerProcess], kind: str
) -> None:
    data = str(tmp_path / "data")
    server = serve(data)
    port = server.port

    def restart() -> None:
        server.stop(signal.SIGKILL)
        serve(data, "--port", str(port))

    outcomes, sent = push_through_a_kill(kind, server.target, 5, restart, wait_for_ready=True, timeout=120)
    for outcome, uids in zip(outcomes, sent, strict=True):
        assert isinstance(outcome, PushResult), outcome
        assert sorted(outcome.stored + outcome.duplicates) == sorted(uids)
    with BufferClient(server.target) as client:
        assert client.get([uid for uids in sent for uid in uids]).missing_uids == []
