"""Deprecated: `expbuf.server.store.schema.table_config` (moved.py)."""

from .moved import moved
from .schema import table_config

__getattr__ = moved(__name__, table_config)
