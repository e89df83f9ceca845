"""Deprecated: `expbuf.server.advantages.shaping` (store/moved.py)."""

from .advantages import shaping
from .store.moved import moved

__getattr__ = moved(__name__, shaping)
