"""Deprecated: `expbuf.server.store.schema.table_config` (client/moved.py)."""

from expbuf.client.moved import moved

from .schema import table_config

__getattr__ = moved(__name__, table_config)
