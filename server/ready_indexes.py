"""Deprecated: the ready-group indexes are `expbuf.server.store.ready_indexes` (moved.py)."""

from .moved import moved
from .store import ready_indexes

__getattr__ = moved(__name__, ready_indexes)
