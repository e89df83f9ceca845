"""Deprecated: the ready-group indexes are `expbuf.server.store.schema.ready_indexes` (store/moved.py)."""

from .store.moved import moved
from .store.schema import ready_indexes

__getattr__ = moved(__name__, ready_indexes)
