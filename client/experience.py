"""Deprecated: `expbuf.client.schema.experience` (moved.py)."""

from .moved import moved
from .schema import experience

__getattr__ = moved(__name__, experience)
