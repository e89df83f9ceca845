"""Deprecated: `expbuf.server.store.schema.ready_indexes` (moved.py)."""

from .moved import moved
from .schema import ready_indexes

__getattr__ = moved(__name__, ready_indexes)
