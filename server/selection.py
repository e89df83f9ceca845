"""Deprecated: the orders are `expbuf.server.store.selection` (moved.py)."""

from .moved import moved
from .store import selection

__getattr__ = moved(__name__, selection)
