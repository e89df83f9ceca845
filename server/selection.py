"""Deprecated: the orders are `expbuf.server.store.schema.selection` (store/moved.py)."""

from .store.moved import moved
from .store.schema import selection

__getattr__ = moved(__name__, selection)
