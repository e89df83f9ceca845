"""Deprecated: the ready-group indexes are `expbuf.server.store.schema.ready_indexes` (client/moved.py)."""

from expbuf.client.moved import moved

from .store.schema import ready_indexes

__getattr__ = moved(__name__, ready_indexes)
