"""Deprecated: `expbuf.server.advantages.batch_stage` (client/moved.py)."""

from expbuf.client.moved import moved

from .advantages import batch_stage

__getattr__ = moved(__name__, batch_stage)
