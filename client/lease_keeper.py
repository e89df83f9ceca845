"""Deprecated: `expbuf.client.kit.lease_keeper` (moved.py)."""

from .kit import lease_keeper
from .moved import moved

__getattr__ = moved(__name__, lease_keeper)
