"""Deprecated: `expbuf.server.store.schema.states` (moved.py)."""

from .moved import moved
from .schema import states

__getattr__ = moved(__name__, states)
