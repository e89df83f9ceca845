"""Deprecated: `expbuf.server.advantages.batch_stage` (store/moved.py)."""

from .advantages import batch_stage
from .store.moved import moved

__getattr__ = moved(__name__, batch_stage)
