"""Deprecated: `expbuf.server.store.schema.table_parts` (client/moved.py)."""

from expbuf.client.moved import moved

from .schema import table_parts

__getattr__ = moved(__name__, table_parts)
