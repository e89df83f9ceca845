"""Deprecated: `expbuf.client.shards.blocking` (moved.py)."""

from .moved import moved
from .shards import blocking

__getattr__ = moved(__name__, blocking)
