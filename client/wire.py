"""Deprecated: `expbuf.client.rpc.wire` (moved.py)."""

from .moved import moved
from .rpc import wire

__getattr__ = moved(__name__, wire)
