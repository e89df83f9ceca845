"""Deprecated: `expbuf.client.schema.table_settings` (moved.py)."""

from .moved import moved
from .schema import table_settings

__getattr__ = moved(__name__, table_settings)
