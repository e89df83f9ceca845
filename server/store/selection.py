"""Deprecated: `expbuf.server.store.schema.selection` (client/moved.py)."""

from expbuf.client.moved import moved

from .schema import selection

__getattr__ = moved(__name__, selection)
