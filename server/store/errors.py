"""Deprecated: `expbuf.server.store.schema.errors` (client/moved.py)."""

from expbuf.client.moved import moved

from .schema import errors

__getattr__ = moved(__name__, errors)
