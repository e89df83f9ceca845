"""The adapters' kit (client/kit/): one lease keeper that renews, acknowledges and gives back, and
one way to take a batch whose delivery the server has stored, used by every adapter. A real
server on loopback, real LMDB; a stream cut after its batch arrived is cut on the client's side
of that real stream."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import grpc
import pytest

from expbuf.client import BufferClient, ExpbufError, UnavailableError, trxp
from expbuf.client.kit.batches import take_one
from expbuf.client.kit.lease_keeper import LeaseKeeper
from expbuf.client.kit.retry import Retry
from expbuf.client.results import Batch
from expbuf.client.rpc.connection import BACKOFF

from helpers import fill, group_items, wait_for

CLIENT = Path(__file__).resolve().parent.parent / "client"
ADAPTERS = ("trinity", "verl", "areal", "trl", "torchrl")


@pytest.fixture
def client(client: BufferClient) -> BufferClient:
    """The shared client, with table t holding three groups of two."""
    client.create_table("t", group_size=2, estimator="none")
    fill(client, 3)
    return client


def leased(client: BufferClient, seconds: float = 600.0) -> Batch:
    return next(client.sample("t", num_groups=1, max_batches=1, lease_seconds=seconds))


def test_the_keeper_renews_what_it_holds_and_says_when_it_ends(client: BufferClient) -> None:
    lost: list[str] = []
    keeper = LeaseKeeper(client, "t", 1.5, renewals=client.clone(timeout=0.5), lost=lost.append)
    try:
        batch = leased(client, 1.5)
        keeper.hold(batch.lease_id, batch.lease_expires)
        wait_for(lambda: (keeper.expires(batch.lease_id) or 0) > batch.lease_expires + 1, "a renewal")
        time.sleep(2.0)  # past the lease of 1.5 s the sample asked for
        assert client.stats("t")["t"].leased == 2
        assert keeper.ack(batch.lease_id) == 2
        assert keeper.expires(batch.lease_id) is None and lost == []
    finally:
        keeper.close()
    client.server_info()  # the keeper closed its renewals' client, not the one it settles over


def test_an_ack_that_finds_its_lease_gone_says_so_once_unless_it_was_tried_before(
    client: BufferClient, caplog: pytest.LogCaptureFixture
) -> None:
    lost: list[str] = []
    keeper = LeaseKeeper(client, "t", 600, lost=lost.append)
    first, second = leased(client), leased(client)
    for batch in (first, second):
        keeper.hold(batch.lease_id)
        client.nack(batch.lease_id, "t")  # ended behind the keeper's back
    with caplog.at_level(logging.ERROR):
        assert keeper.ack(first.lease_id) == 0
        assert keeper.ack(first.lease_id) == 0
        assert keeper.ack(second.lease_id, tried=True) == 0  # an earlier attempt may have consumed it
    assert lost == [first.lease_id]
    assert caplog.text.count(f"lease {first.lease_id} ended before it was acknowledged") == 1
    assert second.lease_id not in caplog.text
    assert keeper.give_back(first.lease_id) is True  # gone already: its groups are back
    keeper.close()


def test_an_ack_the_server_cannot_take_keeps_the_lease_renewed(start_server: Any) -> None:
    server = start_server()
    with BufferClient(f"127.0.0.1:{server.port}", timeout=2, retries=0) as client:
        client.create_table("t", group_size=2, estimator="none")
        client.push(trxp.build(group_items(1, 0, 2)), table="t")
        batch = leased(client)
        keeper = LeaseKeeper(client, "t", 600)
        keeper.hold(batch.lease_id, batch.lease_expires)
        server.stop(grace=1)
        with pytest.raises(UnavailableError):
            keeper.ack(batch.lease_id, retry_for=1.0)
        assert keeper.expires(batch.lease_id) == batch.lease_expires  # held, to be acked again
        assert keeper.give_back(batch.lease_id) is False  # out of reach: it returns when it ends
        assert keeper.expires(batch.lease_id) is None
        keeper.close()


def test_an_ack_on_a_closed_client_leaves_the_lease_to_end(target: str, client: BufferClient) -> None:
    """Its ack refused (ExpbufError CANCELLED: the client is closed), the keeper held the lease again
    to ack it later, renewing it over its own open client for good: the batch, which no ack could
    reach, stayed leased (a review of the closed client's error)."""
    settles = BufferClient(target, timeout=5)
    keeper = LeaseKeeper(settles, "t", 600, renewals=client.clone())
    try:
        batch = next(settles.sample("t", num_groups=1, max_batches=1, lease_seconds=600))
        keeper.hold(batch.lease_id, batch.lease_expires)
        settles.close()
        with pytest.raises(ExpbufError, match="Ack on a closed client"):
            keeper.ack(batch.lease_id)
        assert keeper.expires(batch.lease_id) is None  # not renewed: it ends when its lease does
    finally:
        keeper.close()


class CutAfterBatch(BufferClient):
    """A client whose sample streams are cut (UNAVAILABLE) right after their batch arrived,
    before the server ended them: the server may have stored the delivery."""

    def sample(self, *args: Any, **kwargs: Any) -> Generator[Batch, None, None]:  # type: ignore[override]
        for batch in super().sample(*args, **kwargs):
            yield batch
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the connection was cut")


def test_a_batch_is_taken_only_once_its_stream_ended_and_given_back_when_cut(client: BufferClient) -> None:
    batch = take_one(client, "t", pytest.fail, num_groups=1, delivery="lease")
    assert batch is not None and client.stats("t")["t"].leased == 2  # its lease stored before it came
    given: list[Batch] = []
    with CutAfterBatch(client.target) as cut, pytest.raises(UnavailableError):
        take_one(cut, "t", given.append, num_groups=1, delivery="lease")
    assert len(given) == 1 and given[0].lease_id
    assert take_one(client, "t", pytest.fail, num_groups=2, allow_partial=True, timeout=1) is not None
    assert take_one(client, "t", pytest.fail, num_groups=2, allow_partial=True, timeout=1) is None


def test_every_adapter_takes_and_settles_its_batches_through_the_kit() -> None:
    """No adapter calls a client's sample, ack, nack or renew itself: taking a durable batch and
    keeping a lease have one owner each, client/kit/."""
    direct = re.compile(r"client\)?\.(sample|ack|nack|renew)\(")
    found = [
        f"{path.relative_to(CLIENT)}:{number}: {line.strip()}"
        for adapter in ADAPTERS
        for path in sorted((CLIENT / adapter).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert found == []
    uses = {adapter: " ".join(p.read_text() for p in (CLIENT / adapter).rglob("*.py")) for adapter in ADAPTERS}
    assert [a for a, text in uses.items() if "take_one(" not in text or "LeaseKeeper(" not in text] == []


def test_a_retry_pauses_as_the_clients_own_retries_do_and_gives_up_at_its_bound() -> None:
    retry = Retry(within=3.0)
    pauses = [retry.pause() for _ in range(4)]
    assert None not in pauses
    first = BACKOFF.initial  # 0.125 s
    assert all(0.8 * first * 2**n <= p <= 1.2 * first * 2**n for n, p in enumerate(pauses) if p is not None)
    grown = [retry.pause() for _ in range(8)]
    assert all(p is not None and p <= 2.4 for p in grown)  # at most 2 s, jittered
    assert all(p is not None and p >= 1.6 for p in grown[2:])
    late = Retry(within=0.0)
    assert late.pause() is None  # no time to try again: the caller raises what failed
    retry.reset()
    again = retry.pause()
    assert again is not None and again <= 1.2 * first  # a success starts again from the shortest pause
    unbounded = Retry()
    assert all(unbounded.pause() is not None for _ in range(100))


def test_every_adapter_waits_for_an_unavailable_server_with_the_kits_retry() -> None:
    """One policy for a server out of reach: no adapter (nor the kit's other modules) keeps its own
    pause between tries."""
    own = re.compile(r"\b(PAUSE|pause)\s*=\s*[0-9]")
    found = [
        f"{path.relative_to(CLIENT)}:{number}: {line.strip()}"
        for folder in (*ADAPTERS, "kit")
        for path in sorted((CLIENT / folder).rglob("*.py"))
        if path.name != "retry.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if own.search(line)
    ]
    assert found == []
