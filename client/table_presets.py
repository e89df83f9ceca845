"""Deprecated: `expbuf.client.schema.table_presets` (moved.py)."""

from .moved import moved
from .schema import table_presets

__getattr__ = moved(__name__, table_presets)
