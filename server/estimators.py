"""Deprecated: `expbuf.server.advantages.estimators` (store/moved.py)."""

from .advantages import estimators
from .store.moved import moved

__getattr__ = moved(__name__, estimators)
