"""Deprecated: the orders are `expbuf.server.store.schema.selection` (client/moved.py)."""

from expbuf.client.moved import moved

from .store.schema import selection

__getattr__ = moved(__name__, selection)
