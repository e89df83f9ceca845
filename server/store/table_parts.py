"""Deprecated: `expbuf.server.store.schema.table_parts` (moved.py)."""

from .moved import moved
from .schema import table_parts

__getattr__ = moved(__name__, table_parts)
