"""Deprecated: `expbuf.server.store.schema.sample_spec` (moved.py)."""

from .moved import moved
from .schema import sample_spec

__getattr__ = moved(__name__, sample_spec)
