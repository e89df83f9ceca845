"""Deprecated: `expbuf.server.store.schema.errors` (moved.py)."""

from .moved import moved
from .schema import errors

__getattr__ = moved(__name__, errors)
