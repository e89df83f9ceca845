"""The expbuf client and table an AReaL component talks to, given as objects or as config values."""

from __future__ import annotations

from typing import Any

from ..client import BufferClient
from ..results import TableInfo

# Which eid key names a group, per table `group_by` (the server's own grouping).
GROUP_KEY_OF = {"task": "tid", "run": "rid", "step": "sid"}


def connect(client: BufferClient | str, token: str | None = None, **options: Any) -> BufferClient:
    """A BufferClient as given, or one to the target "HOST:PORT" (AReaL's configs hold strings)."""
    if isinstance(client, BufferClient):
        return client
    if not isinstance(client, str) or not client:
        raise ValueError(f"client must be a BufferClient or a 'HOST:PORT' target, got {client!r}")
    return BufferClient(client, token=token, **options)


def table_config(client: BufferClient, table: str) -> TableInfo:
    """The table's settings (ListTables), or a clear error naming the table and the server."""
    for config in client.list_tables():
        if config.name == table:
            return config
    raise ValueError(f"expbuf at {client.target} has no table '{table}'; create it first (create_table or TOML)")
