"""Deprecated: `expbuf.server.store.schema.selection` (moved.py)."""

from .moved import moved
from .schema import selection

__getattr__ = moved(__name__, selection)
