"""How an adapter reaches its table: a client as given or made from a target (frameworks' configs
hold strings), and the table's settings looked up by name, for an adapter that checks them
before it starts: one look-up, one refusal that names the table, the server and how to make it."""

from __future__ import annotations

from typing import Any

from ..client import BufferClient
from ..results import TableInfo


def connect(client: BufferClient | str, token: str | None = None, **options: Any) -> BufferClient:
    """A BufferClient as given, or one to the target "HOST:PORT" (closed by `close_made`)."""
    if isinstance(client, BufferClient):
        return client
    if not isinstance(client, str) or not client:
        raise ValueError(f"client must be a BufferClient or a 'HOST:PORT' target, got {client!r}")
    return BufferClient(client, token=token, **options)


def close_made(given: BufferClient | str, client: BufferClient) -> None:
    """An adapter's close: the client `connect` made from a target string is closed (its channels,
    and their sockets, go now, not when the adapter is garbage); one the caller gave is the caller's."""
    if client is not given:
        client.close()


def table_info(client: BufferClient, table: str, *, make_it: str = "") -> TableInfo:
    """The settings of `table` (ListTables); a ValueError naming the table and the server where
    there is none, and `make_it`, how to create one the adapter can use."""
    for info in client.list_tables():
        if info.name == table:
            return info
    how = f"; {make_it}" if make_it else ""
    raise ValueError(
        f"expbuf table {table!r} does not exist at {client.target}: create it first "
        f"(the server's TOML [[tables]], create_table or `expbuf table create`){how}"
    )
