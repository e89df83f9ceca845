"""Each call of the clients is declared once (client/rpc/declare.py, rpc/api.py): every client has
it under its name, with its parameters, defaults and docstring, a coroutine function on an asyncio
client, and a sharded client's route over the shards takes its arguments by name."""

from __future__ import annotations

import inspect

import pytest

from expbuf.client import AsyncBufferClient, BufferClient
from expbuf.client.rpc.api import Calls, ServerCalls
from expbuf.client.rpc.declare import Plan, Unary, declare, declared_calls
from expbuf.client.shards.blocking import AsyncShardedBufferClient, ShardedBufferClient

CLIENTS = (BufferClient, AsyncBufferClient, ShardedBufferClient, AsyncShardedBufferClient)
AWAITING = (AsyncBufferClient, AsyncShardedBufferClient)
SHARDED = (ShardedBufferClient, AsyncShardedBufferClient)


@pytest.mark.parametrize("kind", CLIENTS, ids=lambda kind: kind.__name__)
def test_each_client_has_each_declared_call_as_declared(kind: type) -> None:
    declared = declared_calls(kind)
    assert set(declared) >= {"put_values", "get_values", "clear_values", "get_partials", "read_part", "get"}
    assert set(declared) >= {"claim", "report_prompts", "create_dataset", "ledger", "list_prompts"}
    for name, call in declared.items():
        method = getattr(kind, name)
        assert (method.__name__, method.__qualname__) == (name, f"{kind.__name__}.{name}")
        assert method.__doc__ == call.__doc__ and call.__doc__
        assert inspect.signature(method).parameters == call.signature.parameters, name
        assert inspect.iscoroutinefunction(method) == (kind in AWAITING), name


def test_the_calls_of_one_server_are_not_the_sharded_clients() -> None:
    assert set(declared_calls(BufferClient)) - set(declared_calls(ShardedBufferClient)) == {"list_experiences"}
    assert not any(hasattr(kind, "list_experiences") for kind in SHARDED)
    assert declared_calls(AsyncBufferClient).keys() == declared_calls(ServerCalls).keys()
    assert declared_calls(ShardedBufferClient).keys() == declared_calls(Calls).keys()


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
