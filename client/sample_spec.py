"""Deprecated: `expbuf.client.rpc.sample_spec` (moved.py)."""

from .moved import moved
from .rpc import sample_spec

__getattr__ = moved(__name__, sample_spec)
