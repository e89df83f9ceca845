"""Deprecated: `expbuf.server.advantages.estimators` (client/moved.py)."""

from expbuf.client.moved import moved

from .advantages import estimators

__getattr__ = moved(__name__, estimators)
