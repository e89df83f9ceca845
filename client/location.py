"""Deprecated: `expbuf.client.kit.location` (moved.py)."""

from .kit import location
from .moved import moved

__getattr__ = moved(__name__, location)
