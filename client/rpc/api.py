"""The calls of the clients, each declared once (rpc/declare.py), as the classes they inherit.

`Calls` is every call the four clients share: BufferClient, AsyncBufferClient and the two sharded
clients inherit it, each with its runner (client.py, aio.py, shards/). `ServerCalls` adds the calls
only a client of one server makes.
"""

from __future__ import annotations

from .value_calls import ValueCalls


class Calls(ValueCalls):
    """Every call the clients share, declared once."""


class ServerCalls(Calls):
    """The calls of a client of one server: those it shares, and those of its own."""
