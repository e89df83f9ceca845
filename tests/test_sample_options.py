"""`sample()`'s options are checked by the client before any stream opens, each refusal a
ValueError naming the option and the values it may take, the same for the blocking and the
asyncio client (one SampleSpec, and one check of an order against the server's): `num_groups=0`
said "pass exactly one of", and an order no server has was refused by the server once the stream
had opened, though the page says before. A real server on loopback, real LMDB."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from expbuf.client import AsyncBufferClient, BufferClient

from helpers import make_experience


def refusals(target: str, options: dict[str, Any]) -> list[BaseException]:
    """What the first batch of a sample() with `options` of table `t` raises, from either client."""
    raised: list[BaseException] = []
    with BufferClient(target, timeout=10) as client:
        try:
            next(client.sample("t", max_batches=1, timeout=5, **options))
        except Exception as exc:
            raised.append(exc)

    async def sample() -> None:
        async with AsyncBufferClient(target, timeout=10) as aclient:
            await anext(aclient.sample("t", max_batches=1, timeout=5, **options))

    try:
        asyncio.run(sample())
    except Exception as exc:
        raised.append(exc)
    return raised


@pytest.fixture
def table(client: BufferClient) -> str:
    client.create_table("t", group_size=1, estimator="none")
    client.push([make_experience(0, task, 0) for task in range(2)], table="t")
    return "t"


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"num_groups": 0}, "sample: num_groups is 0; it must be an integer >= 1 (whole groups a batch)"),
        ({"batch_size": 0}, "sample: batch_size is 0; it must be an integer >= 1 (experiences a batch"),
        ({"num_groups": 1, "batch_size": 1}, "pass exactly one of batch_size"),
        ({}, "pass exactly one of batch_size"),
        ({"num_groups": 1, "order": "FIFO"}, "sample: order is 'FIFO'; expected one of fifo, lifo, uniform, priority"),
        ({"num_groups": 1, "order": "lifo "}, "or the name of an order registered on the server (lower case"),
        (
            {"num_groups": 1, "delivery": "leased"},
            "sample: delivery is 'leased'; expected one of consume, lease, replay",
        ),
    ],
    ids=["no-groups", "no-experiences", "both", "neither", "order-case", "order-space", "delivery"],
)
def test_a_bad_option_is_refused_naming_what_it_may_be(
    client: BufferClient, target: str, table: str, options: dict[str, Any], says: str
) -> None:
    for refused in refusals(target, options):
        assert type(refused) is ValueError and says in str(refused), refused
    assert client.stats(table)[table].ready == 2  # nothing was taken


def test_an_order_the_server_has_not_is_refused_before_the_stream_naming_the_servers_orders(
    client: BufferClient, target: str, table: str
) -> None:
    """A name of an order's form that the server has not registered: the client asks the server
    which orders it has (ServerInfo) before the stream, and refuses it, naming them."""
    raised = refusals(target, {"num_groups": 1, "order": "random"})
    assert len(raised) == 2
    for refused in raised:
        assert type(refused) is ValueError, refused
        assert "sample: order is 'random'; this server samples in the orders fifo, lifo, uniform, priority" in str(
            refused
        )
    assert client.stats(table)[table].ready == 2
    (batch,) = client.sample(table, num_groups=1, order="uniform", max_batches=1, timeout=5)
    assert len(batch.uids) == 1
