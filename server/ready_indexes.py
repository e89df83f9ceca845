"""Deprecated: the ready-group indexes are `expbuf.server.store.schema.ready_indexes` (moved.py)."""

from .moved import moved
from .store.schema import ready_indexes

__getattr__ = moved(__name__, ready_indexes)
