"""Each call of the clients is declared once (client/rpc/declare.py, rpc/api.py): every client has
it under its name, with its parameters, defaults and docstring, a coroutine function on an asyncio
client, and a sharded client's route over the shards takes its arguments by name."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from expbuf.client import AsyncBufferClient, BufferClient
from expbuf.client.rpc.api import ServerCalls, ShardCalls
from expbuf.client.rpc.declare import Plan, Unary, declare, declared_calls
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient

CLIENTS = (BufferClient, AsyncBufferClient, ShardedBufferClient, AsyncShardedBufferClient)
AWAITING = (AsyncBufferClient, AsyncShardedBufferClient)
SHARDED = (ShardedBufferClient, AsyncShardedBufferClient)


@pytest.mark.parametrize("kind", CLIENTS, ids=lambda kind: kind.__name__)
def test_each_client_has_each_declared_call_as_declared(kind: type) -> None:
    declared = declared_calls(kind)
    assert set(declared) >= {"put_values", "fail_runs", "create_table", "get_partials", "report_prompts"}
    assert set(declared) >= {"read_part", "claim", "push", "ack", "stats", "create_dataset", "list_prompts"}
    for name, call in declared.items():
        method = getattr(kind, name)
        assert (method.__name__, method.__qualname__) == (name, f"{kind.__name__}.{name}")
        assert method.__doc__ == call.__doc__ and call.__doc__
        assert inspect.signature(method).parameters == call.signature.parameters, name
        assert inspect.iscoroutinefunction(method) == (kind in AWAITING), name


def test_each_kind_of_client_has_its_own_calls_and_none_of_the_others() -> None:
    """A client of one server has writers and list_experiences, a sharded one shard_stats."""
    one, sharded = set(declared_calls(BufferClient)), set(declared_calls(ShardedBufferClient))
    assert (one - sharded, sharded - one) == ({"writers", "list_experiences"}, {"shard_stats"})
    assert not any(hasattr(kind, name) for kind in SHARDED for name in ("writers", "list_experiences"))
    assert not hasattr(BufferClient, "shard_stats") and not hasattr(AsyncBufferClient, "shard_stats")
    assert declared_calls(AsyncBufferClient).keys() == declared_calls(ServerCalls).keys()
    assert declared_calls(AsyncShardedBufferClient).keys() == declared_calls(ShardCalls).keys()


@pytest.mark.parametrize("kind", SHARDED, ids=lambda kind: kind.__name__)
def test_every_route_takes_its_calls_arguments_by_name(kind: type) -> None:
    """A sharded client's method calls its route with each argument by its parameter's name,
    defaults applied: the route names them all, and states no default of its own."""
    for name, call in declared_calls(kind).items():
        assert call.route is not None, name
        route = inspect.signature(call.route(kind))  # type: ignore[arg-type]  # the class's plan, unbound
        arguments = [parameter for parameter in call.signature.parameters][1:]
        route.bind(kind, **dict.fromkeys(arguments))
        stated = [p.name for p in route.parameters.values() if p.name in arguments and p.default is not p.empty]
        assert not stated, f"{name}'s route states defaults of its own: {stated}"


def test_a_declared_call_says_what_it_does() -> None:
    with pytest.raises(TypeError, match="undocumented: a declared call says what it does"):

        @declare()
        def undocumented(self: object) -> Plan[int]:
            return Unary("Stats", None, lambda reply: 0, retry=True)


def test_a_warning_of_a_declared_call_names_the_line_that_made_it(target: str) -> None:
    """The client's frames between the caller and the warning (its method, its runner, the
    declaration) are skipped, blocking or awaited."""
    with BufferClient(target, timeout=10) as client, pytest.warns(FutureWarning, match="capacity") as record:
        client.create_table("old", capacity=10)  # the old name of capacity_experiences
    assert record[0].filename == __file__

    async def awaited() -> None:
        async with AsyncBufferClient(target, timeout=10) as client:
            await client.create_table("old_too", capacity=10)

    with pytest.warns(FutureWarning, match="capacity") as record:
        asyncio.run(awaited())
    assert record[0].filename == __file__


def test_a_str_given_for_names_or_a_table_not_a_str_is_refused_before_any_call(target: str) -> None:
    """A uid given alone where a list of uids goes was read as its characters (get("0/0/0/0/")
    answered nothing, each character missing), a field alone as its letters ("unknown field 'r'"),
    and table=None read the default table: each is a TypeError naming the call and its parameter,
    in every kind of client (a helper's audit)."""
    refused = {
        "get": (("0/0/0/0/",), {}, "uids"),
        "read_fields": ((["0/0/0/0/"], "reward"), {}, "fields"),
        "get_partials": (("0/0",), {}, "task_ids"),
        "delete": ((["u"],), {"groups": b"g"}, "groups"),
        "get_values": ((["k"],), {"table": None}, "table"),
    }

    def each(client: object) -> None:
        for name, (args, kwargs, what) in refused.items():
            with pytest.raises(TypeError, match=f"^{name}: {what} must be"):
                getattr(client, name)(*args, **kwargs)

    async def awaited() -> None:
        async with AsyncBufferClient(target, timeout=10) as client:
            for name, (args, kwargs, what) in refused.items():
                with pytest.raises(TypeError, match=f"^{name}: {what} must be"):
                    await getattr(client, name)(*args, **kwargs)

    with BufferClient(target, timeout=10) as client:
        client.create_table("names", group_size=1)
        each(client)
        assert client.get(["0/0/0/0/"], "names").missing_uids == ["0/0/0/0/"]  # a list, as before
        assert client.stats("names")["names"].pushed == 0
    asyncio.run(awaited())
    sharded = ShardedBufferClient([target], timeout=10)
    try:
        each(sharded)
    finally:
        sharded.close()
