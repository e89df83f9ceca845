"""Deprecated: the orders are `expbuf.server.store.schema.selection` (moved.py)."""

from .moved import moved
from .store.schema import selection

__getattr__ = moved(__name__, selection)
