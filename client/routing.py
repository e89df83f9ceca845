"""Deprecated: `expbuf.client.schema.routing` (moved.py)."""

from .moved import moved
from .schema import routing

__getattr__ = moved(__name__, routing)
