"""Deprecated: `expbuf.server.store.disk.stored_advantages` (moved.py)."""

from .disk import stored_advantages
from .moved import moved

__getattr__ = moved(__name__, stored_advantages)
