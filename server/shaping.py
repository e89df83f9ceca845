"""Deprecated: `expbuf.server.advantages.shaping` (client/moved.py)."""

from expbuf.client.moved import moved

from .advantages import shaping

__getattr__ = moved(__name__, shaping)
